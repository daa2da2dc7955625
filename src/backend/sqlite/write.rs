//! SQLite's write transaction: `BEGIN IMMEDIATE` under the in-flight
//! policy's busy timeout, the caller's timeout put back afterwards, and the
//! read of the record under the write lock.

use std::time::{Duration, Instant};

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::sql_types::Integer;
use diesel::sqlite::{Sqlite, SqliteConnection};

use crate::backend::keys::{Hold, KeyStore, Record, claiming, hold_of};
use crate::backend::rules::BackendRules;
use crate::backend::transaction::transaction_depth;
use crate::in_flight::InFlight;

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

impl diesel::query_dsl::RunQueryDslSupport for Pragma {}

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
pub(super) fn open_write(conn: &mut SqliteConnection, in_flight: InFlight) -> QueryResult<i32> {
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
pub(super) fn close_write(
    conn: &mut SqliteConnection,
    previous: i32,
    succeeded: bool,
) -> (QueryResult<()>, QueryResult<()>) {
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
pub(super) fn settle<T, E: From<DieselError>>(
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
pub(super) fn begin_immediate(conn: &mut SqliteConnection, in_flight: InFlight, current: i32) -> QueryResult<()> {
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
pub(super) async fn hold<C: KeyStore>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if conn.transaction_depth()? == 1 {
        Ok(hold_of(conn.find(record.scope, record.idempotency_key).await?, record))
    } else {
        claiming(conn, record).await
    }
}
