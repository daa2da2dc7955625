//! MySQL and MariaDB (InnoDB): a write transaction holds its key with a
//! named lock (`GET_LOCK`) on a hash of the database, the scope and the key,
//! taken before `BEGIN` (or the savepoint) and released after the `COMMIT`
//! or `ROLLBACK`, on every path. A second call with the key waits on that
//! lock until the holder's transaction has ended, for as long as the
//! in-flight policy allows: `GET_LOCK` takes fractions of a second, so the
//! policy bounds the wait exactly, and nothing about the session is changed
//! to bound it. A wait that runs out is
//! [`Error::InProgress`](crate::Error::InProgress).
//!
//! Named locks belong to the session, not to a transaction, so a call nested
//! in a caller's transaction gives its lock back when its savepoint ends,
//! while its record is committed only with the caller's transaction. A later
//! call that gets the lock could then miss that uncommitted record with a
//! plain read. So every call claims its key with a plain `INSERT` before the
//! operation runs and completes the record after it: the primary key makes
//! an insert wait for an uncommitted claim of the same key (for the session's
//! `innodb_lock_wait_timeout`, whole seconds, 50 by default), and then fail
//! with a duplicate key, which means taken, if that claim commits. Under
//! `REPEATABLE READ`, InnoDB's default, a transaction that has read before
//! does not see that commit with a plain `SELECT`, so the record that took
//! the key is read with `FOR UPDATE`. The crate never changes the isolation
//! level or any other setting of the session but `wait_timeout`, which
//! bounds how long a call may hold its key without a word from its client
//! and is put back when the call ends (see [`IdleBound`]); its own
//! background transactions (relay claims, completer picks, purges) run at
//! `READ COMMITTED` when they are not nested in a caller's transaction.
//!
//! In a caller's transaction nothing touches the key table before the named
//! lock is held, not even the read for a replay, so the crate's own
//! statements never make a wait for a named lock part of a cycle with row
//! locks, which InnoDB's deadlock detection does not see. A cycle through
//! the application's own rows (a caller's transaction locks a row that
//! another call's operation waits for, then calls with that call's key)
//! ends when the in-flight wait runs out, with `InProgress`.
//!
//! `INSERT IGNORE` (diesel's `on_conflict_do_nothing` here) is never used: it
//! would turn a value that does not fit into a warning. A deadlock (error
//! 1213) rolls back the whole transaction, a caller's included, and is
//! reported as a storage error of kind `SerializationFailure` (of kind
//! `Unknown` on diesel-async's connection, whose client passes on no
//! error number for it).
//!
//! These rules are written once for `MysqlConnection` and diesel-async's
//! `AsyncMysqlConnection` (feature `diesel-async`), generic over
//! [`Session`], which is only how each sends a statement. On the async
//! connection a call's future may be dropped at any `await`; one dropped
//! while the session holds what the call took from it (from the lowered
//! `wait_timeout` to the release of the named lock, the transaction in
//! between) leaves the connection marked broken ([`TakenSession`]): a pool
//! discards it, and the server frees the lock when the session closes.

#[cfg(feature = "mysql-async")]
mod asynchronous;
mod lock;
mod outbox;
mod phases;
mod session;

use std::ops::RangeInclusive;
use std::panic;

use chrono::NaiveDateTime;
use diesel::dsl::Eq;
use diesel::expression::{AppearsOnTable, Expression, SelectableExpression, ValidGrouping, is_aggregate};
use diesel::mysql::{Mysql, MysqlConnection};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Datetime};
use diesel_migrations::EmbeddedMigrations;

use super::migrate::{self, Count, History};

use self::lock::{GetLock, IdleBound, IdleStatement, ReleaseLock};
use self::session::{Session, TakenSession};
use super::row_with::Head;
use super::{
    BackendRules, BlockingStore, ClaimOutcome, HeldKey, Hold, KeyRecordChanged, KeyStore, Read, Record, catch_unwind,
    transaction_depth, unwind_to_depth,
};
use crate::in_flight::InFlight;
use crate::row_status::RecordStatus;
use crate::telemetry;

pub(crate) mod schema;

use schema::idempotency_keys as k;

super::raw_connection!(MysqlConnection);

impl History for MysqlConnection {
    const MIGRATIONS: EmbeddedMigrations = migrate::MYSQL;

    fn has_table(&mut self, name: &str) -> QueryResult<bool> {
        let found: Count = diesel::sql_query(
            "SELECT COUNT(*) AS n FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(self)?;
        Ok(found.n > 0)
    }

    migrate::schema_history!(MysqlConnection);
}

/// `UTC_TIMESTAMP(6)`, the server's time in UTC to the microsecond, as an
/// expression of the DSL. (diesel's `now` is the session's time, to the
/// second.)
#[derive(Debug, Clone, Copy, QueryId)]
pub(crate) struct UtcNow;

impl Expression for UtcNow {
    type SqlType = Datetime;
}

impl QueryFragment<Mysql> for UtcNow {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        out.push_sql("UTC_TIMESTAMP(6)");
        Ok(())
    }
}

impl<QS> AppearsOnTable<QS> for UtcNow {}

impl<QS> SelectableExpression<QS> for UtcNow {}

impl<GB> ValidGrouping<GB> for UtcNow {
    type IsAggregate = is_aggregate::Never;
}

/// The database's time, in UTC.
pub(crate) struct DatabaseNow;

impl Head for DatabaseNow {
    type Backend = Mysql;
    const SQL: &'static str = "UTC_TIMESTAMP(6)";
    type SqlType = Datetime;
}

/// How an error that stands for a lock wait that ran out begins: InnoDB's
/// error 1205 and the crate's own for a named lock it did not get.
const LOCK_WAIT_TIMEOUT: &str = "lock wait timeout exceeded";

/// Runs `f` in a transaction of its own at `READ COMMITTED`, or in a
/// savepoint at the caller's level inside a caller's transaction.
///
/// Under `REPEATABLE READ` a locking read locks the gaps it walks as well
/// as the rows; an insert into such a gap (a relay marking a message
/// delivered moves its index entry) then waits for the picking transaction,
/// which may itself wait for that insert's row: a deadlock. At
/// `READ COMMITTED` a locking read locks the rows it returns and no gaps.
pub(crate) fn read_committed<T>(
    conn: &mut MysqlConnection,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    if transaction_depth(conn)? == 0 {
        // Applies to the next transaction only; the session keeps its level.
        diesel::sql_query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(conn)?;
    }
    conn.transaction(f)
}

/// The hash of the scope and the key that names the key's lock, in hex:
/// SHA-256 of both, each prefixed with its length. Stable across processes
/// and versions of the crate, which must agree on it while they run side by
/// side.
fn lock_key(scope: &str, key: &str) -> String {
    crate::key::derive(&[scope, key])
}

/// The longest `wait_timeout` the server takes, in seconds (a year).
const MAX_WAIT_TIMEOUT: i64 = 31_536_000;

/// `idle` in whole seconds, rounded up, as `wait_timeout` takes it.
fn wait_timeout_seconds(idle: chrono::Duration) -> i64 {
    let millis = idle.num_milliseconds().max(1);
    (millis.saturating_add(999) / 1000).clamp(1, MAX_WAIT_TIMEOUT)
}

/// Takes the named lock of `(scope, key)`, waiting as `in_flight` allows,
/// and returns its name for the release.
async fn lock<C: Session>(conn: &mut C, scope: &str, key: &str, in_flight: InFlight) -> QueryResult<String> {
    let key = lock_key(scope, key);
    let seconds = in_flight.wait_millis() as f64 / 1000.0;
    let (name, taken) = conn.get_lock(GetLock { key: &key, seconds }).await?;
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

/// The columns a claim writes besides the key: `Record`'s own `Insertable`
/// and `AsChangeset` are for the other backends' table.
type Written<'a> = (
    Eq<k::request_hash, &'a str>,
    Eq<k::status, RecordStatus>,
    Eq<k::response, Option<&'a str>>,
    Eq<k::created_at, NaiveDateTime>,
    Eq<k::completed_at, Option<NaiveDateTime>>,
    Eq<k::expires_at, NaiveDateTime>,
    Eq<k::caller_hash, Option<&'a str>>,
);

fn written<'a>(record: &Record<'a>) -> Written<'a> {
    super::keys::record_values!(k, record)
}

/// Inserts `record` as a claim with a plain `INSERT`; `false` when its key
/// is taken (the insert waited for the holder's transaction, if one was
/// open, and failed with a duplicate key, which leaves MySQL's transaction
/// going).
async fn insert_claim<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<bool> {
    match conn.insert(record).await {
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
async fn read<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Read> {
    if conn.transaction_depth()? > 0 {
        // In a caller's transaction nothing touches the key table before
        // the key's named lock is held: at SERIALIZABLE this read would
        // lock the key's gap until the caller commits, and a call that
        // holds the named lock would wait for that gap while this one
        // waits for the named lock, a cycle InnoDB cannot see. The write
        // path reads the record once it holds the lock.
        return Ok(Read {
            record: None,
            now: conn.database_now().await?,
            claims_first: true,
        });
    }
    let (now, record) = conn.now_and_record(scope, key).await?;
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
async fn key_transaction<C, T, E>(
    conn: &mut C,
    held: HeldKey<'_>,
    work: impl AsyncFnOnce(&mut C, bool) -> Result<T, E>,
) -> Result<T, E>
where
    C: Session,
    E: From<DieselError>,
{
    let depth = conn.transaction_depth()?;
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
        Err(_) => session.unwind_to_depth(depth).await,
    };
    let given = match unwound {
        Ok(()) if held.idle_timeout.is_some() => {
            let release = IdleStatement {
                depth,
                bound: IdleBound::ReleaseAndRestore(&name),
            };
            session.idle(release).await
        }
        Ok(()) => session.release(ReleaseLock(&name)).await,
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
        conn.idle(bound(IdleBound::Set(wait_timeout_seconds(idle)))).await?;
    }
    let locked = lock(conn, scope, key, in_flight).await;
    if locked.is_err() && idle_timeout.is_some() {
        if let Err(error) = conn.idle(bound(IdleBound::Restore)).await {
            discard(conn, &error);
        }
    }
    locked
}

/// How a call's transaction holds its key, on either kind of connection:
/// always by a claim first (see the module docs).
async fn hold<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<Hold> {
    if insert_claim(conn, record).await? {
        return Ok(Hold::Claimed { took_over: false });
    }
    // A lost claim is far more often a replay than an expired record to
    // take over, so the record is read first, with a lock: a locking read
    // sees the latest commit whatever the transaction's snapshot.
    match conn.find_for_update(record.scope, record.idempotency_key).await? {
        Some(stored) if stored.expires_at > record.created_at => Ok(Hold::Recorded(stored)),
        // Expired (and now locked by this transaction), or purged since the
        // claim met it.
        _ => Ok(claim(conn, record).await?.hold().unwrap_or(Hold::ClaimedElsewhere)),
    }
}

/// Claims `record`'s key, on either kind of connection.
async fn claim<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<ClaimOutcome> {
    if insert_claim(conn, record).await? {
        return Ok(ClaimOutcome::Inserted);
    }
    // An existing record is taken over by a second, guarded statement only
    // if its retention has ended.
    Ok(if conn.take_over(record).await? == 1 {
        ClaimOutcome::TookOver
    } else {
        ClaimOutcome::Refused
    })
}

/// Stores the completed `record`, on either kind of connection. Every call
/// claims its key first (see [`hold`]), so a record is only ever completed
/// here.
async fn store<C: Session>(conn: &mut C, hold: Hold, record: &Record<'_>) -> QueryResult<()> {
    let stored = match hold {
        Hold::Claimed { .. } => conn.complete(record).await?,
        Hold::Free | Hold::Expired | Hold::Recorded(_) | Hold::ClaimedElsewhere => 0,
    };
    // The key is held by this transaction; anything else means something
    // bypasses the lock, and committing would leave an executed operation
    // without its result.
    KeyRecordChanged::check(stored)
}

impl BackendRules for Mysql {
    const NAME: &'static str = "mysql";
    const MAX_KEY_LEN: Option<usize> = Some(255);
    // `DATETIME` holds the years 1000 to 9999; beyond them the server
    // stores `0000-00-00`, even in strict mode, which sorts before now.
    const STORABLE_YEARS: Option<RangeInclusive<i32>> = Some(1000..=9999);

    fn is_in_flight_timeout(error: &DieselError) -> bool {
        // diesel does not expose MySQL's error numbers (1205 here) but as
        // their kinds, and this one has none: only the server's message,
        // which is English unless the server's lc_messages says otherwise.
        matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info)
            if info.message().to_ascii_lowercase().starts_with(LOCK_WAIT_TIMEOUT))
    }

    fn commit_rolled_back(error: &DieselError) -> bool {
        // Only the kinds diesel derives from the server's error numbers
        // prove that the server answered (a deadlock or a constraint that
        // refused the commit). Everything else arrives as `Unknown` with the
        // client library's text, connection losses among them, spelled
        // differently by libmysqlclient and libmariadb: no text is trusted
        // to say that nothing committed.
        match error {
            DieselError::DatabaseError(DatabaseErrorKind::Unknown, _) => false,
            DieselError::DatabaseError(..) => true,
            DieselError::RollbackErrorOnCommit { commit_error, .. } => Self::commit_rolled_back(commit_error),
            _ => false,
        }
    }
}

impl KeyStore for MysqlConnection {
    type Rules = Mysql;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        read(self, scope, key).await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        diesel::select(UtcNow).get_result(self)
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        transaction_depth(self)
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        unwind_to_depth(self, depth)
    }

    async fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        key_transaction(self, held, work).await
    }

    async fn hold(&mut self, record: &Record<'_>, _claims_first: bool) -> QueryResult<Hold> {
        hold(self, record).await
    }

    async fn claim(&mut self, record: &Record<'_>) -> QueryResult<ClaimOutcome> {
        claim(self, record).await
    }

    async fn store(&mut self, hold: Hold, record: &Record<'_>) -> QueryResult<()> {
        store(self, hold, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        // Semi-synchronous replication waits for a replica's acknowledgement
        // before the commit returns, but not before other sessions see it;
        // the crate offers no durable replays on MySQL.
        Ok(())
    }

    super::keys::key_statements!(ready schema: find);
}

impl BlockingStore for MysqlConnection {
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // SKIP LOCKED: a record that a live request is taking over right now
        // is not worth waiting for; it is no longer expired once that
        // commits. A locking read locks every row it walks, so the pick walks
        // the expired part of the `expires_at` index only, and the delete
        // reaches the picked rows by their primary key, never by a scan.
        read_committed(self, |tx| {
            diesel::sql_query(
                "DELETE k FROM \
             (SELECT scope, idempotency_key FROM idempotency_keys FORCE INDEX (idempotency_keys_expires_at) \
              WHERE expires_at <= ? ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED) AS expired \
             STRAIGHT_JOIN idempotency_keys AS k FORCE INDEX (PRIMARY) \
             ON k.scope = expired.scope AND k.idempotency_key = expired.idempotency_key",
            )
            .bind::<Datetime, _>(cutoff)
            .bind::<BigInt, _>(super::sql_limit(limit))
            .execute(tx)
        })
    }
}

#[cfg(test)]
mod tests {
    use chrono::Duration;
    use diesel::mysql::Mysql;
    use diesel::result::{DatabaseErrorKind, Error as DieselError};

    use super::{MAX_WAIT_TIMEOUT, lock_key, wait_timeout_seconds};
    use crate::backend::BackendRules;
    use crate::error::is_connection_lost;

    fn error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn the_async_clients_errors_read_as_the_sync_clients() {
        // mysql_async, as diesel-async passes its errors on: a socket that
        // closed under a COMMIT leaves the outcome unknown, and is a lost
        // connection.
        let lost = error(
            DatabaseErrorKind::Unknown,
            "Input/output error: Input/output error: connection closed",
        );
        assert!(is_connection_lost(&lost));
        assert!(!Mysql::commit_rolled_back(&lost));
        let closed = error(
            DatabaseErrorKind::Unknown,
            "Driver error: `Connection to the server is closed.'",
        );
        assert!(is_connection_lost(&closed));
        assert!(!Mysql::commit_rolled_back(&closed));
        // The server's own errors arrive by their message, with the kinds
        // diesel-async derives from their numbers.
        let waited = error(
            DatabaseErrorKind::Unknown,
            "Lock wait timeout exceeded; try restarting transaction",
        );
        assert!(Mysql::is_in_flight_timeout(&waited));
        assert!(!is_connection_lost(&waited));
        let refused = error(
            DatabaseErrorKind::UniqueViolation,
            "Duplicate entry 'a' for key 'PRIMARY'",
        );
        assert!(Mysql::commit_rolled_back(&refused));
    }

    #[test]
    fn the_idle_bound_is_whole_seconds_rounded_up_within_what_the_server_takes() {
        assert_eq!(wait_timeout_seconds(Duration::milliseconds(1)), 1);
        assert_eq!(wait_timeout_seconds(Duration::milliseconds(1_001)), 2);
        assert_eq!(wait_timeout_seconds(Duration::seconds(30)), 30);
        assert_eq!(wait_timeout_seconds(Duration::days(36_500)), MAX_WAIT_TIMEOUT);
    }

    #[test]
    fn lock_key_is_pinned() {
        // Processes of two versions of the crate must lock the same key the
        // same way, so the derivation may never change.
        assert_ne!(lock_key("shop", "order-1"), lock_key("sho", "porder-1"));
        assert_eq!(
            lock_key("shop", "order-1"),
            "e87bc9b2b831352c5373449841a0155f4cc0acc3c7ab41d65c65999ed5f22e88"
        );
    }
}
