//! Helpers for domain tests: an in-memory SQLite connection with the
//! migrations applied, and a clock that moves only when told to.

use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, Duration, TimeZone, Utc};
use diesel::prelude::*;

/// A new in-memory SQLite database with this crate's migrations applied.
///
/// Each call is a separate database: `:memory:` belongs to one connection.
/// Use a file in a temporary directory where several connections must
/// share one database.
///
/// # Panics
///
/// If SQLite cannot open the database or a migration fails, as a test helper
/// may.
///
/// ```
/// use idempotency::{run_idempotent, testing};
///
/// let mut conn = testing::sqlite_memory();
/// let outcome = run_idempotent(&mut conn, "tests", "k1", &1, |_| Ok::<_, std::convert::Infallible>(2));
/// assert!(matches!(outcome, Ok(idempotency::Outcome::Executed(2))));
/// ```
pub fn sqlite_memory() -> SqliteConnection {
    let mut conn = SqliteConnection::establish(":memory:").expect("open an in-memory SQLite database");
    crate::run_migrations(&mut conn).expect("apply the idempotency migrations");
    conn
}

/// A clock for [`Config::clock`](crate::Config::clock) that stands still
/// until advanced. Clones share one time, so a test keeps a clone and moves
/// the time under a `Config` that owns another.
///
/// ```
/// use chrono::Duration;
/// use idempotency::testing::ManualClock;
///
/// let clock = ManualClock::new();
/// let start = clock.now();
/// clock.advance(Duration::hours(25));
/// assert_eq!(clock.now() - start, Duration::hours(25));
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at 2030-01-01 00:00:00 UTC, so tests do not depend
    /// on when they run.
    pub fn new() -> Self {
        Self::at(
            Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
                .single()
                .expect("a valid date"),
        )
    }

    /// A clock standing at `start`.
    pub fn at(start: DateTime<Utc>) -> Self {
        ManualClock {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// The current time of this clock.
    pub fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the clock forward (or back, with a negative duration).
    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }

    /// Sets the clock to `to`.
    pub fn set(&self, to: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }

    /// A time source for [`Config::clock`](crate::Config::clock) that reads
    /// this clock.
    pub fn source(&self) -> impl Fn() -> DateTime<Utc> + Send + Sync + 'static {
        let clock = self.clone();
        move || clock.now()
    }
}
