//! MySQL's clock: `UTC_TIMESTAMP(6)`, as an expression of the DSL and as
//! the head of a read.

use diesel::expression::{AppearsOnTable, Expression, SelectableExpression, ValidGrouping, is_aggregate};
use diesel::mysql::Mysql;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};

use crate::backend::row_with::Head;
use crate::sql_time::Timestamp;

/// `UTC_TIMESTAMP(6)`, the server's time in UTC to the microsecond, as an
/// expression of the DSL. (diesel's `now` is the session's time, to the
/// second.)
#[derive(Debug, Clone, Copy, QueryId)]
pub(crate) struct UtcNow;

impl Expression for UtcNow {
    type SqlType = Timestamp;
}

impl QueryFragment<Mysql> for UtcNow {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        out.push_sql("UTC_TIMESTAMP(6)");
        Ok(())
    }
}

impl<QS> AppearsOnTable<QS> for UtcNow {}

impl<QS> SelectableExpression<QS> for UtcNow {}

impl<GB> ValidGrouping<GB> for UtcNow {
    type IsAggregate = is_aggregate::Never;
}

/// The database's time, in UTC.
pub(crate) struct DatabaseNow;

impl Head for DatabaseNow {
    type Backend = Mysql;
    const SQL: &'static [&'static str] = &["UTC_TIMESTAMP(6)"];
    type SqlType = Timestamp;
}
