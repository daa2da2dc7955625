//! The completer: finishes phased operations whose clients went away.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::AddAssign;
use std::panic::{self, AssertUnwindSafe};

use chrono::{DateTime, Duration, Utc};
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use serde::de::DeserializeOwned;

use super::attempt::without_unfinished_call;
use crate::backend::phases::{ParkedRow, PickedRow};
use crate::backend::{RawConnection, StoreConnection, block_on, transaction_depth, unwind_to_depth};
use crate::clock::{Clock, assert_duration};
use crate::error::Error;
use crate::in_flight::InFlight;
use crate::outcome::Outcome;
use crate::row_status::OperationStatus;
use crate::service::{Next, Shutdown, Stopped, serve};
use crate::telemetry;

/// How long other completers pass over an operation one has picked, unless
/// the attempt it makes fails sooner and frees it.
const PICK_HOLD: Duration = Duration::minutes(5);

/// How long the completer's own writes wait for SQLite's write lock.
const WRITE_LOCK_WAIT: InFlight = InFlight::Wait(Duration::seconds(5));

/// How a resumed operation ended, whatever its types.
enum Resumed {
    Completed,
    /// A client's retry holds it: left alone.
    OperationHold,
    Parked,
    Failed,
}

type Resume<C> = Box<dyn Fn(&mut C, &str, &str, &str) -> Result<Resumed, String> + Send + Sync>;

/// Runs `resume` on the picked operation `row`, with a panic as a failed
/// attempt: the operation's own run freed its lease with the attempt
/// counted, so it is tried again after the grace period and parked after
/// its last attempt, and the pass goes on to the operations picked with it
/// instead of leaving them to their pick hold.
///
/// # Errors
///
/// When the transactions the panic left open on `conn` (opened by the
/// registered function around its run) cannot be rolled back.
fn resume_catching_panic<C: RawConnection>(
    resume: &Resume<C>,
    conn: &mut C,
    row: &PickedRow,
) -> Result<Result<Resumed, String>, Error> {
    let depth = transaction_depth(conn)?;
    match panic::catch_unwind(AssertUnwindSafe(|| {
        resume(conn, &row.scope, &row.idempotency_key, &row.request)
    })) {
        Ok(resumed) => Ok(resumed),
        Err(_) => {
            unwind_to_depth(conn, depth)?;
            tracing::warn!(target: telemetry::TARGET, scope = %row.scope, key = %row.idempotency_key, "resumed operation panicked; counted as a failed attempt");
            Ok(Ok(Resumed::Failed))
        }
    }
}

/// Finishes [phased operations](super) whose clients went away, and parks
/// those it cannot: the crate's equivalent of a background job that
/// retries on the client's behalf. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`operation`](Completer::operation) | none: register every operation it may finish |
/// | [`grace`](Completer::grace) | 5 minutes idle before an operation counts as abandoned |
/// | [`max_attempts`](Completer::max_attempts) | 5 attempts, then parked |
/// | [`batch_size`](Completer::batch_size) | 10 operations per pass |
/// | [`poll_interval`](Completer::poll_interval) | 30 seconds between passes of [`serve`](Completer::serve) |
/// | [`clock`](Completer::clock) | the database's clock |
///
/// An operation is abandoned when it is running, no attempt holds its
/// lease, and nothing was committed for it during the grace period. The
/// completer runs the registered function on the stored request (so the
/// operation needs [`store_requests`](super::Phased::store_requests)),
/// which resumes it like a client's retry would: a completer and a client
/// racing for one operation finish it once, through its lease. Completers
/// on several machines pick each operation once: a pick is an update
/// guarded by the operation still being abandoned.
///
/// `C` is the diesel connection the registered functions take, such as
/// `PgConnection`. The completer is a thread over such connections; the
/// function registered for an operation with async steps drives
/// `Phased::run_async` on the application's runtime, with an async
/// connection of its own (the [async guide](crate::guide::asynchronous)
/// shows one).
pub struct Completer<C> {
    operations: BTreeMap<String, Resume<C>>,
    grace: Duration,
    max_attempts: u32,
    batch_size: usize,
    poll_interval: std::time::Duration,
    clock: Clock,
}

impl<C> fmt::Debug for Completer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("operations", &self.operations.keys().collect::<Vec<_>>())
            .field("grace", &self.grace)
            .field("max_attempts", &self.max_attempts)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

impl<C> Default for Completer<C> {
    fn default() -> Self {
        Completer {
            operations: BTreeMap::new(),
            grace: Duration::minutes(5),
            max_attempts: 5,
            batch_size: 10,
            poll_interval: std::time::Duration::from_secs(30),
            clock: Clock::Database,
        }
    }
}

/// What a completer did: one [`Completer::run_once`], or all of them added
/// up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completions {
    /// Abandoned operations picked.
    pub picked: usize,
    /// Operations the completer finished.
    pub completed: usize,
    /// Picked operations whose attempt failed; tried again after the grace
    /// period, until their maximum of attempts.
    pub failed: usize,
    /// Picked operations a client's retry finished or had taken over
    /// meanwhile, or that another writer kept this completer out of.
    pub skipped: usize,
    /// Operations parked: out of attempts, with a stored request that no
    /// longer decodes, or parked by their own attempt.
    pub parked: usize,
}

impl AddAssign for Completions {
    fn add_assign(&mut self, other: Completions) {
        self.picked += other.picked;
        self.completed += other.completed;
        self.failed += other.failed;
        self.skipped += other.skipped;
        self.parked += other.parked;
    }
}

/// A parked operation, waiting for a person, as
/// [`Completer::parked`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Parked {
    /// The operation's scope.
    pub scope: String,
    /// Its idempotency key.
    pub key: String,
    /// The [`Phased`](super::Phased) name.
    pub operation: String,
    /// Attempts made.
    pub attempts: u32,
    /// Why it was parked, or why its last attempt failed.
    pub reason: Option<String>,
    /// When its first commit was made (UTC).
    pub created_at: DateTime<Utc>,
    /// When it was parked (UTC).
    pub parked_at: DateTime<Utc>,
}

impl From<ParkedRow> for Parked {
    fn from(row: ParkedRow) -> Self {
        Parked {
            scope: row.scope,
            key: row.idempotency_key,
            operation: row.operation,
            attempts: u32::try_from(row.attempts).unwrap_or(0),
            reason: row.last_error,
            created_at: row.created_at.and_utc(),
            parked_at: row.updated_at.and_utc(),
        }
    }
}

impl<C> Completer<C>
where
    C: RawConnection + 'static,
{
    /// A completer with no operations and the defaults in the table above.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `finish` as the way to resume the operations named `name`:
    /// called with a connection, the operation's scope and key, and its
    /// stored request decoded into `Q`. It should make the same call the
    /// client's handler makes (`Phased::new(name).run(conn, scope, key,
    /// &request, ..)`) and return its outcome: a replay means a client
    /// finished the operation first.
    pub fn operation<Q, T, E, F>(mut self, name: impl Into<String>, finish: F) -> Self
    where
        Q: DeserializeOwned,
        F: Fn(&mut C, &str, &str, Q) -> Result<Outcome<T>, Error<E>> + Send + Sync + 'static,
    {
        let resume = move |conn: &mut C, scope: &str, key: &str, request: &str| {
            let request: Q = serde_json::from_str(request)
                .map_err(|error| format!("the stored request does not decode ({:?})", error.classify()))?;
            Ok(match finish(conn, scope, key, request) {
                Ok(Outcome::Executed(_)) => Resumed::Completed,
                Ok(Outcome::Replayed(_)) => Resumed::OperationHold,
                Err(Error::InProgress) => Resumed::OperationHold,
                Err(Error::Parked) => Resumed::Parked,
                Err(_) => Resumed::Failed,
            })
        };
        self.operations.insert(name.into(), Box::new(resume));
        self
    }

    /// How long an operation must have been idle, with its lease free,
    /// before the completer takes it up (default 5 minutes): clients that
    /// retry by themselves get there first.
    ///
    /// # Panics
    ///
    /// If `grace` is not positive or longer than 100 years.
    pub fn grace(mut self, grace: Duration) -> Self {
        assert_duration(grace, "grace");
        self.grace = grace;
        self
    }

    /// After how many attempts (the client's and the completer's) an
    /// operation is parked instead of tried again (default 5).
    ///
    /// # Panics
    ///
    /// If `max_attempts` is zero.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        assert!(max_attempts > 0, "max_attempts must be positive");
        self.max_attempts = max_attempts;
        self
    }

    /// How many operations one pass picks at most (default 10).
    ///
    /// # Panics
    ///
    /// If `batch_size` is zero.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        self.batch_size = batch_size;
        self
    }

    /// The pause between passes of [`serve`](Completer::serve) (default 30
    /// seconds).
    ///
    /// # Panics
    ///
    /// If `poll_interval` is not positive or longer than 100 years.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        assert_duration(poll_interval, "poll_interval");
        self.poll_interval = poll_interval.to_std().unwrap_or_default();
        self
    }

    /// The time source for the grace period (default: the database's
    /// clock). Tests inject a [`ManualClock`](crate::testing::ManualClock);
    /// give the operations' [`Config`](crate::Config) the same one.
    pub fn clock(mut self, clock: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.clock = Clock::injected(clock);
        self
    }

    /// One pass: parks the registered operations that are out of attempts,
    /// then picks up to [`batch_size`](Completer::batch_size) abandoned ones
    /// and resumes each.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when parking or picking fails. A resumed
    /// operation's own failure is counted in [`Completions::failed`], not
    /// returned.
    ///
    /// A panic in a registered operation is a failed attempt of that
    /// operation (counted in [`Completions::failed`]), and the pass goes on
    /// to the others: its run freed the lease and counted the attempt, so
    /// it is tried again after the grace period and parked after
    /// [`max_attempts`](Completer::max_attempts). Transactions the
    /// registered function opened around the run and left open are rolled
    /// back.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use diesel::SqliteConnection;
    /// use idempotency::phased::{Completer, Phased};
    /// use idempotency::{testing::ManualClock, Config, Error};
    ///
    /// let clock = ManualClock::new();
    /// let config = Config::default().clock(clock.source());
    /// let phased = Phased::new("greet").config(config).store_requests(true);
    /// let greet = move |conn: &mut SqliteConnection, scope: &str, key: &str, name: String, fail: bool| {
    ///     phased.run(conn, scope, key, &name, |s| {
    ///         let greeting = s.phase("greeting", |_| Ok::<_, String>(format!("hello {name}")))?;
    ///         if fail {
    ///             return Err(Error::Operation(String::from("the client went away")));
    ///         }
    ///         s.finish(|_| Ok::<_, String>(greeting))
    ///     })
    /// };
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// assert!(greet(&mut conn, "shop", "greet-1", "ada".into(), true).is_err());
    ///
    /// let completer = Completer::new()
    ///     .clock(clock.source())
    ///     .operation("greet", move |conn, scope, key, name: String| greet(conn, scope, key, name, false));
    /// assert_eq!(completer.run_once(&mut conn)?.picked, 0, "within the grace period");
    /// clock.advance(Duration::minutes(5));
    /// assert_eq!(completer.run_once(&mut conn)?.completed, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn run_once<S>(&self, conn: &mut S) -> Result<Completions, Error>
    where
        S: StoreConnection<Raw = C>,
    {
        let conn = conn.raw();
        let names: Vec<&str> = self.operations.keys().map(String::as_str).collect();
        let now = self.clock.now(conn)?;
        let idle_since = now - self.grace;
        let max_attempts = i32::try_from(self.max_attempts).unwrap_or(i32::MAX);
        let mut report = Completions {
            parked: conn.write_now(WRITE_LOCK_WAIT, |tx| {
                tx.park_exhausted(&names, max_attempts, now, idle_since)
            })?,
            ..Completions::default()
        };
        if report.parked > 0 {
            tracing::warn!(target: telemetry::TARGET, count = report.parked, "operations parked after their last attempt");
        }
        let picked = conn.write_now(WRITE_LOCK_WAIT, |tx| {
            tx.pick_abandoned(&names, now, idle_since, now + PICK_HOLD, self.batch_size)
        })?;
        report.picked = picked.len();
        for row in picked {
            let resumed = match self.operations.get(&row.operation) {
                Some(resume) => resume_catching_panic(resume, conn, &row)?,
                None => Err(String::from("no function registered for the operation")),
            };
            match resumed {
                Ok(Resumed::Completed) => report.completed += 1,
                Ok(Resumed::OperationHold) => report.skipped += 1,
                Ok(Resumed::Parked) => report.parked += 1,
                Ok(Resumed::Failed) => report.failed += 1,
                Err(reason) => {
                    let now = self.clock.now(conn)?;
                    if conn.write_now(WRITE_LOCK_WAIT, |tx| {
                        tx.park_unheld(&row.scope, &row.idempotency_key, &reason, now)
                    })? {
                        tracing::warn!(target: telemetry::TARGET, scope = %row.scope, key_digest = %telemetry::key_digest(&row.idempotency_key), %reason, "operation parked");
                        report.parked += 1;
                    }
                }
            }
        }
        Ok(report)
    }

    /// Passes until `shutdown` is triggered, one every
    /// [`poll_interval`](Completer::poll_interval) (at once again after a
    /// full batch): the completer as a background service. A database
    /// error is reported and counted in [`Stopped::errors`], and the
    /// completer carries on after a pause that doubles from 100 ms up to
    /// 10 s. An operation being resumed when `shutdown` is triggered
    /// finishes first; a wait for a pooled connection ends at once. A panic
    /// in a registered operation is a failed attempt of that operation, as
    /// in [`run_once`](Completer::run_once), and the service goes on.
    pub fn serve(&self, pool: &Pool<ConnectionManager<C>>, shutdown: &Shutdown) -> Stopped<Completions>
    where
        C: R2D2Connection + Send,
    {
        let stop = || shutdown.is_triggered();
        serve(
            "completer",
            pool,
            shutdown,
            pool.connection_timeout(),
            &stop,
            |conn, done| {
                let pass = self.run_once(&mut **conn)?;
                *done += pass;
                Ok(match pass.picked < self.batch_size {
                    true => Next::Sleep(self.poll_interval),
                    false => Next::Now,
                })
            },
        )
    }

    /// Up to `limit` parked operations, oldest first: what waits for a
    /// person.
    ///
    /// An operator's tool: it lists the parked operations of every scope
    /// (their scopes, keys, names and why they were parked), never a stored
    /// response or request. Serve it to the service's operators, never on
    /// a route of the clients, whose lookups answer only their own calls.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the query fails.
    pub fn parked<S>(&self, conn: &mut S, limit: usize) -> Result<Vec<Parked>, Error>
    where
        S: StoreConnection<Raw = C>,
    {
        let rows = conn.raw().parked_operations(limit)?;
        Ok(rows.into_iter().map(Parked::from).collect())
    }

    /// Makes a parked operation running again with fresh attempts, for its
    /// client's next retry or the next pass of a completer; returns `false`
    /// when `(scope, key)` names no parked operation. Requeue only once the
    /// reason it was parked is dealt with: a call that was interrupted (past
    /// its provider horizon, or made [at most
    /// once](super::Steps::call_at_most_once)) will be made again as if for
    /// the first time, with the same provider key and a horizon that starts
    /// anew.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the update fails, [`Error::Codec`] when the
    /// stored recovery points do not read back.
    pub fn requeue<S>(&self, conn: &mut S, scope: &str, key: &str) -> Result<bool, Error>
    where
        S: StoreConnection<Raw = C>,
    {
        let conn = conn.raw();
        let now = self.clock.now(conn)?;
        block_on(conn.write(WRITE_LOCK_WAIT, async |tx: &mut C| {
            let Some(row) = tx
                .read_operation(scope, key)
                .await?
                .0
                .filter(|row| row.status == OperationStatus::Parked)
            else {
                return Ok(false);
            };
            let points = without_unfinished_call(&row.points).map_err(Error::Codec)?;
            Ok(tx.requeue_operation(scope, key, &points, now)?)
        }))
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use diesel::SqliteConnection;

    use super::*;
    use crate::testing::{ManualClock, sqlite_memory};
    use crate::{Config, phased::Phased};

    /// A registered operation that panics is a failed attempt of that
    /// operation: the pass goes on to the others, and once the operation is
    /// out of attempts it is parked.
    #[test]
    fn panicking_operation_is_a_failed_attempt_and_the_pass_goes_on() {
        let clock = ManualClock::new();
        let config = Config::default().clock(clock.source());
        let mut conn = sqlite_memory();
        for (name, key) in [("explode", "a"), ("greet", "b")] {
            let phased = Phased::new(name).config(config.clone()).store_requests(true);
            let abandoned = phased.run(&mut conn, "shop", key, &"ada", |s| {
                s.phase("first", |_| Ok::<_, String>(()))?;
                Err::<crate::phased::Finished<()>, _>(Error::Operation(String::from("the client went away")))
            });
            assert!(matches!(abandoned, Err(Error::Operation(_))), "{abandoned:?}");
        }
        let explode = Phased::new("explode").config(config.clone()).store_requests(true);
        let greet = Phased::new("greet").config(config).store_requests(true);
        let completer = Completer::new()
            .clock(clock.source())
            .max_attempts(2)
            .operation(
                "explode",
                move |conn: &mut SqliteConnection, scope, key, name: String| {
                    explode.run(
                        conn,
                        scope,
                        key,
                        &name,
                        |_| -> Result<crate::phased::Finished<()>, Error> { panic!("a bug in the operation") },
                    )
                },
            )
            .operation("greet", move |conn, scope, key, name: String| {
                greet.run(conn, scope, key, &name, |s| s.finish(|_| Ok::<_, String>(())))
            });

        clock.advance(Duration::minutes(5));
        let report = completer.run_once(&mut conn).expect("a pass");
        assert_eq!(
            (report.picked, report.completed, report.failed),
            (2, 1, 1),
            "{report:?}"
        );

        clock.advance(Duration::minutes(5));
        assert_eq!(
            completer.run_once(&mut conn).expect("a pass").parked,
            1,
            "out of attempts"
        );
        let parked = completer.parked(&mut conn, 10).expect("parked");
        assert_eq!(
            parked.iter().map(|p| p.operation.as_str()).collect::<Vec<_>>(),
            ["explode"]
        );
    }
}
