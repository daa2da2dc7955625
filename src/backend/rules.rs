//! What a database is, whichever kind of connection reaches it: its name,
//! the keys and times its tables hold, and how it reports a lock wait that
//! ran out or a commit it refused. Implemented on diesel's backend types
//! (`Sqlite`, `Pg`, `Mysql`), which a synchronous connection and an async
//! one to the same database both name as their `Backend`.

use std::ops::RangeInclusive;

use chrono::NaiveDateTime;

/// A database's rules, on diesel's backend type. In a private module, like
/// the statement traits: only the crate implements and calls it.
pub trait BackendRules: diesel::backend::Backend {
    /// The backend's name, as events and metrics report it.
    const NAME: &'static str;

    /// The longest key or scope, in bytes, that the key table holds, where
    /// that is less than any configured limit: keys are refused beyond it,
    /// never cut.
    const MAX_KEY_LEN: Option<usize> = None;

    /// The years the backend's time columns hold, where they hold fewer
    /// than chrono does.
    const STORABLE_YEARS: Option<RangeInclusive<i32>> = None;

    /// `at` within [`STORABLE_YEARS`](BackendRules::STORABLE_YEARS). For a
    /// time a caller chooses (a message's `not_before`): a backend that
    /// stores a time beyond its range as a zero date would make a message
    /// meant for the far future due at once.
    fn storable_time(at: NaiveDateTime) -> NaiveDateTime {
        match &Self::STORABLE_YEARS {
            Some(years) => within_years(at, years),
            None => at,
        }
    }

    /// Whether a call reads its key's record before its write transaction
    /// unless [`Config::read_before_transaction`](crate::Config::read_before_transaction)
    /// says otherwise.
    const READS_BEFORE_TRANSACTION: bool = true;

    /// Whether `error` means a wait for a lock ran out.
    fn is_in_flight_timeout(error: &diesel::result::Error) -> bool;

    /// Whether `error`, returned by the commit of a top-level transaction,
    /// proves that the transaction rolled back: the server answered the
    /// `COMMIT` with a refusal. Any other failure of a commit (the
    /// connection lost on the way, an answer that never came, a text that
    /// proves nothing) leaves the outcome unknown.
    fn commit_rolled_back(error: &diesel::result::Error) -> bool;
}

/// `at`, moved into the years `years`.
fn within_years(at: NaiveDateTime, years: &RangeInclusive<i32>) -> NaiveDateTime {
    use chrono::{NaiveDate, NaiveTime};
    let day = |year, month, date| NaiveDate::from_ymd_opt(year, month, date).expect("a calendar date");
    let earliest = day(*years.start(), 1, 1).and_time(NaiveTime::MIN);
    let latest = day(*years.end(), 12, 31)
        .and_hms_micro_opt(23, 59, 59, 999_999)
        .expect("a time of day");
    at.clamp(earliest, latest)
}
