//! SQLite test databases: a WAL file in a temporary directory, so that every
//! connection of a test, pooled or not, sees the same database.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use tempfile::TempDir;

pub type Conn = SqliteConnection;
pub const BACKEND: &str = "sqlite";

super::orders_repository!();

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

impl Db {
    pub fn new() -> Db {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let url = dir.path().join("test.db").to_str().expect("utf-8 path").to_owned();
        let db = Db { url, _dir: dir };
        let mut conn = db.conn();
        conn.batch_execute(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL, quantity INTEGER NOT NULL);",
        )
        .expect("create the orders table");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn conn(&self) -> Conn {
        let mut conn = SqliteConnection::establish(&self.url).expect("open the test database");
        Setup.on_acquire(&mut conn).expect("configure the connection");
        conn
    }

    pub fn pool(&self, size: u32) -> Pool<ConnectionManager<Conn>> {
        pool_at(&self.url, size)
    }
}

/// A pool on a database that `Db::new` made, by its url: for a child process
/// that works on its parent's database.
pub fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<Conn>> {
    Pool::builder()
        .max_size(size)
        .connection_customizer(Box::new(Setup))
        .build(ConnectionManager::new(url))
        .expect("build a pool")
}
