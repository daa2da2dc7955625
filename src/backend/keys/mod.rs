//! Key records: the statements every backend implements for them, the rows
//! they read and write, and how a write transaction holds its key.

use std::future::Future;

use chrono::NaiveDateTime;
use diesel::connection::AnsiTransactionManager;
use diesel::prelude::*;

use super::block_on;
use super::rules::BackendRules;
use super::sealed::Sealed;
use crate::in_flight::InFlight;

mod complete;
mod record;
mod statements;

pub(crate) use complete::Complete;
pub use record::{ClaimOutcome, Hold, KeyNotClaimed, KeyRecordChanged, Read, Record, Stored};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use statements::{claim, find_record, shared_key_statements, store};
#[cfg(feature = "mysql")]
pub(crate) use statements::{find, insert, take_over};

/// The key records' statements, one implementation per kind of
/// connection: a supertrait of the crate's public connection traits
/// ([`RawConnection`](crate::RawConnection),
/// [`AsyncStoreConnection`](crate::AsyncStoreConnection)), in this private
/// module, so only the crate implements and calls it. The call's protocol
/// (`run::call`) is written against it once.
///
/// Async-shaped for both kinds of connection: a synchronous connection's
/// methods are `async fn`s whose statements complete as they are sent, so
/// its futures are ready at their first poll, and a synchronous entry point
/// drives the call with [`block_on`](super::block_on); a diesel-async
/// connection awaits its statements.
///
/// The reads and writes of one key record are [`KeyStatements`].
pub trait KeyStore: KeyStatements {
    /// The database's rules: diesel's backend type, which both kinds of
    /// connection to it name.
    type Rules: BackendRules;

    /// The record for `(scope, key)` and the database's time, in one
    /// statement outside any write transaction.
    fn read(&mut self, scope: &str, key: &str) -> impl Future<Output = QueryResult<Read>>;

    /// The database's time (UTC).
    fn database_now(&mut self) -> impl Future<Output = QueryResult<NaiveDateTime>>;

    /// How deep the connection's open transactions are nested; 0 outside
    /// one.
    fn transaction_depth(&mut self) -> QueryResult<u32>;

    /// Rolls back the levels above `depth`, which an operation that
    /// panicked left open.
    fn unwind_to_depth(&mut self, depth: u32) -> impl Future<Output = QueryResult<()>>;

    /// Runs `work` in a write transaction (a savepoint when a transaction is
    /// open) that holds the key `(held.scope, held.key)` against every
    /// other call, waiting for a holder as `held.in_flight` allows. Commits
    /// if `work` succeeds and rolls back otherwise. `work` learns whether
    /// the transaction already holds the key by
    /// [`held.claim`](HeldKey::claim), written while it took the key;
    /// otherwise it decides with [`hold`](KeyStore::hold).
    fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> impl Future<Output = Result<T, E>>
    where
        E: From<diesel::result::Error>;

    /// Runs `work` in a short write transaction (a savepoint when one is
    /// open) that waits for the database's write lock as `in_flight`
    /// allows, where the backend has one (SQLite).
    ///
    /// By default `work` runs as it is: where writers wait for the rows
    /// they touch, not for the database, each statement is a transaction of
    /// its own outside a caller's.
    fn write<T, E>(
        &mut self,
        _in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> impl Future<Output = Result<T, E>>
    where
        E: From<diesel::result::Error>,
    {
        async move { work(self).await }
    }

    /// Inside [`key_transaction`](KeyStore::key_transaction): how this
    /// transaction holds the key `record` is for, claiming it first where a
    /// read could miss a concurrent commit, or where the read before the
    /// transaction found that the database `claims_first`.
    fn hold(&mut self, record: &Record<'_>, claims_first: bool) -> impl Future<Output = QueryResult<Hold>>;

    /// Whether [`key_transaction`](KeyStore::key_transaction) takes a
    /// [`Claim::AtDatabaseTime`], and the call then completes the record
    /// with [`complete_at_database_time`](KeyStore::complete_at_database_time).
    const CLAIMS_AT_DATABASE_TIME: bool = false;

    /// Completes the record a [`Claim::AtDatabaseTime`] claimed, with the
    /// completed `record`'s status and response and the database's time as
    /// its completion, and returns the claim's times: when it was created
    /// and when it expires. Asked only of a backend that
    /// [`CLAIMS_AT_DATABASE_TIME`](KeyStore::CLAIMS_AT_DATABASE_TIME); any
    /// other refuses it as a statement it cannot build.
    fn complete_at_database_time(
        &mut self,
        _record: &Record<'_>,
    ) -> impl Future<Output = QueryResult<(NaiveDateTime, NaiveDateTime)>> {
        std::future::ready(Err(diesel::result::Error::QueryBuilderError(
            "this backend claims no key at the database's time".into(),
        )))
    }

    /// Returns once everything this connection has seen is safe on the
    /// database's synchronous standbys: outside a transaction by a commit
    /// of its own that waits for them; inside one by making the enclosing
    /// commit such a commit. Nothing to do on a backend without standbys.
    fn await_replication(&mut self) -> impl Future<Output = QueryResult<()>>;
}

/// The reads and writes of one key record, each statement built once in
/// `statements.rs`: sent by one impl per connection of SQLite and
/// PostgreSQL (`shared_key_statements!`), and by one impl for both of
/// MySQL's connections, whose calls always claim first and complete a
/// claimed record (`mysql/mod.rs`).
pub trait KeyStatements: Sized {
    /// The stored record for `(scope, key)`.
    fn find(&mut self, scope: &str, key: &str) -> impl Future<Output = QueryResult<Option<Stored>>>;

    /// Inserts `record` as a claim, or takes over an expired record with its
    /// key.
    fn claim(&mut self, record: &Record<'_>) -> impl Future<Output = QueryResult<ClaimOutcome>>;

    /// Writes the completed `record` as `hold` requires.
    fn store(&mut self, hold: Hold, record: &Record<'_>) -> impl Future<Output = QueryResult<()>>;
}

/// What only a synchronous connection runs, for the services and the
/// outbox on threads: short write transactions, and the purge of expired
/// records.
pub trait BlockingStore:
    KeyStore<Rules = <Self as Connection>::Backend>
    + Connection<TransactionManager = AnsiTransactionManager, Backend: BackendRules>
    + Sealed
{
    /// [`write`](KeyStore::write) with work that does not wait, driven to
    /// its end: the short writes of the services and the outbox on a
    /// synchronous connection.
    fn write_now<T, E>(&mut self, in_flight: InFlight, f: impl FnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<diesel::result::Error>,
    {
        block_on(self.write(in_flight, async |tx: &mut Self| f(tx)))
    }

    /// Deletes at most `limit` records expired at `cutoff`.
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;

    /// Turns at most `limit` records that expired after `after` and at or
    /// before `cutoff` into tombstones, clearing their responses; records
    /// already cleared are not counted.
    fn tombstone_batch(&mut self, after: NaiveDateTime, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;
}

/// The key a call holds, and how long it waits for another holder.
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
    /// The claim to write in the round trip that takes the key, where the
    /// backend can (PostgreSQL, outside a caller's transaction): the
    /// transaction then holds the key by its claim without reading it again.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(dead_code, reason = "only PostgreSQL claims in the round trip that takes the key")
    )]
    pub(crate) claim: Option<Claim<'a>>,
}

/// How the round trip that takes a key claims it.
#[derive(Debug, Clone, Copy)]
pub enum Claim<'a> {
    /// The record as it is, its times bound: the read before the
    /// transaction found no record for the key and brought the database's
    /// time (or the clock is injected). A claim the primary key refuses
    /// (a holder committed a record meanwhile) is rolled back, and the
    /// transaction takes the key again and reads the record.
    Bound(
        #[cfg_attr(
            not(feature = "postgres"),
            expect(dead_code, reason = "only PostgreSQL claims in the round trip that takes the key")
        )]
        &'a Record<'a>,
    ),
    /// The record stamped with the database's time at the claim, and
    /// `retention` after it as its expiry, its own times not written: no
    /// read came before. Where the claim is not made, the transaction ends
    /// at once with [`KeyNotClaimed`], and the call reads the record as if
    /// it had read first.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(dead_code, reason = "only PostgreSQL claims at the database's time")
    )]
    AtDatabaseTime {
        /// The record, but for its times.
        record: &'a Record<'a>,
        /// How long after the claim the record expires, in microseconds.
        retention_micros: i64,
    },
}

/// What a record read under the key's lock means for `record`: a record
/// that expired but keeps its tombstone is still there
/// ([`Hold::Recorded`]), and the call answers it.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn hold_of(stored: Option<Stored>, record: &Record<'_>) -> Hold {
    match stored {
        None => Hold::Free,
        Some(stored) if stored.expires_at <= record.reusable_by => Hold::Expired,
        Some(stored) => Hold::Recorded(stored),
    }
}

/// How a transaction whose reads may miss a concurrent commit holds its key:
/// by a claim that the primary key guards, before the operation runs.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) async fn claiming<C: KeyStore>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if let Some(hold) = conn.claim(record).await?.hold() {
        return Ok(hold);
    }
    match conn.find(record.scope, record.idempotency_key).await? {
        Some(stored) => Ok(Hold::Recorded(stored)),
        // Purged between the claim and this read, so free now.
        None => Ok(conn.claim(record).await?.hold().unwrap_or(Hold::ClaimedElsewhere)),
    }
}

#[cfg(test)]
mod tests {
    use super::KeyRecordChanged;
    use crate::Error;

    #[test]
    fn a_changed_key_record_is_a_storage_error_that_says_so_and_may_be_retried() {
        assert!(KeyRecordChanged::check(1).is_ok());
        let changed = KeyRecordChanged::check(0).expect_err("no row written");
        assert!(changed.to_string().contains("the key record changed"), "{changed}");
        assert!(Error::<()>::Storage(changed).is_retryable());
    }
}
