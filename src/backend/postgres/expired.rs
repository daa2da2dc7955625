//! The rows a purge deletes (or, for tombstones, clears), described once
//! for PostgreSQL's statement and for Citus's.

use diesel::pg::Pg;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};

/// Rows a purge deletes: those of `table` that `condition` selects, its
/// parameters (`$1` onwards, each once) bound by `bind`; with `set`, the
/// purge updates them with that `SET` list instead of deleting them.
pub(crate) struct Expired<'a> {
    pub(crate) table: &'static str,
    /// The column that, with `scope`, is the table's primary key.
    pub(crate) key: &'static str,
    pub(crate) condition: &'static str,
    /// The `SET` list of an update in place of the delete, if any.
    pub(crate) set: Option<&'static str>,
    pub(crate) bind: &'a dyn Fn(BoxedSqlQuery<'a, Pg, SqlQuery>) -> BoxedSqlQuery<'a, Pg, SqlQuery>,
}

impl<'a> Expired<'a> {
    /// `sql` with the condition's parameters bound.
    pub(crate) fn query(&self, sql: String) -> BoxedSqlQuery<'a, Pg, SqlQuery> {
        (self.bind)(diesel::sql_query(sql).into_boxed())
    }

    /// The statement's head, before its `WHERE`: a `DELETE`, or the
    /// `UPDATE` with `set`.
    pub(crate) fn head(&self) -> String {
        match self.set {
            None => format!("DELETE FROM {}", self.table),
            Some(set) => format!("UPDATE {} SET {set}", self.table),
        }
    }

    /// The number of the first parameter after the condition's.
    pub(crate) fn next_parameter(&self) -> usize {
        self.condition.matches('$').count() + 1
    }
}
