//! PostgreSQL: a write transaction holds its key with a transaction-level
//! advisory lock on a hash of `(scope, key)`, taken in the `BEGIN` round
//! trip. A second call with the key waits on that lock until the holder
//! commits (it then reads the holder's record and replays) or rolls back (it
//! then executes). The in-flight policy bounds the wait with a
//! `lock_timeout` that is put back to the caller's value in the same round
//! trip, so it bounds the lock and never the operation.
//!
//! A top-level call claims its key in that same round trip, after the lock:
//! a plain `INSERT` of its record, stamped with the database's time, which
//! the primary key refuses if the key has a record (a retry, or a holder
//! that committed while this call waited), and the operation's result
//! completes it. A first call thus sends as many statements as its
//! transaction with one insert of the record would. A refused or failed
//! claim is rolled back, and the call reads the record outside any
//! transaction, as a call that reads first does
//! ([`Config::read_before_transaction`](crate::Config::read_before_transaction));
//! a key such a read found free is claimed in the lock's round trip too,
//! with the read's time.
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
mod clock;
mod expired;
mod key;
mod outbox;
mod phases;
mod purge;
mod session;

use chrono::NaiveDateTime;
use diesel::pg::{Pg, PgConnection};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::Timestamp;
use diesel_migrations::EmbeddedMigrations;

use super::history::{self, Count, History};
use super::migrate;

use expired::Expired;
use key::{LOCK_WAIT_ENDED, await_replication, complete_at_database_time, database_now, hold, key_transaction, read};
pub(crate) use purge::purge;

use super::send::{AtOnce, Sends};
use super::{BackendRules, BlockingStore, HeldKey, Hold, KeyStore, Read, Record, transaction_depth, unwind_to_depth};

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

    history::schema_history!(PgConnection);
}

impl BackendRules for Pg {
    const NAME: &'static str = "postgres";
    // A first call claims its key at the database's time in the round trip
    // that takes the key's lock: the read before would be a round trip more
    // for every first call, which pays only where most calls are retries.
    const READS_BEFORE_TRANSACTION: bool = false;
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

impl Sends for PgConnection {
    type Way = AtOnce;
}

crate::backend::keys::shared_key_statements!(PgConnection);

impl KeyStore for PgConnection {
    type Rules = Pg;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        read(self, scope, key).await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        database_now(self).await
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

    const CLAIMS_AT_DATABASE_TIME: bool = true;

    async fn complete_at_database_time(&mut self, record: &Record<'_>) -> QueryResult<(NaiveDateTime, NaiveDateTime)> {
        complete_at_database_time(self, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        await_replication(self).await
    }
}

impl BlockingStore for PgConnection {
    fn purge_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_keys",
            key: "idempotency_key",
            condition: "expires_at <= $1",
            set: None,
            bind: &|rows| rows.bind::<Timestamp, _>(cutoff),
        };
        purge(self, &expired, limit)
    }

    fn tombstone_batch(&mut self, after: NaiveDateTime, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        let expired = Expired {
            table: "idempotency_keys",
            key: "idempotency_key",
            condition: "expires_at > $1 AND expires_at <= $2 AND response IS NOT NULL",
            set: Some("response = NULL"),
            bind: &|rows| rows.bind::<Timestamp, _>(after).bind::<Timestamp, _>(cutoff),
        };
        purge(self, &expired, limit)
    }
}

#[cfg(test)]
mod tests {
    use diesel::pg::Pg;
    use diesel::result::{DatabaseErrorKind, Error as DieselError};

    use super::citus::CLAIM_FIRST;
    use super::key::{HoldBy, lock_key, lock_key_sql, lock_wait_ended};
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
        assert!(
            HoldBy::SQL
                .concat()
                .contains(&format!("current_setting('{CLAIM_FIRST}', true)"))
        );
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
