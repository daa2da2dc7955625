//! What became of a key, for a client that lost the response and no longer
//! has the request: looked up within the caller's scope, without running
//! anything.

use std::convert::Infallible;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::de::DeserializeOwned;

use super::Config;
use super::call::call_error;
use crate::backend::{HeldKey, KeyStore, Read, Stored};
use crate::error::Error;
use crate::in_flight::InFlight;
use crate::row_status::RecordStatus;

/// What [`Config::status`] found for a key in a scope.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyStatus<R> {
    /// No call with this key in this scope has committed, and none holds
    /// the key now: nothing happened, or it failed and was rolled back.
    NoRecord,
    /// A call with this key holds it now. On SQLite, whose one write lock
    /// holds every key, any write in progress looks so.
    InProgress,
    /// The operation ran and its result is stored: what a retry with the
    /// same request is answered with, until `expires_at`.
    Completed {
        /// The stored result.
        response: R,
        /// When the call that executed the operation began (UTC).
        created_at: DateTime<Utc>,
        /// When the retention of the record ends (UTC).
        expires_at: DateTime<Utc>,
    },
    /// The operation ran, but the record's retention has ended: its result
    /// is no longer answered, and a call with the key executes as new.
    Expired {
        /// When the retention ended (UTC).
        expired_at: DateTime<Utc>,
    },
}

/// [`Config::status`] once `scope` and `key` passed the key rules: one read
/// for a completed, unexpired record; otherwise the key held without
/// waiting and the record read again.
pub(super) fn look_up<C: KeyStore, R: DeserializeOwned>(
    config: &Config,
    conn: &mut C,
    scope: &str,
    key: &str,
) -> Result<KeyStatus<R>, Error> {
    let Read { record, now, .. } = match conn.read(scope, key) {
        Ok(read) => read,
        // A reader kept out by a writer (SQLite outside WAL mode).
        Err(error) if C::is_in_flight_timeout(&error) => return Ok(KeyStatus::InProgress),
        Err(error) => return Err(Error::Storage(error)),
    };
    let now = config.clock.or_database(now);
    if let Some(stored) = record.as_ref().filter(|stored| is_answered(stored, now)) {
        return completed(stored);
    }
    let held = HeldKey {
        scope,
        key,
        in_flight: InFlight::Reject,
        idle_timeout: config.idle_timeout,
        claim: None,
    };
    // Holding the key proves no call holds it; the transaction writes
    // nothing, so its commit changes nothing.
    match conn.key_transaction(held, |tx, _| tx.find(scope, key).map_err(Error::Storage)) {
        Ok(None) => Ok(KeyStatus::NoRecord),
        Ok(Some(stored)) if is_answered(&stored, now) => completed(&stored),
        Ok(Some(stored)) if stored.status == RecordStatus::Completed => Ok(KeyStatus::Expired {
            expired_at: stored.expires_at.and_utc(),
        }),
        // A claim this connection's own enclosing call holds.
        Ok(Some(_)) => Ok(KeyStatus::InProgress),
        Err(error) => match call_error::<C, Infallible>(error, false) {
            Error::InProgress => Ok(KeyStatus::InProgress),
            other => Err(other),
        },
    }
}

fn is_answered(stored: &Stored, now: NaiveDateTime) -> bool {
    stored.status == RecordStatus::Completed && stored.expires_at > now
}

fn completed<R: DeserializeOwned>(stored: &Stored) -> Result<KeyStatus<R>, Error> {
    // As a replay reads it: a record without its result is still a claim.
    let Some(response) = stored.response.as_deref() else {
        return Ok(KeyStatus::InProgress);
    };
    Ok(KeyStatus::Completed {
        response: serde_json::from_str(response).map_err(Error::Codec)?,
        created_at: stored.created_at.and_utc(),
        expires_at: stored.expires_at.and_utc(),
    })
}
