//! The relay as a background service: workers that deliver while messages
//! are due and sleep while none are, and on PostgreSQL a listener that
//! wakes them when an enqueue commits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::Instant;

use chrono::NaiveDateTime;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use tracing::{Dispatch, Span};

use super::error::Error;
use super::failure::{Failure, HandlerError};
use super::handler::{Attempts, traced};
use super::message::{Deliveries, Message};
use super::relay::{Blocking, Relay};
use crate::backend::outbox::{BlockingOutboxStore, Due, OutboxStore};
use crate::backend::{StoreConnection, block_on};
use crate::service::{Next, Shutdown, Stopped, serve};
use crate::telemetry;

/// How long a service waits for a pooled connection before it looks at its
/// shutdown signal again.
pub(super) const CHECKOUT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a listening connection is asked for notifications. Asking
/// reads the socket without a round trip.
const LISTEN_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// How often the service's first worker refreshes the backlog gauges.
pub(super) const STATS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Delivers one batch if a message is due, counted into `done`;
/// otherwise says how long to sleep.
fn step<C, E, F>(
    relay: &Relay,
    conn: &mut C,
    attempts: &mut Attempts<'_, '_, F>,
    shutdown: &Shutdown,
    done: &mut Deliveries,
) -> Result<Next, Error>
where
    C: StoreConnection,
    E: HandlerError,
    F: Fn(&Message) -> Result<(), E> + Sync,
{
    if attempts.too_many_abandoned(relay.workers) {
        return Ok(Next::Sleep(relay.poll_interval));
    }
    let conn = conn.raw();
    let clock = block_on(relay.clock.start(conn))?;
    if let Some(sleep) = relay.sleep_until_due(clock.at(), block_on(conn.next_due())?) {
        return Ok(sleep);
    }
    let give_up_at = relay
        .give_up_after()
        .and_then(|patience| Instant::now().checked_add(patience));
    let gave_up = AtomicBool::new(false);
    let mut report = Deliveries::default();
    let passed = block_on(relay.pass(
        conn,
        &clock,
        &mut Blocking(|message: &Message| {
            attempts.hand_over(message, give_up_at).unwrap_or_else(|abandoned| {
                gave_up.store(true, Ordering::SeqCst);
                Err(Failure::Retry(abandoned))
            })
        }),
        // After an attempt given up on, the rest of the batch is given
        // back, due at once, rather than reached after its lease.
        &|| shutdown.is_triggered() || gave_up.load(Ordering::SeqCst),
        &mut report,
    ));
    *done += report;
    passed?;
    Ok(relay.after_pass(&report))
}

impl Relay {
    /// How long a worker sleeps before its next pass, given the time `now`
    /// and when the next message is `due`; `None` when one is due now.
    pub(super) fn sleep_until_due(&self, now: NaiveDateTime, due: Option<Due>) -> Option<Next> {
        match due {
            Some(Due::At(due)) if due > now => {
                let until_due = (due - now).to_std().unwrap_or_default();
                Some(Next::SleepOrWake(until_due.min(self.poll_interval)))
            }
            None => Some(Next::SleepOrWake(self.poll_interval)),
            Some(Due::Now | Due::At(_)) => None,
        }
    }

    /// How long after its claim a worker waits for a handler: three
    /// quarters of the lease, which runs from about the claim, so that the
    /// failure of an attempt given up on is recorded while the lease still
    /// holds, before another worker may claim the message again.
    pub(super) fn give_up_after(&self) -> Option<std::time::Duration> {
        self.lease.to_std().ok().map(|lease| lease.mul_f64(0.75))
    }

    /// What a worker does after a pass that claimed `report.claimed`.
    pub(super) fn after_pass(&self, report: &Deliveries) -> Next {
        if report.claimed == 0 {
            // Due, but another relay claimed it first.
            Next::SleepOrWake(self.poll_interval)
        } else {
            Next::Now
        }
    }
}

/// Listens for announced messages and wakes the workers, on backends
/// that announce them, until `stopped`; reconnects after a lost
/// connection.
fn listen<C>(pool: &Pool<ConnectionManager<C>>, shutdown: &Shutdown, stopped: &dyn Fn() -> bool)
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
{
    serve("relay listener", pool, shutdown, CHECKOUT_WAIT, stopped, |conn, ()| {
        Ok(match listen_on(&mut **conn, shutdown, stopped)? {
            true => Next::Now,
            false => Next::Stop,
        })
    });
}

/// Listens on `conn` and wakes the workers at every announcement until
/// `stopped`; `false` at once where the backend announces nothing.
fn listen_on<C: StoreConnection>(conn: &mut C, shutdown: &Shutdown, stopped: &dyn Fn() -> bool) -> Result<bool, Error> {
    let conn = conn.raw();
    if !announces::<C>() {
        return Ok(false);
    }
    block_on(conn.listen())?;
    // Wakes once now: a message committed before LISTEN took effect was
    // announced to nobody.
    shutdown.wake();
    while !stopped() {
        if conn.announced()? {
            shutdown.wake();
        }
        shutdown.pause(LISTEN_POLL);
    }
    block_on(conn.unlisten())?;
    Ok(true)
}

/// Counts a worker out when its thread ends, by return or by panic.
pub(super) struct Leaving<'a>(pub(super) &'a AtomicUsize);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether connections of type `C` announce new messages to listeners.
/// (Generic over any `StoreConnection`, where `C::Raw` stays a projection
/// whose bounds the compiler knows.)
fn announces<C: StoreConnection>() -> bool {
    <C::Raw as OutboxStore>::ANNOUNCES
}

impl Relay {
    /// Delivers messages until `shutdown` is triggered: the relay as a
    /// background service. Returns what it did.
    ///
    /// [`workers`](Relay::workers) threads each take a connection from
    /// `pool` while they work and give it back while they sleep. A worker
    /// claims as long as messages are due, then sleeps until the next one
    /// is due, at most a [`poll_interval`](Relay::poll_interval). On
    /// PostgreSQL a further pooled connection listens for the notification
    /// each enqueue sends when it commits, and wakes the workers within
    /// milliseconds; the notification only wakes them, polling is what
    /// guarantees delivery. Give the pool `workers + 1` connections: the
    /// listener keeps its own while the service runs, and on a smaller pool
    /// the relay does not listen (it says so in a `warn` event) and finds
    /// new messages by polling alone.
    ///
    /// A database error never ends the service: it is reported (a `tracing`
    /// event, counted in [`Stopped::errors`]), and the worker tries again
    /// after a pause that doubles from 100 ms up to 10 s, so it carries on by
    /// itself once the database is back. The service's threads send their
    /// `tracing` events where the calling thread sends its own: to its
    /// subscriber, inside its current span.
    ///
    /// When `shutdown` is triggered no new claim is made; a handler that is
    /// running finishes and its outcome is recorded, and the rest of its
    /// batch is given back, due at once for the next relay. `serve` returns
    /// when every worker has stopped.
    ///
    /// A panic in `handler` is a failed attempt of its message, as an `Err`
    /// is, with the text `the handler panicked: ` and the panic's message as
    /// its error: backed off, and parked as dead after
    /// [`max_attempts`](Relay::max_attempts), while the worker goes on with
    /// the next message. (The panic is still reported by the panic hook;
    /// with `panic = "abort"` it ends the process, and the message counts
    /// as an attempt cut short by a relay that died.)
    ///
    /// Each worker hands its messages to a handler thread of its own and
    /// waits for it at most three quarters of the [`lease`](Relay::lease),
    /// counted from the claim (the lease is never renewed). A handler still
    /// running then is given up on: its attempt is recorded as failed (the
    /// error text `the handler did not return within three quarters of the
    /// lease; the attempt was given up`), backed off and parked as dead
    /// after [`max_attempts`](Relay::max_attempts) like any other failure,
    /// the rest of its batch is given back, due at once, and the worker goes
    /// on with a new handler thread. A thread cannot be stopped from
    /// outside, so the one given up on runs on until its handler returns;
    /// what it returns then is dropped, and a message it did deliver late is
    /// delivered again, as at-least-once allows (the consumer absorbs it by
    /// the message's [`key`](Message::key)). While four such threads per
    /// worker are still running, the service claims nothing more until one
    /// of them has returned, and `serve` returns only once all of them have.
    /// So choose the lease longer than a whole batch takes, and bound the
    /// handler's own waits (a timeout on every call it makes).
    ///
    /// # Panics
    ///
    /// A panic outside the handler, such as in an injected
    /// [`clock`](Relay::clock), ends its worker's thread and resumes here
    /// once the other workers have stopped (trigger `shutdown` to stop
    /// them).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use std::sync::mpsc;
    /// use std::thread;
    ///
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use diesel::SqliteConnection;
    /// use idempotency::outbox::{self, Relay};
    /// use idempotency::Shutdown;
    ///
    /// # let db = idempotency::testing::SqliteFile::new();
    /// # let url = db.path().to_str().ok_or("path is not utf-8")?.to_owned();
    /// let pool = Pool::builder().max_size(2).build(ConnectionManager::<SqliteConnection>::new(url))?;
    /// let shutdown = Shutdown::new();
    /// let (delivered, received) = mpsc::channel();
    ///
    /// let service = {
    ///     let (pool, shutdown) = (pool.clone(), shutdown.clone());
    ///     thread::spawn(move || {
    ///         Relay::default().serve(&pool, |message| delivered.send(message.topic.clone()), &shutdown)
    ///     })
    /// };
    /// outbox::enqueue(&mut pool.get()?, "receipts", &42)?;
    /// assert_eq!(received.recv()?, "receipts");
    ///
    /// shutdown.trigger();
    /// let stopped = service.join().map_err(|_| "the relay panicked")?;
    /// assert_eq!(stopped.work.delivered, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn serve<C, E, F>(
        &self,
        pool: &Pool<ConnectionManager<C>>,
        handler: F,
        shutdown: &Shutdown,
    ) -> Stopped<Deliveries>
    where
        C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
        E: HandlerError,
        F: Fn(&Message) -> Result<(), E> + Sync,
    {
        // The service's threads report where the caller's thread does: to
        // its subscriber (also one set with `with_default`), inside its
        // current span.
        let dispatch = tracing::dispatcher::get_default(Dispatch::clone);
        let span = Span::current();
        // The listener keeps its connection while the service runs: on a
        // pool that cannot spare one besides the workers' it would take the
        // one they need, so there they find new messages by polling alone.
        let announces = announces::<C>();
        let listens = announces && pool.max_size() as usize > self.workers;
        if announces && !listens {
            telemetry::relay::not_listening(pool.max_size(), self.workers);
        }
        // The listener serves the workers: it stops with the last of them,
        // also when a panic ended them before `shutdown` was triggered.
        let working = AtomicUsize::new(self.workers);
        let stopped = || shutdown.is_triggered() || working.load(Ordering::SeqCst) == 0;
        // Handlers their workers gave up on, still running.
        let abandoned = AtomicUsize::new(0);
        let stops: Vec<thread::Result<Stopped<Deliveries>>> = thread::scope(|scope| {
            let work = |worker: usize| {
                let mut attempts = Attempts::new(scope, &handler, &dispatch, &span, &abandoned);
                let mut stats_due = Instant::now();
                let patience = self.poll_interval.max(CHECKOUT_WAIT);
                let stop = || shutdown.is_triggered();
                serve("relay", pool, shutdown, patience, &stop, |conn, done| {
                    let conn: &mut C = conn;
                    if worker == 0 && Instant::now() >= stats_due {
                        // Keeps the backlog gauges current for monitoring.
                        stats_due = Instant::now() + STATS_EVERY;
                        self.stats(conn)?;
                    }
                    Ok(step(self, conn, &mut attempts, shutdown, done)?)
                })
            };
            if listens {
                scope.spawn(|| traced(&dispatch, &span, || listen(pool, shutdown, &stopped)));
            }
            let workers: Vec<_> = (0..self.workers)
                .map(|worker| {
                    let (dispatch, span, working) = (&dispatch, &span, &working);
                    scope.spawn(move || {
                        let _leaving = Leaving(working);
                        traced(dispatch, span, || work(worker))
                    })
                })
                .collect();
            workers.into_iter().map(|worker| worker.join()).collect()
        });
        let mut total = Stopped::default();
        for stopped in stops {
            match stopped {
                Ok(stopped) => total += stopped,
                Err(payload) => std::panic::resume_unwind(payload),
            }
        }
        total
    }
}
