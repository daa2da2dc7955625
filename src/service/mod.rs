//! What every background service shares: the one loop they all run, the
//! [`Shutdown`] that stops them and the [`Stopped`] they return.
//!
//! [`Relay::serve`](crate::outbox::Relay::serve) delivers outbox messages,
//! [`Purger::serve`](crate::Purger::serve) deletes what is past its
//! retention and [`Completer::serve`](crate::phased::Completer::serve)
//! finishes abandoned phased operations. Each lives beside the feature it
//! serves and is a loop of passes, and the loop is written once here: take a pooled connection, waiting in slices so that a
//! [`Shutdown`] is seen at once; run a pass; sleep as the pass asks, or
//! until a wake; after an error, log its whole cause chain, count it, and
//! back off from 100 ms, doubling up to 10 s, so that the service carries on
//! by itself once the database is back. Every service returns what it did
//! as one shape, [`Stopped`].

mod shutdown;

use std::error::Error as StdError;
use std::fmt;
#[cfg(feature = "diesel-async")]
use std::future::Future;
use std::ops::AddAssign;
use std::time::{Duration, Instant};

use diesel::r2d2::{ManageConnection, Pool, PoolError, PooledConnection};

#[cfg(feature = "diesel-async")]
use crate::AsyncConnectionPool;

pub use shutdown::Shutdown;

use crate::telemetry;

/// What a background service did until it was stopped: its work, added up
/// over its passes, and the database errors it met and carried on after.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use diesel::SqliteConnection;
/// use idempotency::{Purger, Shutdown};
///
/// # let db = idempotency::testing::SqliteFile::new();
/// # let url = db.path().to_str().ok_or("path is not utf-8")?.to_owned();
/// let pool = Pool::builder().max_size(1).build(ConnectionManager::<SqliteConnection>::new(url))?;
/// let shutdown = Shutdown::new();
/// shutdown.trigger();
/// let stopped = Purger::default().serve(&pool, &shutdown);
/// assert_eq!((stopped.work.rounds, stopped.errors), (0, 0));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stopped<W> {
    /// What the service did, added up over its passes.
    pub work: W,
    /// Database errors the service met; it carried on after each.
    pub errors: usize,
}

impl<W: AddAssign> AddAssign for Stopped<W> {
    fn add_assign(&mut self, other: Stopped<W>) {
        self.work += other.work;
        self.errors += other.errors;
    }
}

/// What a service does after a pass that succeeded.
#[derive(Clone, Copy)]
pub(crate) enum Next {
    /// Another pass at once: there may be more to do.
    Now,
    /// Sleep this long before the next pass.
    Sleep(Duration),
    /// Sleep this long, or until a wake, before the next pass: for the
    /// relay, whose listener wakes it when a message is announced. Every
    /// service holding a clone of the relay's [`Shutdown`] sees those
    /// wakes, and only the relay has anything to do after one.
    SleepOrWake(Duration),
    /// Stop: there is nothing this service can do here.
    Stop,
}

/// The error of a service's pass, for the log.
pub(crate) type PassError = Box<dyn StdError>;

/// The pool had no connection for a service in time.
#[derive(Debug)]
struct NoConnection(Box<dyn StdError + Send + Sync>);

impl fmt::Display for NoConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no database connection")
    }
}

impl StdError for NoConnection {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.0)
    }
}

/// Runs service `name` until `stop` holds (it holds once `shutdown` is
/// triggered) or a pass says [`Next::Stop`]: each pass gets a connection
/// from `pool`, waited for up to `patience`, and adds what it does to the
/// work it is given.
pub(crate) fn serve<M, W>(
    name: &'static str,
    pool: &Pool<M>,
    shutdown: &Shutdown,
    patience: Duration,
    stop: &dyn Fn() -> bool,
    mut pass: impl FnMut(&mut PooledConnection<M>, &mut W) -> Result<Next, PassError>,
) -> Stopped<W>
where
    M: ManageConnection,
    W: Default,
{
    let mut stopped = Stopped {
        work: W::default(),
        errors: 0,
    };
    let mut backoff = ErrorBackoff::new();
    while !stop() {
        let wakes = shutdown.wakes();
        let next = match checkout(pool, shutdown, patience) {
            Ok(None) => break,
            Ok(Some(mut conn)) => pass(&mut conn, &mut stopped.work),
            Err(error) => Err(NoConnection(Box::new(error)).into()),
        };
        let passed = next.as_ref().map(|next| *next).map_err(|error| &**error);
        match next_after(name, passed, &mut backoff, &mut stopped.errors) {
            Next::Now => {}
            Next::Sleep(wait) => {
                shutdown.pause(wait);
            }
            Next::SleepOrWake(wait) => shutdown.wait_for_wake(wakes, wait),
            Next::Stop => break,
        }
    }
    stopped
}

/// How long one wait for a pooled connection lasts before a service looks at
/// its shutdown signal again.
const CHECKOUT_SLICE: Duration = Duration::from_millis(100);

/// A connection from `pool`, waited for up to `patience`, or `None` once
/// `shutdown` is triggered: r2d2's wait cannot be cut short, so a service
/// waits in slices, and a database that is down, or a pool drained by
/// others, does not hold up its stop.
///
/// # Errors
///
/// The pool's error when `patience` runs out.
fn checkout<M: ManageConnection>(
    pool: &Pool<M>,
    shutdown: &Shutdown,
    patience: Duration,
) -> Result<Option<PooledConnection<M>>, PoolError> {
    let deadline = Instant::now() + patience;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match pool.get_timeout(left.min(CHECKOUT_SLICE)) {
            Ok(conn) => return Ok(Some(conn)),
            Err(_) if shutdown.is_triggered() => return Ok(None),
            Err(error) if left <= CHECKOUT_SLICE => return Err(error),
            Err(_) => {}
        }
    }
}

/// The error of an async service's pass, for the log.
#[cfg(feature = "diesel-async")]
pub(crate) type AsyncPassError = Box<dyn StdError + Send + Sync>;

/// An async service's pass on a connection `C`: a trait rather than an
/// async closure, so that the service's future is `Send` wherever its
/// parts are (an async closure called by reference hides that behind a
/// lifetime the compiler cannot generalise).
#[cfg(feature = "diesel-async")]
pub(crate) trait AsyncPass<C> {
    /// What the passes add up to.
    type Work: Default;

    /// One pass on `conn`, adding what it does to `work`.
    fn pass(&mut self, conn: &mut C, work: &mut Self::Work) -> impl Future<Output = Result<Next, AsyncPassError>>;
}

/// [`serve`] for a task: each pass gets a connection from an async `pool`
/// (waiting up to `patience`, or until `shutdown`), and every wait is
/// awaited, never blocking a thread of the runtime.
#[cfg(feature = "diesel-async")]
pub(crate) async fn serve_async<P, S>(
    name: &'static str,
    pool: &P,
    shutdown: &Shutdown,
    patience: Duration,
    stop: &(dyn Fn() -> bool + Sync),
    mut service: S,
) -> Stopped<S::Work>
where
    P: AsyncConnectionPool,
    S: AsyncPass<P::Connection>,
{
    use futures_util::future::{Either, select};

    let mut stopped = Stopped {
        work: S::Work::default(),
        errors: 0,
    };
    let mut backoff = ErrorBackoff::new();
    while !stop() {
        let wakes = shutdown.wakes();
        let lent = match select(std::pin::pin!(pool.lend()), std::pin::pin!(shutdown.paused(patience))).await {
            Either::Left((lent, _)) => lent,
            Either::Right((true, _)) => break,
            Either::Right((false, _)) => Err(format!("none within {} ms", patience.as_millis()).into()),
        };
        let next = match lent {
            Ok(mut conn) => service.pass(&mut *conn, &mut stopped.work).await,
            Err(error) => Err(Box::new(NoConnection(error)) as AsyncPassError),
        };
        let passed = next
            .as_ref()
            .map(|next| *next)
            .map_err(|error| &**error as &(dyn StdError + 'static));
        match next_after(name, passed, &mut backoff, &mut stopped.errors) {
            Next::Now => {}
            Next::Sleep(wait) => {
                shutdown.paused(wait).await;
            }
            Next::SleepOrWake(wait) => shutdown.woken_for(wakes, wait).await,
            Next::Stop => break,
        }
    }
    stopped
}

/// What a service does after a pass that `passed`: as the pass says; after
/// an error, which is reported and counted into `errors`, a sleep as long
/// as `backoff` says.
fn next_after(
    name: &'static str,
    passed: Result<Next, &(dyn StdError + 'static)>,
    backoff: &mut ErrorBackoff,
    errors: &mut usize,
) -> Next {
    match passed {
        Ok(next) => {
            backoff.succeeded();
            next
        }
        Err(error) => {
            *errors += 1;
            let wait = backoff.failed();
            telemetry::service_error(name, error, wait);
            Next::Sleep(wait)
        }
    }
}

/// How long a service waits after a database error before it tries again:
/// short at first, doubling up to a cap, back to short after a success.
pub(crate) struct ErrorBackoff {
    next: Duration,
}

impl ErrorBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(10);

    pub(crate) fn new() -> Self {
        ErrorBackoff { next: Self::FIRST }
    }

    /// The wait after one more error in a row.
    pub(crate) fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        wait
    }

    pub(crate) fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }
}
