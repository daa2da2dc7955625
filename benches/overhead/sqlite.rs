//! SQLite as the bench runs it: a WAL file database in a temporary
//! directory with `synchronous = FULL`, so that every commit is durable as
//! on the servers and the comparison is of the same promise. The busy
//! timeout lets the multi-threaded scenarios queue for the one write lock
//! instead of failing at once.

use diesel::SqliteConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;

use crate::db::{Bench, KEY_COLUMNS, Statement, place_order_returning_id};

/// A statement SQLite executes.
pub trait Executable: ExecuteDsl<SqliteConnection> {}

impl<S: ExecuteDsl<SqliteConnection>> Executable for S {}

/// A WAL file database in a temporary directory, every commit durable:
/// WAL with `synchronous = FULL` syncs the log on each commit, as
/// PostgreSQL does.
impl Bench for SqliteConnection {
    const NAME: &'static str = "sqlite";

    fn configure(&mut self) -> QueryResult<()> {
        self.batch_execute("PRAGMA synchronous = FULL; PRAGMA busy_timeout = 10000;")
    }

    fn create_tables(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL, quantity INTEGER NOT NULL);
             CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key)) WITHOUT ROWID;
             CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at);
             CREATE TABLE bare_keys ({KEY_COLUMNS});"
        ))
    }

    fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
        diesel::sql_query(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)
             INSERT INTO idempotency_keys
                 (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
             SELECT 'bench', lower(hex(randomblob(16))), lower(hex(randomblob(32))), 'completed', '12345',
                    '2000-01-01 00:00:00', '2000-01-01 00:00:00', datetime('2000-01-02', '+' || n || ' seconds')
             FROM g",
        )
        .bind::<diesel::sql_types::BigInt, _>(records)
        .execute(self)
    }

    fn place_order(&mut self) -> QueryResult<i64> {
        place_order_returning_id(self)
    }

    fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
        ExecuteDsl::execute(statement, self)
    }
}
