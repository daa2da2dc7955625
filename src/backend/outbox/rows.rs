//! The outbox's rows as the statements write and read them.

use chrono::NaiveDateTime;
use diesel::prelude::*;

use crate::schema::idempotency_outbox;

/// A message as `enqueue` writes it: pending, never attempted, due at once
/// or at `not_before`. Its columns bind `NULL` for what it leaves out, not
/// `DEFAULT`, so that every message is the same statement.
#[derive(Insertable, Clone, Copy)]
#[diesel(table_name = idempotency_outbox, treat_none_as_default_value = false)]
pub struct NewMessage<'a> {
    pub(crate) id: &'a str,
    pub(crate) scope: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) payload: &'a str,
    #[diesel(column_name = available_at)]
    pub(crate) not_before: Option<NaiveDateTime>,
    /// A JSON object of string to string.
    pub(crate) headers: Option<&'a str>,
    pub(crate) ordering_key: Option<&'a str>,
    pub(crate) traceparent: Option<&'a str>,
    pub(crate) tracestate: Option<&'a str>,
}

/// What a relay claims: up to `limit` pending messages due at `now`,
/// leased until `lease_until` with `lease_token`.
#[derive(Debug, Clone, Copy)]
pub struct BatchClaim<'a> {
    pub(crate) now: NaiveDateTime,
    pub(crate) lease_until: NaiveDateTime,
    pub(crate) lease_token: &'a str,
    pub(crate) limit: usize,
}

/// A message a relay has just claimed; `attempts` counts this attempt.
#[derive(Queryable, QueryableByName)]
#[diesel(table_name = idempotency_outbox)]
pub struct Claimed {
    pub(crate) id: String,
    pub(crate) scope: String,
    pub(crate) topic: String,
    pub(crate) payload: String,
    pub(crate) attempts: i32,
    pub(crate) headers: Option<String>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) traceparent: Option<String>,
    pub(crate) tracestate: Option<String>,
}

/// A claimed message, by its scope and its id.
#[derive(Debug, Clone, Copy)]
pub struct MessageId<'a> {
    pub(crate) scope: &'a str,
    pub(crate) id: &'a str,
}

/// A message parked as dead, as listed.
#[derive(Queryable)]
pub struct DeadRow {
    pub(crate) id: String,
    pub(crate) topic: String,
    pub(crate) payload: String,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
    pub(crate) created_at: NaiveDateTime,
}

/// The messages by state, as `Relay::stats` reports them.
pub struct Backlog {
    pub(crate) pending: i64,
    pub(crate) oldest_pending: Option<NaiveDateTime>,
    pub(crate) due: i64,
    pub(crate) dead: i64,
}

/// When the next pending message is due, as a relay service sleeps for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// A message was never attempted, or was given back.
    Now,
    /// The earliest end of a lease, a backoff or a `not_before`.
    At(NaiveDateTime),
}

/// How a claimed message's attempt ended, written only while the claim's
/// lease token is still the message's.
#[derive(Debug, Clone)]
pub enum Settlement {
    /// The handler accepted it.
    Delivered { at: NaiveDateTime },
    /// The handler failed; the message is due again at `due`.
    Retry { due: NaiveDateTime, error: String },
    /// Parked after `attempts` attempts, the last with `error`.
    Dead { error: String, attempts: i32 },
}
