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
mod write;

use std::ops::RangeInclusive;

use chrono::{NaiveDateTime, Utc};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Timestamp};
use diesel::sqlite::{Sqlite, SqliteConnection};
use diesel_migrations::EmbeddedMigrations;

use super::history::{self, Count, History};
use super::migrate;

use write::{close_write, hold, open_write, settle};

use super::send::{AtOnce, Sends};
use super::{
    BackendRules, BlockingStore, HeldKey, Hold, KeyStatements, KeyStore, Read, Record, transaction_depth,
    unwind_to_depth,
};
use crate::in_flight::InFlight;

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

    history::schema_history!(SqliteConnection);
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

impl Sends for SqliteConnection {
    type Way = AtOnce;
}

crate::backend::keys::shared_key_statements!(SqliteConnection);

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

    fn tombstone_batch(&mut self, after: NaiveDateTime, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        diesel::sql_query(
            "UPDATE idempotency_keys SET response = NULL WHERE (scope, idempotency_key) IN \
             (SELECT scope, idempotency_key FROM idempotency_keys \
              WHERE expires_at > ? AND expires_at <= ? AND response IS NOT NULL LIMIT ?)",
        )
        .bind::<Timestamp, _>(after)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(super::sql_limit(limit))
        .execute(self)
    }
}
