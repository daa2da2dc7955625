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

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::backend::StoreConnection;

mod backlog;
mod envelope;
mod error;
mod failure;
mod handler;
mod message;
mod relay;
mod retention;
#[cfg(feature = "diesel-async")]
mod tasks;
mod workers;

pub use backlog::{DeadLetter, Stats};
pub use envelope::Envelope;
pub use error::{Error, HeaderError, TraceContextError};
pub use failure::{Failure, HandlerError, Permanent};
pub use message::{Deliveries, Message};
pub use relay::Relay;
pub(crate) use retention::{DEFAULT_RETENTION, purge_delivered};

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
