//! The phase table's rows as the statements write and read them.

use chrono::NaiveDateTime;
use diesel::prelude::*;

use crate::outcome::Origin;
use crate::row_status::OperationStatus;
use crate::schema::idempotency_phases;
use crate::sql_time::At;

/// An operation as its first commit writes it. Its columns bind `NULL` for
/// what it leaves out, not `DEFAULT`, so that every operation is the same
/// statement.
#[derive(Insertable, Clone, Copy)]
#[diesel(table_name = idempotency_phases, treat_none_as_default_value = false)]
pub struct NewOperation<'a> {
    pub(crate) scope: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) request_hash: &'a str,
    pub(crate) request: Option<&'a str>,
    pub(crate) op_id: &'a str,
    pub(crate) status: OperationStatus,
    pub(crate) points: &'a str,
    pub(crate) lease_token: &'a str,
    #[diesel(serialize_as = At)]
    pub(crate) lease_until: NaiveDateTime,
    pub(crate) attempts: i32,
    #[diesel(serialize_as = At)]
    pub(crate) created_at: NaiveDateTime,
    #[diesel(serialize_as = At)]
    pub(crate) updated_at: NaiveDateTime,
    /// Who may look the operation up, as [`Record::caller_hash`](crate::backend::Record).
    pub(crate) caller_hash: Option<&'a str>,
    /// Where its result comes from, as the [`Record`](crate::backend::Record)'s.
    pub(crate) traceparent: Option<&'a str>,
    pub(crate) request_id: Option<&'a str>,
}

/// An operation as an attempt, or a lookup, reads it.
#[derive(Queryable, Selectable, Debug)]
#[diesel(table_name = idempotency_phases)]
pub struct OperationRow {
    pub(crate) operation: String,
    pub(crate) request_hash: String,
    pub(crate) op_id: String,
    pub(crate) status: OperationStatus,
    pub(crate) points: String,
    pub(crate) response: Option<String>,
    pub(crate) lease_until: Option<NaiveDateTime>,
    pub(crate) expires_at: Option<NaiveDateTime>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) caller_hash: Option<String>,
    pub(crate) traceparent: Option<String>,
    pub(crate) request_id: Option<String>,
}

impl OperationRow {
    /// Where the operation's result comes from: its first attempt.
    pub(crate) fn origin(&self) -> Origin {
        Origin::kept(self.traceparent.as_deref(), self.request_id.as_deref())
    }
}

/// An attempt's hold on an operation: its key and lease token.
#[derive(Clone, Copy)]
pub struct Lease<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) token: &'a str,
}

/// An operation a completer picked.
#[derive(Queryable, Debug)]
pub struct PickedRow {
    pub(crate) scope: String,
    pub(crate) idempotency_key: String,
    pub(crate) operation: String,
    pub(crate) request: String,
}

/// A parked operation, as listed.
#[derive(Queryable, Debug)]
pub struct ParkedRow {
    pub(crate) scope: String,
    pub(crate) idempotency_key: String,
    pub(crate) operation: String,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) updated_at: NaiveDateTime,
}
