//! How a write transaction holds its key on PostgreSQL, on either kind of
//! connection: the advisory lock taken in the `BEGIN` round trip with the
//! policy's `lock_timeout`, the claim that rides with it, and the read
//! after the lock.

use chrono::{Datelike, Duration, NaiveDateTime};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Bool, Nullable, Text};
use diesel::{OptionalExtension, QueryResult};

use super::clock::database_time;
use super::session::Session;
use crate::backend::keys::{
    Claim, HeldKey, Hold, KeyNotClaimed, KeyRecordChanged, Read, Record, Stored, claiming, hold_of,
};
use crate::backend::row_with::{Head, KeyRecord, KeyRecordRow, RowWith, stored_of};
use crate::backend::send::first;
use crate::error::is_connection_lost;
use crate::in_flight::InFlight;
use crate::sql_time::Timestamp;

/// The hint a failure of the key's lock statement carries. That statement
/// only sets local settings of ours and waits for the advisory lock, so on
/// a connection that is still up it fails only because the wait ended
/// (`lock_timeout`, a caller's `statement_timeout`, a cancel, a deadlock):
/// the key is held. Known by construction, not by the server's message,
/// which is in the language of its `lc_messages`, and not by the SQLSTATE,
/// which diesel does not pass on.
pub(super) const LOCK_WAIT_ENDED: &str = "idempotency: the wait for the key's lock ended before the lock was free";

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
pub(super) fn lock_wait_ended(error: DieselError) -> DieselError {
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
pub(super) fn lock_key_sql(scope: &str, key: &str, in_flight: InFlight, idle: Option<Duration>) -> String {
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
pub(super) fn claim_sql(record: &Record<'_>) -> Option<String> {
    let time = |at: NaiveDateTime| {
        (1..=9999)
            .contains(&at.year())
            .then(|| format!("'{}'::timestamp", at.format("%Y-%m-%d %H:%M:%S%.6f")))
    };
    Some(format!(
        "INSERT INTO idempotency_keys \
         (scope, idempotency_key, request_hash, status, created_at, expires_at, {BESIDE_TIMES}) \
         VALUES ({}, {}, {}, {}, {}, {}, {})",
        text_literal(record.scope),
        text_literal(record.idempotency_key),
        text_literal(record.request_hash),
        text_literal(record.status.as_str()),
        time(record.created_at)?,
        time(record.expires_at)?,
        beside_times(record),
    ))
}

/// The claim of `record` as [`claim_sql`] writes it, but stamped with the
/// database's time at the claim and expiring `micros` microseconds after it.
pub(super) fn claim_at_database_time_sql(record: &Record<'_>, micros: i64) -> String {
    let now = "timezone('UTC', statement_timestamp())";
    format!(
        "INSERT INTO idempotency_keys \
         (scope, idempotency_key, request_hash, status, created_at, expires_at, {BESIDE_TIMES}) \
         VALUES ({}, {}, {}, {}, {now}, {now} + interval '{micros} microseconds', {})",
        text_literal(record.scope),
        text_literal(record.idempotency_key),
        text_literal(record.request_hash),
        text_literal(record.status.as_str()),
        beside_times(record),
    )
}

/// The optional columns a claim writes after its times.
const BESIDE_TIMES: &str = "caller_hash, traceparent, request_id";

/// The literals of [`BESIDE_TIMES`] for `record`, `NULL` where it has none.
fn beside_times(record: &Record<'_>) -> String {
    let literal = |value: Option<&str>| value.map_or_else(|| String::from("NULL"), text_literal);
    format!(
        "{}, {}, {}",
        literal(record.caller_hash),
        literal(record.traceparent),
        literal(record.request_id)
    )
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
pub(super) fn lock_key(scope: &str, key: &str) -> (i32, i32) {
    let digest = crate::key::digest(&[scope, key]);
    let int = |bytes: &[u8]| i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    (int(&digest[..4]), int(&digest[4..8]))
}

/// Whether the session's setting `idempotency.claim_first` (as
/// [`citus::distribute`] sets it for the database) is true: a placeholder
/// setting is text as it was written, so any of PostgreSQL's spellings of
/// true, in any case. On Citus the setting is the one of the node that
/// holds the key's shard, where the read runs.
const CLAIMS_FIRST: &str =
    "coalesce(lower(current_setting('idempotency.claim_first', true)) IN ('on', 'true', 'yes', '1'), false)";

/// The database's time, in UTC, and whether it claims every key first.
pub(super) struct NowAndClaimFirst;

impl Head for NowAndClaimFirst {
    type Backend = Pg;
    const SQL: &'static [&'static str] = &["timezone('UTC', statement_timestamp()), ", CLAIMS_FIRST];
    type SqlType = (Timestamp, Bool);
}

/// How a write transaction holds its key: the isolation level of the
/// transaction, or `claim first` where the database claims every key
/// before the operation runs. The read before the transaction tells that
/// already, but a call whose read waited out its time goes on to the
/// transaction without it.
pub(super) struct HoldBy;

impl Head for HoldBy {
    type Backend = Pg;
    const SQL: &'static [&'static str] = &[
        "CASE WHEN ",
        CLAIMS_FIRST,
        " THEN 'claim first' ELSE current_setting('transaction_isolation') END",
    ];
    type SqlType = Text;
}

/// The write that makes a commit wait for the synchronous standbys. A
/// commit waits for them only if its transaction wrote to the log before
/// committing: a transaction id alone (`txid_current()`) writes nothing,
/// and its commit does not wait. A transactional logical message is such a
/// write, on any `wal_level` and without privileges, and the wait covers
/// every commit this session could see, the replayed record's included.
pub(super) const DURABLE_REPLAY: &str = "SELECT pg_logical_emit_message(true, 'idempotency', 'durable replay')";

/// The read after the key's lock: how the transaction holds its key
/// ([`HoldBy`]) and the record.
async fn hold_by<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<(String, Option<Stored>)> {
    let (hold_by, row): (String, KeyRecordRow) =
        first(conn.load(RowWith::<HoldBy, KeyRecord>::new(scope, key)).await?)?;
    Ok((hold_by, stored_of(row)))
}

/// How a transaction that holds its key's lock holds the key: by the
/// record read after the lock at `READ COMMITTED`, which sees every commit
/// before the lock was granted; by a guarded claim in a caller's
/// transaction, at a stricter isolation level, or where the read before
/// the transaction found that the database claims first (a statement fewer
/// than reading first).
pub(super) async fn hold<C: Session>(conn: &mut C, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold> {
    if claims_first || conn.transaction_depth()? > 1 {
        return claiming(conn, record).await;
    }
    let (hold_by, stored) = hold_by(conn, record.scope, record.idempotency_key).await?;
    if matches!(hold_by.as_str(), "read committed" | "read uncommitted") {
        Ok(hold_of(stored, record))
    } else {
        claiming(conn, record).await
    }
}

/// The transaction that holds a key on PostgreSQL, on either kind of
/// connection: in a caller's transaction a savepoint that takes the key's
/// lock; a key the replay read found free claimed in the round trip that
/// takes its lock; otherwise the lock alone in the `BEGIN` round trip.
pub(super) async fn key_transaction<C, T, E>(
    conn: &mut C,
    held: HeldKey<'_>,
    work: impl AsyncFnOnce(&mut C, bool) -> Result<T, E>,
) -> Result<T, E>
where
    C: Session,
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
    // A key the read found free, or one no read came before, is claimed in
    // the round trip that takes its lock: the transaction then holds it
    // without reading it.
    let claim = match claim {
        Some(Claim::Bound(record)) => claim_sql(record).map(|sql| (sql, false)),
        Some(Claim::AtDatabaseTime {
            record,
            retention_micros,
        }) => Some((claim_at_database_time_sql(record, retention_micros), true)),
        None => None,
    };
    if let Some((claim, at_database_time)) = claim {
        let begin = format!("BEGIN; {}; {claim}", lock_key_sql(scope, key, in_flight, idle_timeout));
        match conn.begin_with(&begin).await {
            Ok(()) => return conn.within(async |tx: &mut C| work(tx, true).await).await,
            Err(error) => {
                // BEGIN went through: see below.
                let _ = conn.batch("ROLLBACK").await;
                if is_connection_lost(&error) {
                    return Err(error.into());
                }
                // Without the claim's time the transaction cannot decide
                // what a record it reads means: the call reads it as if it
                // had read first.
                if at_database_time {
                    return Err(match error {
                        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info) => {
                            KeyNotClaimed::Taken.error(info)
                        }
                        DieselError::DatabaseError(_, info) => KeyNotClaimed::Failed.error(info),
                        other => other,
                    }
                    .into());
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

/// `UPDATE idempotency_keys SET status, response, completed_at WHERE` the
/// key of `record` `RETURNING created_at, expires_at`: the completion of a
/// [`Claim::AtDatabaseTime`], stamped with the database's time, which
/// returns the times the claim was stamped with. A query type of its own,
/// so that it is prepared once per session.
pub(super) struct CompleteAtDatabaseTime<'a>(pub(super) &'a Record<'a>);

impl QueryId for CompleteAtDatabaseTime<'_> {
    type QueryId = CompleteAtDatabaseTime<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for CompleteAtDatabaseTime<'_> {
    type SqlType = (Timestamp, Timestamp);
}

impl QueryFragment<Pg> for CompleteAtDatabaseTime<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let record = self.0;
        out.push_sql("UPDATE idempotency_keys SET status = ");
        out.push_bind_param::<Text, _>(&record.status)?;
        out.push_sql(", response = ");
        out.push_bind_param::<Nullable<Text>, _>(&record.response)?;
        out.push_sql(", completed_at = timezone('UTC', statement_timestamp()) WHERE scope = ");
        out.push_bind_param::<Text, _>(record.scope)?;
        out.push_sql(" AND idempotency_key = ");
        out.push_bind_param::<Text, _>(record.idempotency_key)?;
        out.push_sql(" RETURNING created_at, expires_at");
        Ok(())
    }
}

impl diesel::query_dsl::RunQueryDslSupport for CompleteAtDatabaseTime<'_> {}

/// The claim's times that a [`CompleteAtDatabaseTime`] returned, or the
/// error of a record that changed under its key's lock.
fn completed(times: Option<(NaiveDateTime, NaiveDateTime)>) -> QueryResult<(NaiveDateTime, NaiveDateTime)> {
    times.ok_or_else(KeyRecordChanged::error)
}

/// [`KeyStore::read`](crate::backend::KeyStore::read): the record of
/// `(scope, key)`, the database's time and whether it claims every key
/// first, in one statement.
pub(super) async fn read<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Read> {
    let ((now, claims_first), row): ((NaiveDateTime, bool), KeyRecordRow) = first(
        conn.load(RowWith::<NowAndClaimFirst, KeyRecord>::new(scope, key))
            .await?,
    )?;
    Ok(Read {
        record: stored_of(row),
        now,
        claims_first,
    })
}

/// The database's time (UTC).
pub(super) async fn database_now<C: Session>(conn: &mut C) -> QueryResult<NaiveDateTime> {
    first(conn.load(diesel::select(database_time())).await?)
}

/// [`KeyStore::complete_at_database_time`](crate::backend::KeyStore::complete_at_database_time):
/// the claim's times, as the completion returned them.
pub(super) async fn complete_at_database_time<C: Session>(
    conn: &mut C,
    record: &Record<'_>,
) -> QueryResult<(NaiveDateTime, NaiveDateTime)> {
    completed(first(conn.load(CompleteAtDatabaseTime(record)).await?).optional()?)
}

/// [`KeyStore::await_replication`](crate::backend::KeyStore::await_replication):
/// a commit that waits for the synchronous standbys, or the write that
/// makes the enclosing commit one.
pub(super) async fn await_replication<C: Session>(conn: &mut C) -> QueryResult<()> {
    let emit = DURABLE_REPLAY;
    if conn.transaction_depth()? == 0 {
        conn.batch(&format!("BEGIN; {emit}; COMMIT")).await
    } else {
        conn.batch(emit).await
    }
}
