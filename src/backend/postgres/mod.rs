//! PostgreSQL: a write transaction holds its key with a transaction-level
//! advisory lock on a hash of `(scope, key)`, taken in the `BEGIN` round
//! trip. A second call with the key waits on that lock until the holder
//! commits (it then reads the holder's record and replays) or rolls back (it
//! then executes). The in-flight policy bounds the wait with a
//! `lock_timeout` that is put back to the caller's value in the same round
//! trip, so it bounds the lock and never the operation.
//!
//! A key the replay read found no record for is claimed in that same round
//! trip, after the lock: a plain `INSERT` of its record, which the primary
//! key refuses if a holder committed one while this call waited, and the
//! operation's result completes it. A first call thus sends one statement
//! more than its transaction with one insert of the record would. A refused
//! or failed claim is rolled back and the key taken again without one.
//!
//! A key whose record the read found is read again after the lock: at `READ
//! COMMITTED` that read sees the holder's commit, so an expired record is
//! replaced once, after the operation. In a caller's
//! transaction, or a session at `REPEATABLE READ` or `SERIALIZABLE`, the read
//! may miss it: there the key is claimed with a guarded insert before the
//! operation runs, and a conflict with a commit the transaction cannot see
//! fails as a serialization failure before the operation is called. The
//! crate never changes the isolation level the operation runs under.
//!
//! A database whose setting `idempotency.claim_first` is `on` (or another
//! of PostgreSQL's spellings of true) claims every key that way. The
//! advisory lock orders the calls of one server; where calls reach the same
//! rows through several servers (Citus, whose every node can run them),
//! only the primary key orders them all.
//!
//! The lock uses PostgreSQL's two-integer advisory key space, which is
//! separate from the single `bigint` space most applications lock in (their
//! locks can never meet the crate's). Both integers come from a SHA-256 of
//! the scope and the key, so an application that does use two-integer locks
//! meets one of the crate's only by a 1 in 2^64 chance, and two keys that
//! meet merely wait for each other.

#[cfg(feature = "postgres-async")]
mod asynchronous;
pub mod citus;
mod expired;
mod outbox;
mod phases;

use chrono::{Datelike, Duration, NaiveDateTime};
use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::pg::{Pg, PgConnection};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Bool, Text, Timestamp, Timestamptz};
use diesel_migrations::EmbeddedMigrations;

use super::migrate::{self, Count, History};

use citus::distributed;
use expired::Expired;

use super::keys::{claiming, hold_of};
use super::row_with::{Head, record_with};
use super::{
    BackendRules, BlockingStore, HeldKey, Hold, KeyStore, Read, Record, Stored, end_level, transaction_depth,
    unwind_to_depth,
};
use crate::error::is_connection_lost;
use crate::in_flight::InFlight;
use crate::schema;

super::raw_connection!(PgConnection);

impl History for PgConnection {
    const MIGRATIONS: EmbeddedMigrations = migrate::POSTGRES;

    // `to_regclass` finds a table as an unqualified name does, through the
    // session's `search_path`, and is null where there is none.
    fn has_table(&mut self, name: &str) -> QueryResult<bool> {
        let found: Count = diesel::sql_query("SELECT COUNT(to_regclass($1)) AS n")
            .bind::<diesel::sql_types::Text, _>(name)
            .get_result(self)?;
        Ok(found.n > 0)
    }

    migrate::schema_history!(PgConnection);
}

diesel::define_sql_function! {
    /// PostgreSQL's `timezone(zone, timestamptz)`: the time in `zone`,
    /// without a zone.
    fn timezone(zone: Text, at: Timestamptz) -> Timestamp;
}

diesel::define_sql_function! {
    /// PostgreSQL's `statement_timestamp()`: when the server received the
    /// statement. The crate's clock on PostgreSQL, rather than `now()`, the
    /// start of the transaction: a call nested in a caller's transaction
    /// that began long ago would get a retention shortened by its age, and
    /// a relay pass on it leases that are over already. Unlike
    /// `clock_timestamp()` it is one time for the whole statement, as
    /// MySQL's `UTC_TIMESTAMP(6)` is.
    fn statement_timestamp() -> Timestamptz;
}

/// The database's time in UTC, as the crate writes times.
pub(crate) fn database_time() -> timezone<&'static str, statement_timestamp> {
    timezone("UTC", statement_timestamp())
}

/// The hint a failure of the key's lock statement carries. That statement
/// only sets local settings of ours and waits for the advisory lock, so on
/// a connection that is still up it fails only because the wait ended
/// (`lock_timeout`, a caller's `statement_timeout`, a cancel, a deadlock):
/// the key is held. Known by construction, not by the server's message,
/// which is in the language of its `lc_messages`, and not by the SQLSTATE,
/// which diesel does not pass on.
const LOCK_WAIT_ENDED: &str = "idempotency: the wait for the key's lock ended before the lock was free";

/// The server's error, marked as the end of the wait for the key's lock.
struct LockWaitEnded(Box<dyn DatabaseErrorInformation + Send + Sync>);

impl DatabaseErrorInformation for LockWaitEnded {
    fn message(&self) -> &str {
        self.0.message()
    }
    fn details(&self) -> Option<&str> {
        self.0.details()
    }
    fn hint(&self) -> Option<&str> {
        Some(LOCK_WAIT_ENDED)
    }
    fn table_name(&self) -> Option<&str> {
        self.0.table_name()
    }
    fn column_name(&self) -> Option<&str> {
        self.0.column_name()
    }
    fn constraint_name(&self) -> Option<&str> {
        self.0.constraint_name()
    }
    fn statement_position(&self) -> Option<i32> {
        self.0.statement_position()
    }
}

/// A failure of the key's lock statement, marked as the end of the wait
/// unless the connection went down with it.
fn lock_wait_ended(error: DieselError) -> DieselError {
    if is_connection_lost(&error) {
        return error;
    }
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(LockWaitEnded(info)))
        }
        other => other,
    }
}

/// Where the caller's `lock_timeout` waits while the lock is taken under the
/// policy's; a placeholder setting, local to the transaction.
const SAVED_LOCK_TIMEOUT: &str = "idempotency.caller_lock_timeout";

/// The statements that take the key's advisory lock with the policy's
/// `lock_timeout` and then put the caller's back; all local to the
/// transaction. Zero would mean "no limit" to PostgreSQL, so rejecting at
/// once is the smallest wait it accepts. Simple-query text with no bound
/// parameters: the only values in it are integers of ours.
///
/// The first statement also bounds how long the transaction may wait for
/// its client with `idle`: the server ends a session whose client went
/// silent while it holds the key, which frees the key. It stays set until
/// the transaction ends, as the lock does (a caller's transaction, for a
/// nested call), unless the session's own bound is lower. The caller's
/// `idle_in_transaction_session_timeout` comes back with the transaction's
/// end, as every local setting does.
fn lock_key_sql(scope: &str, key: &str, in_flight: InFlight, idle: Option<Duration>) -> String {
    let (high, low) = lock_key(scope, key);
    let idle = idle.map_or_else(String::new, |idle| {
        let millis = idle.num_milliseconds().clamp(1, i64::from(i32::MAX));
        format!(
            ", set_config('{IDLE}', CASE WHEN current_setting('{IDLE}')::interval \
                 BETWEEN interval '1 millisecond' AND interval '{millis} milliseconds' \
                 THEN current_setting('{IDLE}') ELSE '{millis}ms' END, true)"
        )
    });
    format!(
        "SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true), \
                set_config('lock_timeout', '{}ms', true){idle}; \
         SELECT pg_advisory_xact_lock({high}, {low}); \
         SELECT set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true)",
        in_flight.wait_millis().max(1)
    )
}

/// The claim of `record` as simple-query text, to follow the lock in the
/// round trip that takes it; `None` for a time the text form below does not
/// write (years outside 1 to 9999), which is claimed by bound statements
/// instead. The values are written as literals because a simple query binds
/// none: escape strings, which mean the same whatever
/// `standard_conforming_strings` says, and timestamps in ISO form.
fn claim_sql(record: &Record<'_>) -> Option<String> {
    let time = |at: NaiveDateTime| {
        (1..=9999)
            .contains(&at.year())
            .then(|| format!("'{}'::timestamp", at.format("%Y-%m-%d %H:%M:%S%.6f")))
    };
    Some(format!(
        "INSERT INTO idempotency_keys \
         (scope, idempotency_key, request_hash, status, created_at, expires_at, caller_hash) \
         VALUES ({}, {}, {}, {}, {}, {}, {})",
        text_literal(record.scope),
        text_literal(record.idempotency_key),
        text_literal(record.request_hash),
        text_literal(record.status.as_str()),
        time(record.created_at)?,
        time(record.expires_at)?,
        record.caller_hash.map_or_else(|| String::from("NULL"), text_literal),
    ))
}

/// `value` as an escape string literal: every backslash and quote escaped.
fn text_literal(value: &str) -> String {
    format!("E'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The setting that bounds how long a transaction waits for its client.
const IDLE: &str = "idle_in_transaction_session_timeout";

/// The advisory lock's two integers: 64 bits of a SHA-256 of the scope and
/// the key, each prefixed with its length. Stable across processes and
/// versions of the crate, which must agree on it while they run side by side.
fn lock_key(scope: &str, key: &str) -> (i32, i32) {
    let digest = crate::key::digest(&[scope, key]);
    let int = |bytes: &[u8]| i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    (int(&digest[..4]), int(&digest[4..8]))
}

/// Deletes at most `limit` of the `expired` rows, passing over those a live
/// transaction holds: a record that a live request is taking over right now
/// is not worth waiting for, and it is no longer expired once that commits.
/// Citus refuses this statement on a distributed table, and takes its own.
pub(crate) fn purge(conn: &mut PgConnection, expired: &Expired<'_>, limit: usize) -> QueryResult<usize> {
    if distributed(conn, expired.table)? {
        return citus::purge(conn, expired, limit);
    }
    let Expired { table, condition, .. } = expired;
    expired
        .query(format!(
            "DELETE FROM {table} WHERE ctid IN \
             (SELECT ctid FROM {table} WHERE {condition} LIMIT ${} FOR UPDATE SKIP LOCKED)",
            expired.next_parameter()
        ))
        .bind::<BigInt, _>(super::sql_limit(limit))
        .execute(conn)
}

/// The database's time, in UTC.
pub(crate) struct DatabaseNow;

impl Head for DatabaseNow {
    type Backend = Pg;
    const SQL: &'static str = "timezone('UTC', statement_timestamp())";
    type SqlType = Timestamp;
}

/// Whether the session's setting `idempotency.claim_first` (as
/// [`citus::distribute`] sets it for the database) is true: a placeholder
/// setting is text as it was written, so any of PostgreSQL's spellings of
/// true, in any case. On Citus the setting is the one of the node that
/// holds the key's shard, where the read runs.
macro_rules! claims_first {
    () => {
        "coalesce(lower(current_setting('idempotency.claim_first', true)) IN ('on', 'true', 'yes', '1'), false)"
    };
}

/// The database's time, in UTC, and whether it claims every key first.
struct NowAndClaimFirst;

impl Head for NowAndClaimFirst {
    type Backend = Pg;
    const SQL: &'static str = concat!("timezone('UTC', statement_timestamp()), ", claims_first!());
    type SqlType = (Timestamp, Bool);
}

/// How a write transaction holds its key: the isolation level of the
/// transaction, or `claim first` where the database claims every key
/// before the operation runs. The read before the transaction tells that
/// already, but a call whose read waited out its time goes on to the
/// transaction without it.
struct HoldBy;

impl Head for HoldBy {
    type Backend = Pg;
    const SQL: &'static str = concat!(
        "CASE WHEN ",
        claims_first!(),
        " THEN 'claim first' ELSE current_setting('transaction_isolation') END"
    );
    type SqlType = Text;
}

/// The write that makes a commit wait for the synchronous standbys. A
/// commit waits for them only if its transaction wrote to the log before
/// committing: a transaction id alone (`txid_current()`) writes nothing,
/// and its commit does not wait. A transactional logical message is such a
/// write, on any `wal_level` and without privileges, and the wait covers
/// every commit this session could see, the replayed record's included.
const DURABLE_REPLAY: &str = "SELECT pg_logical_emit_message(true, 'idempotency', 'durable replay')";

/// The read after the key's lock, on either kind of connection: how the
/// transaction holds its key ([`HoldBy`]) and the record.
trait HoldByRead: KeyStore {
    fn hold_by(&mut self, scope: &str, key: &str) -> impl Future<Output = QueryResult<(String, Option<Stored>)>>;
}

impl HoldByRead for PgConnection {
    fn hold_by(&mut self, scope: &str, key: &str) -> impl Future<Output = QueryResult<(String, Option<Stored>)>> {
        std::future::ready(record_with::<HoldBy, Timestamp, _, String>(self, scope, key))
    }
}

/// How a transaction that holds its key's lock holds the key: by the
/// record read after the lock at `READ COMMITTED`, which sees every commit
/// before the lock was granted; by a guarded claim in a caller's
/// transaction, at a stricter isolation level, or where the read before
/// the transaction found that the database claims first (a statement fewer
/// than reading first).
async fn hold<C: HoldByRead>(conn: &mut C, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold> {
    if claims_first || conn.transaction_depth()? > 1 {
        return claiming(conn, record).await;
    }
    let (hold_by, stored) = conn.hold_by(record.scope, record.idempotency_key).await?;
    if matches!(hold_by.as_str(), "read committed" | "read uncommitted") {
        Ok(hold_of(stored, record))
    } else {
        claiming(conn, record).await
    }
}

/// How a key transaction opens and ends its level on either kind of
/// connection, so that [`key_transaction`] is written once.
trait Levels: HoldByRead {
    /// Opens a transaction with `sql`, whose first statement is `BEGIN`.
    fn begin_with(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>>;

    /// Opens a savepoint in the caller's transaction.
    fn savepoint(&mut self) -> impl Future<Output = QueryResult<()>>;

    /// Sends `sql` as it is, as one simple query.
    fn batch(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>>;

    /// Runs `work` in the level just opened, then commits that level if
    /// `work` succeeded and rolls it back otherwise.
    fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> impl Future<Output = Result<T, E>>
    where
        E: From<DieselError>;
}

impl Levels for PgConnection {
    fn begin_with(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(AnsiTransactionManager::begin_transaction_sql(self, sql))
    }

    fn savepoint(&mut self) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(<AnsiTransactionManager as TransactionManager<Self>>::begin_transaction(
            self,
        ))
    }

    fn batch(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(self.batch_execute(sql))
    }

    async fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let result = work(self).await;
        end_level(self, result)
    }
}

/// The transaction that holds a key on PostgreSQL, on either kind of
/// connection: in a caller's transaction a savepoint that takes the key's
/// lock; a key the replay read found free claimed in the round trip that
/// takes its lock; otherwise the lock alone in the `BEGIN` round trip.
async fn key_transaction<C, T, E>(
    conn: &mut C,
    held: HeldKey<'_>,
    work: impl AsyncFnOnce(&mut C, bool) -> Result<T, E>,
) -> Result<T, E>
where
    C: Levels,
    E: From<DieselError>,
{
    let HeldKey {
        scope,
        key,
        mut in_flight,
        idle_timeout,
        claim,
    } = held;
    if conn.transaction_depth()? > 0 {
        // In a savepoint: a lock wait that runs out rolls back to it,
        // settings included; otherwise the lock is held until the caller's
        // transaction ends, as its record would be.
        let lock = lock_key_sql(scope, key, in_flight, idle_timeout);
        conn.savepoint().await?;
        return conn
            .within(async |tx: &mut C| {
                tx.batch(&lock).await.map_err(lock_wait_ended)?;
                work(tx, false).await
            })
            .await;
    }
    // A key the read found free is claimed in the round trip that takes its
    // lock: the transaction then holds it without reading it again.
    if let Some(claim) = claim.and_then(claim_sql) {
        let begin = format!("BEGIN; {}; {claim}", lock_key_sql(scope, key, in_flight, idle_timeout));
        match conn.begin_with(&begin).await {
            Ok(()) => return conn.within(async |tx: &mut C| work(tx, true).await).await,
            Err(error) => {
                // BEGIN went through: see below.
                let _ = conn.batch("ROLLBACK").await;
                if is_connection_lost(&error) {
                    return Err(error.into());
                }
                // A duplicate is a record committed since the read (by the
                // holder this call waited for): the transaction below reads
                // it. Any other failure is the end of the wait for the lock
                // or a failure of the claim itself; the transaction below
                // tells them apart, and waits no longer for a lock that is
                // still held.
                if !matches!(error, DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) {
                    in_flight = InFlight::Reject;
                }
            }
        }
    }
    // BEGIN, the policy's lock timeout, the lock and the caller's timeout
    // back: one round trip.
    let begin = format!("BEGIN; {}", lock_key_sql(scope, key, in_flight, idle_timeout));
    if let Err(error) = conn.begin_with(&begin).await {
        // BEGIN went through before the statement that failed: the server
        // holds an aborted transaction that diesel does not know of. A
        // broken connection fails this too and is discarded as broken
        // anyway.
        let _ = conn.batch("ROLLBACK").await;
        return Err(lock_wait_ended(error).into());
    }
    conn.within(async |tx: &mut C| work(tx, false).await).await
}

impl BackendRules for Pg {
    const NAME: &'static str = "postgres";
    // A B-tree entry holds at most 2704 bytes, and the primary keys hold the
    // scope and the key side by side: 1300 bytes each fit with their headers
    // even when the values do not compress.
    const MAX_KEY_LEN: Option<usize> = Some(1300);

    fn is_in_flight_timeout(error: &DieselError) -> bool {
        // The key's lock statement marks its own failures, in any language.
        // Elsewhere (a claim that waits for another's uncommitted claim
        // under the caller's own `lock_timeout` or `statement_timeout`)
        // diesel passes on no SQLSTATE (55P03, lock_not_available; 57014,
        // query_canceled), only the message, which is English unless the
        // server's lc_messages says otherwise.
        matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info)
            if info.hint() == Some(LOCK_WAIT_ENDED)
                || info.message().contains("lock timeout")
                || info.message().contains("statement timeout"))
    }

    fn commit_rolled_back(error: &DieselError) -> bool {
        // Only a refusal whose SQLSTATE diesel knows proves a rollback: a
        // deferred constraint's violation, a serialization failure, a
        // read-only server. Those are decided by the server that commits,
        // and a transaction whose commit reports them has rolled back. Any
        // other error may have come after the commit: a connection that
        // went down may have taken the commit's answer with it, and a Citus
        // coordinator commits a single-shard transaction on its worker and
        // answers the client's COMMIT with an error of no SQLSTATE of its
        // own (XX000, "could not commit transaction for shard ...") when
        // the worker's answer fails to come, over a connection still up,
        // though the worker may have committed. No message is read.
        match error {
            DieselError::DatabaseError(
                DatabaseErrorKind::UniqueViolation
                | DatabaseErrorKind::ForeignKeyViolation
                | DatabaseErrorKind::SerializationFailure
                | DatabaseErrorKind::ReadOnlyTransaction
                | DatabaseErrorKind::NotNullViolation
                | DatabaseErrorKind::CheckViolation
                | DatabaseErrorKind::RestrictViolation
                | DatabaseErrorKind::ExclusionViolation,
                _,
            ) => true,
            DieselError::RollbackErrorOnCommit { commit_error, .. } => Self::commit_rolled_back(commit_error),
            _ => false,
        }
    }
}

impl KeyStore for PgConnection {
    type Rules = Pg;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        let ((now, claims_first), record) =
            record_with::<NowAndClaimFirst, Timestamp, _, (NaiveDateTime, bool)>(self, scope, key)?;
        Ok(Read {
            record,
            now,
            claims_first,
        })
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        diesel::select(database_time()).get_result(self)
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

    async fn hold(&mut self, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold> {
        hold(self, record, claims_first).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        let emit = DURABLE_REPLAY;
        if transaction_depth(self)? == 0 {
            self.batch_execute(&format!("BEGIN; {emit}; COMMIT"))
        } else {
            self.batch_execute(emit)
        }
    }

    super::keys::key_statements!(ready schema: find, claim, store);
}

impl BlockingStore for PgConnection {
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_keys",
            key: "idempotency_key",
            condition: "expires_at <= $1",
            bind: &|rows| rows.bind::<Timestamp, _>(cutoff),
        };
        purge(self, &expired, limit)
    }
}

#[cfg(test)]
mod tests {
    use diesel::pg::Pg;
    use diesel::result::{DatabaseErrorKind, Error as DieselError};

    use super::citus::CLAIM_FIRST;
    use super::{HoldBy, lock_key, lock_key_sql, lock_wait_ended};
    use crate::backend::BackendRules;
    use crate::backend::row_with::Head;
    use crate::in_flight::InFlight;

    #[test]
    fn a_failed_lock_statement_is_the_end_of_the_wait_in_any_language() {
        const GERMAN: &str = "Abbruch des Befehls wegen Zeitüberschreitung einer Sperre";
        let german = DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(GERMAN.to_owned()));
        assert!(!Pg::is_in_flight_timeout(&german), "the text alone says nothing");
        let marked = lock_wait_ended(german);
        assert!(Pg::is_in_flight_timeout(&marked));
        let DieselError::DatabaseError(_, info) = &marked else {
            panic!("still the server's error: {marked:?}")
        };
        assert_eq!(info.message(), GERMAN, "the server's message is kept for the log");

        let lost = DieselError::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(String::from("terminating connection due to administrator command")),
        );
        assert!(
            !Pg::is_in_flight_timeout(&lock_wait_ended(lost)),
            "a lost connection stays lost"
        );
    }

    #[test]
    fn the_idle_bound_goes_into_the_locking_round_trip_only_when_set() {
        let bounded = lock_key_sql(
            "shop",
            "k",
            InFlight::Reject,
            Some(chrono::Duration::milliseconds(1_500)),
        );
        assert!(bounded.contains("'1500ms'"), "{bounded}");
        assert_eq!(
            bounded.matches(';').count(),
            2,
            "three statements, as without the bound: {bounded}"
        );
        let unbounded = lock_key_sql("shop", "k", InFlight::Reject, None);
        assert!(
            !unbounded.contains("idle_in_transaction_session_timeout"),
            "{unbounded}"
        );
    }

    #[test]
    fn the_hold_reads_the_setting_that_distribute_writes() {
        assert!(HoldBy::SQL.contains(&format!("current_setting('{CLAIM_FIRST}', true)")));
    }

    fn refused(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn a_commit_rolled_back_only_when_the_sqlstate_says_the_server_refused_it() {
        assert!(Pg::commit_rolled_back(&refused(
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access due to read/write dependencies among transactions"
        )));
        assert!(Pg::commit_rolled_back(&refused(
            DatabaseErrorKind::UniqueViolation,
            "duplicate key value violates unique constraint"
        )));
        // Citus's coordinator, when a worker's answer to its COMMIT was lost.
        assert!(!Pg::commit_rolled_back(&refused(
            DatabaseErrorKind::Unknown,
            "could not commit transaction for shard 102008 on at least one active node"
        )));
        assert!(!Pg::commit_rolled_back(&refused(
            DatabaseErrorKind::ClosedConnection,
            "server closed the connection unexpectedly"
        )));
    }

    #[test]
    fn lock_key_is_pinned() {
        // Processes of two versions of the crate must lock the same key the
        // same way, so the derivation may never change.
        assert_eq!(lock_key("shop", "order-1"), lock_key("shop", "order-1"));
        assert_ne!(lock_key("shop", "order-1"), lock_key("sho", "porder-1"));
        assert_eq!(lock_key("shop", "order-1"), (-394_540_622, -1_204_734_676));
    }
}
