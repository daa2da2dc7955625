//! PostgreSQL test databases: a schema of its own per test in the database
//! named by `DATABASE_URL`, reached through `search_path`, and dropped when
//! the test ends. Without `DATABASE_URL` the tests fail; they never skip.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};

pub type Conn = PgConnection;
pub const BACKEND: &str = "postgres";

super::orders_repository!();

pub struct Db {
    base_url: String,
    url: String,
    schema: String,
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "the postgres tests need DATABASE_URL, e.g. DATABASE_URL=postgres://localhost/test \
         cargo test --features postgres",
    )
}

impl Db {
    pub fn new() -> Db {
        let base_url = database_url();
        let schema = super::unique_name("idem_test");
        let separator = if base_url.contains('?') { '&' } else { '?' };
        let url = format!("{base_url}{separator}options=-csearch_path%3D{schema}");
        let mut admin = PgConnection::establish(&base_url).expect("connect to DATABASE_URL");
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .expect("create the test schema");
        let db = Db { base_url, url, schema };
        let mut conn = db.conn();
        conn.batch_execute(
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL)",
        )
        .expect("create the orders table");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    pub fn conn(&self) -> Conn {
        PgConnection::establish(&self.url).expect("connect to the test schema")
    }

    pub fn pool(&self, size: u32) -> Pool<ConnectionManager<Conn>> {
        Pool::builder()
            .max_size(size)
            .build(ConnectionManager::new(&self.url))
            .expect("build a pool")
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.base_url) {
            let _ = admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema));
        }
    }
}
