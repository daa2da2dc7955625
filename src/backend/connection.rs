//! The connection traits generic code names in its bounds: a plain or
//! pooled connection ([`StoreConnection`]), the plain one an operation
//! receives ([`RawConnection`]), and a diesel-async one
//! ([`AsyncStoreConnection`]). Sealed, the way diesel seals `Connection`.

use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};

use super::history::History;
use super::keys::BlockingStore;
#[cfg(feature = "diesel-async")]
use super::keys::KeyStore;
use super::outbox::BlockingOutboxStore;
#[cfg(feature = "diesel-async")]
use super::outbox::OutboxStore;
use super::phases::BlockingPhaseStore;
#[cfg(feature = "diesel-async")]
use super::phases::PhaseStore;
use super::sealed;

/// Makes a backend's plain connection a [`RawConnection`]: its own
/// [`StoreConnection::Raw`].
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! raw_connection {
    ($conn:ty) => {
        impl $crate::backend::connection::StoreConnection for $conn {
            type Raw = Self;

            fn raw(&mut self) -> &mut Self {
                self
            }
        }

        impl $crate::backend::sealed::Sealed for $conn {}

        impl $crate::backend::connection::RawConnection for $conn {}
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(super) use raw_connection;

/// A diesel connection that idempotent calls can run on:
/// `SqliteConnection` (feature `sqlite`), `PgConnection` (feature
/// `postgres`), `MysqlConnection` (feature `mysql`), or an r2d2
/// `PooledConnection` of any of them.
///
/// The operation of an idempotent call receives the underlying connection,
/// [`StoreConnection::Raw`], also when the call was given a pooled one, so
/// repository functions taking `&mut PgConnection` plug in as they are.
/// `Raw` is a `StoreConnection` itself, so an operation can enqueue outbox
/// messages or make nested calls on it.
///
/// The trait is sealed, the way diesel seals `Connection`: name it in
/// bounds to write code once for every backend; only this crate implements
/// it. `C: StoreConnection` is all that any function of the crate asks of a
/// connection.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::convert::Infallible;
///
/// use idempotency::outbox::{self, Relay};
/// use idempotency::{run_idempotent, Error, Outcome, StoreConnection};
///
/// // Written once; SQLite in the tests, PostgreSQL in production, pooled or not.
/// fn place_with_receipt<C: StoreConnection>(conn: &mut C, key: &str) -> Result<Outcome<u32>, Error<outbox::Error>> {
///     run_idempotent(conn, "shop", key, &"book", |tx| {
///         outbox::enqueue(tx, "receipts", &"book")?;
///         Ok(1)
///     })
/// }
///
/// fn deliver_all<C: StoreConnection>(conn: &mut C) -> Result<usize, outbox::Error> {
///     Ok(Relay::default().run_once(conn, |_m| Ok::<_, Infallible>(()))?.delivered)
/// }
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// assert_eq!(place_with_receipt(&mut conn, "order-1")?, Outcome::Executed(1));
/// assert_eq!(place_with_receipt(&mut conn, "order-1")?, Outcome::Replayed(1));
/// assert_eq!(deliver_all(&mut conn)?, 1);
/// # Ok(())
/// # }
/// ```
pub trait StoreConnection: sealed::Sealed {
    /// The diesel connection that the operation runs on.
    type Raw: RawConnection;

    /// The diesel connection behind this one.
    fn raw(&mut self) -> &mut Self::Raw;
}

/// A plain diesel connection of a backend this crate stores keys on:
/// `SqliteConnection`, `PgConnection` or `MysqlConnection`, what an
/// operation receives as
/// [`StoreConnection::Raw`]. Sealed like [`StoreConnection`]: name it in
/// bounds where code is generic over the plain connection itself (a
/// [`Completer`](crate::phased::Completer) of it, say); only the crate
/// implements it. Its supertraits besides `StoreConnection` hold the
/// crate's statements (key records, outbox, phases); they are private, and
/// `RawConnection` is the one bound that brings them all.
pub trait RawConnection:
    StoreConnection<Raw = Self> + BlockingStore + BlockingOutboxStore + BlockingPhaseStore + History
{
}

impl<C> StoreConnection for PooledConnection<ConnectionManager<C>>
where
    C: StoreConnection + R2D2Connection + Send + 'static,
{
    type Raw = C::Raw;

    fn raw(&mut self) -> &mut C::Raw {
        (**self).raw()
    }
}

impl<C> sealed::Sealed for PooledConnection<ConnectionManager<C>> where
    C: StoreConnection + R2D2Connection + Send + 'static
{
}

/// A diesel-async connection that idempotent calls can run on
/// (feature `diesel-async`, enabled by each of the backends' async
/// features): `AsyncPgConnection` (feature `postgres-async`),
/// `AsyncMysqlConnection` (`mysql-async`), or
/// `SyncConnectionWrapper<SqliteConnection>` (`sqlite-async`). The
/// operation of [`run_idempotent_async`](crate::run_idempotent_async)
/// receives the same connection, inside the call's transaction. A pooled
/// connection (bb8, deadpool) is passed as the connection it derefs to:
/// `&mut *pooled`.
///
/// Sealed like [`StoreConnection`]; its private supertrait sends and
/// awaits the statements of the protocol every call shares.
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::{run_idempotent_async, AsyncStoreConnection, Error, Outcome};
///
/// // Written once: SQLite in the tests, PostgreSQL in production.
/// async fn place<C: AsyncStoreConnection>(conn: &mut C, key: &str) -> Result<Outcome<u32>, Error> {
///     run_idempotent_async(conn, "shop", key, &"book", async |_: &mut C| Ok(1)).await
/// }
///
/// let mut conn = idempotency::testing::sqlite_memory_async();
/// assert_eq!(place(&mut conn, "order-1").await?, Outcome::Executed(1));
/// assert_eq!(place(&mut conn, "order-1").await?, Outcome::Replayed(1));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub trait AsyncStoreConnection: KeyStore + PhaseStore + OutboxStore + Send + sealed::Sealed {}
