//! The test harness: one test body, run against every backend.
//!
//! A test body is an ordinary generic function, `fn name<D: TestDb>()`, at
//! the top level of its file, where rustfmt and clippy see it. It reaches the
//! database only through `D`: `D::new()` makes a database of its own for the
//! test, and the associated functions of [`TestDb`] read and write the
//! tables of the tests. The crate itself is called as an application calls
//! it, generically over `C: StoreConnection`.
//!
//! `backend_tests!(name, ...)` then emits, per backend, a module of `#[test]`
//! shims that call `name::<Db>()`: `sqlite::name` (a file database in a
//! temporary directory); with the `postgres` feature, `postgres::name` (a
//! schema of its own in the database named by `DATABASE_URL`, dropped
//! afterwards); with the `mysql` feature, `mysql::name` (a database of its
//! own on the server named by `MYSQL_URL`, dropped afterwards). A new
//! backend implements [`TestDb`] in a module of its own and adds one line to
//! the macro. `backend_tests!(async: name, ...)` does the same for
//! `async fn name<D: TestDb>()` bodies, each on a tokio runtime of its own.
//!
//! The backends with a server also implement [`ServerDb`]: the sessions a
//! test watches and ends, the locks it sees held, the settings it checks;
//! `server_backend_tests!` runs a `fn name<D: ServerDb>()` on each of them.
//!
//! Beside them: `wait` (every wait a test makes, bounded), `child` (a test
//! run again as a child process), `own` (a schema or database of a test's
//! own on a server), `race` (what a race for one key must come to), `server`
//! (the holders, waiters and races of the server tests), `outbox` (outbox
//! scenarios several suites observe), `http` (the HTTP layer's service,
//! client and proxies) and `pg_cluster` (a PostgreSQL cluster of a test's
//! own). `wait`, `own` and `race` stand on nothing else of the harness, so
//! that a suite of its own (`tests/citus/`) can use them too.

// With a backend's feature off, the parts of the harness that only its tests
// use are unused.
#![allow(dead_code, unused_macros, unused_imports)]

use diesel::QueryResult;
use diesel::connection::{AnsiTransactionManager, Connection, SimpleConnection, TransactionManager};
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use idempotency::{RawConnection, StoreConnection};

#[cfg(feature = "diesel-async")]
pub mod asynchronous;
pub mod child;
pub mod global_subscriber;
#[cfg(feature = "axum")]
pub mod http;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "axum")]
pub mod orders_service;
pub mod outbox;
pub mod own;
#[cfg(feature = "postgres")]
pub mod pg;
#[cfg(feature = "postgres")]
pub mod pg_cluster;
pub mod property;
pub mod race;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod server;
pub mod sqlite;
#[cfg(feature = "opentelemetry")]
pub mod traces;
pub mod wait;

pub use own::{OnServer, unique_name};

/// Emits a `#[test]` per backend for each generic test body named: a module
/// per backend, named as [`TestDb::BACKEND`], whose `name` runs
/// `super::name::<Db>()`. With `async:` first, the bodies are `async` and
/// each test runs its body on a multi-threaded tokio runtime of its own.
macro_rules! backend_tests {
    (async: $($test:ident),+ $(,)?) => {
        $crate::common::backend_tests!(@every [async] $($test),+);
    };
    ($($test:ident),+ $(,)?) => {
        $crate::common::backend_tests!(@every [sync] $($test),+);
    };
    (@every $kind:tt $($test:ident),+) => {
        $crate::common::backend_tests!(@backend $kind sqlite, $crate::common::sqlite::Db, $($test),+);
        #[cfg(feature = "postgres")]
        $crate::common::backend_tests!(@backend $kind postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::backend_tests!(@backend $kind mysql, $crate::common::mysql::Db, $($test),+);
    };
    (@backend [sync] $backend:ident, $db:ty, $($test:ident),+) => {
        mod $backend {
            $(
                #[test]
                fn $test() {
                    super::$test::<$db>()
                }
            )+
        }
    };
    (@backend [async] $backend:ident, $db:ty, $($test:ident),+) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<$db>().await
                }
            )+
        }
    };
}
pub(crate) use backend_tests;

diesel::table! {
    /// The domain table of the tests.
    orders (id) {
        id -> BigInt,
        item -> Text,
        quantity -> Integer,
    }
}

diesel::table! {
    /// The `orders` table as the order service of [`http`] makes it, with
    /// the account that owns each order.
    #[sql_name = "orders"]
    account_orders (id) {
        id -> BigInt,
        account -> Text,
        item -> Text,
        quantity -> Integer,
    }
}

diesel::table! {
    /// The crate's key records, the columns the tests read.
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        response -> Nullable<Text>,
    }
}

diesel::table! {
    /// The crate's outbox table, the columns the tests read.
    idempotency_outbox (id) {
        id -> Text,
        topic -> Text,
        status -> Text,
        attempts -> Integer,
        last_error -> Nullable<Text>,
        available_at -> Nullable<Timestamp>,
        delivered_at -> Nullable<Timestamp>,
    }
}

/// An outbox message as (id, topic, status, attempts, last error).
pub type OutboxRow = (String, String, String, i32, Option<String>);

/// When an outbox message is next due (for a leased message: when its lease
/// ends) and when it was delivered, as the relay's clock wrote them.
pub type OutboxSchedule = (Option<chrono::NaiveDateTime>, Option<chrono::NaiveDateTime>);

/// A database for one test on one backend, with the crate's migrations and
/// the `orders` table, and the queries the tests check it with.
pub trait TestDb: Sized + Send + Sync + 'static {
    /// The backend's diesel connection. It is its own `Raw`: the operation
    /// of a call on it, plain or pooled, receives this type. `RawConnection`
    /// is stated although `Raw` implies it, because the compiler forgets
    /// what it knows of `Raw` once it has replaced `Raw` by `Conn`: the
    /// steps of a phased operation and a completer need it.
    type Conn: StoreConnection<Raw = Self::Conn>
        + RawConnection
        + Connection<TransactionManager = AnsiTransactionManager>
        + R2D2Connection
        + Send
        + 'static;

    /// The name of the backend, which is also the name of its module of
    /// tests (`sqlite::name`).
    const BACKEND: &'static str;

    /// What [`TestDb::new`] runs on an empty database before the crate's
    /// migrations: the `orders` table, and any setting of the database's own.
    const SETUP: &'static str;

    /// Whether a top-level call on a fresh key writes its key record once,
    /// after the operation. MySQL claims every key before the operation and
    /// PostgreSQL a fresh one with its lock, and both complete the record
    /// after it (see the crate's `backend::mysql` and `backend::postgres`).
    const WRITES_KEY_RECORD_ONCE: bool = true;

    /// A new database of its own with nothing in it, for a program that sets
    /// it up itself (the HTTP example); gone when dropped.
    fn empty() -> Self;

    /// A new database of its own with the `orders` table, migrated; gone
    /// when dropped.
    fn new() -> Self {
        let db = Self::empty();
        let mut conn = db.conn();
        conn.batch_execute(Self::SETUP).expect("create the orders table");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    /// The url that reaches this database, for a child process.
    fn url(&self) -> &str;

    /// A new connection to this database.
    fn conn(&self) -> Self::Conn {
        Self::Conn::establish(self.url()).unwrap_or_else(|error| panic!("connect to the test's database: {error}"))
    }

    /// A pool of `size` connections to this database.
    fn pool(&self, size: u32) -> Pool<ConnectionManager<Self::Conn>> {
        Self::pool_at(self.url(), size)
    }

    /// A pool on a database that `new` made, by its url: for a child process
    /// that works on its parent's database.
    fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<Self::Conn>> {
        Pool::builder()
            .max_size(size)
            .build(ConnectionManager::new(url))
            .expect("build a pool")
    }

    /// What the order service of [`http`] runs on an empty database before
    /// the crate's migrations: an `orders` table whose orders belong to
    /// accounts, with room for items of 1,000 characters.
    const SERVICE_SETUP: &'static str;

    /// Inserts an order of `account` into the order service's table and
    /// returns its id.
    fn place_account_order(conn: &mut Self::Conn, account: &str, item: &str, quantity: i32) -> QueryResult<i64>;

    /// The orders of `account` in the order service's table, oldest first,
    /// as (id, item, quantity).
    fn account_orders(conn: &mut Self::Conn, account: &str) -> QueryResult<Vec<(i64, String, i32)>>;

    /// Inserts an order and returns its id.
    fn place_order(conn: &mut Self::Conn, item: &str, quantity: i32) -> QueryResult<i64>;

    /// How many orders there are.
    fn order_count(conn: &mut Self::Conn) -> i64;

    /// The items of all orders, in the order they were placed.
    fn order_items(conn: &mut Self::Conn) -> Vec<String> {
        Self::orders(conn).into_iter().map(|(_, item)| item).collect()
    }

    /// The ids and items of all orders, in the order they were placed.
    fn orders(conn: &mut Self::Conn) -> Vec<(i64, String)>;

    /// How many key records there are.
    fn key_count(conn: &mut Self::Conn) -> i64;

    /// The stored request fingerprints of all key records.
    fn request_hashes(conn: &mut Self::Conn) -> Vec<String>;

    /// The keys of the key records in `scope`.
    fn keys_in_scope(conn: &mut Self::Conn, scope: &str) -> Vec<String>;

    /// The keys of the key records in `scope` with their stored responses,
    /// in key order.
    fn responses_in_scope(conn: &mut Self::Conn, scope: &str) -> Vec<(String, Option<String>)>;

    /// The outbox messages, in id order.
    fn outbox_messages(conn: &mut Self::Conn) -> Vec<OutboxRow>;

    /// The schedule of outbox message `id`.
    fn outbox_schedule(conn: &mut Self::Conn, id: &str) -> OutboxSchedule;

    /// Returns once every transaction that wrote orders has ended, also one
    /// whose client died while the server was still committing it.
    fn await_order_writers(conn: &mut Self::Conn);

    /// Whether the connection is inside a transaction.
    fn in_transaction(conn: &mut Self::Conn) -> bool {
        AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .expect("a healthy transaction manager")
            .is_some()
    }
}

/// The queries of [`TestDb`] that read the same on every backend, for the
/// `impl TestDb` of a backend's `Db`, whose connection is `$conn`; with
/// `with_returning`, also those written with `RETURNING`, which MySQL does
/// not have.
macro_rules! same_on_every_backend {
    ($conn:ty, with_returning) => {
        fn place_account_order(conn: &mut $conn, account: &str, item: &str, quantity: i32) -> QueryResult<i64> {
            use $crate::common::account_orders as o;
            diesel::insert_into(o::table)
                .values((o::account.eq(account), o::item.eq(item), o::quantity.eq(quantity)))
                .returning(o::id)
                .get_result(conn)
        }

        fn place_order(conn: &mut $conn, item: &str, quantity: i32) -> QueryResult<i64> {
            use $crate::common::orders;
            diesel::insert_into(orders::table)
                .values((orders::item.eq(item), orders::quantity.eq(quantity)))
                .returning(orders::id)
                .get_result(conn)
        }

        fn outbox_schedule(conn: &mut $conn, id: &str) -> $crate::common::OutboxSchedule {
            use $crate::common::idempotency_outbox as o;
            o::table
                .find(id)
                .select((o::available_at, o::delivered_at))
                .get_result(conn)
                .expect("read the message's schedule")
        }

        $crate::common::same_on_every_backend!($conn);
    };
    ($conn:ty) => {
        fn account_orders(conn: &mut $conn, account: &str) -> QueryResult<Vec<(i64, String, i32)>> {
            use $crate::common::account_orders as o;
            o::table
                .filter(o::account.eq(account))
                .order(o::id)
                .select((o::id, o::item, o::quantity))
                .load(conn)
        }

        fn order_count(conn: &mut $conn) -> i64 {
            $crate::common::orders::table
                .count()
                .get_result(conn)
                .expect("count orders")
        }

        fn orders(conn: &mut $conn) -> Vec<(i64, String)> {
            use $crate::common::orders;
            orders::table
                .order(orders::id)
                .select((orders::id, orders::item))
                .load(conn)
                .expect("read the orders")
        }

        fn key_count(conn: &mut $conn) -> i64 {
            $crate::common::idempotency_keys::table
                .count()
                .get_result(conn)
                .expect("count key records")
        }

        fn request_hashes(conn: &mut $conn) -> Vec<String> {
            use $crate::common::idempotency_keys as k;
            k::table
                .select(k::request_hash)
                .load(conn)
                .expect("read the key records")
        }

        fn keys_in_scope(conn: &mut $conn, scope: &str) -> Vec<String> {
            use $crate::common::idempotency_keys as k;
            k::table
                .filter(k::scope.eq(scope))
                .select(k::idempotency_key)
                .load(conn)
                .expect("read the key records")
        }

        fn responses_in_scope(conn: &mut $conn, scope: &str) -> Vec<(String, Option<String>)> {
            use $crate::common::idempotency_keys as k;
            k::table
                .filter(k::scope.eq(scope))
                .order(k::idempotency_key)
                .select((k::idempotency_key, k::response))
                .load(conn)
                .expect("read the key records")
        }

        fn outbox_messages(conn: &mut $conn) -> Vec<$crate::common::OutboxRow> {
            use $crate::common::idempotency_outbox as o;
            o::table
                .order(o::id)
                .select((o::id, o::topic, o::status, o::attempts, o::last_error))
                .load(conn)
                .expect("read the outbox")
        }
    };
}
pub(crate) use same_on_every_backend;

/// The isolation levels of SQL transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    /// Every level, weakest first.
    pub const ALL: [Isolation; 3] = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];

    /// How SQL names the level.
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A database on a server, whose sessions a test can watch, and end as a
/// crash, an operator or a failover would. A session is known by the
/// server's id for it: PostgreSQL's backend pid, MySQL's connection id.
pub trait ServerDb: TestDb {
    /// The server's id of the session that `conn` holds.
    fn session_id(conn: &mut Self::Conn) -> i64;

    /// Ends session `id` from `admin`, whatever it is doing; a session that
    /// is already gone is no error.
    fn kill_session(admin: &mut Self::Conn, id: i64);

    /// Whether session `id` is there.
    fn session_exists(admin: &mut Self::Conn, id: i64) -> bool;

    /// Whether session `id` is there with no transaction open, as the server
    /// sees it.
    fn session_is_idle(admin: &mut Self::Conn, id: i64) -> bool;

    /// Whether session `id` waits for the lock by which another call holds a
    /// key (PostgreSQL: a lock not granted; MySQL: the key's named lock).
    fn session_waits_for_a_key(admin: &mut Self::Conn, id: i64) -> bool;

    /// The session that holds the lock of `(scope, key)` in this database,
    /// if any (PostgreSQL: the key's advisory lock; MySQL: its named lock).
    fn key_lock_holder(&self, admin: &mut Self::Conn, scope: &str, key: &str) -> Option<i64>;

    /// The session's own bound on how long a statement waits for a lock, as
    /// the server shows it (PostgreSQL: `lock_timeout`; MySQL:
    /// `innodb_lock_wait_timeout`).
    fn lock_wait_setting(conn: &mut Self::Conn) -> String;

    /// Sets that bound to 7 seconds for the rest of the caller's transaction
    /// `tx` (or longer), and returns how [`ServerDb::lock_wait_setting`]
    /// shows it.
    fn set_lock_wait_to_seven_seconds(tx: &mut Self::Conn) -> QueryResult<String>;

    /// Makes the transactions of `conn`'s session run at `isolation`.
    fn set_session_isolation(conn: &mut Self::Conn, isolation: Isolation);

    /// The isolation level the next statement on `conn` runs at, as the
    /// server names it.
    fn isolation(conn: &mut Self::Conn) -> QueryResult<String>;

    /// How the server names `isolation`.
    fn isolation_name(isolation: Isolation) -> String;

    /// Waits until session `id` waits for the lock of a key.
    fn wait_until_waiting_for_a_key(admin: &mut Self::Conn, id: i64) {
        wait::wait_for(&format!("session {id} waiting for a key's lock"), || {
            Self::session_waits_for_a_key(admin, id)
        });
    }

    /// Waits until the server has ended session `id`.
    fn wait_until_gone(admin: &mut Self::Conn, id: i64) {
        wait::wait_for(&format!("session {id} gone"), || !Self::session_exists(admin, id));
    }

    /// A new connection whose session runs its transactions at `isolation`.
    fn session_at(&self, isolation: Isolation) -> Self::Conn {
        let mut conn = self.conn();
        Self::set_session_isolation(&mut conn, isolation);
        conn
    }
}

/// The message of the panic that `caught`, what `std::panic::catch_unwind`
/// returned, holds: a test tells the panic it raised from another.
pub fn panic_message<T>(caught: std::thread::Result<T>) -> String {
    let Err(payload) = caught else {
        panic!("the panic did not reach the caller")
    };
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(message), _) => (*message).to_owned(),
        (None, Some(message)) => message.clone(),
        (None, None) => panic!("a panic without a message"),
    }
}

/// A policy that keeps records an hour by a clock of the test's own, which
/// the test advances past it: for the tests of expiry.
pub fn kept_an_hour() -> (idempotency::testing::ManualClock, idempotency::Config) {
    let clock = idempotency::testing::ManualClock::new();
    let config = idempotency::Config::default()
        .retention(chrono::Duration::hours(1))
        .clock(clock.source());
    (clock, config)
}

/// A request type with hash sets, at the top and nested: each time it is
/// read, its sets hold their members in another order.
#[derive(serde::Deserialize, serde::Serialize)]
pub struct Tagged {
    pub tags: std::collections::HashSet<String>,
    pub groups: Vec<std::collections::HashSet<u32>>,
    pub by_owner: std::collections::HashMap<String, std::collections::HashSet<String>>,
    pub optional: Option<std::collections::HashSet<String>>,
}

/// A [`Tagged`] as JSON, with sets of sixteen members: enough that two reads
/// of it are all but sure to order a set differently.
pub fn tagged_body() -> String {
    let tags: Vec<String> = (0..16).map(|i| format!("\"tag-{i}\"")).collect();
    let tags = format!("[{}]", tags.join(","));
    format!(
        r#"{{"tags": {tags}, "groups": [[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16], [0]], "by_owner": {{"ann": {tags}}}, "optional": {tags}}}"#
    )
}

/// The bytes of `text` with its `%XX` escapes decoded; a `%` not followed by
/// two hex digits stands for itself.
pub fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escape = bytes
            .get(at + 1..at + 3)
            .filter(|hex| bytes[at] == b'%' && hex.iter().all(u8::is_ascii_hexdigit));
        match escape.and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()) {
            Some(byte) => {
                out.push(byte);
                at += 3;
            }
            None => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    out
}

/// The SHA-256 by which the crate locks `(scope, key)`: each part prefixed
/// with its length. A test that derives the lock as the crate does can see
/// it held, or free.
pub fn key_hash(scope: &str, key: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for part in [scope, key] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

/// As [`backend_tests!`], for the backends with a server: PostgreSQL and
/// MySQL, as their features are enabled.
macro_rules! server_backend_tests {
    ($($test:ident),+ $(,)?) => {
        #[cfg(feature = "postgres")]
        $crate::common::backend_tests!(@backend [sync] postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::backend_tests!(@backend [sync] mysql, $crate::common::mysql::Db, $($test),+);
    };
}
pub(crate) use server_backend_tests;

/// The name by which the test harness knows test `name` of the module whose
/// `module_path!()` is `module`: for a test that runs itself again in a child
/// process (`--exact`). The harness leaves out the name of the crate.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_owned(),
    }
}

/// The name of test `name` of backend `D`, as [`backend_tests!`] emits it in
/// the module whose `module_path!()` is `module`.
pub fn test_name<D: TestDb>(module: &str, name: &str) -> String {
    test_path(module, &format!("{}::{name}", D::BACKEND))
}
