//! The purge of expired rows on PostgreSQL, and on Citus.

use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;

use super::citus::{self, distributed};
use super::expired::Expired;

/// Deletes (or updates, with [`Expired::set`]) at most `limit` of the `expired` rows, passing over those a live
/// transaction holds: a record that a live request is taking over right now
/// is not worth waiting for, and it is no longer expired once that commits.
/// Citus refuses this statement on a distributed table, and takes its own.
pub(crate) fn purge(conn: &mut PgConnection, expired: &Expired<'_>, limit: usize) -> QueryResult<usize> {
    if distributed(conn, expired.table)? {
        return citus::purge(conn, expired, limit);
    }
    let Expired { table, condition, .. } = expired;
    expired
        .query(format!(
            "{} WHERE ctid IN \
             (SELECT ctid FROM {table} WHERE {condition} LIMIT ${} FOR UPDATE SKIP LOCKED)",
            expired.head(),
            expired.next_parameter()
        ))
        .bind::<BigInt, _>(crate::backend::sql_limit(limit))
        .execute(conn)
}
