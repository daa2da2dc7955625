//! PostgreSQL's clock: the statement's time in UTC, as the crate writes
//! times.

use diesel::pg::Pg;
use diesel::sql_types::{Text, Timestamptz};

use crate::backend::row_with::Head;
use crate::sql_time::Timestamp;

diesel::define_sql_function! {
    /// PostgreSQL's `timezone(zone, timestamptz)`: the time in `zone`,
    /// without a zone.
    fn timezone(zone: Text, at: Timestamptz) -> crate::sql_time::Timestamp;
}

diesel::define_sql_function! {
    /// PostgreSQL's `statement_timestamp()`: when the server received the
    /// statement. The crate's clock on PostgreSQL, rather than `now()`, the
    /// start of the transaction: a call nested in a caller's transaction
    /// that began long ago would get a retention shortened by its age, and
    /// a relay pass on it leases that are over already. Unlike
    /// `clock_timestamp()` it is one time for the whole statement, as
    /// MySQL's `UTC_TIMESTAMP(6)` is.
    fn statement_timestamp() -> Timestamptz;
}

/// The database's time in UTC, as the crate writes times.
pub(crate) fn database_time() -> timezone<&'static str, statement_timestamp> {
    timezone("UTC", statement_timestamp())
}

/// The database's time, in UTC.
pub(crate) struct DatabaseNow;

impl Head for DatabaseNow {
    type Backend = Pg;
    const SQL: &'static [&'static str] = &["timezone('UTC', statement_timestamp())"];
    type SqlType = Timestamp;
}
