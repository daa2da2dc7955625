//! The in-flight policy: what a request does while another transaction
//! holds its key.

use chrono::Duration;

#[cfg(doc)]
use crate::Error;

/// What a request does when another transaction holds the same key.
///
/// On PostgreSQL a call holds its key with an advisory lock on it until its
/// transaction ends; a second call with the key waits for that lock, and the
/// policy bounds the wait with a transaction-local `lock_timeout`. When the
/// holder commits, the waiting request replays its result; when it rolls
/// back, the waiting request executes.
///
/// A request whose transaction cannot see the holder's commit (nested in a
/// caller's `REPEATABLE READ` or `SERIALIZABLE` transaction, or in a session
/// at that level) fails with a serialization failure ([`Error::Storage`])
/// once the holder commits, without running its operation; the caller
/// retries its whole transaction, which then replays.
///
/// On MySQL and MariaDB a call holds its key with a named lock (`GET_LOCK`)
/// from before its transaction begins until after it ends, and the policy is
/// the timeout of that lock, to the millisecond; no session setting is
/// changed. A call that finds the key claimed by a caller's transaction
/// still open (a nested call that finished, its caller not yet committed)
/// waits for that row instead, as long as the session's
/// `innodb_lock_wait_timeout` allows (whole seconds, 50 by default), then
/// fails with [`Error::InProgress`] too.
///
/// On SQLite every writer holds the one database lock, so the policy bounds
/// the wait for that lock (the connection's busy timeout), whoever holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Wait up to this long, then replay or execute; if the key is still held
    /// after it, fail with [`Error::InProgress`]. Waits beyond about 24.8
    /// days (`i32::MAX` milliseconds, the most either backend takes) are
    /// shortened to that.
    ///
    /// ```
    /// use chrono::Duration;
    /// use idempotency::{Config, InFlight};
    ///
    /// // A duplicate that arrives while the first request runs waits for
    /// // its result, up to the client's own timeout.
    /// let config = Config::default().in_flight(InFlight::Wait(Duration::seconds(30)));
    /// # let _ = config;
    /// ```
    Wait(Duration),
    /// Fail with [`Error::InProgress`] at once while another transaction holds
    /// the key.
    Reject,
}

impl Default for InFlight {
    /// `InFlight::Wait` for 5 seconds.
    fn default() -> Self {
        InFlight::Wait(Duration::seconds(5))
    }
}

impl InFlight {
    /// The wait in whole milliseconds; zero for [`InFlight::Reject`]. At most
    /// `i32::MAX` (about 24.8 days), the longest wait either backend's
    /// setting takes.
    pub(crate) fn wait_millis(self) -> i64 {
        match self {
            InFlight::Wait(wait) => wait.num_milliseconds().clamp(0, i64::from(i32::MAX)),
            InFlight::Reject => 0,
        }
    }
}
