//! SQLite: one writer at a time. A call that is not a replay takes the
//! database's write lock (`BEGIN IMMEDIATE`), which holds its key and every
//! other, so a read under it sees every commit and the record is written
//! once after the operation. A call nested in a caller's transaction cannot
//! know whether that transaction holds the write lock yet, so it claims the
//! key before its operation instead.
//!
//! The in-flight policy bounds the wait for the write lock: `BEGIN
//! IMMEDIATE` is retried in short polls with the busy timeout off, then the
//! policy is the busy timeout for the rest of the transaction (a commit
//! outside WAL mode waits for readers), and the caller's own busy timeout is
//! put back at the end. A connection already at 0 (diesel's default) is
//! not set to 0 again, and the reject policy's 0 is not set twice. The
//! PRAGMAs are prepared statements that diesel caches, so each costs
//! microseconds, not a parse per call.

#[cfg(feature = "sqlite-async")]
mod asynchronous;
mod outbox;
mod phases;

use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

use chrono::{NaiveDateTime, Utc};
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Integer, Timestamp};
use diesel::sqlite::{Sqlite, SqliteConnection};
use diesel_migrations::EmbeddedMigrations;

use super::migrate::{self, Count, History};

use super::keys::{claiming, hold_of};
use super::{BackendRules, BlockingStore, HeldKey, Hold, KeyStore, Read, Record, transaction_depth, unwind_to_depth};
use crate::in_flight::InFlight;
use crate::schema;

super::raw_connection!(SqliteConnection);

impl History for SqliteConnection {
    const MIGRATIONS: EmbeddedMigrations = migrate::SQLITE;

    // A table of the main database: an attached database's is found only
    // by a qualified name.
    fn has_table(&mut self, name: &str) -> QueryResult<bool> {
        let found: Count =
            diesel::sql_query("SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table' AND name = ?")
                .bind::<diesel::sql_types::Text, _>(name)
                .get_result(self)?;
        Ok(found.n > 0)
    }

    migrate::schema_history!(SqliteConnection);
}

/// A PRAGMA that reads or sets an integer, sent as a prepared statement
/// that diesel caches by its text. (`sql_query` is never cached, and a
/// PRAGMA takes no bound parameters; the only value in the text is an
/// integer of ours.)
struct Pragma(String);

impl QueryId for Pragma {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Sqlite> for Pragma {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Sqlite>) -> QueryResult<()> {
        out.push_sql(&self.0);
        Ok(())
    }
}

impl Query for Pragma {
    type SqlType = Integer;
}

impl RunQueryDsl<SqliteConnection> for Pragma {}

fn busy_timeout(conn: &mut SqliteConnection) -> QueryResult<i32> {
    Pragma(String::from("PRAGMA busy_timeout")).get_result(conn)
}

fn set_busy_timeout(conn: &mut SqliteConnection, millis: i64) -> QueryResult<()> {
    Pragma(format!("PRAGMA busy_timeout = {millis}")).execute(conn)?;
    Ok(())
}

/// Opens a write transaction, or a savepoint in a caller's, that waits for
/// the write lock as `in_flight` allows (see [`begin_immediate`]), with the
/// policy as the busy timeout for the rest of it. Returns the connection's
/// busy timeout from before, which [`close_write`] puts back; on a failure
/// it is back already.
fn open_write(conn: &mut SqliteConnection, in_flight: InFlight) -> QueryResult<i32> {
    let previous = busy_timeout(conn)?;
    let opened = if transaction_depth(conn)? == 0 {
        // A deferred BEGIN would take the write lock only at the first
        // write, and two racing writers would then fail with "database is
        // locked" instead of waiting for each other.
        begin_immediate(conn, in_flight, previous)
    } else if i64::from(previous) != in_flight.wait_millis() {
        set_busy_timeout(conn, in_flight.wait_millis()).and_then(|()| AnsiTransactionManager::begin_transaction(conn))
    } else {
        AnsiTransactionManager::begin_transaction(conn)
    };
    match opened {
        Ok(()) => Ok(previous),
        Err(error) => {
            let _ = set_busy_timeout(conn, previous.into());
            Err(error)
        }
    }
}

/// Ends what [`open_write`] opened: commits if `succeeded`, rolls back
/// otherwise, and puts the busy timeout `previous` back. Returns how the
/// end went and how the busy timeout's return went, for [`settle`].
fn close_write(conn: &mut SqliteConnection, previous: i32, succeeded: bool) -> (QueryResult<()>, QueryResult<()>) {
    let ended = if succeeded {
        AnsiTransactionManager::commit_transaction(conn)
    } else {
        match AnsiTransactionManager::rollback_transaction(conn) {
            Err(DieselError::BrokenTransactionManager) => Ok(()),
            other => other,
        }
    };
    (ended, set_busy_timeout(conn, previous.into()))
}

/// What a write transaction's work returned, once [`close_write`] ended
/// the transaction: a failed end first, as diesel's `transaction` reports
/// it, then the work's own failure, then a busy timeout not put back.
fn settle<T, E: From<DieselError>>(
    result: Result<T, E>,
    (ended, restored): (QueryResult<()>, QueryResult<()>),
) -> Result<T, E> {
    ended?;
    let value = result?;
    restored?;
    Ok(value)
}

/// How long a writer waiting for the write lock sleeps between attempts: it
/// starts short and doubles up to the cap. SQLite's own busy handler backs
/// off to 100 ms sleeps, so a writer queued behind a few short transactions
/// would wait far longer than they take; a fixed short sleep would spend the
/// holder's CPU on waiters that keep trying.
const WRITE_LOCK_FIRST_POLL: Duration = Duration::from_micros(100);
const WRITE_LOCK_MAX_POLL: Duration = Duration::from_millis(2);

/// Opens a `BEGIN IMMEDIATE` transaction, retrying at short intervals while
/// another connection holds the write lock, for as long as `in_flight`
/// allows. Once it holds the lock, the policy's busy timeout bounds the
/// rest of the transaction's waits. `current` is the connection's busy
/// timeout when it is called: at 0 (diesel's default) it is left as it is,
/// since the first attempt then already fails at once.
fn begin_immediate(conn: &mut SqliteConnection, in_flight: InFlight, current: i32) -> QueryResult<()> {
    let deadline = Instant::now() + Duration::from_millis(u64::try_from(in_flight.wait_millis()).unwrap_or(0));
    if current != 0 {
        set_busy_timeout(conn, 0)?;
    }
    let mut poll = WRITE_LOCK_FIRST_POLL;
    loop {
        match AnsiTransactionManager::begin_transaction_sql(conn, "BEGIN IMMEDIATE") {
            Err(error) if Sqlite::is_in_flight_timeout(&error) && Instant::now() < deadline => {
                std::thread::sleep(poll);
                poll = (poll * 2).min(WRITE_LOCK_MAX_POLL);
            }
            Err(error) => return Err(error),
            // Still 0 under the reject policy: nothing to set.
            Ok(()) if in_flight.wait_millis() == 0 => return Ok(()),
            Ok(()) => return set_busy_timeout(conn, in_flight.wait_millis()),
        }
    }
}

/// How a write transaction holds its key, on either kind of connection: a
/// transaction of its own holds the write lock, which holds every key, so
/// the record read under it decides; a savepoint in a caller's transaction
/// cannot know whether that holds the lock yet, and claims the key.
async fn hold<C: KeyStore>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if conn.transaction_depth()? == 1 {
        Ok(hold_of(conn.find(record.scope, record.idempotency_key).await?, record))
    } else {
        claiming(conn, record).await
    }
}

impl BackendRules for Sqlite {
    const NAME: &'static str = "sqlite";
    // Times are text compared as text, which orders them only while the
    // year has four digits: `+10021-01-01` sorts before `2026-01-01`.
    const STORABLE_YEARS: Option<RangeInclusive<i32>> = Some(1..=9999);

    fn is_in_flight_timeout(error: &DieselError) -> bool {
        // SQLITE_BUSY reaches diesel as an unknown database error whose text
        // SQLite fixes: "database is locked".
        matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info)
            if info.message().contains("database is locked"))
    }

    fn commit_rolled_back(error: &DieselError) -> bool {
        // A constraint checked at the commit, or the write lock not had in
        // time (the transaction stays open for the rollback that follows),
        // refuses it. An I/O error does not prove as much: in WAL mode the
        // frames that commit may be written when the sync after them fails.
        match error {
            DieselError::DatabaseError(DatabaseErrorKind::Unknown, _) => Self::is_in_flight_timeout(error),
            DieselError::DatabaseError(..) => true,
            DieselError::RollbackErrorOnCommit { commit_error, .. } => Self::commit_rolled_back(commit_error),
            _ => false,
        }
    }
}

impl KeyStore for SqliteConnection {
    type Rules = Sqlite;

    async fn write<T, E>(
        &mut self,
        in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<diesel::result::Error>,
    {
        let previous = open_write(self, in_flight)?;
        let result = work(self).await;
        let closed = close_write(self, previous, result.is_ok());
        settle(result, closed)
    }

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        Ok(Read {
            record: self.find(scope, key).await?,
            // SQLite's clock is the application host's: the database runs in-process.
            now: Utc::now().naive_utc(),
            claims_first: false,
        })
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        Ok(Utc::now().naive_utc())
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        transaction_depth(self)
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        unwind_to_depth(self, depth)
    }

    // The database's write lock holds every key.
    async fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        self.write(held.in_flight, async |tx: &mut Self| work(tx, false).await)
            .await
    }

    async fn hold(&mut self, record: &Record<'_>, _claims_first: bool) -> QueryResult<Hold> {
        hold(self, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        Ok(())
    }

    super::keys::key_statements!(ready schema: find, claim, store);
}

impl BlockingStore for SqliteConnection {
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // diesel's DSL cannot delete through a limited subquery.
        diesel::sql_query(
            "DELETE FROM idempotency_keys WHERE (scope, idempotency_key) IN \
             (SELECT scope, idempotency_key FROM idempotency_keys WHERE expires_at <= ? LIMIT ?)",
        )
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(super::sql_limit(limit))
        .execute(self)
    }
}
