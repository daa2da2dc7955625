//! What a successful idempotent call returns.

use chrono::{DateTime, NaiveDateTime, Utc};

/// The result of an idempotent call: either the operation ran now, or an
/// earlier call with the same key and request ran it and this is its stored
/// result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// The operation ran in this call and its result was stored.
    Executed(R),
    /// The operation did not run; this is the result stored by the call that
    /// did.
    Replayed(R),
}

impl<R> Outcome<R> {
    /// The result, however it was obtained.
    ///
    /// ```
    /// use idempotency::Outcome;
    ///
    /// assert_eq!(Outcome::Replayed(7).into_inner(), 7);
    /// ```
    pub fn into_inner(self) -> R {
        match self {
            Outcome::Executed(value) | Outcome::Replayed(value) => value,
        }
    }

    /// Whether the result came from an earlier call. Handlers often report
    /// it, for example in an `Idempotent-Replayed: true` response header.
    ///
    /// ```
    /// use idempotency::Outcome;
    ///
    /// assert!(Outcome::Replayed(()).is_replayed());
    /// assert!(!Outcome::Executed(()).is_replayed());
    /// ```
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }
}

/// An [`Outcome`] with the times of the key record behind it, as
/// [`Config::run_recorded`](crate::Config::run_recorded) returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recorded<R> {
    /// Whether the operation ran now, and its result.
    pub outcome: Outcome<R>,
    /// When the call that executed the operation began (UTC).
    pub created_at: DateTime<Utc>,
    /// When the retention of the record ends (UTC): from then on the key may
    /// execute again.
    pub expires_at: DateTime<Utc>,
}

impl<R> Recorded<R> {
    pub(crate) fn new(outcome: Outcome<R>, created_at: NaiveDateTime, expires_at: NaiveDateTime) -> Self {
        Recorded {
            outcome,
            created_at: created_at.and_utc(),
            expires_at: expires_at.and_utc(),
        }
    }
}
