//! SQLite: one writer at a time, so a claim first takes the database's write
//! lock (`BEGIN IMMEDIATE`) and the in-flight policy bounds the wait for it.
//! The policy is the connection's busy timeout while a call writes; the
//! caller's own busy timeout is put back afterwards.

use std::time::{Duration, Instant};

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, SimpleConnection};
use diesel::prelude::*;
use diesel::query_dsl::methods::FilterDsl;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Integer, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::upsert::excluded;

use super::{Backend, NewRecord, StoreConnection, sealed, transaction_depth, transaction_with};
use crate::config::InFlight;
use crate::schema::idempotency_keys as k;

impl StoreConnection for SqliteConnection {
    type Raw = Self;

    fn raw(&mut self) -> &mut Self {
        self
    }
}

impl sealed::Sealed for SqliteConnection {}

#[derive(QueryableByName)]
struct BusyTimeout {
    #[diesel(sql_type = Integer)]
    timeout: i32,
}

/// Runs `f` and then puts the connection's busy timeout back to what it was
/// before, whatever `f` did with it.
fn keeping_busy_timeout<T, E>(
    conn: &mut SqliteConnection,
    f: impl FnOnce(&mut SqliteConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<DieselError>,
{
    let previous = diesel::sql_query("PRAGMA busy_timeout").get_result::<BusyTimeout>(conn)?;
    let result = f(conn);
    let restored = conn.batch_execute(&busy_timeout_sql(previous.timeout.into()));
    let value = result?;
    restored?;
    Ok(value)
}

/// Makes the connection's busy timeout follow the in-flight policy.
fn apply_busy_timeout(conn: &mut SqliteConnection, in_flight: InFlight) -> QueryResult<()> {
    conn.batch_execute(&busy_timeout_sql(in_flight.wait_millis()))
}

fn busy_timeout_sql(millis: i64) -> String {
    // A PRAGMA takes no bound parameters; the value is an integer of ours.
    format!("PRAGMA busy_timeout = {millis}")
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
/// rest of the transaction's waits (a commit waiting for readers outside
/// WAL mode).
fn begin_immediate(conn: &mut SqliteConnection, in_flight: InFlight) -> QueryResult<()> {
    let deadline = Instant::now() + Duration::from_millis(u64::try_from(in_flight.wait_millis()).unwrap_or(0));
    // One call in the common case, where the lock is free. Setting the busy
    // timeout cannot fail, so the batch stops, if at all, at BEGIN.
    let attempt = format!(
        "PRAGMA busy_timeout = 0; BEGIN IMMEDIATE; {}",
        busy_timeout_sql(in_flight.wait_millis())
    );
    let mut poll = WRITE_LOCK_FIRST_POLL;
    loop {
        match AnsiTransactionManager::begin_transaction_sql(conn, &attempt) {
            Err(error) if SqliteConnection::is_in_flight_timeout(&error) && Instant::now() < deadline => {
                std::thread::sleep(poll);
                poll = (poll * 2).min(WRITE_LOCK_MAX_POLL);
            }
            result => return result,
        }
    }
}

impl Backend for SqliteConnection {
    fn write_transaction<T, E>(
        &mut self,
        in_flight: InFlight,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let top_level = transaction_depth(self)? == 0;
        keeping_busy_timeout(self, |conn| {
            if top_level {
                // A deferred BEGIN would take the write lock only at the
                // first write, and two racing writers would then fail with
                // "database is locked" instead of waiting for each other.
                transaction_with(conn, |conn| begin_immediate(conn, in_flight), f)
            } else {
                apply_busy_timeout(conn, in_flight)?;
                conn.transaction(f)
            }
        })
    }

    fn claim(&mut self, record: &NewRecord<'_>) -> QueryResult<bool> {
        let claimed = diesel::insert_into(k::table)
            .values(record)
            .on_conflict((k::scope, k::idempotency_key))
            .do_update()
            .set((
                k::request_hash.eq(excluded(k::request_hash)),
                k::status.eq(excluded(k::status)),
                k::response.eq(None::<String>),
                k::created_at.eq(excluded(k::created_at)),
                k::completed_at.eq(None::<NaiveDateTime>),
                k::expires_at.eq(excluded(k::expires_at)),
            ))
            .filter(k::expires_at.le(record.created_at))
            .execute(self)?;
        Ok(claimed == 1)
    }

    fn is_in_flight_timeout(error: &DieselError) -> bool {
        // SQLITE_BUSY reaches diesel as an unknown database error whose text
        // SQLite fixes: "database is locked".
        matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info)
            if info.message().contains("database is locked"))
    }

    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize, in_flight: InFlight) -> QueryResult<usize> {
        keeping_busy_timeout(self, |conn| {
            apply_busy_timeout(conn, in_flight)?;
            // diesel's DSL cannot delete through a limited subquery.
            diesel::sql_query(
                "DELETE FROM idempotency_keys WHERE rowid IN \
                 (SELECT rowid FROM idempotency_keys WHERE expires_at <= ? LIMIT ?)",
            )
            .bind::<Timestamp, _>(cutoff)
            .bind::<BigInt, _>(super::sql_limit(limit))
            .execute(conn)
        })
    }

    super::shared_queries!();
}
