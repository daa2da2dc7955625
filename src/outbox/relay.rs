//! The relay: claims due messages, hands each to a handler and records how
//! its attempt ended.

use std::fmt;
use std::future::Future;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};

use super::backlog::{self, DeadLetter, Stats};
use super::error::Error;
use super::failure::HandlerError;
use super::message::{Deliveries, Message};
use super::retention::{DEFAULT_RETENTION, WRITE_LOCK_WAIT, purge_delivered};
use crate::backend::outbox::{BatchClaim, Claimed, MessageId, OutboxStore, Settlement};
use crate::backend::{StoreConnection, block_on};
use crate::clock::{Clock, Reading, assert_duration};
use crate::id;
use crate::telemetry;

/// The most of a handler's error text kept on a message, in bytes.
const MAX_ERROR_LEN: usize = 2000;

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
/// | [`clock`](Relay::clock) | the database's clock |
/// | [`workers`](Relay::workers) | 1 for [`serve`](Relay::serve) and [`serve_async`](Relay::serve_async) |
/// | [`in_flight`](Relay::in_flight) | 1 message at a time for [`serve_async`](Relay::serve_async) |
/// | [`poll_interval`](Relay::poll_interval) | 250 ms for [`serve`](Relay::serve) and [`serve_async`](Relay::serve_async) |
///
/// A relay holds no connection and no state between runs. Start it as a
/// background service with [`serve`](Relay::serve), which claims while messages
/// are due and sleeps while none are, until stopped; or call
/// [`run_once`](Relay::run_once) from a scheduler of your own. Any number of
/// relays, in one process or several, may run over one database; see the
/// [module docs](crate::outbox) for what each guarantees.
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
    pub(super) lease: Duration,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_max: Duration,
    retention: Duration,
    pub(super) clock: Clock,
    pub(super) workers: usize,
    pub(super) in_flight: usize,
    pub(super) poll_interval: std::time::Duration,
}

impl Default for Relay {
    fn default() -> Self {
        Relay {
            batch_size: 100,
            lease: Duration::seconds(30),
            max_attempts: 10,
            backoff_base: Duration::seconds(1),
            backoff_max: Duration::minutes(15),
            retention: DEFAULT_RETENTION,
            clock: Clock::Database,
            workers: 1,
            in_flight: 1,
            poll_interval: std::time::Duration::from_millis(250),
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
            .field("workers", &self.workers)
            .field("in_flight", &self.in_flight)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// The lease of one claim: until when its messages are this relay's, and
/// the token that settling them requires.
pub(super) struct Lease {
    pub(super) token: String,
    until: NaiveDateTime,
}

/// What the relay keeps of a claimed message while its handler has it: to
/// record the outcome, and to report it.
pub(super) struct Handed {
    pub(super) id: String,
    pub(super) scope: String,
    topic: String,
    attempt: u32,
}

impl Handed {
    pub(super) fn of(row: &Claimed) -> Handed {
        Handed {
            id: row.id.clone(),
            scope: row.scope.clone(),
            topic: row.topic.clone(),
            attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
        }
    }

    /// Reports the outcome recorded for it.
    pub(super) fn recorded(&self, settlement: &Settlement) {
        match settlement {
            Settlement::Delivered { .. } => telemetry::relay::delivered(&self.id, &self.topic, self.attempt),
            Settlement::Retry { due, .. } => telemetry::relay::retrying(&self.id, &self.topic, self.attempt, *due),
            Settlement::Dead { attempts, .. } => telemetry::relay::dead(&self.id, &self.topic, *attempts),
        }
    }
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
    /// message again. [`serve`](Relay::serve) gives up on a handler still
    /// running at three quarters of it.
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

    /// The time source for leases, backoff and retention (default: the
    /// database's clock, read once per [`run_once`](Relay::run_once) and
    /// carried on by this process's monotonic clock). Tests inject a
    /// [`ManualClock`](crate::testing::ManualClock) to step through them
    /// without waiting. Relays sharing a database must agree on the time,
    /// which the database's clock gives them wherever they run.
    pub fn clock(mut self, clock: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.clock = Clock::injected(clock);
        self
    }

    /// How many threads [`serve`](Relay::serve) delivers on, and how many
    /// concurrent loops [`serve_async`](Relay::serve_async) runs, each
    /// claiming batches of its own on a pooled connection (default 1). One worker
    /// keeps each topic in enqueue order; several deliver in parallel and
    /// keep only the order of each [ordering key](super::Envelope::ordering_key).
    ///
    /// # Panics
    ///
    /// If `workers` is zero.
    pub fn workers(mut self, workers: usize) -> Self {
        assert!(workers > 0, "workers must be positive");
        self.workers = workers;
        self
    }

    /// How many messages of a batch each worker of
    /// [`serve_async`](Relay::serve_async) hands over at once (default 1):
    /// their handlers are awaited together, and the ones delivered are
    /// marked in one statement. With a broker's publisher this pipelines
    /// the confirmations instead of waiting for each in turn.
    ///
    /// One at a time keeps a single relay's delivery of each topic in
    /// enqueue order. Above one, the messages handed over together may
    /// arrive in any order among themselves; each
    /// [ordering key](super::Envelope::ordering_key) keeps its order
    /// all the same, because a claim takes at most one message of a key.
    /// The thread relay ([`serve`](Relay::serve), [`run_once`](Relay::run_once))
    /// and [`run_once_async`](Relay::run_once_async) hand over one at a time.
    ///
    /// # Panics
    ///
    /// If `in_flight` is zero.
    pub fn in_flight(mut self, in_flight: usize) -> Self {
        assert!(in_flight > 0, "in_flight must be positive");
        self.in_flight = in_flight;
        self
    }

    /// How often [`serve`](Relay::serve) looks for due messages while none
    /// are (default 250 ms): the longest a new message waits on SQLite and
    /// MySQL, and on PostgreSQL when a notification was missed. A retry whose
    /// backoff ends sooner wakes the relay at its due time instead.
    ///
    /// # Panics
    ///
    /// If `poll_interval` is not positive or longer than 100 years.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        assert_duration(poll_interval, "poll_interval");
        self.poll_interval = poll_interval.to_std().unwrap_or_default();
        self
    }

    /// The wait after failed attempt number `attempt` (from 1).
    fn backoff_after(&self, attempt: u32) -> Duration {
        // 2^31 is beyond an i32 (a shift would wrap it to i32::MIN, a
        // negative wait): the factor saturates instead.
        let factor = 2i32.checked_pow(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        self.backoff_base
            .checked_mul(factor)
            .map_or(self.backoff_max, |wait| wait.min(self.backoff_max))
    }

    /// Hands a claimed message to `handler` and decides how its attempt
    /// ended; `None` for a message reached only after the lease ran out,
    /// which the rest of the batch may already belong to another relay.
    async fn attempt<D: Deliver>(
        &self,
        row: Claimed,
        clock: &Reading,
        lease: &Lease,
        handler: &mut D,
    ) -> Option<Settlement> {
        let attempts = row.attempts;
        match self.prepare(row, clock, lease) {
            Ok(message) => Some(self.settlement(handler.deliver(&message).await, attempts, clock)),
            Err(ended) => ended,
        }
    }

    /// The message a claimed row hands over, or how its attempt ends
    /// without one: `Err(None)` reached only after the lease ran out,
    /// `Err(Some(_))` parked as dead unattempted.
    pub(super) fn prepare(&self, row: Claimed, clock: &Reading, lease: &Lease) -> Result<Message, Option<Settlement>> {
        if clock.now() >= lease.until {
            return Err(None);
        }
        let attempt = u32::try_from(row.attempts).unwrap_or(u32::MAX);
        if attempt > self.max_attempts {
            // The claim counted an attempt in advance; parking the message
            // without handing it over made none.
            return Err(Some(Settlement::Dead {
                error: format!("lease ran out during attempt {} without an outcome", attempt - 1),
                attempts: row.attempts - 1,
            }));
        }
        let headers = match row.headers.as_deref().map(serde_json::from_str).transpose() {
            Ok(headers) => headers.unwrap_or_default(),
            // Written by `Envelope` as a map of strings, so changed by hand:
            // the message can no longer be delivered as it was enqueued.
            Err(error) => {
                return Err(Some(Settlement::Dead {
                    error: storable_error(format!("the stored headers do not decode: {error}")),
                    attempts: row.attempts,
                }));
            }
        };
        Ok(Message {
            key: row.id.clone(),
            id: row.id,
            scope: row.scope,
            topic: row.topic,
            payload_json: row.payload,
            attempt,
            headers,
            ordering_key: row.ordering_key,
            traceparent: row.traceparent,
            tracestate: row.tracestate,
        })
    }

    /// How the attempt of a message claimed for its `attempts`th time
    /// ended, given the handler's `outcome`.
    pub(super) fn settlement<E: HandlerError>(
        &self,
        outcome: Result<(), E>,
        attempts: i32,
        clock: &Reading,
    ) -> Settlement {
        let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
        match outcome {
            Ok(()) => Settlement::Delivered { at: clock.now() },
            Err(failure) if failure.is_permanent() || attempt >= self.max_attempts => Settlement::Dead {
                error: storable_error(failure.text()),
                attempts,
            },
            Err(failure) => Settlement::Retry {
                due: clock.now() + self.backoff_after(attempt),
                error: storable_error(failure.text()),
            },
        }
    }

    /// Claims up to [`batch_size`](Relay::batch_size) due messages, oldest
    /// first, hands each to `handler` in that order, and records each
    /// outcome: `Ok` marks the message delivered; `Err` schedules it again
    /// after the [backoff](Relay::backoff), or parks it as dead with the
    /// error's text once it had [`max_attempts`](Relay::max_attempts), or at
    /// once when the error is [permanent](super::HandlerError) (such as a
    /// [`Permanent`](super::Permanent)). A
    /// message whose earlier lease ran out after its last attempt is parked
    /// without being handed over again.
    ///
    /// The claim is one short transaction, and each outcome is written in one
    /// statement of its own, so on a connection outside a transaction no lock
    /// is held while the handler calls out. On SQLite every one of these
    /// writes waits for the database's write lock as a call does (up to 5
    /// seconds), so a relay runs beside the application's own writers. (On a connection inside a
    /// transaction, the claim and the outcomes become part of it.) Messages
    /// the relay reaches only after their lease ran out are not handed over:
    /// choose the lease longer than a whole batch takes. The handler's error
    /// text is stored on the message (at most 2000 bytes, a NUL as U+FFFD);
    /// keep payload data out of it.
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
    pub fn run_once<C, E, F>(&self, conn: &mut C, mut handler: F) -> Result<Deliveries, Error>
    where
        C: StoreConnection,
        E: HandlerError,
        F: FnMut(&Message) -> Result<(), E>,
    {
        let mut report = Deliveries::default();
        let conn = conn.raw();
        block_on(async {
            let clock = self.clock.start(conn).await?;
            self.pass(conn, &clock, &mut Blocking(&mut handler), &|| false, &mut report)
                .await
        })?;
        Ok(report)
    }

    /// One claim and its deliveries, on the time `clock` reads on from,
    /// counted into `report` as they are recorded, so that an error later
    /// in the batch keeps what was done before it. Once `stop` says so, the
    /// messages not yet handed over are given back, due at once for another
    /// relay.
    pub(super) async fn pass<C: OutboxStore, D: Deliver>(
        &self,
        conn: &mut C,
        clock: &Reading,
        handler: &mut D,
        stop: &(dyn Fn() -> bool + Sync),
        report: &mut Deliveries,
    ) -> Result<(), Error> {
        let (lease, claimed) = self.claim(conn, clock).await?;
        report.claimed += claimed.len();
        for row in claimed {
            if stop() {
                self.release(conn, &row, &lease, report).await?;
                continue;
            }
            let claimed = Handed::of(&row);
            let settlement = self.attempt(row, clock, &lease, handler).await;
            self.record(conn, &claimed, settlement, &lease, report).await?;
        }
        Ok(())
    }

    /// Claims up to [`batch_size`](Relay::batch_size) due messages for a
    /// lease from now, as `clock` reads it (the reading the caller took to
    /// see whether anything is due, read on: not a second round trip): the
    /// lease, and the messages in enqueue order.
    pub(super) async fn claim<C: OutboxStore>(
        &self,
        conn: &mut C,
        clock: &Reading,
    ) -> Result<(Lease, Vec<Claimed>), Error> {
        let now = clock.now();
        let lease = Lease {
            token: id::new(),
            until: now + self.lease,
        };
        let claim = BatchClaim {
            now,
            lease_until: lease.until,
            lease_token: &lease.token,
            limit: self.batch_size,
        };
        let mut claimed = conn
            .write(WRITE_LOCK_WAIT, async |tx: &mut C| tx.claim_batch(&claim).await)
            .await?;
        telemetry::relay::claimed(claimed.len(), lease.until);
        // The claim returns its rows in no particular order.
        claimed.sort_by(|a, b| a.id.cmp(&b.id));
        Ok((lease, claimed))
    }

    /// Gives claimed message `row` back unattempted, counted into `report`.
    pub(super) async fn release<C: OutboxStore>(
        &self,
        conn: &mut C,
        row: &Claimed,
        lease: &Lease,
        report: &mut Deliveries,
    ) -> Result<(), Error> {
        let message = MessageId {
            scope: &row.scope,
            id: &row.id,
        };
        if conn
            .write(WRITE_LOCK_WAIT, async |tx: &mut C| {
                tx.release(message, &lease.token).await
            })
            .await?
        {
            report.released += 1;
        }
        Ok(())
    }

    /// Records how the attempt of `handed` ended, counted into `report`;
    /// `None` for one reached only after its lease ran out.
    pub(super) async fn record<C: OutboxStore>(
        &self,
        conn: &mut C,
        handed: &Handed,
        settlement: Option<Settlement>,
        lease: &Lease,
        report: &mut Deliveries,
    ) -> Result<(), Error> {
        let Some(settlement) = settlement else {
            telemetry::relay::lease_lost(&handed.id);
            report.lost += 1;
            return Ok(());
        };
        let message = MessageId {
            scope: &handed.scope,
            id: &handed.id,
        };
        if conn
            .write(WRITE_LOCK_WAIT, async |tx: &mut C| {
                tx.settle(message, &lease.token, &settlement).await
            })
            .await?
        {
            handed.recorded(&settlement);
            report.count(&settlement);
        } else {
            telemetry::relay::lease_lost(&handed.id);
            report.lost += 1;
        }
        Ok(())
    }

    /// The outbox's backlog now: pending messages, the age of the oldest,
    /// those due now, and dead ones. With the `metrics` feature it also sets
    /// the backlog gauges (a running [`serve`](Relay::serve) or
    /// [`serve_async`](Relay::serve_async) refreshes them every 10 seconds).
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the query fails.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::outbox::{self, Relay};
    /// use idempotency::testing::ManualClock;
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let clock = ManualClock::at(chrono::Utc::now());
    /// let relay = Relay::default().clock(clock.source()).max_attempts(1);
    /// outbox::enqueue(&mut conn, "webhooks", &"order shipped")?;
    /// outbox::enqueue(&mut conn, "webhooks", &"order paid")?;
    /// clock.advance(Duration::minutes(5));
    ///
    /// let stats = relay.stats(&mut conn)?;
    /// assert_eq!((stats.pending, stats.due_now, stats.dead), (2, 2, 0));
    /// // Enqueued a moment after the clock was read: almost five minutes.
    /// assert!(stats.oldest_pending_age > Some(Duration::minutes(4)));
    ///
    /// relay.run_once(&mut conn, |_| Err("410 gone"))?;
    /// let stats = relay.stats(&mut conn)?;
    /// assert_eq!((stats.pending, stats.dead, stats.oldest_pending_age), (0, 2, None));
    /// # Ok(())
    /// # }
    /// ```
    pub fn stats<C: StoreConnection>(&self, conn: &mut C) -> Result<Stats, Error> {
        backlog::stats(conn, &self.clock)
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
    {
        backlog::dead_letters(conn, limit)
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
    {
        backlog::requeue(conn, id)
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
    {
        purge_delivered(conn, &self.clock, self.retention, batch_size, &|| false)
    }
}

/// How a relay's pass hands a message over: a trait rather than an async
/// closure, so that the future of a pass on a diesel-async connection is
/// `Send` wherever its parts are (an async closure called by reference
/// hides that behind a lifetime the compiler cannot generalise).
pub(super) trait Deliver {
    /// The handler's error.
    type Error: HandlerError;

    /// Hands `message` over and waits for the outcome.
    fn deliver(&mut self, message: &Message) -> impl Future<Output = Result<(), Self::Error>>;
}

/// A synchronous handler, whose outcome is ready when it returns.
pub(super) struct Blocking<F>(pub(super) F);

impl<E, F> Deliver for Blocking<F>
where
    E: HandlerError,
    F: FnMut(&Message) -> Result<(), E>,
{
    type Error = E;

    fn deliver(&mut self, message: &Message) -> impl Future<Output = Result<(), E>> {
        std::future::ready((self.0)(message))
    }
}

/// Cuts `text` to at most `MAX_ERROR_LEN` bytes on a character boundary,
/// with every NUL replaced by U+FFFD: PostgreSQL's text refuses NUL, and a
/// handler's error text that the database refuses would leave its message
/// leased, and the rest of the batch with it, until the lease runs out.
fn storable_error(text: String) -> String {
    let mut text = if text.contains('\0') {
        text.replace('\0', "\u{fffd}")
    } else {
        text
    };
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
    fn backoff_never_falls_after_the_thirty_first_attempt() {
        let relay = Relay::default().backoff(Duration::milliseconds(1), Duration::minutes(15));
        let mut previous = relay.backoff_after(30);
        for attempt in [31, 32, 33, 64, u32::MAX] {
            let wait = relay.backoff_after(attempt);
            assert!(
                wait >= previous && wait <= Duration::minutes(15),
                "attempt {attempt}: {wait} after {previous}"
            );
            previous = wait;
        }
    }

    #[test]
    fn long_error_text_is_cut_on_a_character_boundary() {
        let text = "é".repeat(MAX_ERROR_LEN);
        let cut = storable_error(text);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() >= MAX_ERROR_LEN - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
