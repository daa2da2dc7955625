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
//! the macro.

// Each test binary uses a different part of the harness.
#![allow(dead_code, unused_macros, unused_imports)]

use std::sync::atomic::{AtomicU64, Ordering};

use diesel::QueryResult;
use diesel::connection::{AnsiTransactionManager, Connection, TransactionManager};
use diesel::r2d2::{ConnectionManager, Pool, PooledConnection, R2D2Connection};
use idempotency::{RawConnection, StoreConnection};

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod pg;
pub mod sqlite;

/// Emits a `#[test]` per backend for each generic test body named: a module
/// per backend, named as [`TestDb::BACKEND`], whose `name` runs
/// `super::name::<Db>()`.
macro_rules! backend_tests {
    ($($test:ident),+ $(,)?) => {
        $crate::common::backend_tests!(@backend sqlite, $crate::common::sqlite::Db, $($test),+);
        #[cfg(feature = "postgres")]
        $crate::common::backend_tests!(@backend postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::backend_tests!(@backend mysql, $crate::common::mysql::Db, $($test),+);
    };
    (@backend $backend:ident, $db:ty, $($test:ident),+) => {
        mod $backend {
            $(
                #[test]
                fn $test() {
                    super::$test::<$db>()
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
    /// The crate's key records, the columns the tests read.
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
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
pub trait TestDb: Sized + Sync {
    /// The backend's diesel connection. It is its own `Raw`: the operation
    /// of a call on it, plain or pooled, receives this type. `RawConnection`
    /// is stated although `Raw` implies it, because the compiler forgets
    /// what it knows of `Raw` once it has replaced `Raw` by `Conn`: the
    /// steps of a phased operation and a completer need it.
    type Conn: StoreConnection<Raw = Self::Conn>
        + RawConnection
        + Connection<TransactionManager = AnsiTransactionManager>
        + R2D2Connection
        + 'static;

    /// The name of the backend, which is also the name of its module of
    /// tests (`sqlite::name`).
    const BACKEND: &'static str;

    /// Whether a top-level call writes its key record once, after the
    /// operation. MySQL claims every key before the operation and completes
    /// the record after it (see the crate's `backend::mysql`).
    const WRITES_KEY_RECORD_ONCE: bool = true;

    /// A new, empty database of its own, migrated; gone when dropped.
    fn new() -> Self;

    /// The url that reaches this database, for a child process.
    fn url(&self) -> &str;

    /// A new connection to this database.
    fn conn(&self) -> Self::Conn;

    /// A pool of `size` connections to this database.
    fn pool(&self, size: u32) -> Pool<ConnectionManager<Self::Conn>> {
        Self::pool_at(self.url(), size)
    }

    /// A pool on a database that `new` made, by its url: for a child process
    /// that works on its parent's database.
    fn pool_at(url: &str, size: u32) -> Pool<ConnectionManager<Self::Conn>>;

    /// Inserts an order and returns its id.
    fn place_order(conn: &mut Self::Conn, item: &str, quantity: i32) -> QueryResult<i64>;

    /// How many orders there are.
    fn order_count(conn: &mut Self::Conn) -> i64;

    /// The items of all orders, in the order they were placed.
    fn order_items(conn: &mut Self::Conn) -> Vec<String>;

    /// How many key records there are.
    fn key_count(conn: &mut Self::Conn) -> i64;

    /// The stored request fingerprints of all key records.
    fn request_hashes(conn: &mut Self::Conn) -> Vec<String>;

    /// The keys of the key records in `scope`.
    fn keys_in_scope(conn: &mut Self::Conn, scope: &str) -> Vec<String>;

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

/// A database on a server, whose sessions a test can end as a crash, an
/// operator or a failover would.
pub trait ServerDb: TestDb {
    /// The server's id of the session that `conn` holds.
    fn session_id(conn: &mut Self::Conn) -> i64;

    /// Ends session `id` from `admin`, whatever it is doing; a session that
    /// is already gone is no error.
    fn kill_session(admin: &mut Self::Conn, id: i64);
}

/// As [`backend_tests!`], for the backends with a server: PostgreSQL and
/// MySQL, as their features are enabled.
macro_rules! server_backend_tests {
    ($($test:ident),+ $(,)?) => {
        #[cfg(feature = "postgres")]
        $crate::common::backend_tests!(@backend postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::backend_tests!(@backend mysql, $crate::common::mysql::Db, $($test),+);
    };
}
pub(crate) use server_backend_tests;

/// The name of test `name` of backend `D`, as the test harness knows it: for
/// a test that runs itself again in a child process.
pub fn test_name<D: TestDb>(name: &str) -> String {
    format!("{}::{name}", D::BACKEND)
}

/// A name no other test, in this process or another, is using.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
