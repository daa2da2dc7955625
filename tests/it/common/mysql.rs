//! MySQL and MariaDB test databases: a database of its own per test on the
//! server named by `MYSQL_URL`, dropped when the test ends. Without
//! `MYSQL_URL` the tests fail; they never skip.

use diesel::connection::SimpleConnection;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;

use super::{Isolation, OutboxSchedule, ServerDb, TestDb, orders};

pub struct Db {
    url: String,
    name: String,
    _database: super::OnServer,
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

impl TestDb for Db {
    type Conn = MysqlConnection;
    const BACKEND: &'static str = "mysql";
    const SETUP: &'static str = "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
        item VARCHAR(255) NOT NULL, quantity INTEGER NOT NULL)";
    const SERVICE_SETUP: &'static str = "CREATE TABLE IF NOT EXISTS orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
        account VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, \
        item TEXT CHARACTER SET utf8mb4 NOT NULL, quantity INTEGER NOT NULL)";
    const WRITES_KEY_RECORD_ONCE: bool = false;

    fn empty() -> Db {
        let base_url = database_url();
        let name = super::unique_name("idem_test");
        let create = format!("CREATE DATABASE {name}");
        let drop = format!("DROP DATABASE IF EXISTS {name}");
        let own = super::OnServer::create::<MysqlConnection>(&base_url, &create, drop);
        let url = url_of_database(&base_url, &name);
        Db {
            url,
            name,
            _database: own,
        }
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn place_order(conn: &mut MysqlConnection, item: &str, quantity: i32) -> QueryResult<i64> {
        diesel::insert_into(orders::table)
            .values((orders::item.eq(item), orders::quantity.eq(quantity)))
            .execute(conn)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(conn)?;
        Ok(i64::try_from(id).expect("an order id within i64"))
    }

    fn place_account_order(conn: &mut MysqlConnection, account: &str, item: &str, quantity: i32) -> QueryResult<i64> {
        use super::account_orders as o;
        diesel::insert_into(o::table)
            .values((o::account.eq(account), o::item.eq(item), o::quantity.eq(quantity)))
            .execute(conn)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(conn)?;
        Ok(i64::try_from(id).expect("an order id within i64"))
    }

    super::same_on_every_backend!(MysqlConnection);

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

impl ServerDb for Db {
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

    fn session_exists(admin: &mut MysqlConnection, id: i64) -> bool {
        thread_state(admin, thread(id)).is_some()
    }

    fn session_is_idle(admin: &mut MysqlConnection, id: i64) -> bool {
        Db::session_exists(admin, id) && open_write_transactions(admin, thread(id)) == 0
    }

    fn session_waits_for_a_key(admin: &mut MysqlConnection, id: i64) -> bool {
        thread_state(admin, thread(id)).is_some_and(|state| state.eq_ignore_ascii_case("user lock"))
    }

    fn key_lock_holder(&self, admin: &mut MysqlConnection, scope: &str, key: &str) -> Option<i64> {
        named_lock_holder(admin, &lock_name(&self.name, scope, key))
            .map(|id| i64::try_from(id).expect("a connection id within i64"))
    }

    fn lock_wait_setting(conn: &mut MysqlConnection) -> String {
        lock_wait_timeout(conn).to_string()
    }

    fn set_lock_wait_to_seven_seconds(tx: &mut MysqlConnection) -> QueryResult<String> {
        tx.batch_execute("SET SESSION innodb_lock_wait_timeout = 7")?;
        Ok("7".to_owned())
    }

    fn set_session_isolation(conn: &mut MysqlConnection, isolation: Isolation) {
        conn.batch_execute(&format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", isolation.sql()))
            .expect("set the session's isolation level");
    }

    /// The isolation level of the session: MySQL 8 calls the variable
    /// `transaction_isolation`, MariaDB `tx_isolation`.
    fn isolation(conn: &mut MysqlConnection) -> QueryResult<String> {
        let read = |conn: &mut MysqlConnection, variable: &str| {
            diesel::select(diesel::dsl::sql::<diesel::sql_types::Text>(&format!(
                "@@SESSION.{variable}"
            )))
            .get_result::<String>(conn)
        };
        read(conn, "transaction_isolation").or_else(|_| read(conn, "tx_isolation"))
    }

    fn isolation_name(isolation: Isolation) -> String {
        isolation.sql().replace(' ', "-")
    }
}

/// A session id as the server thread id it is.
fn thread(id: i64) -> u64 {
    u64::try_from(id).expect("a connection id")
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

/// The session's `innodb_lock_wait_timeout`.
pub fn lock_wait_timeout(conn: &mut MysqlConnection) -> i64 {
    diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "@@SESSION.innodb_lock_wait_timeout",
    ))
    .get_result(conn)
    .expect("read innodb_lock_wait_timeout")
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

/// Waits until the server's thread `id` waits for a row lock, such as the
/// index entry of a key another transaction has claimed: until its claim,
/// an insert that takes a fraction of a millisecond when nothing holds it
/// up, has run for 100 ms. (MariaDB's `innodb_trx` leaves out a transaction
/// whose first write waits, and its `SHOW ENGINE INNODB STATUS` does not
/// come back through a prepared statement; `TIME_MS` is MariaDB's.)
pub fn wait_until_waiting_for_row_lock(admin: &mut MysqlConnection, id: i64) {
    super::wait::wait_for(&format!("session {id} waiting for a row lock"), || {
        diesel::sql_query(
            "SELECT count(*) AS n FROM information_schema.processlist \
             WHERE id = ? AND info LIKE 'INSERT INTO `idempotency_keys`%' AND time_ms >= 100",
        )
        .bind::<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>, _>(thread(id))
        .get_result::<Count>(admin)
        .expect("read the process list")
        .n > 0
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
    let key_hash = hex(&super::key_hash(scope, key));
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
