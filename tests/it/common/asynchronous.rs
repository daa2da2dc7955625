//! The async connections of the backends that have one in the tests: how a
//! test opens one on its database and writes an order through it. The
//! tables, the truth a test checks, are read through the backend's
//! synchronous [`TestDb`] connection, as every other test reads them.

use std::future::Future;

use diesel::sqlite::SqliteConnection;
use diesel::{ExpressionMethods, QueryResult};
#[cfg(feature = "mysql")]
use diesel_async::AsyncMysqlConnection;
#[cfg(feature = "postgres")]
use diesel_async::AsyncPgConnection;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, PoolableConnection};
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_async::{AsyncConnection, RunQueryDsl};
use idempotency::outbox::{Deliveries, HandlerError, Message, Relay};
use idempotency::{AsyncConnectionPool, AsyncStoreConnection, Shutdown, Stopped};

use super::{ServerDb, TestDb, orders};

/// A backend whose database a test also reaches through diesel-async.
pub trait AsyncDb: TestDb {
    /// The backend's diesel-async connection.
    type Async: AsyncStoreConnection + AsyncConnection + PoolableConnection + Send + 'static;

    /// A bb8 pool of [`Async`](AsyncDb::Async) connections.
    type Bb8: AsyncConnectionPool<Connection = Self::Async> + Clone + 'static;

    /// A deadpool pool of [`Async`](AsyncDb::Async) connections.
    type Deadpool: AsyncConnectionPool<Connection = Self::Async> + Clone + 'static;

    /// A new async connection to this test's database.
    fn connect(&self) -> impl Future<Output = Self::Async> + Send;

    /// Inserts an order of one `item` through `conn`.
    fn insert_order(conn: &mut Self::Async, item: &str) -> impl Future<Output = QueryResult<()>> + Send;

    /// A bb8 pool of at most `size` async connections to this test's
    /// database.
    fn bb8(&self, size: u32) -> impl Future<Output = Self::Bb8> + Send;

    /// A deadpool pool of at most `size` async connections to this test's
    /// database.
    fn deadpool(&self, size: u32) -> impl Future<Output = Self::Deadpool> + Send;

    /// `relay.serve_async` on `pool` with `handler`, spawned as an
    /// application spawns it: its future is `Send` on every backend.
    fn spawn_relay<P, E, F, H>(
        pool: P,
        relay: Relay,
        handler: H,
        shutdown: Shutdown,
    ) -> tokio::task::JoinHandle<Stopped<Deliveries>>
    where
        P: AsyncConnectionPool<Connection = Self::Async> + 'static,
        E: HandlerError + 'static,
        F: Future<Output = Result<(), E>> + Send + 'static,
        H: Fn(Message) -> F + Send + Sync + 'static;
}

/// A bb8 pool of at most `size` connections of `manager`.
pub async fn bb8_pool<C>(
    manager: AsyncDieselConnectionManager<C>,
    size: u32,
) -> diesel_async::pooled_connection::bb8::Pool<C>
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: bb8::ManageConnection<Connection = C>,
{
    bb8::Pool::builder()
        .max_size(size)
        .build(manager)
        .await
        .expect("a bb8 pool")
}

/// A deadpool pool of at most `size` connections of `manager`.
pub async fn deadpool_pool<C>(
    manager: AsyncDieselConnectionManager<C>,
    size: u32,
) -> diesel_async::pooled_connection::deadpool::Pool<C>
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>:
        deadpool::managed::Manager<Type = C, Error = diesel_async::pooled_connection::PoolError>,
{
    diesel_async::pooled_connection::deadpool::Pool::builder(manager)
        .max_size(usize::try_from(size).expect("a pool size"))
        .build()
        .expect("a deadpool pool")
}

/// A backend with a server that a test also reaches through diesel-async.
pub trait AsyncServerDb: AsyncDb<Async: PoolableConnection> + ServerDb {
    /// bb8's manager of the backend's async connections.
    type Manager: bb8::ManageConnection<Connection = Self::Async>;

    /// Whether a future dropped while a statement of its connection is in
    /// flight leaves the connection to be discarded, wherever it was: the
    /// statement's reply may still arrive (diesel-async 0.10's MySQL
    /// connection), so no cut leaves the connection as it was.
    const CUT_STATEMENT_DISCARDS_THE_CONNECTION: bool;

    /// A bb8 pool of at most `size` async connections to this test's
    /// database.
    fn async_pool(&self, size: u32) -> impl Future<Output = bb8::Pool<Self::Manager>> + Send;

    /// The server's id of `conn`'s session, as [`ServerDb`] names sessions.
    fn session_of(conn: &mut Self::Async) -> impl Future<Output = i64> + Send;

    /// The bound the session of `conn` puts on how long the server waits
    /// for its client, as the server shows it outside a transaction
    /// (PostgreSQL: `idle_in_transaction_session_timeout`; MySQL:
    /// `wait_timeout`, which a call lowers for as long as it holds its key).
    fn idle_bound(conn: &mut Self::Async) -> impl Future<Output = String> + Send;
}

/// A connection from `pool`, checked as the pool must lend it after a call
/// was cut: not marked broken, and its session in no transaction as
/// `admin` sees it.
pub async fn lent_outside_a_transaction<'a, D: AsyncServerDb>(
    pool: &'a bb8::Pool<D::Manager>,
    admin: &mut D::Conn,
) -> bb8::PooledConnection<'a, D::Manager> {
    let mut conn = pool.get().await.expect("a connection from the pool");
    assert!(!conn.is_broken(), "the pool lends no connection inside a transaction");
    let lent = D::session_of(&mut conn).await;
    assert!(D::session_is_idle(admin, lent), "the lent session is in no transaction");
    conn
}

/// The [`AsyncDb`] of backend `$db`, whose diesel-async connection is
/// `$conn`.
macro_rules! async_db {
    ($db:ty, $conn:ty) => {
        impl AsyncDb for $db {
            type Async = $conn;
            type Bb8 = diesel_async::pooled_connection::bb8::Pool<$conn>;
            type Deadpool = diesel_async::pooled_connection::deadpool::Pool<$conn>;

            fn spawn_relay<P, E, F, H>(
                pool: P,
                relay: Relay,
                handler: H,
                shutdown: Shutdown,
            ) -> tokio::task::JoinHandle<Stopped<Deliveries>>
            where
                P: AsyncConnectionPool<Connection = $conn> + 'static,
                E: HandlerError + 'static,
                F: Future<Output = Result<(), E>> + Send + 'static,
                H: Fn(Message) -> F + Send + Sync + 'static,
            {
                tokio::spawn(async move { relay.serve_async(&pool, handler, &shutdown).await })
            }

            async fn connect(&self) -> $conn {
                <$conn>::establish(self.url())
                    .await
                    .expect("an async connection to the test's database")
            }

            async fn bb8(&self, size: u32) -> diesel_async::pooled_connection::bb8::Pool<$conn> {
                bb8_pool(AsyncDieselConnectionManager::new(self.url()), size).await
            }

            async fn deadpool(&self, size: u32) -> diesel_async::pooled_connection::deadpool::Pool<$conn> {
                deadpool_pool(AsyncDieselConnectionManager::new(self.url()), size).await
            }

            async fn insert_order(conn: &mut $conn, item: &str) -> QueryResult<()> {
                diesel::insert_into(orders::table)
                    .values((orders::item.eq(item), orders::quantity.eq(1)))
                    .execute(conn)
                    .await
                    .map(drop)
            }
        }
    };
}

async_db!(super::sqlite::Db, SyncConnectionWrapper<SqliteConnection>);
#[cfg(feature = "postgres")]
async_db!(super::pg::Db, AsyncPgConnection);
#[cfg(feature = "mysql")]
async_db!(super::mysql::Db, AsyncMysqlConnection);

#[cfg(feature = "postgres")]
impl AsyncServerDb for super::pg::Db {
    type Manager = AsyncDieselConnectionManager<AsyncPgConnection>;
    const CUT_STATEMENT_DISCARDS_THE_CONNECTION: bool = false;

    async fn async_pool(&self, size: u32) -> bb8::Pool<Self::Manager> {
        bb8_pool(AsyncDieselConnectionManager::new(self.url()), size).await
    }

    async fn session_of(conn: &mut AsyncPgConnection) -> i64 {
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>("pg_backend_pid()"))
            .get_result::<i32>(conn)
            .await
            .expect("the session's backend pid")
            .into()
    }

    async fn idle_bound(conn: &mut AsyncPgConnection) -> String {
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Text>(
            "current_setting('idle_in_transaction_session_timeout')",
        ))
        .get_result(conn)
        .await
        .expect("the session's idle_in_transaction_session_timeout")
    }
}

#[cfg(feature = "mysql")]
impl AsyncServerDb for super::mysql::Db {
    type Manager = AsyncDieselConnectionManager<AsyncMysqlConnection>;
    const CUT_STATEMENT_DISCARDS_THE_CONNECTION: bool = true;

    async fn async_pool(&self, size: u32) -> bb8::Pool<Self::Manager> {
        bb8_pool(AsyncDieselConnectionManager::new(self.url()), size).await
    }

    async fn session_of(conn: &mut AsyncMysqlConnection) -> i64 {
        let id: u64 = diesel::select(
            diesel::dsl::sql::<diesel::sql_types::Unsigned<diesel::sql_types::BigInt>>("CONNECTION_ID()"),
        )
        .get_result(conn)
        .await
        .expect("the session's connection id");
        i64::try_from(id).expect("a connection id within i64")
    }

    async fn idle_bound(conn: &mut AsyncMysqlConnection) -> String {
        diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>("@@SESSION.wait_timeout"))
            .get_result::<i64>(conn)
            .await
            .expect("the session's wait_timeout")
            .to_string()
    }
}

/// Emits a `#[tokio::test]` per backend with an async connection for each
/// `async fn name<D: AsyncDb>()` named; with `server:` first, per backend
/// with a server, for `async fn name<D: AsyncServerDb>()`.
macro_rules! async_backend_tests {
    (server: $($test:ident),+ $(,)?) => {
        #[cfg(feature = "postgres")]
        $crate::common::asynchronous::async_backend_tests!(@backend postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::asynchronous::async_backend_tests!(@backend mysql, $crate::common::mysql::Db, $($test),+);
    };
    ($($test:ident),+ $(,)?) => {
        $crate::common::asynchronous::async_backend_tests!(@backend sqlite, $crate::common::sqlite::Db, $($test),+);
        #[cfg(feature = "postgres")]
        $crate::common::asynchronous::async_backend_tests!(@backend postgres, $crate::common::pg::Db, $($test),+);
        #[cfg(feature = "mysql")]
        $crate::common::asynchronous::async_backend_tests!(@backend mysql, $crate::common::mysql::Db, $($test),+);
    };
    (@backend $backend:ident, $db:ty, $($test:ident),+) => {
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
pub(crate) use async_backend_tests;
