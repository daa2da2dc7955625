//! What became of a key, for a client that lost the response and no longer
//! has the request: looked up within the caller's scope, without running
//! anything.

use std::convert::Infallible;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::de::DeserializeOwned;

use crate::backend::{self, HeldKey, KeyStore, Read, StoreConnection, Stored};
use crate::config::Config;
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

impl Config {
    /// What became of `key` in `scope`: no record, in progress, completed
    /// with its stored result, or expired. It never runs an operation and
    /// never writes; the request is not needed, so the fingerprint is not
    /// compared. Lookups are by `(scope, key)` only: take the scope from
    /// the authenticated caller, as for every call, so that one tenant
    /// never learns of another's keys.
    ///
    /// A completed, unexpired record is answered with one read. Otherwise
    /// the lookup tries to hold the key as a call would, without waiting
    /// (whatever the [`InFlight`] policy): a holder makes it
    /// [`InProgress`](KeyStatus::InProgress); held, the record is read
    /// again, so a call that committed meanwhile is seen.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidScope`] and [`Error::InvalidKey`] where the key
    /// rules refuse them; [`Error::Storage`] when the database fails;
    /// [`Error::Codec`] when the stored result does not decode into `R`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::testing::ManualClock;
    /// use idempotency::{Config, KeyStatus};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let clock = ManualClock::new();
    /// let config = Config::default().retention(Duration::hours(1)).clock(clock.source());
    /// assert_eq!(config.status::<_, i32>(&mut conn, "shop", "order-1")?, KeyStatus::NoRecord);
    ///
    /// let first = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(7))?;
    /// let KeyStatus::Completed { response, expires_at, .. } = config.status::<_, i32>(&mut conn, "shop", "order-1")? else {
    ///     return Err("not completed".into());
    /// };
    /// assert_eq!((response, expires_at), (7, first.expires_at));
    /// // Another scope knows nothing of it.
    /// assert_eq!(config.status::<_, i32>(&mut conn, "other", "order-1")?, KeyStatus::NoRecord);
    ///
    /// clock.advance(Duration::hours(1));
    /// assert_eq!(
    ///     config.status::<_, i32>(&mut conn, "shop", "order-1")?,
    ///     KeyStatus::Expired { expired_at: first.expires_at }
    /// );
    /// # Ok(())
    /// # }
    /// ```
    pub fn status<C, R>(&self, conn: &mut C, scope: &str, key: &str) -> Result<KeyStatus<R>, Error>
    where
        C: StoreConnection,
        R: DeserializeOwned,
    {
        self.check_rules::<C::Raw, Infallible>(scope, key, None)?;
        let conn = conn.raw();
        let Read { record, now, .. } = match conn.read(scope, key) {
            Ok(read) => read,
            // A reader kept out by a writer (SQLite outside WAL mode).
            Err(error) if C::Raw::is_in_flight_timeout(&error) => return Ok(KeyStatus::InProgress),
            Err(error) => return Err(Error::Storage(error)),
        };
        let now = self.clock.or_database(now);
        if let Some(stored) = record.as_ref().filter(|stored| is_answered(stored, now)) {
            return completed(stored);
        }
        let held = HeldKey {
            scope,
            key,
            in_flight: InFlight::Reject,
            idle_timeout: self.idle_timeout,
        };
        // Holding the key proves no call holds it; the transaction writes
        // nothing, so its commit changes nothing.
        match conn.key_transaction(held, |tx| tx.find(scope, key).map_err(Error::Storage)) {
            Ok(None) => Ok(KeyStatus::NoRecord),
            Ok(Some(stored)) if is_answered(&stored, now) => completed(&stored),
            Ok(Some(stored)) if stored.status == RecordStatus::Completed => Ok(KeyStatus::Expired {
                expired_at: stored.expires_at.and_utc(),
            }),
            // A claim this connection's own enclosing call holds.
            Ok(Some(_)) => Ok(KeyStatus::InProgress),
            Err(error) => match backend::call_error::<C::Raw, Infallible>(error, false) {
                Error::InProgress => Ok(KeyStatus::InProgress),
                other => Err(other),
            },
        }
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
