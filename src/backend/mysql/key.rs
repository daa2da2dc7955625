//! How a write transaction holds its key on MySQL, on either kind of
//! connection: the key's named lock, with the idle bound, and the claim
//! inserted before the operation.

use std::panic;

use diesel::QueryResult;
use diesel::result::{DatabaseErrorKind, Error as DieselError};

use super::lock::{GetLock, IdleBound, IdleStatement, ReleaseLock};
use super::session::{
    Session, TakenSession, database_now, find_for_update, get_lock, insert, now_and_record, take_over,
};
use crate::backend::future::catch_unwind;
use crate::backend::keys::{ClaimOutcome, Complete, HeldKey, Hold, KeyRecordChanged, Read, Record};
use crate::in_flight::InFlight;
use crate::telemetry;

/// How an error that stands for a lock wait that ran out begins: InnoDB's
/// error 1205 and the crate's own for a named lock it did not get.
pub(super) const LOCK_WAIT_TIMEOUT: &str = "lock wait timeout exceeded";

/// The hash of the scope and the key that names the key's lock, in hex:
/// SHA-256 of both, each prefixed with its length. Stable across processes
/// and versions of the crate, which must agree on it while they run side by
/// side.
pub(super) fn lock_key(scope: &str, key: &str) -> String {
    crate::key::derive(&[scope, key])
}

/// The longest `wait_timeout` the server takes, in seconds (a year).
pub(super) const MAX_WAIT_TIMEOUT: i64 = 31_536_000;

/// `idle` in whole seconds, rounded up, as `wait_timeout` takes it.
pub(super) fn wait_timeout_seconds(idle: chrono::Duration) -> i64 {
    let millis = idle.num_milliseconds().max(1);
    (millis.saturating_add(999) / 1000).clamp(1, MAX_WAIT_TIMEOUT)
}

/// Takes the named lock of `(scope, key)`, waiting as `in_flight` allows,
/// and returns its name for the release.
async fn lock<C: Session>(conn: &mut C, scope: &str, key: &str, in_flight: InFlight) -> QueryResult<String> {
    let key = lock_key(scope, key);
    let seconds = in_flight.wait_millis() as f64 / 1000.0;
    let (name, taken) = get_lock(conn, GetLock { key: &key, seconds }).await?;
    match taken {
        Some(1) => Ok(name),
        Some(_) => Err(DieselError::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(format!("{LOCK_WAIT_TIMEOUT}: another transaction holds the key")),
        )),
        None => Err(DieselError::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(String::from("the server did not take the named lock of the key")),
        )),
    }
}

/// Inserts `record` as a claim with a plain `INSERT`; `false` when its key
/// is taken (the insert waited for the holder's transaction, if one was
/// open, and failed with a duplicate key, which leaves MySQL's transaction
/// going).
async fn insert_claim<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<bool> {
    match insert(conn, record).await {
        Ok(_) => Ok(true),
        Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Marks the connection broken, so that its pool discards it instead of
/// handing out a session that may still hold a key, or the bound of one.
fn discard<C: Session>(conn: &mut C, error: &DieselError) {
    tracing::warn!(target: telemetry::TARGET, %error, "could not release the key's named lock");
    conn.mark_broken();
}

/// The record of `(scope, key)` and the database's time, on either kind of
/// connection.
pub(super) async fn read<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Read> {
    if conn.depth()? > 0 {
        // In a caller's transaction nothing touches the key table before
        // the key's named lock is held: at SERIALIZABLE this read would
        // lock the key's gap until the caller commits, and a call that
        // holds the named lock would wait for that gap while this one
        // waits for the named lock, a cycle InnoDB cannot see. The write
        // path reads the record once it holds the lock.
        return Ok(Read {
            record: None,
            now: database_now(conn).await?,
            claims_first: true,
        });
    }
    let (now, record) = now_and_record(conn, scope, key).await?;
    // Every call claims first here (see `hold`).
    Ok(Read {
        record,
        now,
        claims_first: true,
    })
}

/// The transaction that holds a key on MySQL, on either kind of
/// connection: the idle bound lowered and the key's named lock taken
/// before it opens (a savepoint in a caller's transaction), and both given
/// back once it has ended, on every path.
pub(super) async fn key_transaction<C, T, E>(
    conn: &mut C,
    held: HeldKey<'_>,
    work: impl AsyncFnOnce(&mut C, bool) -> Result<T, E>,
) -> Result<T, E>
where
    C: Session,
    E: From<DieselError>,
{
    let depth = conn.depth()?;
    let mut session = TakenSession::taking(conn);
    let name = match take_key(&mut *session, depth, held).await {
        Ok(name) => name,
        Err(error) => {
            session.given_back();
            return Err(error.into());
        }
    };
    // The lock outlives any transaction: it must be released on every
    // path, a panic included, and only once the transaction (or the
    // savepoint) has ended.
    let result = catch_unwind(async { session.within(async |tx: &mut C| work(tx, false).await).await }).await;
    let unwound = match result {
        Ok(_) => Ok(()),
        Err(_) => session.unwind(depth).await,
    };
    let given = match unwound {
        Ok(()) if held.idle_timeout.is_some() => {
            let release = IdleStatement {
                depth,
                bound: IdleBound::ReleaseAndRestore(&name),
            };
            session.execute(release).await.map(drop)
        }
        Ok(()) => session.execute(ReleaseLock(&name)).await.map(drop),
        Err(error) => Err(error),
    };
    if let Err(error) = given {
        discard(&mut *session, &error);
    }
    session.given_back();
    match result {
        Ok(result) => result,
        Err(payload) => panic::resume_unwind(payload),
    }
}

/// Lowers the session's `wait_timeout` to the idle bound, if the call has
/// one, and takes the key's named lock; returns the lock's name. A lock
/// not taken puts the bound back.
async fn take_key<C: Session>(conn: &mut C, depth: u32, held: HeldKey<'_>) -> QueryResult<String> {
    let HeldKey {
        scope,
        key,
        in_flight,
        idle_timeout,
        claim: _,
    } = held;
    let bound = |bound| IdleStatement { depth, bound };
    // Lowered before the lock is taken and put back by the statement that
    // releases it: a client that goes silent at any moment between the two
    // loses its session, and the key with it, within the bound.
    if let Some(idle) = idle_timeout {
        conn.execute(bound(IdleBound::Set(wait_timeout_seconds(idle)))).await?;
    }
    let locked = lock(conn, scope, key, in_flight).await;
    if locked.is_err()
        && idle_timeout.is_some()
        && let Err(error) = conn.execute(bound(IdleBound::Restore)).await
    {
        discard(conn, &error);
    }
    locked
}

/// How a call's transaction holds its key, on either kind of connection:
/// always by a claim first (see the module docs).
pub(super) async fn hold<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if insert_claim(conn, record).await? {
        return Ok(Hold::Claimed { took_over: false });
    }
    // A lost claim is far more often a replay than an expired record to
    // take over, so the record is read first, with a lock: a locking read
    // sees the latest commit whatever the transaction's snapshot.
    match find_for_update(conn, record.scope, record.idempotency_key).await? {
        Some(stored) if stored.expires_at > record.reusable_by => Ok(Hold::Recorded(stored)),
        // Expired (and now locked by this transaction), or purged since the
        // claim met it.
        _ => Ok(claim(conn, record).await?.hold().unwrap_or(Hold::ClaimedElsewhere)),
    }
}

/// Claims `record`'s key, on either kind of connection.
pub(super) async fn claim<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<ClaimOutcome> {
    if insert_claim(conn, record).await? {
        return Ok(ClaimOutcome::Inserted);
    }
    // An existing record is taken over by a second, guarded statement only
    // if its retention has ended.
    Ok(if take_over(conn, record).await? == 1 {
        ClaimOutcome::TookOver
    } else {
        ClaimOutcome::Refused
    })
}

/// Stores the completed `record`, on either kind of connection. Every call
/// claims its key first (see [`hold`]), so a record is only ever completed
/// here.
pub(super) async fn store<C: Session>(conn: &mut C, hold: Hold, record: &Record<'_>) -> QueryResult<()> {
    let stored = match hold {
        Hold::Claimed { .. } => conn.execute(Complete::new(record)).await?,
        Hold::Free | Hold::Expired | Hold::Recorded(_) | Hold::ClaimedElsewhere => 0,
    };
    // The key is held by this transaction; anything else means something
    // bypasses the lock, and committing would leave an executed operation
    // without its result.
    KeyRecordChanged::check(stored)
}
