//! Transactional outbox: messages for other systems, written in the same
//! transaction as the domain change that causes them and delivered
//! afterwards, at least once, each with a stable key the receiver
//! deduplicates on.
//!
//! Telling another system from inside the transaction is wrong (the call
//! cannot be rolled back), and telling it after the commit loses the message
//! when the process dies in between. [`enqueue`] instead writes the message
//! through the transaction's own connection: inside
//! [`run_idempotent`](crate::run_idempotent) it commits or rolls back with the
//! key record and the domain writes, and a replayed call enqueues nothing
//! because its operation does not run. A [`Relay`] then claims due messages,
//! hands each to a handler that performs the call, and records the outcome.
//!
//! # Delivery guarantees
//!
//! - **At least once.** A message is marked delivered only after its handler
//!   returned `Ok`. A relay that dies, or whose handler panics, leaves the
//!   message leased; when the [`lease`](Relay::lease) runs out another run
//!   delivers it again. A handler error schedules it again after a
//!   [backoff](Relay::backoff); after [`max_attempts`](Relay::max_attempts)
//!   it is parked as dead with its last error and the relay carries on with
//!   the others. [`Relay::dead_letters`] lists dead messages and
//!   [`Relay::requeue`] sends one again.
//! - **One key per message.** [`Message::key`] is the same on every delivery
//!   of a message, requeued or not. Send it as the `Idempotency-Key` of an
//!   outbound HTTP call, or deduplicate with
//!   [`run_idempotent`](crate::run_idempotent) on the receiving side (scope:
//!   the consumer's name, key: the message key), so that redeliveries do not
//!   repeat the effect.
//! - **Leases.** A claim leases its messages: until the lease runs out no
//!   other relay claims them, and a relay may settle a message only while its
//!   claim is the latest, so a relay whose lease was taken over cannot mark
//!   the new holder's delivery. On PostgreSQL relays claim concurrently with
//!   `FOR UPDATE SKIP LOCKED`; on SQLite claims take the write lock one after
//!   the other. Choose the lease longer than a handler ever takes: a handler
//!   still running when its lease runs out may see its message delivered
//!   concurrently by another relay.
//!
//! # Ordering
//!
//! Each claim takes the oldest due messages in enqueue order (message ids are
//! time-ordered: strictly increasing within a process, by the millisecond
//! across processes), and a relay hands its batch to the handler in that
//! order. So one relay running alone delivers the messages of a topic in the
//! order they were enqueued, with two exceptions: a message whose attempt
//! failed comes again only after its backoff, behind messages enqueued after
//! it, and a message committed by a slow transaction may become visible after
//! a later one was delivered.
//!
//! Several relays running at once deliver their batches in parallel, so
//! across relays no order holds, within a topic or otherwise: neighbouring
//! messages may arrive in either order or at the same time. Receivers that
//! need order must restore it themselves (from a sequence in the payload),
//! or a single relay must serve their topic.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use idempotency::outbox::{self, Relay};
//! use idempotency::run_idempotent;
//!
//! let mut conn = idempotency::testing::sqlite_memory();
//! run_idempotent(&mut conn, "shop", "order-5d1e", &"one book", |tx| {
//!     // ... insert the order on `tx` ...
//!     outbox::enqueue(tx, "receipts", &serde_json::json!({ "order": 1, "email": "ada@example.com" }))?;
//!     Ok::<_, outbox::Error>(1)
//! })?;
//!
//! let mut sent = Vec::new();
//! let batch = Relay::default().run_once(&mut conn, |message| {
//!     // e.g. POST to the mailer with `Idempotency-Key: {message.key}`
//!     sent.push((message.topic.clone(), message.key.clone()));
//!     Ok::<_, std::convert::Infallible>(())
//! })?;
//! assert_eq!(batch.delivered, 1);
//! assert_eq!(sent[0].0, "receipts");
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::InFlight;
use crate::error::KeyError;
use crate::store::{Backend, StoreConnection};

mod id;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

use store::{NewMessage, OutboxBackend, PENDING, Settlement};

/// The longest topic accepted, in bytes.
const MAX_TOPIC_LEN: usize = 255;

/// The most of a handler's error text kept on a message, in bytes.
const MAX_ERROR_LEN: usize = 2000;

/// Writes a message for `topic` with `payload` as JSON, through `conn`.
///
/// Call it with the connection of the transaction that makes the domain
/// change (the `tx` of [`run_idempotent`](crate::run_idempotent), or any
/// open transaction): the message then exists exactly when that transaction
/// commits. Outside a transaction the message is committed at once.
///
/// The message is due at once, whatever a relay's clock says. Returns its
/// id, which is also the key it is delivered with ([`Message::key`]).
///
/// The payload is stored as it is; keep personal data out of it where the
/// receiver can look it up instead.
///
/// # Errors
///
/// - [`Error::InvalidTopic`]: `topic` is empty, longer than 255 bytes or not
///   visible ASCII; nothing was written.
/// - [`Error::Codec`]: `payload` did not serialize; nothing was written.
/// - [`Error::Storage`]: the insert failed. Inside a transaction, the
///   transaction should be rolled back (on PostgreSQL it cannot go on).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::outbox;
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let result = conn.transaction(|tx| {
///     outbox::enqueue(tx, "receipts", &42)?;
///     Err::<(), _>(outbox::Error::Storage(diesel::result::Error::RollbackTransaction))
/// });
/// assert!(result.is_err());
/// // Rolled back with the transaction: nothing to deliver.
/// let batch = outbox::Relay::default().run_once(&mut conn, |_| Ok::<_, std::convert::Infallible>(()))?;
/// assert_eq!(batch.claimed, 0);
///
/// let id = outbox::enqueue(&mut conn, "receipts", &42)?;
/// assert_eq!(id.len(), 36);
/// # Ok(())
/// # }
/// ```
pub fn enqueue<C, P>(conn: &mut C, topic: &str, payload: &P) -> Result<String, Error>
where
    C: StoreConnection,
    C::Raw: OutboxBackend,
    P: Serialize + ?Sized,
{
    crate::key::validate_scope(topic, MAX_TOPIC_LEN).map_err(Error::InvalidTopic)?;
    let payload = serde_json::to_string(payload).map_err(Error::Codec)?;
    let id = id::new();
    conn.raw().insert_message(&NewMessage {
        id: &id,
        topic,
        payload: &payload,
        status: PENDING,
        attempts: 0,
        created_at: Utc::now().naive_utc(),
    })?;
    Ok(id)
}

/// One delivery of a message, as a [`Relay`] hands it to its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The message id: a time-ordered UUID, unique across processes.
    pub id: String,
    /// The topic it was enqueued for.
    pub topic: String,
    /// The payload as JSON text; [`Message::payload`] decodes it.
    pub payload_json: String,
    /// The idempotency key for the receiver: the message id, the same on
    /// every delivery, so a receiver that deduplicates on it performs the
    /// message's effect once however often it arrives.
    pub key: String,
    /// Which attempt this is, from 1. Attempts cut short by a relay that died
    /// or a lease that ran out count too.
    pub attempt: u32,
}

impl Message {
    /// The payload decoded into `T`.
    ///
    /// # Errors
    ///
    /// The JSON error when the payload does not decode into `T`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{self, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// outbox::enqueue(&mut conn, "receipts", &(7, "ada@example.com"))?;
    /// Relay::default().run_once(&mut conn, |message| {
    ///     let (order, email): (u32, String) = message.payload()?;
    ///     assert_eq!((order, email.as_str()), (7, "ada@example.com"));
    ///     Ok::<_, serde_json::Error>(())
    /// })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.payload_json)
    }
}

/// A message parked after its last attempt failed, as
/// [`Relay::dead_letters`] lists it.
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

/// What one [`Relay::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batch {
    /// Messages claimed; zero means none was due.
    pub claimed: usize,
    /// Messages the handler accepted and that are now marked delivered.
    pub delivered: usize,
    /// Messages the handler failed and that are scheduled again.
    pub retried: usize,
    /// Messages parked as dead on this run.
    pub dead: usize,
    /// Messages whose lease was taken over (or that were requeued) before
    /// this relay settled them, or whose lease ran out before the relay
    /// reached them in its batch; they are left to the next claim.
    pub lost: usize,
}

/// Why an outbox call failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The topic breaks the key rules (without the card number check):
    /// empty, longer than 255 bytes or not visible ASCII. Nothing was written.
    InvalidTopic(KeyError),
    /// The payload did not serialize to JSON. Nothing was written.
    Codec(serde_json::Error),
    /// The database failed. For a relay: messages it had claimed and not yet
    /// settled are delivered again once their lease runs out.
    Storage(diesel::result::Error),
}

impl From<diesel::result::Error> for Error {
    fn from(error: diesel::result::Error) -> Self {
        Error::Storage(error)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidTopic(reason) => write!(f, "invalid outbox topic: {reason}"),
            Error::Codec(_) => f.write_str("outbox payload did not serialize to json"),
            Error::Storage(_) => f.write_str("outbox storage failed"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::InvalidTopic(reason) => Some(reason),
            Error::Codec(error) => Some(error),
            Error::Storage(error) => Some(error),
        }
    }
}

type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// Delivers outbox messages: claims due ones, hands each to a handler and
/// records the outcome. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`batch_size`](Relay::batch_size) | 100 messages per claim |
/// | [`lease`](Relay::lease) | 30 seconds |
/// | [`max_attempts`](Relay::max_attempts) | 10 |
/// | [`backoff`](Relay::backoff) | 1 second, doubling, at most 15 minutes |
/// | [`retention`](Relay::retention) | 7 days for delivered messages |
/// | [`clock`](Relay::clock) | `Utc::now` |
///
/// A relay holds no connection and no state between runs; run
/// [`run_once`](Relay::run_once) in a loop, pausing while it claims nothing.
/// Any number of relays, in one process or several, may run over one
/// database; see the [module docs](self) for what each guarantees.
///
/// ```
/// use chrono::Duration;
/// use idempotency::outbox::Relay;
///
/// let relay = Relay::default()
///     .batch_size(50)
///     .lease(Duration::minutes(2))
///     .max_attempts(5)
///     .backoff(Duration::seconds(2), Duration::minutes(10));
/// # let _ = relay;
/// ```
#[derive(Clone)]
pub struct Relay {
    batch_size: usize,
    lease: Duration,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_max: Duration,
    retention: Duration,
    clock: Clock,
}

impl Default for Relay {
    fn default() -> Self {
        Relay {
            batch_size: 100,
            lease: Duration::seconds(30),
            max_attempts: 10,
            backoff_base: Duration::seconds(1),
            backoff_max: Duration::minutes(15),
            retention: Duration::days(7),
            clock: Arc::new(Utc::now),
        }
    }
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("max_attempts", &self.max_attempts)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_max", &self.backoff_max)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// Durations beyond this are certainly a unit mistake, and it keeps
/// `now + duration` far from chrono's range limits.
const MAX_DURATION_DAYS: i64 = 100 * 366;

fn assert_duration(value: Duration, what: &str) {
    assert!(value > Duration::zero(), "{what} must be positive");
    assert!(
        value <= Duration::days(MAX_DURATION_DAYS),
        "{what} must be at most 100 years"
    );
}

impl Relay {
    /// How many messages one [`run_once`](Relay::run_once) claims at most
    /// (default 100). All of them are leased together, so the lease must
    /// cover the handler's time for the whole batch.
    ///
    /// # Panics
    ///
    /// If `batch_size` is zero.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        self.batch_size = batch_size;
        self
    }

    /// How long claimed messages are reserved for this relay (default 30
    /// seconds), counted from the claim. When it runs out before the relay
    /// recorded an outcome, as when the relay died, another run claims the
    /// message again.
    ///
    /// # Panics
    ///
    /// If `lease` is not positive or longer than 100 years.
    pub fn lease(mut self, lease: Duration) -> Self {
        assert_duration(lease, "lease");
        self.lease = lease;
        self
    }

    /// How many attempts a message gets before it is parked as dead (default
    /// 10). Attempts cut short by a relay that died count: a message that
    /// crashes its relay every time is parked too, without another delivery.
    ///
    /// # Panics
    ///
    /// If `max_attempts` is zero.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        assert!(max_attempts > 0, "max_attempts must be positive");
        self.max_attempts = max_attempts;
        self
    }

    /// The wait after a failed attempt (default 1 second, at most 15
    /// minutes): `base` after the first, doubling after each further one, and
    /// never more than `max`. The wait counts from when the failure is
    /// recorded.
    ///
    /// # Panics
    ///
    /// If either is not positive or longer than 100 years, or `max < base`.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        assert_duration(base, "backoff base");
        assert_duration(max, "backoff maximum");
        assert!(max >= base, "backoff maximum must not be below its base");
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// How long delivered messages are kept before
    /// [`purge_delivered`](Relay::purge_delivered) deletes them (default 7
    /// days).
    ///
    /// # Panics
    ///
    /// If `retention` is not positive or longer than 100 years.
    pub fn retention(mut self, retention: Duration) -> Self {
        assert_duration(retention, "retention");
        self.retention = retention;
        self
    }

    /// The time source for leases, backoff and retention (default
    /// `Utc::now`). Tests inject a
    /// [`ManualClock`](crate::testing::ManualClock) to step through them
    /// without waiting. Relays sharing a database must agree on the time.
    pub fn clock(mut self, clock: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    fn now(&self) -> NaiveDateTime {
        (self.clock)().naive_utc()
    }

    /// The wait after failed attempt number `attempt` (from 1).
    fn backoff_after(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(62);
        let factor = 1i32.checked_shl(doublings).unwrap_or(i32::MAX);
        self.backoff_base
            .checked_mul(factor)
            .map_or(self.backoff_max, |wait| wait.min(self.backoff_max))
    }

    /// Claims up to [`batch_size`](Relay::batch_size) due messages, oldest
    /// first, hands each to `handler` in that order, and records each
    /// outcome: `Ok` marks the message delivered; `Err` schedules it again
    /// after the [backoff](Relay::backoff), or parks it as dead with the
    /// error's text once it had [`max_attempts`](Relay::max_attempts). A
    /// message whose earlier lease ran out after its last attempt is parked
    /// without being handed over again.
    ///
    /// The claim is one short transaction, and each outcome is written in one
    /// statement of its own, so on a connection outside a transaction no lock
    /// is held while the handler calls out. (On a connection inside a
    /// transaction, the claim and the outcomes become part of it.) Messages
    /// the relay reaches only after their lease ran out are not handed over:
    /// choose the lease longer than a whole batch takes. The handler's error
    /// text is stored on the message (at most 2000 bytes); keep payload data
    /// out of it.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the claim or recording an outcome fails. The
    /// messages claimed and not yet settled stay leased and are delivered
    /// again after the lease.
    ///
    /// # Panics
    ///
    /// A panic in `handler` passes through; its message and the rest of the
    /// batch are delivered again after the lease.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::outbox::{self, Relay};
    /// use idempotency::testing::ManualClock;
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// outbox::enqueue(&mut conn, "payments", &"capture 12.00")?;
    /// let clock = ManualClock::new();
    /// let relay = Relay::default().clock(clock.source()).backoff(Duration::seconds(10), Duration::minutes(5));
    ///
    /// let failed = relay.run_once(&mut conn, |_| Err("gateway unavailable"))?;
    /// assert_eq!(failed.retried, 1);
    /// // Not due again before the backoff.
    /// assert_eq!(relay.run_once(&mut conn, |_| Ok::<_, &str>(()))?.claimed, 0);
    /// clock.advance(Duration::seconds(10));
    /// let retried = relay.run_once(&mut conn, |message| {
    ///     assert_eq!(message.attempt, 2);
    ///     Ok::<_, &str>(())
    /// })?;
    /// assert_eq!(retried.delivered, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn run_once<C, E, F>(&self, conn: &mut C, mut handler: F) -> Result<Batch, Error>
    where
        C: StoreConnection,
        C::Raw: OutboxBackend,
        E: fmt::Display,
        F: FnMut(&Message) -> Result<(), E>,
    {
        let conn = conn.raw();
        let now = self.now();
        let token = id::new();
        let mut claimed = conn.write_transaction(InFlight::default(), |tx| {
            tx.claim_batch(now, now + self.lease, &token, self.batch_size)
        })?;
        // The claim returns its rows in no particular order.
        claimed.sort_by(|a, b| a.id.cmp(&b.id));

        let mut batch = Batch {
            claimed: claimed.len(),
            ..Batch::default()
        };
        let lease_until = now + self.lease;
        for row in claimed {
            if self.now() >= lease_until {
                // Handlers slower than the lease: the rest of the batch may
                // already be another relay's, so it is left to that relay.
                batch.lost += 1;
                continue;
            }
            let id = row.id.clone();
            let attempts = row.attempts;
            let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
            let error;
            let (settlement, tally): (Settlement<'_>, fn(&mut Batch) -> &mut usize) = if attempt > self.max_attempts {
                // The claim counted an attempt in advance; parking the
                // message without handing it over made none.
                error = format!("lease ran out during attempt {} without an outcome", attempt - 1);
                (
                    Settlement::Dead {
                        error: &error,
                        attempts: attempts - 1,
                    },
                    |b| &mut b.dead,
                )
            } else {
                let message = Message {
                    key: row.id,
                    id: id.clone(),
                    topic: row.topic,
                    payload_json: row.payload,
                    attempt,
                };
                match handler(&message) {
                    Ok(()) => (Settlement::Delivered { at: self.now() }, |b| &mut b.delivered),
                    Err(failure) => {
                        error = truncate(failure.to_string());
                        if attempt >= self.max_attempts {
                            (
                                Settlement::Dead {
                                    error: &error,
                                    attempts,
                                },
                                |b| &mut b.dead,
                            )
                        } else {
                            let due = self.now() + self.backoff_after(attempt);
                            (Settlement::Retry { due, error: &error }, |b| &mut b.retried)
                        }
                    }
                }
            };
            if conn.settle(&id, &token, settlement)? {
                *tally(&mut batch) += 1;
            } else {
                batch.lost += 1;
            }
        }
        Ok(batch)
    }

    /// Up to `limit` dead messages, oldest first.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the query fails.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{self, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let id = outbox::enqueue(&mut conn, "webhooks", &"order shipped")?;
    /// let relay = Relay::default().max_attempts(1);
    /// relay.run_once(&mut conn, |_| Err("410 gone"))?;
    ///
    /// let dead = relay.dead_letters(&mut conn, 10)?;
    /// assert_eq!(dead.len(), 1);
    /// assert_eq!((dead[0].id.as_str(), dead[0].last_error.as_deref()), (id.as_str(), Some("410 gone")));
    /// # Ok(())
    /// # }
    /// ```
    pub fn dead_letters<C>(&self, conn: &mut C, limit: usize) -> Result<Vec<DeadLetter>, Error>
    where
        C: StoreConnection,
        C::Raw: OutboxBackend,
    {
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

    /// Sends a dead message again: pending, due at once, with a fresh count
    /// of attempts and the same key. Returns `false` when `id` names no dead
    /// message.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the update fails.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{self, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let id = outbox::enqueue(&mut conn, "webhooks", &"order shipped")?;
    /// let relay = Relay::default().max_attempts(1);
    /// relay.run_once(&mut conn, |_| Err("endpoint misconfigured"))?;
    ///
    /// // The endpoint was fixed.
    /// assert!(relay.requeue(&mut conn, &id)?);
    /// assert_eq!(relay.run_once(&mut conn, |_| Ok::<_, &str>(()))?.delivered, 1);
    /// assert!(!relay.requeue(&mut conn, &id)?, "a delivered message is not dead");
    /// # Ok(())
    /// # }
    /// ```
    pub fn requeue<C>(&self, conn: &mut C, id: &str) -> Result<bool, Error>
    where
        C: StoreConnection,
        C::Raw: OutboxBackend,
    {
        Ok(conn.raw().requeue(id)?)
    }

    /// Deletes every message delivered longer than
    /// [`retention`](Relay::retention) ago, `batch_size` rows per statement,
    /// each statement its own short transaction, so it can run beside live
    /// traffic. Returns how many were deleted. Pending and dead messages are
    /// never purged.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when a batch fails; the batches before it stay
    /// deleted.
    ///
    /// # Panics
    ///
    /// If `batch_size` is zero.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::outbox::{self, Relay};
    /// use idempotency::testing::ManualClock;
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let clock = ManualClock::new();
    /// let relay = Relay::default().clock(clock.source()).retention(Duration::days(1));
    /// outbox::enqueue(&mut conn, "receipts", &1)?;
    /// relay.run_once(&mut conn, |_| Ok::<_, &str>(()))?;
    ///
    /// assert_eq!(relay.purge_delivered(&mut conn, 500)?, 0);
    /// clock.advance(Duration::days(1));
    /// assert_eq!(relay.purge_delivered(&mut conn, 500)?, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn purge_delivered<C>(&self, conn: &mut C, batch_size: usize) -> Result<usize, Error>
    where
        C: StoreConnection,
        C::Raw: OutboxBackend,
    {
        assert!(batch_size > 0, "batch_size must be positive");
        // One fixed cut-off, so the loop ends while deliveries go on.
        let cutoff = self.now() - self.retention;
        let conn = conn.raw();
        let mut total = 0;
        loop {
            let deleted = conn.purge_delivered_batch(cutoff, batch_size)?;
            total += deleted;
            if deleted < batch_size {
                return Ok(total);
            }
        }
    }
}

/// Cuts `text` to at most `MAX_ERROR_LEN` bytes on a character boundary.
fn truncate(mut text: String) -> String {
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_maximum() {
        let relay = Relay::default().backoff(Duration::seconds(10), Duration::seconds(70));
        let waits: Vec<i64> = (1..=6)
            .map(|attempt| relay.backoff_after(attempt).num_seconds())
            .collect();
        assert_eq!(waits, [10, 20, 40, 70, 70, 70]);
        assert_eq!(
            relay.backoff_after(u32::MAX),
            Duration::seconds(70),
            "no overflow on huge attempt counts"
        );
    }

    #[test]
    fn long_error_text_is_cut_on_a_character_boundary() {
        let text = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate(text);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() >= MAX_ERROR_LEN - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
