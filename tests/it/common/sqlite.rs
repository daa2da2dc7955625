//! SQLite test databases: a WAL file in a temporary directory, so that every
//! connection of a test, pooled or not, sees the same database.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use tempfile::TempDir;

use super::TestDb;

pub struct Db {
    url: String,
    _dir: TempDir,
}

#[derive(Debug)]
struct Setup;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for Setup {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 10000; PRAGMA synchronous = NORMAL;")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

impl TestDb for Db {
    type Conn = SqliteConnection;
    const BACKEND: &'static str = "sqlite";
    const SETUP: &'static str = "PRAGMA journal_mode = WAL;
        CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL, quantity INTEGER NOT NULL);";
    const SERVICE_SETUP: &'static str = "PRAGMA journal_mode = WAL;
        CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, \
        item TEXT NOT NULL, quantity INTEGER NOT NULL);";

    fn empty() -> Db {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let url = dir.path().join("test.db").to_str().expect("utf-8 path").to_owned();
        Db { url, _dir: dir }
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn conn(&self) -> SqliteConnection {
        let mut conn = SqliteConnection::establish(&self.url).expect("open the test database");
        Setup.on_acquire(&mut conn).expect("configure the connection");
        conn
    }

    fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<SqliteConnection>> {
        Pool::builder()
            .max_size(size)
            .connection_customizer(Box::new(Setup))
            .build(ConnectionManager::new(url))
            .expect("build a pool")
    }

    super::same_on_every_backend!(SqliteConnection, with_returning);

    fn await_order_writers(_conn: &mut SqliteConnection) {
        // A writer's lock on the file ends with its process; what it had not
        // committed is rolled back by the next reader.
    }
}
