//! A key record as the statements write and read it, how a write
//! transaction holds its key, and the error for a record changed under it.

use chrono::NaiveDateTime;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind};

use crate::outcome::Origin;
use crate::row_status::RecordStatus;
use crate::schema::idempotency_keys;
use crate::sql_time::At;

/// A key record as this crate writes it: claimed (`processing`, no response
/// yet) or completed with its response.
#[derive(Insertable, AsChangeset, Clone, Copy, Debug)]
#[diesel(table_name = idempotency_keys, primary_key(scope, idempotency_key))]
#[diesel(treat_none_as_null = true)]
pub struct Record<'a> {
    pub(crate) scope: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) request_hash: &'a str,
    pub(crate) status: RecordStatus,
    pub(crate) response: Option<&'a str>,
    #[diesel(serialize_as = At)]
    pub(crate) created_at: NaiveDateTime,
    /// Bound as it is: diesel's derives cannot convert an `Option` of
    /// another crate's type to the crate's time (`serialize_as`).
    pub(crate) completed_at: Option<At>,
    #[diesel(serialize_as = At)]
    pub(crate) expires_at: NaiveDateTime,
    /// Who may look the record up (written by the HTTP layer: the hash of
    /// the caller's principal and endpoint); `None` for no HTTP lookup.
    pub(crate) caller_hash: Option<&'a str>,
    /// The W3C `traceparent` of the span the operation executed in, where
    /// the application traces with OpenTelemetry.
    pub(crate) traceparent: Option<&'a str>,
    /// The id the application gave the request that executed.
    pub(crate) request_id: Option<&'a str>,
    /// A record of the key that expired at or before this time may be
    /// taken over: `created_at`, or the start of the grace period that ends
    /// then where the policy keeps [tombstones](crate::Config::tombstones).
    /// Not a column.
    #[diesel(skip_insertion, skip_update)]
    pub(crate) reusable_by: NaiveDateTime,
}

/// What a replay, and a lookup, needs of a stored record.
#[derive(Queryable, Debug)]
pub struct Stored {
    pub(crate) request_hash: String,
    pub(crate) status: RecordStatus,
    pub(crate) response: Option<String>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) expires_at: NaiveDateTime,
    pub(crate) caller_hash: Option<String>,
    pub(crate) traceparent: Option<String>,
    pub(crate) request_id: Option<String>,
}

impl Stored {
    /// Where the stored result came from.
    pub(crate) fn origin(&self) -> Origin {
        Origin::kept(self.traceparent.as_deref(), self.request_id.as_deref())
    }
}

/// What the replay read outside the write transaction found.
pub struct Read {
    /// The record, whatever its state.
    pub(crate) record: Option<Stored>,
    /// The database's time when it was read.
    pub(crate) now: NaiveDateTime,
    /// Whether the database claims every key before the operation runs
    /// (PostgreSQL's `idempotency.claim_first`): a write transaction then
    /// claims at once, without reading the record again.
    pub(crate) claims_first: bool,
}

/// What a guarded claim of a key did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// There was no record: the claim is inserted.
    Inserted,
    /// There was an expired record: the claim replaced it.
    TookOver,
    /// An unexpired record, or a tombstone, holds the key.
    Refused,
}

impl ClaimOutcome {
    /// The hold a successful claim gives.
    pub(crate) fn hold(self) -> Option<Hold> {
        match self {
            ClaimOutcome::Inserted => Some(Hold::Claimed { took_over: false }),
            ClaimOutcome::TookOver => Some(Hold::Claimed { took_over: true }),
            ClaimOutcome::Refused => None,
        }
    }
}

/// How a write transaction holds its key, decided once it holds the key's
/// lock, and so how the operation's result is stored.
#[derive(Debug)]
pub enum Hold {
    /// No record: the completed record is inserted after the operation.
    Free,
    /// An expired record: it is replaced by the completed one after the
    /// operation.
    Expired,
    /// Claimed with a guarded insert before the operation (`took_over`: by
    /// replacing an expired record): the operation's result completes the
    /// record.
    Claimed {
        /// Whether the claim replaced an expired record.
        took_over: bool,
    },
    /// An unexpired record, or the tombstone of an expired one: the answer
    /// is a replay, a mismatch, [`Error::Expired`](crate::Error::Expired)
    /// or (for a record an enclosing call has claimed) in progress.
    Recorded(Stored),
    /// The key was freed and claimed again by another call while this
    /// transaction looked at it: in progress elsewhere.
    ClaimedElsewhere,
}

/// A [`Claim::AtDatabaseTime`](super::Claim::AtDatabaseTime) that was not
/// made, reported as a storage error with the server's message and one of
/// this type's hints: the key has a record ([`taken`](KeyNotClaimed::taken)),
/// or the round trip that was to take the key failed otherwise (its lock's
/// wait ran out, or the claim itself failed). Nothing was written; the call
/// goes on by reading the record, and waits no longer for a lock whose wait
/// may have run out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyNotClaimed {
    /// The primary key refused the claim: the key has a record.
    Taken,
    /// The round trip failed otherwise.
    Failed,
}

impl KeyNotClaimed {
    const TAKEN: &str = "idempotency: the key was not claimed: it has a record";
    const FAILED: &str = "idempotency: the key was not claimed: the round trip that takes it failed";

    /// The error that says so, with the server's own.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(dead_code, reason = "only PostgreSQL claims at the database's time")
    )]
    pub(crate) fn error(self, server: Box<dyn DatabaseErrorInformation + Send + Sync>) -> diesel::result::Error {
        diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, Box::new(NotClaimed(self, server)))
    }

    /// The claim that `error` reports as not made, if it is one.
    pub(crate) fn of(error: &diesel::result::Error) -> Option<KeyNotClaimed> {
        match error {
            diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, info) => match info.hint() {
                Some(KeyNotClaimed::TAKEN) => Some(KeyNotClaimed::Taken),
                Some(KeyNotClaimed::FAILED) => Some(KeyNotClaimed::Failed),
                _ => None,
            },
            _ => None,
        }
    }
}

/// The server's error, marked as a claim not made.
struct NotClaimed(KeyNotClaimed, Box<dyn DatabaseErrorInformation + Send + Sync>);

impl DatabaseErrorInformation for NotClaimed {
    fn message(&self) -> &str {
        self.1.message()
    }
    fn details(&self) -> Option<&str> {
        self.1.details()
    }
    fn hint(&self) -> Option<&str> {
        Some(match self.0 {
            KeyNotClaimed::Taken => KeyNotClaimed::TAKEN,
            KeyNotClaimed::Failed => KeyNotClaimed::FAILED,
        })
    }
    fn table_name(&self) -> Option<&str> {
        self.1.table_name()
    }
    fn column_name(&self) -> Option<&str> {
        self.1.column_name()
    }
    fn constraint_name(&self) -> Option<&str> {
        self.1.constraint_name()
    }
    fn statement_position(&self) -> Option<i32> {
        self.1.statement_position()
    }
}

/// The key record changed while this transaction held its key: a statement
/// that writes the record of a held key did not find it as the hold left
/// it. Something bypassed the key's lock; the transaction is rolled back
/// rather than commit an executed operation without its result, so
/// nothing of the call remains and a retry is safe.
///
/// Reported as what diesel calls such a conflict with a concurrent
/// transaction, a storage error of kind `SerializationFailure`, which
/// [`Error::is_retryable`](crate::Error::is_retryable) already answers
/// with `true`; its message says what happened.
#[derive(Debug)]
pub struct KeyRecordChanged;

impl KeyRecordChanged {
    /// `Ok` when the write of a held key's record changed its one row.
    pub(crate) fn check(written: usize) -> QueryResult<()> {
        match written {
            1 => Ok(()),
            _ => Err(KeyRecordChanged::error()),
        }
    }

    /// The error that reports it.
    pub(crate) fn error() -> diesel::result::Error {
        diesel::result::Error::DatabaseError(DatabaseErrorKind::SerializationFailure, Box::new(KeyRecordChanged))
    }
}

impl DatabaseErrorInformation for KeyRecordChanged {
    fn message(&self) -> &str {
        "idempotency: the key record changed while this transaction held the key; rolled back, a retry is safe"
    }
    fn details(&self) -> Option<&str> {
        None
    }
    fn hint(&self) -> Option<&str> {
        None
    }
    fn table_name(&self) -> Option<&str> {
        Some("idempotency_keys")
    }
    fn column_name(&self) -> Option<&str> {
        None
    }
    fn constraint_name(&self) -> Option<&str> {
        None
    }
    fn statement_position(&self) -> Option<i32> {
        None
    }
}
