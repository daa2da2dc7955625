//! PostgreSQL: a claim is one guarded insert. A concurrent insert of the same
//! key blocks on the primary key index until the holder commits (the waiter
//! then finds the record and replays) or rolls back (the waiter's insert goes
//! through and it executes). The in-flight policy bounds that wait with a
//! `lock_timeout` set for the claim statement alone.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Text, Timestamp};

use super::{Backend, NewRecord, StoreConnection, sealed};
use crate::config::InFlight;

impl StoreConnection for PgConnection {
    type Raw = Self;

    fn raw(&mut self) -> &mut Self {
        self
    }
}

impl sealed::Sealed for PgConnection {}

/// The claim in one round trip: set `lock_timeout` for this transaction,
/// insert or take over an expired record, and put the caller's
/// `lock_timeout` back, so the wait bound applies to the claim and not to
/// the operation that follows. diesel's DSL cannot express the settings, and
/// three statements would cost three round trips on every call.
///
/// The insert reads its row from `timeout`, so the new setting is in force
/// before it can wait; the final projection runs after the insert finished.
/// Only a record whose retention has ended is taken over; `RETURNING` yields
/// a row exactly when the key became this transaction's.
const CLAIM: &str = "\
WITH timeout AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS previous, set_config('lock_timeout', $6, true) AS applied
), claimed AS (
    INSERT INTO idempotency_keys AS k
        (scope, idempotency_key, request_hash, status, created_at, expires_at)
    SELECT $1, $2, $3, $4, $5, $7 FROM timeout
    ON CONFLICT (scope, idempotency_key) DO UPDATE SET
        request_hash = EXCLUDED.request_hash,
        status = EXCLUDED.status,
        response = NULL,
        created_at = EXCLUDED.created_at,
        completed_at = NULL,
        expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= EXCLUDED.created_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM claimed) AS claimed, set_config('lock_timeout', previous, true) AS restored
FROM timeout";

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = BigInt)]
    claimed: i64,
}

/// `lock_timeout` for the policy. Zero would mean "no limit" to PostgreSQL,
/// so rejecting at once is the smallest wait it accepts.
fn lock_timeout(in_flight: InFlight) -> String {
    format!("{}ms", in_flight.wait_millis().max(1))
}

impl Backend for PgConnection {
    fn write_transaction<T, E>(
        &mut self,
        _in_flight: InFlight,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        // diesel opens a transaction, or a savepoint inside an open one.
        self.transaction(f)
    }

    fn claim(&mut self, record: &NewRecord<'_>, in_flight: InFlight) -> QueryResult<bool> {
        let row: ClaimRow = diesel::sql_query(CLAIM)
            .bind::<Text, _>(record.scope)
            .bind::<Text, _>(record.idempotency_key)
            .bind::<Text, _>(record.request_hash)
            .bind::<Text, _>(record.status)
            .bind::<Timestamp, _>(record.created_at)
            .bind::<Text, _>(lock_timeout(in_flight))
            .bind::<Timestamp, _>(record.expires_at)
            .get_result(self)?;
        Ok(row.claimed == 1)
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
        .bind::<BigInt, _>(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(self)
    }

    super::shared_queries!();
}
