//! The statement that completes a claimed key record, as a query type of
//! its own: diesel prepares its own `UPDATE` statements anew on every call,
//! which on PostgreSQL and MySQL is a round trip of its own (a prepare,
//! then the execution); this one it prepares once per connection. SQLite's
//! calls use it too, where a prepare costs no round trip.

use chrono::NaiveDateTime;
use diesel::QueryResult;
use diesel::backend::Backend;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Nullable, Text};

use super::record::Record;
use crate::row_status::RecordStatus;
use crate::sql_time::Timestamp;

/// `UPDATE idempotency_keys SET status, response, completed_at WHERE` the
/// key of `record`.
pub(crate) struct Complete<'a> {
    record: &'a Record<'a>,
}

impl<'a> Complete<'a> {
    /// The completion of the claimed record of `record`'s key with
    /// `record`'s status, response and completion time.
    pub(crate) fn new(record: &'a Record<'a>) -> Self {
        Complete { record }
    }
}

impl QueryId for Complete<'_> {
    type QueryId = Complete<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<DB> QueryFragment<DB> for Complete<'_>
where
    DB: Backend + HasSqlType<Text> + HasSqlType<Timestamp>,
    str: ToSql<Text, DB>,
    RecordStatus: ToSql<Text, DB>,
    for<'x> Option<&'x str>: ToSql<Nullable<Text>, DB>,
    NaiveDateTime: ToSql<Timestamp, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let record = self.record;
        out.push_sql("UPDATE idempotency_keys SET status = ");
        out.push_bind_param::<Text, _>(&record.status)?;
        out.push_sql(", response = ");
        out.push_bind_param::<Nullable<Text>, _>(&record.response)?;
        out.push_sql(", completed_at = ");
        out.push_bind_param::<Nullable<Timestamp>, _>(&record.completed_at)?;
        out.push_sql(" WHERE scope = ");
        out.push_bind_param::<Text, _>(record.scope)?;
        out.push_sql(" AND idempotency_key = ");
        out.push_bind_param::<Text, _>(record.idempotency_key)?;
        Ok(())
    }
}
