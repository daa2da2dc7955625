//! PostgreSQL test databases: a schema of its own per test in the database
//! named by `DATABASE_URL`, reached through `search_path`, and dropped when
//! the test ends. Without `DATABASE_URL` the tests fail; they never skip.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};

use super::{OutboxRow, OutboxSchedule, TestDb, idempotency_keys, idempotency_outbox, orders};

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
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl TestDb for Db {
    type Conn = PgConnection;
    const BACKEND: &'static str = "postgres";

    fn new() -> Db {
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

    fn url(&self) -> &str {
        &self.url
    }

    fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).expect("connect to the test schema")
    }

    fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<PgConnection>> {
        Pool::builder()
            .max_size(size)
            .build(ConnectionManager::new(url))
            .expect("build a pool")
    }

    fn place_order(conn: &mut PgConnection, item: &str, quantity: i32) -> QueryResult<i64> {
        diesel::insert_into(orders::table)
            .values((orders::item.eq(item), orders::quantity.eq(quantity)))
            .returning(orders::id)
            .get_result(conn)
    }

    fn order_count(conn: &mut PgConnection) -> i64 {
        orders::table.count().get_result(conn).expect("count orders")
    }

    fn order_items(conn: &mut PgConnection) -> Vec<String> {
        orders::table
            .order(orders::id)
            .select(orders::item)
            .load(conn)
            .expect("read the orders")
    }

    fn key_count(conn: &mut PgConnection) -> i64 {
        idempotency_keys::table
            .count()
            .get_result(conn)
            .expect("count key records")
    }

    fn request_hashes(conn: &mut PgConnection) -> Vec<String> {
        idempotency_keys::table
            .select(idempotency_keys::request_hash)
            .load(conn)
            .expect("read the key records")
    }

    fn keys_in_scope(conn: &mut PgConnection, scope: &str) -> Vec<String> {
        idempotency_keys::table
            .filter(idempotency_keys::scope.eq(scope))
            .select(idempotency_keys::idempotency_key)
            .load(conn)
            .expect("read the key records")
    }

    fn outbox_messages(conn: &mut PgConnection) -> Vec<OutboxRow> {
        use idempotency_outbox as o;
        o::table
            .order(o::id)
            .select((o::id, o::topic, o::status, o::attempts, o::last_error))
            .load(conn)
            .expect("read the outbox")
    }

    fn outbox_schedule(conn: &mut PgConnection, id: &str) -> OutboxSchedule {
        use idempotency_outbox as o;
        o::table
            .find(id)
            .select((o::available_at, o::delivered_at))
            .get_result(conn)
            .expect("read the message's schedule")
    }

    fn await_order_writers(conn: &mut PgConnection) {
        // A COMMIT a client sent just before it died may still be in the
        // server's hands; this lock waits for every transaction that wrote
        // orders to end.
        conn.transaction(|tx| diesel::sql_query("LOCK TABLE orders IN SHARE MODE").execute(tx))
            .expect("wait for the transactions that wrote orders");
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.base_url) {
            let _ = admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema));
        }
    }
}

impl super::ServerDb for Db {
    fn session_id(conn: &mut PgConnection) -> i64 {
        backend_pid(conn).into()
    }

    fn kill_session(admin: &mut PgConnection, id: i64) {
        diesel::sql_query("SELECT pg_terminate_backend($1)")
            .bind::<diesel::sql_types::Integer, _>(i32::try_from(id).expect("a backend pid"))
            .execute(admin)
            .expect("terminate a backend");
    }
}

/// The server process serving `conn`.
pub fn backend_pid(conn: &mut PgConnection) -> i32 {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(conn)
        .expect("read the backend pid")
        .pid
}

/// The session's `lock_timeout` as `SHOW` reports it.
pub fn show_lock_timeout(conn: &mut PgConnection) -> String {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        lock_timeout: String,
    }
    diesel::sql_query("SHOW lock_timeout")
        .get_result::<Setting>(conn)
        .expect("show lock_timeout")
        .lock_timeout
}

/// How long the polls below wait for the server before the test fails; far
/// beyond what a healthy server needs, so it only ends a test that hangs.
const SERVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Polls the server through `admin` until `condition` holds. The server
/// changes these states on its own, so there is nothing to wait on but the
/// server's view.
fn poll_server(admin: &mut PgConnection, what: &str, mut condition: impl FnMut(&mut PgConnection) -> bool) {
    let deadline = std::time::Instant::now() + SERVER_PATIENCE;
    while !condition(admin) {
        assert!(std::time::Instant::now() < deadline, "the server did not report {what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// Waits until the session `pid` waits for a lock, such as the index entry
/// of a key another transaction has claimed.
pub fn wait_until_waiting_for_lock(admin: &mut PgConnection, pid: i32) {
    poll_server(admin, &format!("backend {pid} waiting for a lock"), |admin| {
        diesel::sql_query("SELECT count(*) AS n FROM pg_locks WHERE pid = $1 AND NOT granted")
            .bind::<diesel::sql_types::Integer, _>(pid)
            .get_result::<Count>(admin)
            .expect("read pg_locks")
            .n
            > 0
    });
}

/// Waits until the server has ended the session `pid`.
pub fn wait_until_backend_gone(admin: &mut PgConnection, pid: i32) {
    poll_server(admin, &format!("backend {pid} gone"), |admin| {
        diesel::sql_query("SELECT count(*) AS n FROM pg_stat_activity WHERE pid = $1")
            .bind::<diesel::sql_types::Integer, _>(pid)
            .get_result::<Count>(admin)
            .expect("read pg_stat_activity")
            .n
            == 0
    });
}

/// The state of session `pid` in `pg_stat_activity` (`idle`, `idle in
/// transaction`, ...); `None` once the session has ended.
pub fn backend_state(admin: &mut PgConnection, pid: i32) -> Option<String> {
    #[derive(QueryableByName)]
    struct State {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
    }
    diesel::sql_query("SELECT coalesce(state, '') AS state FROM pg_stat_activity WHERE pid = $1")
        .bind::<diesel::sql_types::Integer, _>(pid)
        .get_result::<State>(admin)
        .optional()
        .expect("read pg_stat_activity")
        .map(|row| row.state)
}
