//! Where key records live: the connection types this crate accepts and, per
//! backend, the few statements whose SQL or transaction handling differs.
//!
//! Everything the backends share is written once here with diesel's DSL;
//! `sqlite.rs` and `postgres.rs` hold only what differs: how a transaction is
//! opened, how the claim waits for a key held elsewhere, how that wait is
//! recognised when it times out, and how a purge batch picks its rows.

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
use diesel_migrations::MigrationHarness;

use crate::config::InFlight;
use crate::schema::idempotency_keys;

/// The methods of [`Backend`] whose DSL is the same on every backend.
/// diesel's query types are concrete per connection, so a generic function
/// would need a bound for every intermediate query type; the bodies are
/// written once here and expanded into each backend's impl instead.
macro_rules! shared_queries {
    () => {
        fn find(&mut self, scope: &str, key: &str) -> diesel::QueryResult<Option<$crate::store::Stored>> {
            use crate::schema::idempotency_keys as k;
            use diesel::prelude::*;
            k::table
                .find((scope, key))
                .select((k::request_hash, k::status, k::response, k::expires_at))
                .first(self)
                .optional()
        }

        fn complete(
            &mut self,
            scope: &str,
            key: &str,
            response: &str,
            at: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<()> {
            use crate::schema::idempotency_keys as k;
            use diesel::prelude::*;
            let updated = diesel::update(k::table.find((scope, key)))
                .set((
                    k::status.eq($crate::store::COMPLETED),
                    k::response.eq(response),
                    k::completed_at.eq(at),
                ))
                .execute(self)?;
            // The record was claimed by this transaction a moment ago;
            // anything else means something interferes with the table, and
            // committing would leave an executed operation without its
            // result.
            if updated == 1 {
                Ok(())
            } else {
                Err(diesel::result::Error::NotFound)
            }
        }
    };
}
pub(crate) use shared_queries;

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub(crate) const PROCESSING: &str = "processing";
pub(crate) const COMPLETED: &str = "completed";

/// A diesel connection that idempotent calls can run on:
/// `SqliteConnection` (feature `sqlite`), `PgConnection` (feature
/// `postgres`), or an r2d2 `PooledConnection` of either.
///
/// The operation of an idempotent call receives the underlying connection,
/// [`StoreConnection::Raw`], also when the call was given a pooled one, so
/// repository functions taking `&mut PgConnection` plug in as they are.
///
/// This trait is sealed: the crate implements it for the backends it stores
/// keys on.
pub trait StoreConnection: sealed::Sealed {
    /// The diesel connection that the operation runs on.
    type Raw: Backend;

    /// The diesel connection behind this one.
    fn raw(&mut self) -> &mut Self::Raw;
}

impl<C> StoreConnection for PooledConnection<ConnectionManager<C>>
where
    C: Backend + R2D2Connection + Send + 'static,
{
    type Raw = C;

    fn raw(&mut self) -> &mut C {
        self
    }
}

impl<C> sealed::Sealed for PooledConnection<ConnectionManager<C>> where C: Backend + R2D2Connection + Send + 'static {}

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// The record as it is claimed: status `processing`, no response yet.
#[derive(Insertable)]
#[diesel(table_name = idempotency_keys)]
pub struct NewRecord<'a> {
    pub(crate) scope: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) request_hash: &'a str,
    pub(crate) status: &'a str,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) expires_at: NaiveDateTime,
}

/// What a replay needs of a stored record.
#[derive(Queryable)]
#[diesel(table_name = idempotency_keys)]
pub struct Stored {
    pub(crate) request_hash: String,
    pub(crate) status: String,
    pub(crate) response: Option<String>,
    pub(crate) expires_at: NaiveDateTime,
}

/// The per-backend part of storage. Implemented by the diesel connection
/// types only; the combinator in `run.rs` is written against it alone.
pub trait Backend:
    Connection<TransactionManager = AnsiTransactionManager> + MigrationHarness<<Self as Connection>::Backend> + Sized
{
    /// Runs `f` in a transaction that may write at once, or in a savepoint
    /// when a transaction is already open. On return the transaction is
    /// committed if `f` succeeded and rolled back otherwise.
    #[doc(hidden)]
    fn write_transaction<T, E>(
        &mut self,
        in_flight: InFlight,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<diesel::result::Error>;

    /// Inserts `record`, or takes over an expired record with its key.
    /// Returns whether the key is now this transaction's; `false` means an
    /// unexpired record exists. Waits for a record held by another
    /// transaction as the `in_flight` policy given to
    /// [`write_transaction`](Backend::write_transaction) allows.
    #[doc(hidden)]
    fn claim(&mut self, record: &NewRecord<'_>) -> QueryResult<bool>;

    /// Whether `error` means the in-flight wait ran out.
    #[doc(hidden)]
    fn is_in_flight_timeout(error: &diesel::result::Error) -> bool;

    /// Deletes at most `limit` records expired at `cutoff`.
    #[doc(hidden)]
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize, in_flight: InFlight) -> QueryResult<usize>;

    /// The stored record for `(scope, key)`.
    #[doc(hidden)]
    fn find(&mut self, scope: &str, key: &str) -> QueryResult<Option<Stored>>;

    /// Stores the response of a claimed record and marks it completed.
    #[doc(hidden)]
    fn complete(&mut self, scope: &str, key: &str, response: &str, at: NaiveDateTime) -> QueryResult<()>;
}

/// A row count as SQL's `LIMIT` takes it.
pub(crate) fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// How deep the connection's open transactions are nested; 0 outside one.
pub(crate) fn transaction_depth<C: Backend>(conn: &mut C) -> QueryResult<u32> {
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()?;
    Ok(depth.map_or(0, |depth| depth.get()))
}

/// Runs `f` in a transaction opened by `begin` (which must open exactly one
/// level), committing if `f` succeeds and rolling back otherwise, as
/// diesel's own `transaction` does for its fixed `BEGIN`.
pub(crate) fn transaction_with<C, T, E>(
    conn: &mut C,
    begin: impl FnOnce(&mut C) -> QueryResult<()>,
    f: impl FnOnce(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    C: Backend,
    E: From<diesel::result::Error>,
{
    begin(conn)?;
    match f(conn) {
        Ok(value) => {
            AnsiTransactionManager::commit_transaction(conn)?;
            Ok(value)
        }
        Err(error) => match AnsiTransactionManager::rollback_transaction(conn) {
            Ok(()) | Err(diesel::result::Error::BrokenTransactionManager) => Err(error),
            Err(rollback_error) => Err(rollback_error.into()),
        },
    }
}

/// Rolls back the levels an operation opened and left open when it panicked,
/// so that the caller's own level can be rolled back as usual.
pub(crate) fn unwind_to_depth<C: Backend>(conn: &mut C, depth: u32) -> QueryResult<()> {
    while transaction_depth(conn)? > depth {
        AnsiTransactionManager::rollback_transaction(conn)?;
    }
    Ok(())
}
