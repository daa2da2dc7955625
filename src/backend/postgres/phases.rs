//! PostgreSQL: the read brings the server's time along.

use std::time::Duration;

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{Text, Timestamp};

use super::clock::DatabaseNow;
use super::expired::Expired;
use super::purge::purge;
use crate::backend::phases::{BlockingPhaseStore, OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::row_with::operation_with;
use crate::row_status::OperationStatus;

impl PhaseStore for PgConnection {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        operation_with::<DatabaseNow, _>(self, scope, key)
    }

    async fn pause(&mut self, duration: Duration) {
        std::thread::sleep(duration);
    }

    shared_phase_statements!();
}

impl BlockingPhaseStore for PgConnection {
    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_phases",
            key: "idempotency_key",
            condition: "status = $1 AND expires_at <= $2",
            set: None,
            bind: &|rows| {
                rows.bind::<Text, _>(OperationStatus::Completed)
                    .bind::<Timestamp, _>(cutoff)
            },
        };
        purge(self, &expired, limit)
    }

    fn tombstone_operations_batch(
        &mut self,
        after: NaiveDateTime,
        cutoff: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_phases",
            key: "idempotency_key",
            condition: "status = $1 AND expires_at > $2 AND expires_at <= $3 AND response IS NOT NULL",
            set: Some("response = NULL, request = NULL, points = '[]'"),
            bind: &|rows| {
                rows.bind::<Text, _>(OperationStatus::Completed)
                    .bind::<Timestamp, _>(after)
                    .bind::<Timestamp, _>(cutoff)
            },
        };
        purge(self, &expired, limit)
    }

    shared_phase_statements!(blocking);
}
