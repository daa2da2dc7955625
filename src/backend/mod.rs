//! The backends: the connection types this crate stores keys on, and the
//! traits generic code names in its bounds.
//!
//! Code written once for every backend is generic over
//! [`StoreConnection`] (a plain diesel connection or a pooled one) or
//! [`RawConnection`] (the plain connection an operation receives). Both are
//! sealed, the way diesel seals `Connection`: the statements each database
//! needs are the methods of supertraits in a private module, which only
//! the crate implements and calls. Each table has one store trait, the same
//! for both kinds of connection ([`KeyStore`], `PhaseStore`, `OutboxStore`):
//! async-shaped, so that the protocol written against it exists once; a
//! synchronous connection's methods complete as they are sent, and a
//! synchronous entry point drives them with [`block_on`]. What only the
//! services on threads run is in the `Blocking*` traits beside them. A
//! database's rules (its name, limits and error classifiers) are
//! [`BackendRules`] on diesel's backend type.
//!
//! Everything one database does lives in its own folder of the source
//! (`sqlite/`, `postgres/`, `mysql/`: its connection impls, how it holds a
//! key, its clock, and its key, outbox and phase statements); what the
//! backends share is written once beside them: `keys/`, `outbox/` and
//! `phases/` (each statement trait, its rows and its shared statements),
//! `transaction.rs` and `purge.rs`.
//!
//! The write transaction first holds the key (SQLite: the database's write
//! lock; PostgreSQL: an advisory lock on the key; MySQL: a named lock on the
//! key). On SQLite it reads the record under that lock, runs the operation
//! and inserts the record once, completed. On PostgreSQL a key the replay
//! read found free is claimed in the round trip that takes the lock, and the
//! claim is completed after the operation. Where a read under the lock could
//! miss a concurrent commit (a call nested in a caller's transaction, a
//! PostgreSQL session at `REPEATABLE READ` or above, every call on MySQL,
//! whose named locks do not last as long as a caller's transaction), the
//! transaction claims the key with a guarded insert before the operation and
//! completes the record after it; otherwise a record found is read under the
//! lock and replaced once. Either way the primary key backs the lock: a
//! writer that got past it cannot commit a second record.

use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};

/// Makes a backend's plain connection a [`RawConnection`]: its own
/// [`StoreConnection::Raw`].
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! raw_connection {
    ($conn:ty) => {
        impl $crate::backend::StoreConnection for $conn {
            type Raw = Self;

            fn raw(&mut self) -> &mut Self {
                self
            }
        }

        impl $crate::backend::sealed::Sealed for $conn {}

        impl $crate::backend::RawConnection for $conn {}
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use raw_connection;

mod future;
mod keys;
pub(crate) mod migrate;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
pub(crate) mod outbox;
pub(crate) mod phases;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod purge;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod row_with;
mod rules;
#[cfg(feature = "sqlite")]
mod sqlite;
mod transaction;

#[cfg(any(feature = "postgres-async", feature = "mysql-async"))]
pub(crate) use future::{AsyncTransaction, async_transaction_depth, async_unwind_to_depth, end_transaction};
pub(crate) use future::{Panic, block_on, catch_unwind};
pub(crate) use keys::{BlockingStore, ClaimOutcome, HeldKey, Hold, KeyRecordChanged, KeyStore, Read, Record, Stored};
pub(crate) use migrate::History;
pub(crate) use outbox::BlockingOutboxStore;
pub(crate) use phases::BlockingPhaseStore;
pub(crate) use purge::{purge_in_batches, sql_limit};
pub(crate) use rules::BackendRules;

/// The rules of the database that connection `C` reaches.
pub(crate) type RulesOf<C> = <C as KeyStore>::Rules;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use transaction::end_level;
pub(crate) use transaction::{transaction_depth, unwind_to_depth};

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
pub trait AsyncStoreConnection: KeyStore + phases::PhaseStore + outbox::OutboxStore + Send + sealed::Sealed {}

pub(crate) mod sealed {
    pub trait Sealed {}
}
