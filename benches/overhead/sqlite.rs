//! SQLite as the bench runs it: a WAL file database in a temporary
//! directory with `synchronous = FULL`, so that every commit is durable as
//! on the servers and the comparison is of the same promise. The busy
//! timeout lets the multi-threaded scenarios queue for the one write lock
//! instead of failing at once.

use diesel::SqliteConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;

use diesel::sql_types::{BigInt, Integer};
use serde_json::Value;

use crate::db::{Bench, KEY_COLUMNS, KeyTable, Statement, find_key_in, place_order_returning_id};
use crate::server::{Figure, Probe, Task};

/// A statement SQLite executes.
pub trait Executable: ExecuteDsl<SqliteConnection> {}

impl<S: ExecuteDsl<SqliteConnection>> Executable for S {}

/// A WAL file database in a temporary directory, every commit durable:
/// WAL with `synchronous = FULL` syncs the log on each commit, as
/// PostgreSQL does.
impl Bench for SqliteConnection {
    const NAME: &'static str = "sqlite";

    type Probe = SqliteProbe;

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

    fn find_key(&mut self, table: KeyTable, key: &str) -> QueryResult<bool> {
        find_key_in(self, table, key)
    }

    fn probe(&mut self) -> SqliteProbe {
        SqliteProbe::new(self)
    }
}

/// What SQLite tells of a connection's work: the pages its commits append
/// to the write-ahead log, each a frame of a page and a 24-byte header. A
/// reading learns how many frames the log holds (a `PASSIVE` checkpoint
/// reports it), then starts the log anew (`TRUNCATE`); the connection
/// checkpoints only so, so the frames a reading finds are those written
/// since the one before. SQLite runs in the bench's process: its CPU time
/// is the client's.
pub struct SqliteProbe {
    page_size: i64,
    notes: Vec<String>,
}

#[derive(QueryableByName)]
struct Checkpoint {
    #[diesel(sql_type = Integer)]
    busy: i32,
    #[diesel(sql_type = Integer)]
    log: i32,
}

#[derive(QueryableByName)]
struct PageSize {
    #[diesel(sql_type = BigInt)]
    page_size: i64,
}

impl SqliteProbe {
    fn new(conn: &mut SqliteConnection) -> SqliteProbe {
        let mut notes = vec![String::from(
            "server CPU: SQLite runs in the bench's process, so the client's CPU time includes it",
        )];
        let page_size = conn
            .batch_execute("PRAGMA wal_autocheckpoint = 0")
            .and_then(|()| diesel::sql_query("PRAGMA page_size").get_result::<PageSize>(conn))
            .map(|size| size.page_size)
            .unwrap_or_else(|error| {
                notes.push(format!("WAL bytes: not measured ({error})"));
                0
            });
        SqliteProbe { page_size, notes }
    }
}

impl Probe<SqliteConnection> for SqliteProbe {
    /// The frames the log held when this reading checkpointed it.
    type Reading = i32;

    fn read(&mut self, conn: &mut SqliteConnection) -> Option<i32> {
        if self.page_size == 0 {
            return None;
        }
        let mut checkpoint =
            |mode: &str| diesel::sql_query(format!("PRAGMA wal_checkpoint({mode})")).get_result::<Checkpoint>(conn);
        // TRUNCATE reports the log it leaves, which is empty.
        let passive = checkpoint("PASSIVE");
        match passive.and_then(|passive| Ok((passive, checkpoint("TRUNCATE")?))) {
            Ok((passive, truncate)) if truncate.busy == 0 => Some(passive.log),
            Ok(_) => {
                self.notes
                    .push("a checkpoint was kept from the end of the log: WAL bytes not measured".to_owned());
                None
            }
            Err(error) => {
                self.notes.push(format!("a checkpoint failed: {error}"));
                None
            }
        }
    }

    fn figures(
        &mut self,
        _conn: &mut SqliteConnection,
        _before: &i32,
        after: &i32,
        calls: usize,
    ) -> (Vec<Figure>, Value) {
        let frames = f64::from(*after) / calls as f64;
        let figures = vec![
            Figure::new("wal_bytes", "WAL bytes", frames * (self.page_size + 24) as f64),
            Figure::new("pages_written", "pages written", frames),
        ];
        (figures, Value::Null)
    }

    fn server_task(&self) -> Option<&Task> {
        None
    }

    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }
}
