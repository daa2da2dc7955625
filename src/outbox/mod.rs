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
//!   the new holder's delivery. On PostgreSQL and MySQL relays claim
//!   concurrently with `FOR UPDATE SKIP LOCKED`; on SQLite claims take the
//!   write lock one after the other. Choose the lease longer than a handler ever takes: a handler
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
//! across relays no order holds for messages without an ordering key:
//! neighbouring messages may arrive in either order or at the same time.
//!
//! Messages that share an [ordering key](Envelope::ordering_key) are
//! handed over in enqueue order (their ids' order), one at a time, by any
//! number of relays and workers: a claim takes a keyed message only while
//! no message of its key enqueued before it is pending, leased or not. So
//! a message that fails holds back the later messages of its key (through
//! its backoff, its retries and a lease that runs out) until it is
//! delivered or parked as dead, a dead one by its last attempt or by a
//! [`Permanent`] failure; messages of other keys and without a key go on
//! meanwhile. A handler sees each message of a key only after the one
//! before it was recorded as delivered or dead. What the order cannot
//! cover: messages of one key enqueued by concurrent transactions are
//! ordered by their ids (time-ordered by the millisecond across
//! processes), not by their commits, and one committed after a later one
//! was delivered comes late; a requeued dead message is pending again and
//! holds back the key's messages still pending behind it, but those
//! already delivered stay delivered.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use diesel::prelude::*;
//! use idempotency::outbox::{self, Relay};
//! use idempotency::run_idempotent;
//!
//! // The application's own error wraps the crate's, so that `?` works in the
//! // operation for its database writes and its messages alike.
//! #[derive(Debug)]
//! enum ShopError {
//!     Database(diesel::result::Error),
//!     Outbox(outbox::Error),
//! }
//!
//! impl From<diesel::result::Error> for ShopError {
//!     fn from(error: diesel::result::Error) -> Self { ShopError::Database(error) }
//! }
//!
//! impl From<outbox::Error> for ShopError {
//!     fn from(error: outbox::Error) -> Self { ShopError::Outbox(error) }
//! }
//!
//! let mut conn = idempotency::testing::sqlite_memory();
//! diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
//! let placed = run_idempotent(&mut conn, "shop", "order-5d1e", &"one book", |tx| {
//!     diesel::sql_query("INSERT INTO orders (item) VALUES ('one book')").execute(tx)?;
//!     outbox::enqueue(tx, "receipts", &serde_json::json!({ "order": 1, "email": "ada@example.com" }))?;
//!     Ok::<_, ShopError>(1)
//! });
//! assert!(placed.is_ok());
//!
//! let mut sent = Vec::new();
//! let report = Relay::default().run_once(&mut conn, |message| {
//!     // e.g. POST to the mailer with `Idempotency-Key: {message.key}`
//!     sent.push((message.topic.clone(), message.key.clone()));
//!     Ok::<_, std::convert::Infallible>(())
//! })?;
//! assert_eq!(report.delivered, 1);
//! assert_eq!(sent[0].0, "receipts");
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::ops::AddAssign;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend;
use crate::backend::{BlockingStore, StoreConnection};
use crate::clock::Clock;
use crate::error::KeyError;
use crate::in_flight::InFlight;

mod backlog;
mod envelope;
mod failure;
mod handler;
mod relay;
mod workers;

use crate::backend::outbox::{BlockingOutboxStore, Settlement};
pub use backlog::{DeadLetter, Stats};
pub use envelope::{Envelope, HeaderError, TraceContextError};
pub use failure::{Failure, HandlerError, Permanent};
pub use relay::Relay;

/// The longest topic accepted, in bytes.
const MAX_TOPIC_LEN: usize = 255;

/// Writes a message for `topic` with `payload` as JSON, through `conn`.
///
/// Call it with the connection of the transaction that makes the domain
/// change (the `tx` of [`run_idempotent`](crate::run_idempotent), or any
/// open transaction): the message then exists exactly when that transaction
/// commits. Outside a transaction the message is committed at once.
///
/// The message is due at once, whatever a relay's clock says. Returns its
/// id, which is also the key it is delivered with ([`Message::key`]).
/// Enqueued by the operation of a call (or a phased step) through the
/// call's connection, it carries the call's scope ([`Message::scope`]),
/// which keeps it beside the call's rows on a database distributed by scope
/// ([Citus](crate::guide::citus)).
///
/// The payload is stored as it is; keep personal data out of it where the
/// receiver can look it up instead.
///
/// # Errors
///
/// - [`Error::InvalidTopic`]: `topic` is empty, longer than 255 bytes or not
///   visible ASCII; nothing was written.
/// - [`Error::Codec`]: `payload` did not serialize, or its JSON would not
///   read back (a non-finite float, more than 128 levels of nesting);
///   nothing was written.
/// - [`Error::Storage`]: the insert failed. Inside a transaction, the
///   transaction should be rolled back (on PostgreSQL it cannot go on), and
///   nothing was written. Outside one, the insert commits by itself, and a
///   connection lost on the way leaves it unknown whether it did: enqueue
///   in the transaction of the change the message announces, whose commit
///   decides for both.
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
/// let report = outbox::Relay::default().run_once(&mut conn, |_| Ok::<_, std::convert::Infallible>(()))?;
/// assert_eq!(report.claimed, 0);
///
/// let id = outbox::enqueue(&mut conn, "receipts", &42)?;
/// assert_eq!(id.len(), 36);
/// # Ok(())
/// # }
/// ```
pub fn enqueue<C, P>(conn: &mut C, topic: &str, payload: &P) -> Result<String, Error>
where
    C: StoreConnection,
    P: Serialize + ?Sized,
{
    Envelope::new(topic, payload).enqueue(conn)
}

/// [`enqueue`]s a message that no relay delivers before `not_before`: a
/// reminder, a retry of the application's own, a delayed webhook.
///
/// Relays compare `not_before` with the database's clock (or the clock
/// injected into the [`Relay`]). A time beyond what the backend's time
/// column holds is stored as the nearest it does: the end of the year 9999
/// on SQLite and MySQL, the start of the year 1 on SQLite and 1000 on
/// MySQL, so a "never" far in the future stays in the future.
///
/// # Errors
///
/// As [`enqueue`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use chrono::Duration;
/// use idempotency::outbox::{self, Relay};
/// use idempotency::testing::ManualClock;
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let clock = ManualClock::new();
/// let relay = Relay::default().clock(clock.source());
/// outbox::enqueue_at(&mut conn, "reminders", &"invoice 7 is due", clock.now() + Duration::days(3))?;
///
/// assert_eq!(relay.run_once(&mut conn, |_| Ok::<_, &str>(()))?.claimed, 0, "not yet");
/// clock.advance(Duration::days(3));
/// assert_eq!(relay.run_once(&mut conn, |_| Ok::<_, &str>(()))?.delivered, 1);
/// # Ok(())
/// # }
/// ```
pub fn enqueue_at<C, P>(conn: &mut C, topic: &str, payload: &P, not_before: DateTime<Utc>) -> Result<String, Error>
where
    C: StoreConnection,
    P: Serialize + ?Sized,
{
    Envelope::new(topic, payload).not_before(not_before).enqueue(conn)
}

/// [`enqueue`] on a diesel-async connection (feature `diesel-async`),
/// inside an async call's operation (or a phased step) or anywhere else:
/// the message exists exactly when the transaction on `conn` commits, and
/// carries the scope of the call whose operation enqueued it.
///
/// # Errors
///
/// As [`enqueue`].
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::SqliteConnection;
/// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
/// use idempotency::{outbox, run_idempotent_async};
///
/// type Conn = SyncConnectionWrapper<SqliteConnection>;
///
/// let mut conn = idempotency::testing::sqlite_memory_async();
/// let order = run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut Conn| {
///     outbox::enqueue_async(tx, "receipts", &"book").await?;
///     Ok::<_, outbox::Error>(1)
/// })
/// .await?;
/// assert_eq!(order.into_inner(), 1);
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub async fn enqueue_async<C, P>(conn: &mut C, topic: &str, payload: &P) -> Result<String, Error>
where
    C: crate::AsyncStoreConnection,
    P: Serialize + ?Sized,
{
    Envelope::new(topic, payload).enqueue_async(conn).await
}

/// [`enqueue_at`] on a diesel-async connection (feature `diesel-async`).
///
/// # Errors
///
/// As [`enqueue`].
#[cfg(feature = "diesel-async")]
pub async fn enqueue_at_async<C, P>(
    conn: &mut C,
    topic: &str,
    payload: &P,
    not_before: DateTime<Utc>,
) -> Result<String, Error>
where
    C: crate::AsyncStoreConnection,
    P: Serialize + ?Sized,
{
    Envelope::new(topic, payload)
        .not_before(not_before)
        .enqueue_async(conn)
        .await
}

/// One delivery of a message, as a [`Relay`] hands it to its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The message id: a time-ordered UUID, unique across processes.
    pub id: String,
    /// The scope of the call whose operation enqueued it, empty for a
    /// message enqueued outside a call.
    pub scope: String,
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
    headers: BTreeMap<String, String>,
    ordering_key: Option<String>,
    traceparent: Option<String>,
    tracestate: Option<String>,
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

    /// The headers it was enqueued with ([`Envelope::header`]), by name;
    /// empty for a message enqueued without.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The value of header `name` (as enqueued, case and all), if it has
    /// one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// Its ordering key ([`Envelope::ordering_key`]), if it has one.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The W3C `traceparent` captured when it was enqueued
    /// ([`Envelope::traceparent`]): hand it on to the broker so the
    /// consumer's span joins the trace of the request that caused the
    /// message, not the relay's.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// The W3C `tracestate` captured with the
    /// [`traceparent`](Message::traceparent).
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }
}

/// How long delivered messages are kept by default.
pub(crate) const DEFAULT_RETENTION: chrono::Duration = chrono::Duration::days(7);

/// How long the outbox's own writes (claims, outcomes, requeues, purges)
/// wait for SQLite's write lock while the application's calls hold it; as
/// long as a call waits by default.
const WRITE_LOCK_WAIT: InFlight = InFlight::Wait(chrono::Duration::seconds(5));

/// Deletes the messages delivered `retention` ago on `clock`, in batches of
/// `batch_size`, ending after the batch in which `stop` becomes true.
pub(crate) fn purge_delivered<C: StoreConnection>(
    conn: &mut C,
    clock: &Clock,
    retention: chrono::Duration,
    batch_size: usize,
    stop: &dyn Fn() -> bool,
) -> Result<usize, Error> {
    let conn = conn.raw();
    // One fixed cut-off, so the loop ends while deliveries go on.
    let cutoff = clock.now(conn)? - retention;
    let purged = backend::purge_in_batches("idempotency_outbox", batch_size, stop, |limit| {
        conn.write_now(WRITE_LOCK_WAIT, |tx| tx.purge_delivered_batch(cutoff, limit))
    })?;
    Ok(purged)
}

/// What a relay did: one [`Relay::run_once`], or all of them added up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Deliveries {
    /// Messages claimed; zero means none was due.
    pub claimed: usize,
    /// Messages the handler accepted and that are now marked delivered.
    pub delivered: usize,
    /// Messages the handler failed and that are scheduled again.
    pub retried: usize,
    /// Messages parked as dead.
    pub dead: usize,
    /// Messages whose lease was taken over (or that were requeued) before
    /// this relay settled them, or whose lease ran out before the relay
    /// reached them in its batch; they are left to the next claim.
    pub lost: usize,
    /// Messages given back unattempted because the relay was stopping; due
    /// at once for the next claim.
    pub released: usize,
}

impl Deliveries {
    /// Counts a settlement that was written.
    fn count(&mut self, settlement: &Settlement) {
        match settlement {
            Settlement::Delivered { .. } => self.delivered += 1,
            Settlement::Retry { .. } => self.retried += 1,
            Settlement::Dead { .. } => self.dead += 1,
        }
    }
}

impl AddAssign for Deliveries {
    fn add_assign(&mut self, other: Deliveries) {
        self.claimed += other.claimed;
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.dead += other.dead;
        self.lost += other.lost;
        self.released += other.released;
    }
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
    /// The ordering key breaks a topic's rules: empty, longer than 255
    /// bytes or not visible ASCII. Nothing was written.
    InvalidOrderingKey(KeyError),
    /// A header's name or value breaks its rules, or there are too many.
    /// Nothing was written.
    InvalidHeader(HeaderError),
    /// The trace context is not W3C's. Nothing was written.
    InvalidTraceContext(TraceContextError),
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
            Error::Codec(_) => f.write_str("outbox payload cannot be stored as json"),
            Error::InvalidOrderingKey(reason) => write!(f, "invalid outbox ordering key: {reason}"),
            Error::InvalidHeader(reason) => write!(f, "invalid outbox header: {reason}"),
            Error::InvalidTraceContext(reason) => write!(f, "invalid outbox trace context: {reason}"),
            Error::Storage(_) => f.write_str("outbox storage failed"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // The reason is part of the message already.
            Error::InvalidTopic(_)
            | Error::InvalidOrderingKey(_)
            | Error::InvalidHeader(_)
            | Error::InvalidTraceContext(_) => None,
            Error::Codec(error) => Some(error),
            Error::Storage(error) => Some(error),
        }
    }
}
