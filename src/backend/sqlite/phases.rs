//! SQLite: every write of an operation takes the database's write lock, so
//! a completer's pick needs no row locking.

use std::time::Duration;

use chrono::{NaiveDateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};
use diesel::sqlite::SqliteConnection;

use crate::backend::phases::{BlockingPhaseStore, OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::sql_limit;
use crate::row_status::OperationStatus;
use crate::schema::idempotency_phases as p;

impl PhaseStore for SqliteConnection {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        let row = p::table
            .find((scope, key))
            .select(OperationRow::as_select())
            .get_result(self)
            .optional()?;
        // SQLite's clock is the application host's: the database runs in-process.
        Ok((row, Utc::now().naive_utc()))
    }

    async fn pause(&mut self, duration: Duration) {
        std::thread::sleep(duration);
    }

    shared_phase_statements!();
}

impl BlockingPhaseStore for SqliteConnection {
    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // diesel's DSL cannot delete through a limited subquery.
        diesel::sql_query(
            "DELETE FROM idempotency_phases WHERE (scope, idempotency_key) IN \
             (SELECT scope, idempotency_key FROM idempotency_phases \
              WHERE status = ? AND expires_at <= ? LIMIT ?)",
        )
        .bind::<Text, _>(OperationStatus::Completed)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(limit))
        .execute(self)
    }

    fn tombstone_operations_batch(
        &mut self,
        after: NaiveDateTime,
        cutoff: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<usize> {
        diesel::sql_query(
            "UPDATE idempotency_phases SET response = NULL, request = NULL, points = '[]' \
             WHERE (scope, idempotency_key) IN \
             (SELECT scope, idempotency_key FROM idempotency_phases \
              WHERE status = ? AND expires_at > ? AND expires_at <= ? AND response IS NOT NULL LIMIT ?)",
        )
        .bind::<Text, _>(OperationStatus::Completed)
        .bind::<Timestamp, _>(after)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(limit))
        .execute(self)
    }

    shared_phase_statements!(blocking);
}
