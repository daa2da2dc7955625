//! The backends: the connection types this crate stores keys on, and the
//! traits generic code names in its bounds.
//!
//! Code written once for every backend is generic over
//! [`StoreConnection`] (a plain diesel connection or a pooled one) or
//! [`RawConnection`] (the plain connection an operation receives). Their
//! supertraits [`KeyStore`], [`OutboxStore`] and [`PhaseStore`] are the
//! statements each database needs; they are sealed, and their methods are
//! the crate's internals.
//!
//! Everything one database does lives in its own folder of the source
//! (`sqlite/`, `postgres/`, `mysql/`: its connection impls, how it holds a
//! key, its clock, and its key, outbox and phase statements); what the
//! backends share is written once beside them.
//!
//! A call writes its key record once, completed, after the operation: the
//! write transaction first holds the key (SQLite: the database's write lock;
//! PostgreSQL: an advisory lock on the key; MySQL: a named lock on the key),
//! reads the record under that lock, runs the operation and inserts the
//! record. Where a read under the lock could miss a concurrent commit (a
//! call nested in a caller's transaction, a PostgreSQL session at
//! `REPEATABLE READ` or above, every call on MySQL, whose named locks do not
//! last as long as a caller's transaction), the transaction instead claims
//! the key with a guarded insert before the operation and completes the
//! record after it. Either way the primary key backs the lock: a writer that
//! got past it cannot commit a second record.

use std::ops::RangeInclusive;
use std::time::Instant;

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};

use crate::in_flight::InFlight;
use crate::schema::idempotency_keys;
use crate::telemetry;

/// The methods of [`KeyStore`] whose DSL is the same on SQLite and
/// PostgreSQL. (MySQL, whose calls always claim first, only ever completes
/// a claimed record, with a statement it prepares once.) diesel's query
/// types are concrete per connection, so a generic function would need a
/// bound for every intermediate query type; the bodies are written once here
/// and expanded into each backend's impl instead, against the backend's
/// schema module.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! shared_queries {
    ($($schema:tt)+) => {
        fn find(&mut self, scope: &str, key: &str) -> diesel::QueryResult<Option<$crate::backend::Stored>> {
            use $($schema)+::idempotency_keys as k;
            use diesel::prelude::*;
            // A primary key lookup needs no LIMIT; a bound LIMIT would make
            // SQLite prepare the statement again on every call.
            k::table
                .find((scope, key))
                .select((k::request_hash, k::status, k::response, k::created_at, k::expires_at))
                .get_result(self)
                .optional()
        }

        fn claim(&mut self, record: &$crate::backend::Record<'_>) -> diesel::QueryResult<$crate::backend::Claim> {
            use $($schema)+::idempotency_keys as k;
            use crate::backend::Claim;
            use diesel::prelude::*;
            // DO NOTHING, not DO UPDATE: the claim then knows whether it
            // replaced an expired record, and a fresh key costs PostgreSQL
            // measurably less. A record that is already there is taken over
            // by a second, guarded statement only if its retention has ended.
            let inserted = diesel::insert_into(k::table)
                .values(record)
                .on_conflict_do_nothing()
                .execute(self)?;
            if inserted == 1 {
                return Ok(Claim::Inserted);
            }
            let taken_over = diesel::update(k::table.find((record.scope, record.idempotency_key)))
                .filter(k::expires_at.le(record.created_at))
                .set(record)
                .execute(self)?;
            Ok(if taken_over == 1 {
                Claim::TookOver
            } else {
                Claim::Refused
            })
        }

        fn store(
            &mut self,
            hold: $crate::backend::Hold,
            record: &$crate::backend::Record<'_>,
        ) -> diesel::QueryResult<()> {
            use $($schema)+::idempotency_keys as k;
            use crate::backend::Hold;
            use diesel::prelude::*;
            let completed = $crate::backend::record_values!(k, record);
            let stored = match hold {
                Hold::Free => diesel::insert_into(k::table)
                    .values((k::scope.eq(record.scope), k::idempotency_key.eq(record.idempotency_key), completed))
                    .execute(self)?,
                Hold::Expired => {
                    let replaced = diesel::update(k::table.find((record.scope, record.idempotency_key)))
                        .filter(k::expires_at.le(record.created_at))
                        .set(completed)
                        .execute(self)?;
                    if replaced == 0 {
                        // Purged since it was read: a purge deletes expired
                        // records without taking the key's lock (only
                        // PostgreSQL lets it run meanwhile). The lock still
                        // keeps every other call off the key.
                        diesel::insert_into(k::table)
                            .values((k::scope.eq(record.scope), k::idempotency_key.eq(record.idempotency_key), completed))
                            .execute(self)?
                    } else {
                        replaced
                    }
                }
                Hold::Claimed { .. } => diesel::update(k::table.find((record.scope, record.idempotency_key)))
                    .set((
                        k::status.eq(record.status),
                        k::response.eq(record.response),
                        k::completed_at.eq(record.completed_at),
                    ))
                    .execute(self)?,
                Hold::Taken(_) | Hold::Busy => return Err(diesel::result::Error::NotFound),
            };
            // The key is held by this transaction; anything else means
            // something bypasses the lock, and committing would leave an
            // executed operation without its result.
            if stored == 1 {
                Ok(())
            } else {
                Err(diesel::result::Error::NotFound)
            }
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use shared_queries;

/// The columns of a key record besides its key, in table `$k` (a backend's
/// `idempotency_keys` module), as a call writes them.
macro_rules! record_values {
    ($k:ident, $record:expr) => {
        (
            $k::request_hash.eq($record.request_hash),
            $k::status.eq($record.status),
            $k::response.eq($record.response),
            $k::created_at.eq($record.created_at),
            $k::completed_at.eq($record.completed_at),
            $k::expires_at.eq($record.expires_at),
        )
    };
}
pub(crate) use record_values;

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

#[cfg(feature = "postgres")]
pub mod citus;
pub(crate) mod migrate;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[doc(hidden)]
pub mod outbox;
#[doc(hidden)]
pub mod phases;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod row_with;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use outbox::OutboxStore;
pub use phases::PhaseStore;

pub(crate) const PROCESSING: &str = "processing";
pub(crate) const COMPLETED: &str = "completed";

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
/// implements it.
pub trait RawConnection: StoreConnection<Raw = Self> + KeyStore + OutboxStore + PhaseStore {}

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

pub(crate) mod sealed {
    pub trait Sealed {}
}

#[doc(hidden)]
/// A key record as this crate writes it: claimed (`processing`, no response
/// yet) or completed with its response.
#[derive(Insertable, AsChangeset, Clone, Copy)]
#[diesel(table_name = idempotency_keys, primary_key(scope, idempotency_key), treat_none_as_null = true)]
pub struct Record<'a> {
    pub(crate) scope: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) request_hash: &'a str,
    pub(crate) status: &'a str,
    pub(crate) response: Option<&'a str>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) completed_at: Option<NaiveDateTime>,
    pub(crate) expires_at: NaiveDateTime,
}

#[doc(hidden)]
/// What a replay needs of a stored record.
#[derive(Queryable, Debug)]
pub struct Stored {
    pub(crate) request_hash: String,
    pub(crate) status: String,
    pub(crate) response: Option<String>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) expires_at: NaiveDateTime,
}

#[doc(hidden)]
/// What the replay read outside the write transaction found.
pub struct Read {
    /// The record, whatever its state.
    pub(crate) record: Option<Stored>,
    /// The database's time when it was read.
    pub(crate) now: NaiveDateTime,
    /// Whether the database claims every key before the operation runs
    /// (PostgreSQL's `idempotency.claim_first`): a write transaction then
    /// claims at once, without reading the record again.
    pub(crate) claims_first: bool,
}

#[doc(hidden)]
/// What a guarded claim of a key did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// There was no record: the claim is inserted.
    Inserted,
    /// There was an expired record: the claim replaced it.
    TookOver,
    /// An unexpired record holds the key.
    Refused,
}

impl Claim {
    /// The hold a successful claim gives.
    pub(crate) fn hold(self) -> Option<Hold> {
        match self {
            Claim::Inserted => Some(Hold::Claimed { took_over: false }),
            Claim::TookOver => Some(Hold::Claimed { took_over: true }),
            Claim::Refused => None,
        }
    }
}

#[doc(hidden)]
/// How a write transaction holds its key, decided once it holds the key's
/// lock, and so how the operation's result is stored.
#[derive(Debug)]
pub enum Hold {
    /// No record: the completed record is inserted after the operation.
    Free,
    /// An expired record: it is replaced by the completed one after the
    /// operation.
    Expired,
    /// Claimed with a guarded insert before the operation (`took_over`: by
    /// replacing an expired record): the operation's result completes the
    /// record.
    Claimed {
        /// Whether the claim replaced an expired record.
        took_over: bool,
    },
    /// An unexpired record: the answer is a replay, a mismatch, or (for a
    /// record an enclosing call has claimed) in progress.
    Taken(Stored),
    /// The key was freed and taken again while this transaction looked at
    /// it: in progress elsewhere.
    Busy,
}

/// `at`, moved into the years `years`.
fn within_years(at: NaiveDateTime, years: &RangeInclusive<i32>) -> NaiveDateTime {
    use chrono::{NaiveDate, NaiveTime};
    let day = |year, month, date| NaiveDate::from_ymd_opt(year, month, date).expect("a calendar date");
    let earliest = day(*years.start(), 1, 1).and_time(NaiveTime::MIN);
    let latest = day(*years.end(), 12, 31)
        .and_hms_micro_opt(23, 59, 59, 999_999)
        .expect("a time of day");
    at.clamp(earliest, latest)
}

/// The key records' statements, one implementation per backend: a
/// supertrait of [`RawConnection`], nameable in bounds. Sealed, and its
/// methods are the crate's internals: only the crate implements and calls
/// them.
pub trait KeyStore: Connection<TransactionManager = AnsiTransactionManager> + Sized + sealed::Sealed {
    /// The backend's name, as events and metrics report it.
    #[doc(hidden)]
    const BACKEND: &'static str;

    /// The longest key or scope, in bytes, that the key table holds, where
    /// that is less than any configured limit: keys are refused beyond it,
    /// never cut.
    #[doc(hidden)]
    const MAX_KEY_LEN: Option<usize> = None;

    /// The years the backend's time columns hold, where they hold fewer
    /// than chrono does.
    #[doc(hidden)]
    const STORABLE_YEARS: Option<RangeInclusive<i32>> = None;

    /// `at` within [`STORABLE_YEARS`](KeyStore::STORABLE_YEARS). For a time a
    /// caller chooses (a message's `not_before`): a backend that stores a
    /// time beyond its range as a zero date would make a message meant for
    /// the far future due at once.
    #[doc(hidden)]
    fn storable_time(at: NaiveDateTime) -> NaiveDateTime {
        match &Self::STORABLE_YEARS {
            Some(years) => within_years(at, years),
            None => at,
        }
    }

    /// Applies the pending migrations of this backend's set.
    #[doc(hidden)]
    fn apply_migrations(&mut self) -> diesel::migration::Result<()>;

    /// The record for `(scope, key)` and the database's time, in one
    /// statement outside any write transaction.
    #[doc(hidden)]
    fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read>;

    /// The database's time (UTC).
    #[doc(hidden)]
    fn database_now(&mut self) -> QueryResult<NaiveDateTime>;

    /// Runs `f` in a write transaction (a savepoint when a transaction is
    /// open) that holds the key `(held.scope, held.key)` against every
    /// other call, waiting for a holder as `held.in_flight` allows. Commits
    /// if `f` succeeds and rolls back otherwise.
    ///
    /// By default, the transaction of [`write`](KeyStore::write): enough
    /// where the database's write lock holds every key (SQLite). A backend
    /// whose writers run side by side locks the key itself.
    #[doc(hidden)]
    fn key_transaction<T, E>(&mut self, held: HeldKey<'_>, f: impl FnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<diesel::result::Error>,
    {
        self.write(held.in_flight, f)
    }

    /// Runs `f` in a short write transaction (a savepoint when one is open)
    /// that waits for the database's write lock as `in_flight` allows, where
    /// the backend has one.
    #[doc(hidden)]
    fn write<T, E>(&mut self, in_flight: InFlight, f: impl FnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<diesel::result::Error>;

    /// Inside [`key_transaction`](KeyStore::key_transaction): how this
    /// transaction holds the key `record` is for, claiming it first where a
    /// read could miss a concurrent commit, or where the read before the
    /// transaction found that the database `claims_first`.
    #[doc(hidden)]
    fn hold(&mut self, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold>;

    /// Inserts `record` as a claim, or takes over an expired record with its
    /// key.
    #[doc(hidden)]
    fn claim(&mut self, record: &Record<'_>) -> QueryResult<Claim>;

    /// Writes the completed `record` as `hold` requires.
    #[doc(hidden)]
    fn store(&mut self, hold: Hold, record: &Record<'_>) -> QueryResult<()>;

    /// Whether `error` means a wait for a lock ran out.
    #[doc(hidden)]
    fn is_in_flight_timeout(error: &diesel::result::Error) -> bool;

    /// Whether `error`, returned by the commit of a top-level transaction,
    /// proves that the transaction rolled back: the server answered the
    /// `COMMIT` with a refusal. Any other failure of a commit (the
    /// connection lost on the way, an answer that never came, a text that
    /// proves nothing) leaves the outcome unknown.
    #[doc(hidden)]
    fn commit_rolled_back(error: &diesel::result::Error) -> bool;

    /// Returns once everything this connection has seen is safe on the
    /// database's synchronous standbys: outside a transaction by a commit
    /// of its own that waits for them; inside one by making the enclosing
    /// commit such a commit. Nothing to do on a backend without standbys.
    #[doc(hidden)]
    fn await_replication(&mut self) -> QueryResult<()>;

    /// Deletes at most `limit` records expired at `cutoff`.
    #[doc(hidden)]
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;

    /// The stored record for `(scope, key)`.
    #[doc(hidden)]
    fn find(&mut self, scope: &str, key: &str) -> QueryResult<Option<Stored>>;
}

/// How a transaction whose read sees every commit before it holds its key:
/// the record decides, nothing is written yet.
#[cfg(feature = "sqlite")]
pub(crate) fn hold_by_reading<C: KeyStore>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    Ok(hold_of(conn.find(record.scope, record.idempotency_key)?, record))
}

/// The key a call holds, and how long it waits for another holder.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct HeldKey<'a> {
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(dead_code, reason = "SQLite's write lock holds every key")
    )]
    pub(crate) scope: &'a str,
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(dead_code, reason = "SQLite's write lock holds every key")
    )]
    pub(crate) key: &'a str,
    pub(crate) in_flight: InFlight,
    /// How long the server lets the transaction wait for its client's next
    /// statement while it holds the key ([`Config::idle_timeout`](crate::Config::idle_timeout)).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(dead_code, reason = "a dead process holds no SQLite lock")
    )]
    pub(crate) idle_timeout: Option<chrono::Duration>,
}

/// What a record read under the key's lock means for `record`.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn hold_of(stored: Option<Stored>, record: &Record<'_>) -> Hold {
    match stored {
        None => Hold::Free,
        Some(stored) if stored.expires_at <= record.created_at => Hold::Expired,
        Some(stored) => Hold::Taken(stored),
    }
}

/// How a transaction whose reads may miss a concurrent commit holds its key:
/// by a claim that the primary key guards, before the operation runs.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn hold_by_claiming<C: KeyStore>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if let Some(hold) = conn.claim(record)?.hold() {
        return Ok(hold);
    }
    match conn.find(record.scope, record.idempotency_key)? {
        Some(stored) => Ok(Hold::Taken(stored)),
        // Purged between the claim and this read, so free now.
        None => Ok(conn.claim(record)?.hold().unwrap_or(Hold::Busy)),
    }
}

/// A row count as SQL's `LIMIT` takes it.
pub(crate) fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// Runs `batch` with `batch_size` until it deletes fewer rows than that, or
/// `stop` holds after a batch, and returns the total: a purge of `table` in
/// bounded batches, each reported with the time it took.
///
/// # Panics
///
/// If `batch_size` is zero.
pub(crate) fn purge_in_batches(
    table: &'static str,
    batch_size: usize,
    stop: &dyn Fn() -> bool,
    mut batch: impl FnMut(usize) -> QueryResult<usize>,
) -> QueryResult<usize> {
    assert!(batch_size > 0, "batch_size must be positive");
    let started = Instant::now();
    let (mut total, mut batches) = (0, 0);
    loop {
        let batch_started = Instant::now();
        let deleted = match batch(batch_size) {
            Ok(deleted) => deleted,
            Err(error) => {
                // The batches before this one are committed: counted, so a
                // purge that keeps failing halfway still shows its work.
                if batches > 0 {
                    telemetry::purged(table, total, batches, started.elapsed());
                }
                return Err(error);
            }
        };
        telemetry::purge_batch(table, deleted, batch_started.elapsed());
        total += deleted;
        batches += 1;
        if deleted < batch_size || stop() {
            telemetry::purged(table, total, batches, started.elapsed());
            return Ok(total);
        }
    }
}

/// How deep the connection's open transactions are nested; 0 outside one.
pub(crate) fn transaction_depth<C: KeyStore>(conn: &mut C) -> QueryResult<u32> {
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()?;
    Ok(depth.map_or(0, |depth| depth.get()))
}

/// Runs `f` in a transaction opened by `begin` (which must open exactly one
/// level), committing if `f` succeeds and rolling back otherwise, as
/// diesel's own `transaction` does for its fixed `BEGIN`.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn transaction_with<C, T, E>(
    conn: &mut C,
    begin: impl FnOnce(&mut C) -> QueryResult<()>,
    f: impl FnOnce(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    C: KeyStore,
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
pub(crate) fn unwind_to_depth<C: KeyStore>(conn: &mut C, depth: u32) -> QueryResult<()> {
    while transaction_depth(conn)? > depth {
        AnsiTransactionManager::rollback_transaction(conn)?;
    }
    Ok(())
}
