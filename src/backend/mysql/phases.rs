//! MySQL and MariaDB: the read brings the server's time along, and a new
//! operation is inserted strictly: a duplicate key fails the insert, which means the
//! key is taken (`INSERT IGNORE` would also store a value that does not fit
//! cut short).

use std::time::Duration;

use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Datetime, Text};

use super::clock::DatabaseNow;
use super::committed::read_committed;
use crate::backend::phases::{BlockingPhaseStore, OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::row_with::operation_with;
use crate::backend::sql_limit;
use crate::row_status::OperationStatus;

impl PhaseStore for MysqlConnection {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        operation_with::<DatabaseNow, _>(self, scope, key)
    }

    async fn pause(&mut self, duration: Duration) {
        std::thread::sleep(duration);
    }

    shared_phase_statements!(insert strictly);
}

impl BlockingPhaseStore for MysqlConnection {
    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // SKIP LOCKED: an expired operation that a live request is starting
        // anew is not worth waiting for. The pick walks the `expires_at`
        // index, whose expired part holds completed operations only; the
        // delete reaches the picked rows by their primary key.
        read_committed(self, |tx| {
            diesel::sql_query(
                "DELETE p FROM \
             (SELECT scope, idempotency_key FROM idempotency_phases FORCE INDEX (idempotency_phases_expires_at) \
              WHERE expires_at <= ? AND status = ? ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED) AS expired \
             STRAIGHT_JOIN idempotency_phases AS p FORCE INDEX (PRIMARY) \
             ON p.scope = expired.scope AND p.idempotency_key = expired.idempotency_key",
            )
            .bind::<Datetime, _>(cutoff)
            .bind::<Text, _>(OperationStatus::Completed)
            .bind::<BigInt, _>(sql_limit(limit))
            .execute(tx)
        })
    }

    fn tombstone_operations_batch(
        &mut self,
        after: NaiveDateTime,
        cutoff: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<usize> {
        // Picked as the purge picks, then updated by primary key.
        read_committed(self, |tx| {
            diesel::sql_query(
                "UPDATE \
             (SELECT scope, idempotency_key FROM idempotency_phases FORCE INDEX (idempotency_phases_expires_at) \
              WHERE expires_at > ? AND expires_at <= ? AND status = ? AND response IS NOT NULL \
              ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED) AS expired \
             STRAIGHT_JOIN idempotency_phases AS p FORCE INDEX (PRIMARY) \
             ON p.scope = expired.scope AND p.idempotency_key = expired.idempotency_key \
             SET p.response = NULL, p.request = NULL, p.points = '[]'",
            )
            .bind::<Datetime, _>(after)
            .bind::<Datetime, _>(cutoff)
            .bind::<Text, _>(OperationStatus::Completed)
            .bind::<BigInt, _>(sql_limit(limit))
            .execute(tx)
        })
    }

    shared_phase_statements!(blocking);
}
