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
//! [`Session`], which is only how each sends a statement and keeps its
//! transactions; the key store itself is one impl for both. On the async
//! connection a call's future may be dropped at any `await`; one dropped
//! while the session holds what the call took from it (from the lowered
//! `wait_timeout` to the release of the named lock, the transaction in
//! between) leaves the connection marked broken ([`TakenSession`]): a pool
//! discards it, and the server frees the lock when the session closes.

#[cfg(feature = "mysql-async")]
mod asynchronous;
mod clock;
mod committed;
mod key;
mod lock;
mod outbox;
mod phases;
mod session;

use std::ops::RangeInclusive;

use chrono::NaiveDateTime;
use diesel::mysql::{Mysql, MysqlConnection};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Datetime};
use diesel_migrations::EmbeddedMigrations;

use super::history::{self, Count, History};
use super::migrate;
use super::send::{AtOnce, Sends};

use super::{BackendRules, BlockingStore, ClaimOutcome, HeldKey, Hold, KeyStatements, KeyStore, Read, Record, Stored};
use committed::read_committed;
use key::{LOCK_WAIT_TIMEOUT, claim, hold, key_transaction, read, store};
use session::{Session, database_now, find_record};

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

    history::schema_history!(MysqlConnection);
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

// MySQL's key statements and rules, written once for both kinds of
// connection: what differs between them is how a statement is sent and a
// transaction ended ([`Session`]).
impl<C: Session> KeyStatements for C {
    async fn find(&mut self, scope: &str, key: &str) -> QueryResult<Option<Stored>> {
        find_record(self, scope, key).await
    }

    async fn claim(&mut self, record: &Record<'_>) -> QueryResult<ClaimOutcome> {
        claim(self, record).await
    }

    async fn store(&mut self, hold: Hold, record: &Record<'_>) -> QueryResult<()> {
        store(self, hold, record).await
    }
}

impl<C: Session> KeyStore for C {
    type Rules = Mysql;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        read(self, scope, key).await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        database_now(self).await
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        self.depth()
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        self.unwind(depth).await
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

    async fn await_replication(&mut self) -> QueryResult<()> {
        // Semi-synchronous replication waits for a replica's acknowledgement
        // before the commit returns, but not before other sessions see it;
        // the crate offers no durable replays on MySQL.
        Ok(())
    }
}

impl Sends for MysqlConnection {
    type Way = AtOnce;
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

    fn tombstone_batch(&mut self, after: NaiveDateTime, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // Picked as the purge picks, then updated by primary key.
        read_committed(self, |tx| {
            diesel::sql_query(
                "UPDATE \
             (SELECT scope, idempotency_key FROM idempotency_keys FORCE INDEX (idempotency_keys_expires_at) \
              WHERE expires_at > ? AND expires_at <= ? AND response IS NOT NULL \
              ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED) AS expired \
             STRAIGHT_JOIN idempotency_keys AS k FORCE INDEX (PRIMARY) \
             ON k.scope = expired.scope AND k.idempotency_key = expired.idempotency_key \
             SET k.response = NULL",
            )
            .bind::<Datetime, _>(after)
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

    use super::key::{MAX_WAIT_TIMEOUT, lock_key, wait_timeout_seconds};
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
