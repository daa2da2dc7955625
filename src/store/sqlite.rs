//! SQLite: one writer at a time, so a claim first takes the database's write
//! lock (`BEGIN IMMEDIATE`) and the in-flight policy bounds the wait for it.

use chrono::NaiveDateTime;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::FilterDsl;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::upsert::excluded;

use super::{Backend, NewRecord, StoreConnection, sealed, transaction_depth};
use crate::config::InFlight;
use crate::schema::idempotency_keys as k;

impl StoreConnection for SqliteConnection {
    type Raw = Self;

    fn raw(&mut self) -> &mut Self {
        self
    }
}

impl sealed::Sealed for SqliteConnection {}

/// Makes the connection's busy timeout follow the in-flight policy.
fn apply_busy_timeout(conn: &mut SqliteConnection, in_flight: InFlight) -> QueryResult<()> {
    // A PRAGMA takes no bound parameters; the value is an integer of ours.
    conn.batch_execute(&format!(
        "PRAGMA busy_timeout = {}",
        in_flight.wait_millis().clamp(0, i64::from(i32::MAX))
    ))
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
        apply_busy_timeout(self, in_flight)?;
        if transaction_depth(self)? == 0 {
            // A deferred BEGIN would take the write lock only at the first
            // write, and two racing writers would then fail with "database
            // is locked" instead of waiting for each other.
            self.immediate_transaction(f)
        } else {
            self.transaction(f)
        }
    }

    fn claim(&mut self, record: &NewRecord<'_>, _in_flight: InFlight) -> QueryResult<bool> {
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
        apply_busy_timeout(self, in_flight)?;
        // diesel's DSL cannot delete through a limited subquery.
        diesel::sql_query(
            "DELETE FROM idempotency_keys WHERE rowid IN \
             (SELECT rowid FROM idempotency_keys WHERE expires_at <= ? LIMIT ?)",
        )
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(self)
    }

    super::shared_queries!();
}
