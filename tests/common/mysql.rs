//! MySQL and MariaDB test databases: a database of its own per test on the
//! server named by `MYSQL_URL`, dropped when the test ends. Without
//! `MYSQL_URL` the tests fail; they never skip.

use diesel::connection::SimpleConnection;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};

use super::{OutboxRow, OutboxSchedule, TestDb, idempotency_keys, idempotency_outbox, orders};

pub struct Db {
    base_url: String,
    url: String,
    name: String,
}

pub fn database_url() -> String {
    std::env::var("MYSQL_URL").expect(
        "the mysql tests need MYSQL_URL, e.g. MYSQL_URL=mysql://root@127.0.0.1:3306/test \
         cargo test --features mysql",
    )
}

/// `url` with its database replaced by `database`.
pub fn url_of_database(url: &str, database: &str) -> String {
    let (address, query) = match url.split_once('?') {
        Some((address, query)) => (address, Some(query)),
        None => (url, None),
    };
    let authority_start = address.find("://").map_or(0, |at| at + 3);
    let base = match address[authority_start..].find('/') {
        Some(slash) => &address[..authority_start + slash],
        None => address,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

diesel::define_sql_function! {
    /// The id the last insert on this connection gave its row.
    fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
}

impl Db {
    /// The name of the test's database.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl TestDb for Db {
    type Conn = MysqlConnection;
    const BACKEND: &'static str = "mysql";
    const WRITES_KEY_RECORD_ONCE: bool = false;

    fn new() -> Db {
        let base_url = database_url();
        let name = super::unique_name("idem_test");
        let mut admin = MysqlConnection::establish(&base_url).expect("connect to MYSQL_URL");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create the test database");
        let url = url_of_database(&base_url, &name);
        let db = Db { base_url, url, name };
        let mut conn = db.conn();
        conn.batch_execute(
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, \
             quantity INTEGER NOT NULL)",
        )
        .expect("create the orders table");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn conn(&self) -> MysqlConnection {
        MysqlConnection::establish(&self.url).expect("connect to the test database")
    }

    fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<MysqlConnection>> {
        Pool::builder()
            .max_size(size)
            .build(ConnectionManager::new(url))
            .expect("build a pool")
    }

    fn place_order(conn: &mut MysqlConnection, item: &str, quantity: i32) -> QueryResult<i64> {
        diesel::insert_into(orders::table)
            .values((orders::item.eq(item), orders::quantity.eq(quantity)))
            .execute(conn)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(conn)?;
        Ok(i64::try_from(id).expect("an order id within i64"))
    }

    fn order_count(conn: &mut MysqlConnection) -> i64 {
        orders::table.count().get_result(conn).expect("count orders")
    }

    fn order_items(conn: &mut MysqlConnection) -> Vec<String> {
        orders::table
            .order(orders::id)
            .select(orders::item)
            .load(conn)
            .expect("read the orders")
    }

    fn key_count(conn: &mut MysqlConnection) -> i64 {
        idempotency_keys::table
            .count()
            .get_result(conn)
            .expect("count key records")
    }

    fn request_hashes(conn: &mut MysqlConnection) -> Vec<String> {
        idempotency_keys::table
            .select(idempotency_keys::request_hash)
            .load(conn)
            .expect("read the key records")
    }

    fn keys_in_scope(conn: &mut MysqlConnection, scope: &str) -> Vec<String> {
        idempotency_keys::table
            .filter(idempotency_keys::scope.eq(scope))
            .select(idempotency_keys::idempotency_key)
            .load(conn)
            .expect("read the key records")
    }

    fn outbox_messages(conn: &mut MysqlConnection) -> Vec<OutboxRow> {
        use idempotency_outbox as o;
        o::table
            .order(o::id)
            .select((o::id, o::topic, o::status, o::attempts, o::last_error))
            .load(conn)
            .expect("read the outbox")
    }

    fn outbox_schedule(conn: &mut MysqlConnection, id: &str) -> OutboxSchedule {
        #[derive(QueryableByName)]
        struct Schedule {
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Datetime>)]
            available_at: Option<chrono::NaiveDateTime>,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Datetime>)]
            delivered_at: Option<chrono::NaiveDateTime>,
        }
        let schedule: Schedule =
            diesel::sql_query("SELECT available_at, delivered_at FROM idempotency_outbox WHERE id = ?")
                .bind::<diesel::sql_types::Text, _>(id)
                .get_result(conn)
                .expect("read the message's schedule");
        (schedule.available_at, schedule.delivered_at)
    }

    fn await_order_writers(conn: &mut MysqlConnection) {
        // A transaction that wrote orders holds a metadata lock on the table
        // until it ends, also while the server rolls back the transaction of
        // a client that died; a table read lock waits for all of them.
        conn.batch_execute("LOCK TABLES orders READ; UNLOCK TABLES")
            .expect("wait for the transactions that wrote orders");
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Ok(mut admin) = MysqlConnection::establish(&self.base_url) {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {}", self.name));
        }
    }
}

impl super::ServerDb for Db {
    fn session_id(conn: &mut MysqlConnection) -> i64 {
        i64::try_from(connection_id(conn)).expect("a connection id within i64")
    }

    fn kill_session(admin: &mut MysqlConnection, id: i64) {
        // ER_NO_SUCH_THREAD (1094) for a session that has ended meanwhile.
        if let Err(error) = admin.batch_execute(&format!("KILL CONNECTION {id}")) {
            assert!(
                error.to_string().contains("Unknown thread id"),
                "kill session {id}: {error}"
            );
        }
    }
}

/// The id of the server's thread serving `conn`, as `KILL` and the process
/// list know it.
pub fn connection_id(conn: &mut MysqlConnection) -> u64 {
    diesel::define_sql_function! {
        fn connection_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
    }
    diesel::select(connection_id())
        .get_result(conn)
        .expect("read the connection id")
}

/// How long the polls below wait for the server before the test fails; far
/// beyond what a healthy server needs, so it only ends a test that hangs.
const SERVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Polls the server through `admin` until `condition` holds. The server
/// changes these states on its own, so there is nothing to wait on but the
/// server's view.
fn poll_server(admin: &mut MysqlConnection, what: &str, mut condition: impl FnMut(&mut MysqlConnection) -> bool) {
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

/// What the server's thread `id` is doing, as the process list shows it
/// (`User lock` while it waits in `GET_LOCK`, `Update` while an insert waits
/// for a row lock, ...); `None` once the connection is gone.
pub fn thread_state(admin: &mut MysqlConnection, id: u64) -> Option<String> {
    #[derive(QueryableByName)]
    struct State {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
    }
    diesel::sql_query("SELECT COALESCE(state, '') AS state FROM information_schema.processlist WHERE id = ?")
        .bind::<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>, _>(id)
        .get_result::<State>(admin)
        .optional()
        .expect("read the process list")
        .map(|row| row.state)
}

/// Waits until the server's thread `id` waits for the named lock of a key.
pub fn wait_until_waiting_for_named_lock(admin: &mut MysqlConnection, id: u64) {
    poll_server(admin, &format!("thread {id} waiting for a named lock"), |admin| {
        thread_state(admin, id).is_some_and(|state| state.eq_ignore_ascii_case("user lock"))
    });
}

/// Waits until the server's thread `id` waits for a row lock, such as the
/// index entry of a key another transaction has claimed: until its claim,
/// an insert that takes a fraction of a millisecond when nothing holds it
/// up, has run for 100 ms. (MariaDB's `innodb_trx` leaves out a transaction
/// whose first write waits, and its `SHOW ENGINE INNODB STATUS` does not
/// come back through a prepared statement; `TIME_MS` is MariaDB's.)
pub fn wait_until_waiting_for_row_lock(admin: &mut MysqlConnection, id: u64) {
    poll_server(admin, &format!("thread {id} waiting for a row lock"), |admin| {
        diesel::sql_query(
            "SELECT count(*) AS n FROM information_schema.processlist \
             WHERE id = ? AND info LIKE 'INSERT INTO `idempotency_keys`%' AND time_ms >= 100",
        )
        .bind::<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>, _>(id)
        .get_result::<Count>(admin)
        .expect("read the process list")
        .n > 0
    });
}

/// Waits until the server has ended the connection of thread `id`.
pub fn wait_until_connection_gone(admin: &mut MysqlConnection, id: u64) {
    poll_server(admin, &format!("thread {id} gone"), |admin| {
        thread_state(admin, id).is_none()
    });
}

/// How many transactions that have written the server has open for thread
/// `id`: 0 or 1. (MariaDB does not list one that has only read.)
pub fn open_write_transactions(admin: &mut MysqlConnection, id: u64) -> i64 {
    diesel::sql_query("SELECT count(*) AS n FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = ?")
        .bind::<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>, _>(id)
        .get_result::<Count>(admin)
        .expect("read innodb_trx")
        .n
}

/// The name of the lock that holds `(scope, key)` in `database`, derived
/// as the crate derives it: a test that finds it held, or free, proves where
/// the lock is.
pub fn lock_name(database: &str, scope: &str, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut hasher = Sha256::new();
    for part in [scope, key] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let key_hash = hex(&hasher.finalize());
    let named = hex(&Sha256::digest(format!("{key_hash}:{database}")));
    format!("idempotency:{}", &named[..52])
}

/// The server thread holding the named lock `name`, if any.
pub fn named_lock_holder(admin: &mut MysqlConnection, name: &str) -> Option<u64> {
    diesel::define_sql_function! {
        fn is_used_lock(name: diesel::sql_types::Text) -> diesel::sql_types::Nullable<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>>;
    }
    diesel::select(is_used_lock(name))
        .get_result(admin)
        .expect("ask who holds the named lock")
}
