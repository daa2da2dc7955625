//! A row looked up by `(scope, idempotency_key)` together with a value the
//! server computes, such as its clock, in one statement: on the backends
//! where every statement is a round trip, reading the time costs nothing
//! extra that way. Key records and operations in phases are read so.
//!
//! The statement is `SELECT head, columns FROM (SELECT 1) AS one LEFT JOIN
//! table AS r ON ...`: one row whether or not the looked-up row exists, so
//! the head arrives with a miss too. diesel's DSL joins declared tables only;
//! this is the statement as a query type of its own, so that diesel prepares
//! it once per connection.

use std::marker::PhantomData;

use chrono::NaiveDateTime;
use diesel::backend::Backend;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::query_dsl::LoadQuery;
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Nullable, Text};

use super::Stored;
use crate::backend::phases::OperationRow;
use crate::row_status::{OperationStatus, RecordStatus};
use crate::sql_time::Timestamp;

/// The first column of a [`RowWith`] query, in the SQL of its backend: the
/// pieces of its text, in order.
pub(crate) trait Head: 'static {
    type Backend: Backend;
    const SQL: &'static [&'static str];
    type SqlType;
}

/// The row a [`RowWith`] query looks up by `(scope, idempotency_key)`: its
/// table, the columns it reads (all nullable, as a left join makes them),
/// and their SQL types.
pub(crate) trait Lookup: 'static {
    const TABLE: &'static str;
    const COLUMNS: &'static str;
    type SqlType;
}

/// `SELECT head, columns FROM (SELECT 1) AS one LEFT JOIN table AS r ON
/// r.scope = ? AND r.idempotency_key = ?`, on the backend of `H`.
pub(crate) struct RowWith<'a, H, L> {
    scope: &'a str,
    key: &'a str,
    parts: PhantomData<(H, L)>,
}

impl<'a, H, L> RowWith<'a, H, L> {
    /// The lookup of `(scope, key)`.
    pub(crate) fn new(scope: &'a str, key: &'a str) -> Self {
        RowWith {
            scope,
            key,
            parts: PhantomData,
        }
    }
}

impl<H: Head, L: Lookup> QueryId for RowWith<'_, H, L> {
    type QueryId = RowWith<'static, H, L>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<H: Head, L: Lookup> Query for RowWith<'_, H, L> {
    type SqlType = (H::SqlType, L::SqlType);
}

impl<H, L> QueryFragment<H::Backend> for RowWith<'_, H, L>
where
    H: Head,
    L: Lookup,
    H::Backend: HasSqlType<Text>,
    str: ToSql<Text, H::Backend>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, H::Backend>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        for piece in H::SQL {
            out.push_sql(piece);
        }
        out.push_sql(", ");
        out.push_sql(L::COLUMNS);
        out.push_sql(" FROM (SELECT 1) AS one LEFT JOIN ");
        out.push_sql(L::TABLE);
        out.push_sql(" AS r ON r.scope = ");
        out.push_bind_param::<Text, _>(self.scope)?;
        out.push_sql(" AND r.idempotency_key = ");
        out.push_bind_param::<Text, _>(self.key)?;
        Ok(())
    }
}

// A statement of the crate's own runs on both kinds of connection.
impl<H, L> diesel::query_dsl::RunQueryDslSupport for RowWith<'_, H, L> {}

/// The head and the columns of the row of `(scope, key)`, as `Row`.
pub(crate) fn row_with<H, L, C, Row>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Row>
where
    H: Head,
    L: Lookup,
    for<'a> RowWith<'a, H, L>: LoadQuery<'a, C, Row>,
{
    RowWith::<H, L>::new(scope, key).get_result(conn)
}

/// The columns of a key record that a replay needs.
pub(crate) struct KeyRecord;

impl Lookup for KeyRecord {
    const TABLE: &'static str = "idempotency_keys";
    const COLUMNS: &'static str =
        "r.request_hash, r.status, r.response, r.created_at, r.expires_at, r.caller_hash, r.traceparent, r.request_id";
    type SqlType = (
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Timestamp>,
        Nullable<Timestamp>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
    );
}

pub(crate) type KeyRecordRow = (
    Option<String>,
    Option<RecordStatus>,
    Option<String>,
    Option<NaiveDateTime>,
    Option<NaiveDateTime>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// The key record of a [`KeyRecord`] lookup's columns, if it found one.
pub(crate) fn stored_of(row: KeyRecordRow) -> Option<Stored> {
    match row {
        (
            Some(request_hash),
            Some(status),
            response,
            Some(created_at),
            Some(expires_at),
            caller_hash,
            traceparent,
            request_id,
        ) => Some(Stored {
            request_hash,
            status,
            response,
            created_at,
            expires_at,
            caller_hash,
            traceparent,
            request_id,
        }),
        _ => None,
    }
}

/// The columns of an operation in phases that a call reads.
pub(crate) struct OperationColumns;

impl Lookup for OperationColumns {
    const TABLE: &'static str = "idempotency_phases";
    const COLUMNS: &'static str = "r.operation, r.request_hash, r.op_id, r.status, r.points, r.response, \
         r.lease_until, r.expires_at, r.created_at, r.caller_hash, r.traceparent, r.request_id";
    type SqlType = (
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Timestamp>,
        Nullable<Timestamp>,
        Nullable<Timestamp>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
    );
}

pub(crate) type OperationColumnsRow = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<OperationStatus>,
    Option<String>,
    Option<String>,
    Option<NaiveDateTime>,
    Option<NaiveDateTime>,
    Option<NaiveDateTime>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// The operation of `(scope, key)`, if any, and the head: the database's
/// time, as `PhaseStore::read_operation` returns them.
pub(crate) fn operation_with<H, C>(
    conn: &mut C,
    scope: &str,
    key: &str,
) -> QueryResult<(Option<OperationRow>, NaiveDateTime)>
where
    H: Head,
    for<'a> RowWith<'a, H, OperationColumns>: LoadQuery<'a, C, (NaiveDateTime, OperationColumnsRow)>,
{
    let (now, columns) = row_with::<H, OperationColumns, C, (NaiveDateTime, OperationColumnsRow)>(conn, scope, key)?;
    Ok((operation_of(columns), now))
}

/// The operation of an [`OperationColumns`] lookup's columns, if it found
/// one.
pub(crate) fn operation_of(columns: OperationColumnsRow) -> Option<OperationRow> {
    match columns {
        (
            Some(operation),
            Some(request_hash),
            Some(op_id),
            Some(status),
            Some(points),
            response,
            lease_until,
            expires_at,
            Some(created_at),
            caller_hash,
            traceparent,
            request_id,
        ) => Some(OperationRow {
            operation,
            request_hash,
            op_id,
            status,
            points,
            response,
            lease_until,
            expires_at,
            created_at,
            caller_hash,
            traceparent,
            request_id,
        }),
        _ => None,
    }
}
