//! The outbox as its operator sees it: the backlog to watch, the dead
//! letters to look at, and a dead message sent again.

use chrono::{Duration, NaiveDateTime};

use super::error::Error;
use super::retention::WRITE_LOCK_WAIT;
use crate::backend::outbox::{BlockingOutboxStore, OutboxStore};
use crate::backend::{BlockingStore, StoreConnection, block_on};
use crate::clock::Clock;
use crate::telemetry;

/// The outbox's backlog, as [`Relay::stats`](super::Relay::stats) reports
/// it: what to watch and alert on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Messages not delivered yet: due, leased to a relay, or waiting for
    /// their backoff or not-before time.
    pub pending: u64,
    /// How long the oldest pending message has waited since it was
    /// enqueued; `None` without pending messages. A growing age means the
    /// relays do not keep up, or a handler keeps failing.
    pub oldest_pending_age: Option<Duration>,
    /// Pending messages due now, not leased to any relay; those held back
    /// behind an earlier message of their ordering key count too.
    pub due_now: u64,
    /// Messages parked after their last attempt failed, waiting for a
    /// person ([`Relay::dead_letters`](super::Relay::dead_letters),
    /// [`Relay::requeue`](super::Relay::requeue)).
    pub dead: u64,
}

/// A message parked after its last attempt failed, as
/// [`Relay::dead_letters`](super::Relay::dead_letters) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The message id, also its key.
    pub id: String,
    /// The topic it was enqueued for.
    pub topic: String,
    /// The payload as JSON text.
    pub payload_json: String,
    /// How many attempts were made.
    pub attempts: u32,
    /// The handler's error on the last attempt, or why the attempt ended
    /// without one.
    pub last_error: Option<String>,
    /// When it was enqueued (UTC, by the system clock: `enqueue` takes no
    /// clock).
    pub created_at: NaiveDateTime,
}

/// The backlog at the time `clock` reads, also set as the backlog gauges.
pub(super) fn stats<C: StoreConnection>(conn: &mut C, clock: &Clock) -> Result<Stats, Error> {
    block_on(stats_of(conn.raw(), clock))
}

/// [`stats`] on either kind of connection.
pub(super) async fn stats_of<C: OutboxStore>(conn: &mut C, clock: &Clock) -> Result<Stats, Error> {
    let now = clock.or_database_now(conn).await?;
    let backlog = conn.backlog(now).await?;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let stats = Stats {
        pending: count(backlog.pending),
        oldest_pending_age: backlog
            .oldest_pending
            .map(|oldest| (now - oldest).max(Duration::zero())),
        due_now: count(backlog.due),
        dead: count(backlog.dead),
    };
    telemetry::backlog(stats.pending, stats.due_now, stats.dead, stats.oldest_pending_age);
    Ok(stats)
}

/// Up to `limit` dead messages, oldest first.
pub(super) fn dead_letters<C: StoreConnection>(conn: &mut C, limit: usize) -> Result<Vec<DeadLetter>, Error> {
    let rows = conn.raw().dead_messages(limit)?;
    Ok(rows
        .into_iter()
        .map(|row| DeadLetter {
            id: row.id,
            topic: row.topic,
            payload_json: row.payload,
            attempts: u32::try_from(row.attempts).unwrap_or(0),
            last_error: row.last_error,
            created_at: row.created_at,
        })
        .collect())
}

/// Makes dead message `id` pending again, due at once with fresh attempts;
/// `false` when `id` names no dead message.
pub(super) fn requeue<C: StoreConnection>(conn: &mut C, id: &str) -> Result<bool, Error> {
    Ok(conn.raw().write_now(WRITE_LOCK_WAIT, |tx| tx.requeue(id))?)
}
