//! The relay on tokio: the same passes over a diesel-async connection, with
//! an async handler awaited in the relay's own task, and the service that
//! runs them on a bb8 or deadpool pool.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::{join, join_all};

use super::backlog::stats_of;
use super::error::Error;
use super::failure::{Failure, HandlerError};
use super::handler::{GIVEN_UP, failure_of, given_up, panicked};
use super::message::{Deliveries, Message};
use super::relay::{Deliver, Handed, Relay};
use super::retention::WRITE_LOCK_WAIT;
use super::workers::{CHECKOUT_WAIT, Leaving, STATS_EVERY};
use crate::backend::catch_unwind;
use crate::backend::outbox::{OutboxStore, Settlement};
use crate::clock::Reading;
use crate::service::{AsyncPass, AsyncPassError, ErrorBackoff, Next, Shutdown, Stopped, serve_async};
use crate::{AsyncConnectionPool, AsyncStoreConnection, telemetry};

/// How long the listener waits for an announcement before it looks again
/// whether the workers are still running.
const LISTEN_SLICE: Duration = Duration::from_millis(100);

impl Relay {
    /// [`run_once`](Relay::run_once) on a diesel-async connection, with an
    /// async handler: claims up to [`batch_size`](Relay::batch_size) due
    /// messages, awaits `handler` for each in enqueue order, and records
    /// each outcome as `run_once` does.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the claim or recording an outcome fails. The
    /// messages claimed and not yet settled stay leased and are delivered
    /// again after the lease.
    ///
    /// # Panics
    ///
    /// A panic in `handler` passes through, as in `run_once`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{self, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory_async();
    /// outbox::enqueue_async(&mut conn, "receipts", &42).await?;
    ///
    /// let (sender, mut received) = tokio::sync::mpsc::channel(8);
    /// let report = Relay::default()
    ///     .run_once_async(&mut conn, |message| {
    ///         let sender = sender.clone();
    ///         async move { sender.send(message.key).await }
    ///     })
    ///     .await?;
    /// assert_eq!(report.delivered, 1);
    /// assert!(received.recv().await.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run_once_async<C, E, F, H>(&self, conn: &mut C, handler: H) -> Result<Deliveries, Error>
    where
        C: AsyncStoreConnection,
        E: HandlerError,
        F: Future<Output = Result<(), E>>,
        H: FnMut(Message) -> F,
    {
        let mut report = Deliveries::default();
        let clock = self.clock.start(conn).await?;
        self.pass(conn, &clock, &mut Awaited(handler), &|| false, &mut report)
            .await?;
        Ok(report)
    }

    /// [`serve`](Relay::serve) on tokio: delivers messages from a bb8 or
    /// deadpool pool of diesel-async connections with an async `handler`
    /// until `shutdown` is triggered, and returns what it did. Await it in
    /// a task of its own (`tokio::spawn`).
    ///
    /// [`workers`](Relay::workers) run as concurrent loops of this future,
    /// each taking a connection from `pool` for a pass and giving it back
    /// while it sleeps; on a pool smaller than the workers they take turns.
    /// A worker claims as long as messages are due, then sleeps until the
    /// next one is due, at most a [`poll_interval`](Relay::poll_interval).
    /// On PostgreSQL a listener wakes them within milliseconds of an
    /// enqueue's commit: it keeps a connection of its own while the service
    /// runs, made by the pool's manager outside the pool, so it takes
    /// nothing from the workers. The notification only wakes them; polling
    /// is what guarantees delivery.
    ///
    /// Everything `serve` promises holds here, the same way: each message
    /// at least once, [ordering keys](super::Envelope::ordering_key) in
    /// order across any number of relays, backoff, dead letters after
    /// [`max_attempts`](Relay::max_attempts) or at once on a
    /// [permanent](super::Permanent) failure. A database error, or no
    /// connection from the pool within its timeout, never ends the
    /// service: it is reported, counted in [`Stopped::errors`], and the
    /// worker tries again after a pause that doubles from 100 ms up to
    /// 10 s.
    ///
    /// A handler's panic is a failed attempt of its message, with the text
    /// `the handler panicked: ` and the panic's message. A handler still
    /// running at three quarters of the [`lease`](Relay::lease), counted
    /// from the claim, is dropped there, which cancels it at its `await`:
    /// its attempt is recorded as failed (`the handler did not return
    /// within three quarters of the lease; the attempt was given up`) and
    /// the rest of its batch is given back, due at once. What the handler
    /// had already sent may have arrived: the consumer absorbs it by the
    /// message's [`key`](Message::key).
    ///
    /// When `shutdown` is triggered no new claim is made; a handler that is
    /// running finishes and its outcome is recorded, the rest of its batch
    /// is given back, due at once, and the future completes when every
    /// worker has stopped. Dropping the future instead cuts its handlers
    /// short at their `await`: their messages stay leased and are delivered
    /// again after the lease.
    ///
    /// With the `metrics` feature the first worker refreshes the backlog
    /// gauges every 10 seconds, as `serve` does.
    ///
    /// # Panics
    ///
    /// A panic outside the handler, such as in an injected
    /// [`clock`](Relay::clock), passes through and ends the service.
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::SqliteConnection;
    /// use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    /// use diesel_async::pooled_connection::bb8::Pool;
    /// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
    /// use idempotency::outbox::{self, Relay};
    /// use idempotency::Shutdown;
    ///
    /// # let db = idempotency::testing::SqliteFile::new();
    /// # let url = db.path().to_str().ok_or("path is not utf-8")?.to_owned();
    /// # idempotency::run_migrations(&mut <SqliteConnection as diesel::Connection>::establish(&url)?)?;
    /// let manager = AsyncDieselConnectionManager::<SyncConnectionWrapper<SqliteConnection>>::new(url);
    /// let pool = Pool::builder().max_size(2).build(manager).await?;
    /// let shutdown = Shutdown::new();
    /// let (delivered, mut received) = tokio::sync::mpsc::channel(8);
    ///
    /// let service = tokio::spawn({
    ///     let (pool, shutdown) = (pool.clone(), shutdown.clone());
    ///     async move {
    ///         let publish = |message: outbox::Message| {
    ///             let delivered = delivered.clone();
    ///             async move { delivered.send(message.topic).await }
    ///         };
    ///         Relay::default().serve_async(&pool, publish, &shutdown).await
    ///     }
    /// });
    /// outbox::enqueue_async(&mut *pool.get().await?, "receipts", &42).await?;
    /// assert_eq!(received.recv().await.as_deref(), Some("receipts"));
    ///
    /// shutdown.trigger();
    /// let stopped = service.await?;
    /// assert_eq!(stopped.work.delivered, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn serve_async<P, E, F, H>(&self, pool: &P, handler: H, shutdown: &Shutdown) -> Stopped<Deliveries>
    where
        P: AsyncConnectionPool,
        E: HandlerError,
        F: Future<Output = Result<(), E>> + Send,
        H: Fn(Message) -> F + Sync,
    {
        // The listener serves the workers: it stops with the last of them.
        let working = AtomicUsize::new(self.workers);
        let stopped = || shutdown.is_triggered() || working.load(Ordering::SeqCst) == 0;
        let (working_ref, handler) = (&working, &handler);
        let workers = (0..self.workers).map(|worker| async move {
            let _leaving = Leaving(working_ref);
            let patience = self.poll_interval.max(CHECKOUT_WAIT);
            let stop = || shutdown.is_triggered();
            let worker = Worker {
                relay: self,
                handler,
                shutdown,
                // The first worker keeps the backlog gauges current.
                stats_due: (worker == 0).then(Instant::now),
            };
            serve_async("relay", pool, shutdown, patience, &stop, worker).await
        });
        let listener = async {
            if <P::Connection as OutboxStore>::ANNOUNCES {
                listen(pool, shutdown, &stopped).await;
            }
        };
        let (stops, ()) = join(join_all(workers), listener).await;
        let mut total = Stopped::default();
        for stopped in stops {
            total += stopped;
        }
        total
    }
}

/// A worker of [`Relay::serve_async`]: its relay, the handler and the
/// service's signal.
struct Worker<'a, H> {
    relay: &'a Relay,
    handler: &'a H,
    shutdown: &'a Shutdown,
    /// When the worker that refreshes the backlog gauges does so next.
    stats_due: Option<Instant>,
}

impl<C, E, F, H> AsyncPass<C> for Worker<'_, H>
where
    C: OutboxStore,
    E: HandlerError,
    F: Future<Output = Result<(), E>> + Send,
    H: Fn(Message) -> F + Sync,
{
    type Work = Deliveries;

    /// Delivers one batch if a message is due, counted into `done`;
    /// otherwise says how long to sleep.
    async fn pass(&mut self, conn: &mut C, done: &mut Deliveries) -> Result<Next, AsyncPassError> {
        let relay = self.relay;
        if let Some(due) = &mut self.stats_due
            && Instant::now() >= *due
        {
            *due = Instant::now() + STATS_EVERY;
            stats_of(conn, &relay.clock).await?;
        }
        let clock = relay.clock.start(conn).await.map_err(Error::from)?;
        if let Some(sleep) = relay.sleep_until_due(clock.at(), conn.next_due().await.map_err(Error::from)?) {
            return Ok(sleep);
        }
        let gave_up = AtomicBool::new(false);
        let mut guarded = Guarded {
            handler: self.handler,
            give_up_at: relay
                .give_up_after()
                .and_then(|patience| tokio::time::Instant::now().checked_add(patience)),
            gave_up: &gave_up,
        };
        let shutdown = self.shutdown;
        let mut report = Deliveries::default();
        // After an attempt given up on, the rest of the batch is given
        // back, due at once, rather than reached after its lease.
        let stop = || shutdown.is_triggered() || gave_up.load(Ordering::SeqCst);
        let passed = match relay.in_flight {
            1 => relay.pass(conn, &clock, &mut guarded, &stop, &mut report).await,
            _ => relay.pass_in_flight(conn, &clock, &guarded, &stop, &mut report).await,
        };
        *done += report;
        passed?;
        Ok(relay.after_pass(&report))
    }
}

/// An async handler as [`Relay::run_once_async`] awaits it.
struct Awaited<H>(H);

impl<E, F, H> Deliver for Awaited<H>
where
    E: HandlerError,
    F: Future<Output = Result<(), E>>,
    H: FnMut(Message) -> F,
{
    type Error = E;

    async fn deliver(&mut self, message: &Message) -> Result<(), E> {
        (self.0)(message.clone()).await
    }
}

/// An async handler as [`Relay::serve_async`] awaits it: a panic as a
/// failure of its message, and given up on at `give_up_at`, where it is
/// dropped and `gave_up` set.
struct Guarded<'a, H> {
    handler: &'a H,
    give_up_at: Option<tokio::time::Instant>,
    gave_up: &'a AtomicBool,
}

impl<E, F, H> Guarded<'_, H>
where
    E: HandlerError,
    F: Future<Output = Result<(), E>> + Send,
    H: Fn(Message) -> F + Sync,
{
    /// The outcome of the handler's attempt at `message`.
    async fn handle(&self, message: &Message) -> Result<(), Failure> {
        match attempt((self.handler)(message.clone()), self.give_up_at).await {
            Some(outcome) => outcome,
            None => {
                given_up(message);
                self.gave_up.store(true, Ordering::SeqCst);
                Err(Failure::Retry(String::from(GIVEN_UP)))
            }
        }
    }
}

impl<E, F, H> Deliver for Guarded<'_, H>
where
    E: HandlerError,
    F: Future<Output = Result<(), E>> + Send,
    H: Fn(Message) -> F + Sync,
{
    type Error = Failure;

    async fn deliver(&mut self, message: &Message) -> Result<(), Failure> {
        self.handle(message).await
    }
}

impl Relay {
    /// [`pass`](Relay::pass) with up to [`in_flight`](Relay::in_flight)
    /// messages handed over at once: a window of the batch is handed to
    /// `handler` together, those delivered are marked in one statement and
    /// the others recorded one by one, before the next window is handed
    /// over.
    async fn pass_in_flight<C, E, F, H>(
        &self,
        conn: &mut C,
        clock: &Reading,
        handler: &Guarded<'_, H>,
        stop: &(dyn Fn() -> bool + Sync),
        report: &mut Deliveries,
    ) -> Result<(), Error>
    where
        C: OutboxStore,
        E: HandlerError,
        F: Future<Output = Result<(), E>> + Send,
        H: Fn(Message) -> F + Sync,
    {
        let (lease, claimed) = self.claim(conn, clock).await?;
        report.claimed += claimed.len();
        let mut rows = claimed.into_iter().peekable();
        while rows.peek().is_some() {
            if stop() {
                for row in rows.by_ref() {
                    self.release(conn, &row, &lease, report).await?;
                }
                break;
            }
            let mut window = Vec::new();
            for row in rows.by_ref().take(self.in_flight) {
                let (handed, attempts) = (Handed::of(&row), row.attempts);
                match self.prepare(row, clock, &lease) {
                    Ok(message) => window.push((handed, attempts, message)),
                    Err(ended) => self.record(conn, &handed, ended, &lease, report).await?,
                }
            }
            let outcomes = join_all(window.iter().map(|(_, _, message)| handler.handle(message))).await;
            let mut delivered = Vec::new();
            for ((handed, attempts, _), outcome) in window.into_iter().zip(outcomes) {
                match self.settlement(outcome, attempts, clock) {
                    Settlement::Delivered { .. } => delivered.push(handed),
                    failed => self.record(conn, &handed, Some(failed), &lease, report).await?,
                }
            }
            if !delivered.is_empty() {
                let ids: Vec<String> = delivered.iter().map(|handed| handed.id.clone()).collect();
                let at = clock.now();
                let marked = conn
                    .write(WRITE_LOCK_WAIT, async |tx: &mut C| {
                        tx.mark_delivered(&ids, &lease.token, at).await
                    })
                    .await?;
                report.delivered += marked;
                // Which lease was taken over, if any, the statement does
                // not say: each is reported where all were marked.
                if marked == delivered.len() {
                    for handed in &delivered {
                        handed.recorded(&Settlement::Delivered { at });
                    }
                } else {
                    report.lost += delivered.len() - marked;
                }
            }
        }
        Ok(())
    }
}

/// The outcome of one handler's attempt, with a panic as a failure of its
/// message; `None` when it did not return by `deadline`, where it is
/// dropped.
async fn attempt<E: HandlerError>(
    handled: impl Future<Output = Result<(), E>>,
    deadline: Option<tokio::time::Instant>,
) -> Option<Result<(), Failure>> {
    let caught = catch_unwind(handled);
    let outcome = match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, caught).await.ok()?,
        None => caught.await,
    };
    Some(match outcome {
        Ok(handled) => handled.map_err(failure_of),
        Err(payload) => Err(panicked(&*payload)),
    })
}

/// Listens for announced messages on a connection of its own and wakes
/// the workers, until `stopped`; connects again after a lost connection.
async fn listen<P: AsyncConnectionPool>(pool: &P, shutdown: &Shutdown, stopped: &(dyn Fn() -> bool + Sync)) {
    let mut backoff = ErrorBackoff::new();
    while !stopped() {
        let listened: Result<(), AsyncPassError> = async {
            let mut conn = pool.dedicated().await?;
            conn.listen().await?;
            backoff.succeeded();
            // Wakes once now: a message committed before LISTEN took
            // effect was announced to nobody.
            shutdown.wake();
            while !stopped() {
                if let Ok(announced) = tokio::time::timeout(LISTEN_SLICE, conn.announcement()).await {
                    announced?;
                    shutdown.wake();
                }
            }
            Ok(())
        }
        .await;
        if let Err(error) = listened {
            let wait = backoff.failed();
            telemetry::service_error("relay listener", &*error, wait);
            shutdown.paused(wait).await;
        }
    }
}
