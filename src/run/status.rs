//! What became of a key, for a client that lost the response: looked up
//! within the caller's scope, without running anything, and answered only
//! to a reader a replay would answer. To anyone else a record is no record.

use std::convert::Infallible;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::de::DeserializeOwned;

use super::call::call_error;
use crate::backend::phases::OperationRow;
use crate::backend::phases::PhaseStore;
use crate::backend::{BackendRules, HeldKey, Read, RulesOf, Stored};
use crate::config::Config;
use crate::error::Error;
use crate::in_flight::InFlight;
use crate::outcome::Origin;
use crate::row_status::{OperationStatus, RecordStatus};

/// What a lookup ([`Config::status`],
/// [`Phased::status`](crate::phased::Phased::status), the HTTP layer's
/// `lookup`) found for a key in a scope, as the reader may know it: a
/// record that a replay would not answer this reader is
/// [`NoRecord`](KeyStatus::NoRecord), as if it did not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyStatus<R> {
    /// No call with this key in this scope has committed for this reader,
    /// and none holds the key now: nothing happened, it failed and was
    /// rolled back, or the record is another request's (another caller's,
    /// another endpoint's), which a lookup does not tell apart.
    NoRecord,
    /// A call with this key holds it now, or a phased operation under it
    /// has started and not finished (an attempt carries it on, or waits for
    /// the client's retry or a completer to resume it). On SQLite, whose
    /// one write lock holds every key, any write in progress looks so.
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
        /// Where the result came from: the trace and the request id of the
        /// call that executed (of an operation in phases, its first
        /// attempt), where its record keeps them.
        origin: Origin,
    },
    /// The operation ran, but the record's retention (and the grace period
    /// of its tombstone, where the [`Config`] keeps
    /// [tombstones](Config::tombstones)) has ended: its result is no longer
    /// answered, and a call with the key executes as new.
    Expired {
        /// When the retention ended (UTC).
        expired_at: DateTime<Utc>,
    },
    /// The operation ran and the record's retention has ended, but the
    /// [`Config`] keeps its tombstone ([`Config::tombstones`]): its result
    /// is no longer answered, and a call with the same request is
    /// [`Error::Expired`] until `reusable_at`, when the key executes as new.
    Tombstoned {
        /// When the retention ended (UTC).
        expired_at: DateTime<Utc>,
        /// When the grace period ends and the key may execute again (UTC).
        reusable_at: DateTime<Utc>,
    },
    /// A [phased operation](crate::phased) was stopped partway and waits
    /// for a person ([`Error::Parked`]): some of it may have been carried
    /// out, so it must not be sent again under a new key. A retry is
    /// answered with [`Error::Parked`] until an operator requeues it.
    Parked,
}

/// Whom a lookup answers: what a record must be bound to for the lookup to
/// answer it, as a replay would answer that reader.
pub(crate) enum Reader<'a> {
    /// A caller with the request, fingerprinted: a key record's fingerprint
    /// must be the request's; with `operation`, a phased operation's, whose
    /// name must be `operation` too.
    Request {
        request_hash: &'a str,
        operation: Option<&'a str>,
    },
    /// A caller over HTTP: the record's caller hash must be one of these.
    /// Records of single calls and of phased operations alike.
    #[cfg_attr(
        not(any(feature = "axum", feature = "actix")),
        expect(dead_code, reason = "only the HTTP layer looks up by caller")
    )]
    Callers(&'a [String]),
}

impl Reader<'_> {
    fn reads_records(&self) -> bool {
        !matches!(self, Reader::Request { operation: Some(_), .. })
    }

    fn reads_operations(&self) -> bool {
        !matches!(self, Reader::Request { operation: None, .. })
    }

    /// Whether a replay would answer this reader from `stored`.
    fn answers_record(&self, stored: &Stored) -> bool {
        match self {
            Reader::Request {
                request_hash,
                operation: None,
            } => stored.request_hash == *request_hash,
            Reader::Request { operation: Some(_), .. } => false,
            Reader::Callers(callers) => is_among(stored.caller_hash.as_deref(), callers),
        }
    }

    /// Whether a retry would answer this reader from the operation `row`.
    fn answers_operation(&self, row: &OperationRow) -> bool {
        match self {
            Reader::Request {
                request_hash,
                operation: Some(operation),
            } => row.operation == *operation && row.request_hash == *request_hash,
            Reader::Request { operation: None, .. } => false,
            Reader::Callers(callers) => is_among(row.caller_hash.as_deref(), callers),
        }
    }
}

/// Whether `caller_hash` is one of `callers`; a record without one (written
/// outside the HTTP layer) is answered to no HTTP caller.
fn is_among(caller_hash: Option<&str>, callers: &[String]) -> bool {
    caller_hash.is_some_and(|hash| callers.iter().any(|caller| caller == hash))
}

/// A lookup once `scope` and `key` passed the key rules, answered to
/// `reader` alone. A record the reader may not know of is passed over
/// wherever it is read, so that the lookup goes on exactly as for a key
/// without one: one read answers a completed, unexpired key record; then
/// the operation in phases, if any; otherwise the key is held without
/// waiting and both are read again, so a call that committed meanwhile is
/// seen and a call that holds the key is in progress.
pub(super) async fn look_up<C: PhaseStore, R: DeserializeOwned>(
    config: &Config,
    conn: &mut C,
    scope: &str,
    key: &str,
    reader: &Reader<'_>,
) -> Result<KeyStatus<R>, Error> {
    // The time of the first read, which each read brings along.
    let mut now = None;
    if reader.reads_records() {
        let Read {
            record, now: read_at, ..
        } = match conn.read(scope, key).await {
            Ok(read) => read,
            // A reader kept out by a writer (SQLite outside WAL mode).
            Err(error) if RulesOf::<C>::is_in_flight_timeout(&error) => return Ok(KeyStatus::InProgress),
            Err(error) => return Err(Error::Storage(error)),
        };
        let read_at = *now.insert(config.clock.or_database(read_at));
        let answered = record.filter(|stored| reader.answers_record(stored));
        if let Some(stored) = answered.as_ref().filter(|stored| is_answered(stored, read_at)) {
            return completed(stored);
        }
        if let Some(tombstone) = answered.and_then(|stored| tombstone(config, &stored, read_at)) {
            return Ok(tombstone);
        }
    }
    if reader.reads_operations() {
        let (row, read_at) = match conn.read_operation(scope, key).await {
            Ok(read) => read,
            Err(error) if RulesOf::<C>::is_in_flight_timeout(&error) => return Ok(KeyStatus::InProgress),
            Err(error) => return Err(Error::Storage(error)),
        };
        let read_at = *now.get_or_insert(config.clock.or_database(read_at));
        if let Some(row) = row.filter(|row| reader.answers_operation(row)) {
            return operation_status(config, row, read_at);
        }
    }
    let now = match now {
        Some(now) => now,
        None => config.clock.or_database(conn.database_now().await?),
    };
    let held = HeldKey {
        scope,
        key,
        in_flight: InFlight::Reject,
        idle_timeout: config.idle_timeout,
        claim: None,
    };
    // Holding the key proves no call holds it; the transaction writes
    // nothing, so its commit changes nothing.
    let found = conn
        .key_transaction(held, async |tx: &mut C, _| {
            let record = match reader.reads_records() {
                true => tx
                    .find(scope, key)
                    .await?
                    .filter(|stored| reader.answers_record(stored)),
                false => None,
            };
            let operation = match reader.reads_operations() {
                true => tx
                    .read_operation(scope, key)
                    .await?
                    .0
                    .filter(|row| reader.answers_operation(row)),
                false => None,
            };
            Ok::<_, Error>((record, operation))
        })
        .await;
    match found {
        Ok((Some(stored), _)) if is_answered(&stored, now) => completed(&stored),
        Ok((Some(stored), _)) if stored.status == RecordStatus::Completed => Ok(tombstone(config, &stored, now)
            .unwrap_or(KeyStatus::Expired {
                expired_at: stored.expires_at.and_utc(),
            })),
        // A claim this connection's own enclosing call holds.
        Ok((Some(_), _)) => Ok(KeyStatus::InProgress),
        Ok((None, Some(row))) => operation_status(config, row, now),
        Ok((None, None)) => Ok(KeyStatus::NoRecord),
        Err(error) => match call_error::<RulesOf<C>, Infallible>(error, false) {
            Error::InProgress => Ok(KeyStatus::InProgress),
            other => Err(other),
        },
    }
}

fn is_answered(stored: &Stored, now: NaiveDateTime) -> bool {
    stored.status == RecordStatus::Completed && stored.expires_at > now
}

/// The status of `stored` as of `now` where it is a tombstone: completed,
/// expired, and within the grace period of the policy's
/// [tombstones](Config::tombstones).
fn tombstone<R>(config: &Config, stored: &Stored, now: NaiveDateTime) -> Option<KeyStatus<R>> {
    match stored.status {
        RecordStatus::Completed => tombstoned(config, stored.expires_at, now),
        RecordStatus::Processing => None,
    }
}

/// [`KeyStatus::Tombstoned`] for what completed and expired at
/// `expires_at`, if that is within the grace period of the policy's
/// [tombstones](Config::tombstones) as of `now`.
fn tombstoned<R>(config: &Config, expires_at: NaiveDateTime, now: NaiveDateTime) -> Option<KeyStatus<R>> {
    let grace = config.tombstones?;
    let in_grace = expires_at <= now && expires_at > config.reusable_by(now);
    in_grace.then(|| KeyStatus::Tombstoned {
        expired_at: expires_at.and_utc(),
        reusable_at: (expires_at + grace).and_utc(),
    })
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
        origin: stored.origin(),
    })
}

/// What an operation in phases is as of `now`, as a retry would find it.
fn operation_status<R: DeserializeOwned>(
    config: &Config,
    row: OperationRow,
    now: NaiveDateTime,
) -> Result<KeyStatus<R>, Error> {
    match (row.status, row.expires_at) {
        (OperationStatus::Completed, Some(expires_at)) if expires_at <= now => Ok(tombstoned(config, expires_at, now)
            .unwrap_or(KeyStatus::Expired {
                expired_at: expires_at.and_utc(),
            })),
        (OperationStatus::Completed, expires_at) => Ok(KeyStatus::Completed {
            response: serde_json::from_str(row.response.as_deref().unwrap_or_default()).map_err(Error::Codec)?,
            created_at: row.created_at.and_utc(),
            expires_at: expires_at.unwrap_or(now).and_utc(),
            origin: row.origin(),
        }),
        (OperationStatus::Parked, _) => Ok(KeyStatus::Parked),
        (OperationStatus::Running, _) => Ok(KeyStatus::InProgress),
    }
}
