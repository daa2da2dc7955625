//! PostgreSQL: a claim is one guarded insert. A concurrent insert of the same
//! key blocks on the primary key index until the holder commits (the waiter
//! then finds the record and replays) or rolls back (the waiter's insert goes
//! through and it executes). The in-flight policy bounds that wait with a
//! `lock_timeout` that is set with `BEGIN`, in the same round trip (in a
//! caller's transaction: right after the savepoint), and put back by the
//! claim itself, so it bounds the claim and not the operation.

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, SimpleConnection};
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Bool, Text, Timestamp};

use super::{Backend, NewRecord, StoreConnection, sealed, transaction_depth, transaction_with};
use crate::config::InFlight;
use crate::schema::idempotency_keys as k;

impl StoreConnection for PgConnection {
    type Raw = Self;

    fn raw(&mut self) -> &mut Self {
        self
    }
}

impl sealed::Sealed for PgConnection {}

diesel::define_sql_function! {
    /// PostgreSQL's `set_config(name, value, is_local)`.
    fn set_config(name: Text, value: Text, is_local: Bool) -> Text;
}

diesel::define_sql_function! {
    /// PostgreSQL's `current_setting(name)`.
    fn current_setting(name: Text) -> Text;
}

/// Where the caller's `lock_timeout` waits while the claim runs under the
/// policy's; a placeholder setting, local to the transaction.
const SAVED_LOCK_TIMEOUT: &str = "idempotency.caller_lock_timeout";

/// Saves the caller's `lock_timeout` and puts the policy's in force, so the
/// claim's wait for a key held elsewhere is bounded. Both settings are local
/// to the transaction. Zero would mean "no limit" to PostgreSQL, so rejecting
/// at once is the smallest wait it accepts. A statement that takes no bound
/// parameters: the only value in it is an integer of ours.
fn apply_lock_timeout_sql(in_flight: InFlight) -> String {
    format!(
        "SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true), \
         set_config('lock_timeout', '{}ms', true)",
        in_flight.wait_millis().max(1)
    )
}

/// Puts back the `lock_timeout` that [`apply_lock_timeout_sql`] saved.
fn restore_lock_timeout() -> set_config<&'static str, current_setting<&'static str>, bool> {
    set_config("lock_timeout", current_setting(SAVED_LOCK_TIMEOUT), true)
}

impl Backend for PgConnection {
    fn write_transaction<T, E>(
        &mut self,
        in_flight: InFlight,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        if transaction_depth(self)? == 0 {
            // The lock timeout travels with BEGIN: one round trip, not two.
            let begin = format!("BEGIN; {}", apply_lock_timeout_sql(in_flight));
            transaction_with(
                self,
                |conn| AnsiTransactionManager::begin_transaction_sql(conn, &begin),
                f,
            )
        } else {
            // A savepoint: rolling back to it undoes the setting, but
            // releasing it would leave the policy's timeout to the rest of
            // the caller's transaction.
            self.transaction(|conn| {
                conn.batch_execute(&apply_lock_timeout_sql(in_flight))?;
                let value = f(conn)?;
                diesel::select(restore_lock_timeout()).execute(conn)?;
                Ok(value)
            })
        }
    }

    fn claim(&mut self, record: &NewRecord<'_>) -> QueryResult<bool> {
        // Statements that diesel prepares once per connection and caches, so
        // the server does not parse and plan them on every call. `RETURNING`
        // runs only for a row this transaction now holds, and gives the
        // operation that follows the caller's lock timeout back.
        //
        // DO NOTHING, not DO UPDATE: a fresh key, the common case, costs the
        // server measurably less that way. A record that is already there
        // is taken over by a second, guarded statement only if its
        // retention has ended; of two requests taking over the same record,
        // the second waits for the first and then finds it unexpired.
        let inserted = diesel::insert_into(k::table)
            .values(record)
            .on_conflict_do_nothing()
            .returning(restore_lock_timeout())
            .get_result::<String>(self)
            .optional()?;
        if inserted.is_some() {
            return Ok(true);
        }
        let taken_over = diesel::update(k::table.find((record.scope, record.idempotency_key)))
            .filter(k::expires_at.le(record.created_at))
            .set((
                k::request_hash.eq(record.request_hash),
                k::status.eq(record.status),
                k::response.eq(None::<String>),
                k::created_at.eq(record.created_at),
                k::completed_at.eq(None::<NaiveDateTime>),
                k::expires_at.eq(record.expires_at),
            ))
            .returning(restore_lock_timeout())
            .get_result::<String>(self)
            .optional()?;
        Ok(taken_over.is_some())
    }

    fn is_in_flight_timeout(error: &DieselError) -> bool {
        // diesel does not expose the SQLSTATE (55P03, lock_not_available) for
        // this error, only the server's message, which is English unless the
        // server's lc_messages says otherwise.
        matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info)
            if info.message().contains("lock timeout"))
    }

    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize, _in_flight: InFlight) -> QueryResult<usize> {
        // SKIP LOCKED: a record that a live request is taking over right now
        // is not worth waiting for; it is no longer expired once that commits.
        diesel::sql_query(
            "DELETE FROM idempotency_keys WHERE ctid IN \
             (SELECT ctid FROM idempotency_keys WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
        )
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(super::sql_limit(limit))
        .execute(self)
    }

    super::shared_queries!();
}
