//! Where the time comes from.
//!
//! Expiry, leases and backoff compare times written by one process with
//! times read by another. Process clocks drift apart (a machine an hour
//! ahead would see every record an hour closer to its expiry), so unless a
//! clock is injected, the crate asks the database for the time, in a
//! statement it sends anyway: on PostgreSQL and MySQL the server's clock
//! serves every application server alike. SQLite runs inside the process,
//! so its clock is the application host's.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};
use diesel::QueryResult;

use crate::backend::{KeyStore, block_on};

/// A time source injected with `Config::clock` or `Relay::clock`.
pub(crate) type Source = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// The database's clock, or one injected for tests.
#[derive(Clone, Default)]
pub(crate) enum Clock {
    #[default]
    Database,
    Injected(Source),
}

impl Clock {
    pub(crate) fn injected(source: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        Clock::Injected(Arc::new(source))
    }

    /// The time, given the database's as a statement already read it.
    pub(crate) fn or_database(&self, database: NaiveDateTime) -> NaiveDateTime {
        match self {
            Clock::Database => database,
            Clock::Injected(source) => source().naive_utc(),
        }
    }

    /// The time, given the database's, read by a statement of its own
    /// only when the database's clock is the one in use.
    pub(crate) async fn or_database_now<C: KeyStore>(&self, conn: &mut C) -> QueryResult<NaiveDateTime> {
        match self {
            Clock::Database => conn.database_now().await,
            Clock::Injected(source) => Ok(source().naive_utc()),
        }
    }

    /// The time, asking the database when its clock is the one in use.
    pub(crate) fn now<C: KeyStore>(&self, conn: &mut C) -> QueryResult<NaiveDateTime> {
        match self {
            Clock::Database => block_on(conn.database_now()),
            Clock::Injected(source) => Ok(source().naive_utc()),
        }
    }

    /// A reading of the clock that later readings are taken from without
    /// asking the database again: the database's time moves on with this
    /// process's monotonic clock.
    pub(crate) async fn start<C: KeyStore>(&self, conn: &mut C) -> QueryResult<Reading> {
        Ok(Reading::new(self, self.or_database_now(conn).await?))
    }
}

/// A time read from a [`Clock`], and the way to the times after it.
#[derive(Clone)]
pub(crate) struct Reading {
    clock: Clock,
    at: NaiveDateTime,
    taken: Instant,
}

impl Reading {
    /// A reading of `clock` that says `at` now.
    pub(crate) fn new(clock: &Clock, at: NaiveDateTime) -> Reading {
        Reading {
            clock: clock.clone(),
            at,
            taken: Instant::now(),
        }
    }

    /// The time of the reading itself.
    pub(crate) fn at(&self) -> NaiveDateTime {
        self.at
    }

    /// The time now, on the same clock.
    pub(crate) fn now(&self) -> NaiveDateTime {
        match &self.clock {
            Clock::Database => {
                let elapsed = Duration::from_std(self.taken.elapsed()).unwrap_or(Duration::MAX);
                self.at.checked_add_signed(elapsed).unwrap_or(NaiveDateTime::MAX)
            }
            Clock::Injected(source) => source().naive_utc(),
        }
    }
}

/// Durations beyond this are certainly a unit mistake, and it keeps
/// `now + duration` far from chrono's range limits.
const MAX_DURATION_DAYS: i64 = 100 * 366;

/// Checks a configured duration: positive and at most 100 years.
///
/// # Panics
///
/// With a message naming `what` when it is not.
pub(crate) fn assert_duration(value: Duration, what: &str) {
    assert!(value > Duration::zero(), "{what} must be positive");
    assert!(
        value <= Duration::days(MAX_DURATION_DAYS),
        "{what} must be at most 100 years"
    );
}
