//! PostgreSQL as the bench runs it: a schema of its own in the database
//! `DATABASE_URL` names. The large table is analysed once filled, as
//! autovacuum would do in time, so that the planner knows its size.

use diesel::PgConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;

use crate::db::{Bench, KEY_COLUMNS, Statement, place_order_returning_id};

/// A statement PostgreSQL executes.
pub trait Executable: ExecuteDsl<PgConnection> {}

impl<S: ExecuteDsl<PgConnection>> Executable for S {}

/// A schema of its own in the database named by `DATABASE_URL`.
impl Bench for PgConnection {
    const NAME: &'static str = "postgres";

    fn create_tables(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!(
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL);
             CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key));
             CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at);
             CREATE TABLE bare_keys ({KEY_COLUMNS});"
        ))
    }

    fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
        let inserted = diesel::sql_query(
            "INSERT INTO idempotency_keys
                 (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
             SELECT 'bench', md5(g::text), md5(g::text) || md5(g::text), 'completed', '12345',
                    timestamp '2000-01-01', timestamp '2000-01-01', timestamp '2000-01-02' + g * interval '1 second'
             FROM generate_series(1, $1) AS g",
        )
        .bind::<diesel::sql_types::BigInt, _>(records)
        .execute(self)?;
        self.batch_execute("ANALYZE idempotency_keys")?;
        Ok(inserted)
    }

    fn place_order(&mut self) -> QueryResult<i64> {
        place_order_returning_id(self)
    }

    fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
        ExecuteDsl::execute(statement, self)
    }
}
