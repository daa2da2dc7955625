//! PostgreSQL: the read brings the server's time along, and completers pick
//! abandoned operations with `FOR UPDATE SKIP LOCKED`, passing over those
//! another completer is picking at that moment.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};

use crate::backend::phases::{COMPLETED, OperationRow, PhaseStore};
use crate::backend::postgres::DatabaseNow;
use crate::backend::row_with::operation_with;
use crate::backend::sql_limit;

impl PhaseStore for PgConnection {
    fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        operation_with::<DatabaseNow, Timestamp, _>(self, scope, key)
    }

    fn picking<T>(&mut self, pick: impl FnOnce(&mut Self) -> QueryResult<T>) -> QueryResult<T> {
        // Locks taken by the pick are held until its transaction commits.
        self.transaction(pick)
    }

    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // SKIP LOCKED: an expired operation that a live request is starting
        // anew is not worth waiting for.
        diesel::sql_query(
            "DELETE FROM idempotency_phases WHERE ctid IN \
             (SELECT ctid FROM idempotency_phases WHERE status = $1 AND expires_at <= $2 \
              LIMIT $3 FOR UPDATE SKIP LOCKED)",
        )
        .bind::<Text, _>(COMPLETED)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(limit))
        .execute(self)
    }

    crate::backend::phases::shared_queries!(skip_locked crate::schema);
}
