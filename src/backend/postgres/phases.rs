//! PostgreSQL: the read brings the server's time along.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{Text, Timestamp};

use crate::backend::phases::{COMPLETED, OperationRow, PhaseStore};
use crate::backend::postgres::{DatabaseNow, Expired, purge};
use crate::backend::row_with::operation_with;

impl PhaseStore for PgConnection {
    fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        operation_with::<DatabaseNow, Timestamp, _>(self, scope, key)
    }

    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_phases",
            key: "idempotency_key",
            condition: "status = $1 AND expires_at <= $2",
            bind: &|rows| rows.bind::<Text, _>(COMPLETED).bind::<Timestamp, _>(cutoff),
        };
        purge(self, &expired, limit)
    }

    crate::backend::phases::shared_queries!(crate::schema);
}
