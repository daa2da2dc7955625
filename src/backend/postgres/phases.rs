//! PostgreSQL: the read brings the server's time along.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};

use crate::backend::citus;
use crate::backend::phases::{COMPLETED, OperationRow, PhaseStore};
use crate::backend::postgres::DatabaseNow;
use crate::backend::row_with::operation_with;
use crate::backend::sql_limit;

impl PhaseStore for PgConnection {
    fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        operation_with::<DatabaseNow, Timestamp, _>(self, scope, key)
    }

    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        if citus::distributed(self, "idempotency_phases")? {
            return citus::purge_operations(self, cutoff, limit);
        }
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

    crate::backend::phases::shared_queries!(crate::schema);
}
