//! Batch jobs that survive a crash: every item runs as its own idempotent
//! call under a key derived from the job and the item, so a rerun of the same
//! job replays what finished and executes only what did not.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use diesel::connection::SimpleConnection;
//! use diesel::prelude::*;
//! use diesel::r2d2::{ConnectionManager, Pool};
//! use idempotency::batch::Runner;
//!
//! # let dir = tempfile::tempdir()?;
//! # let url = dir.path().join("jobs.db").to_str().ok_or("path is not utf-8")?.to_owned();
//! let pool = Pool::builder().max_size(2).build(ConnectionManager::<SqliteConnection>::new(&url))?;
//! let mut conn = pool.get()?;
//! // WAL, so that workers replaying finished items read beside the writer.
//! conn.batch_execute("PRAGMA journal_mode = WAL")?;
//! idempotency::run_migrations(&mut conn)?;
//! diesel::sql_query("CREATE TABLE invoices (customer BIGINT NOT NULL UNIQUE)").execute(&mut conn)?;
//! drop(conn);
//!
//! let runner = Runner::new(pool).workers(2).scope("invoicing");
//! let invoice = |tx: &mut SqliteConnection, customer: &i64| {
//!     diesel::sql_query("INSERT INTO invoices (customer) VALUES (?)")
//!         .bind::<diesel::sql_types::BigInt, _>(*customer)
//!         .execute(tx)
//! };
//!
//! // The first run stops after 40 customers (say the process was killed).
//! let first = runner.run("invoices-2026-11", 1..=40_i64, invoice)?;
//! assert_eq!((first.executed, first.replayed), (40, 0));
//!
//! // The rerun covers all 100: the first 40 replay, the rest execute.
//! let rerun = runner.run("invoices-2026-11", 1..=100_i64, invoice)?;
//! assert_eq!((rerun.executed, rerun.replayed), (60, 40));
//! assert!(rerun.failed.is_empty());
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::panic;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;

use diesel::r2d2::{ConnectionManager, Pool, PoolError, PooledConnection, R2D2Connection};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::StoreConnection;
use crate::config::Config;
use crate::error::{Error, KeyError};
use crate::key;
use crate::outcome::Outcome;

/// An item of a batch job: the request of its idempotent call, with an id
/// that stays the same from one run of the job to the next.
///
/// The item's key is [`key::derive`]`(&[job_id, &item.id()])`, and the item
/// itself is the request that key is bound to. An item whose content changed
/// since a run that processed it is therefore reported as
/// [`Error::Mismatch`] instead of being executed a second time.
///
/// Implemented for strings and integers, so a job can run over plain ids:
///
/// ```
/// use idempotency::batch::Item;
///
/// assert_eq!(42_i64.id(), "42");
/// assert_eq!("customer-7".id(), "customer-7");
/// ```
///
/// and for a type of your own:
///
/// ```
/// use idempotency::batch::Item;
/// use serde::Serialize;
///
/// #[derive(Serialize)]
/// struct Reminder { invoice: u64, email: String }
///
/// impl Item for Reminder {
///     fn id(&self) -> String {
///         self.invoice.to_string()
///     }
/// }
/// ```
pub trait Item: Serialize {
    /// The item's id, stable across runs and unique within the job.
    fn id(&self) -> String;
}

impl<T: Item + ?Sized> Item for &T {
    fn id(&self) -> String {
        (**self).id()
    }
}

impl Item for str {
    fn id(&self) -> String {
        self.to_owned()
    }
}

impl Item for String {
    fn id(&self) -> String {
        self.clone()
    }
}

macro_rules! integer_items {
    ($($t:ty)*) => {
        $(
            impl Item for $t {
                fn id(&self) -> String {
                    self.to_string()
                }
            }
        )*
    };
}

integer_items!(i32 i64 u32 u64 usize);

/// How far a run has got; passed to the [`Runner::on_progress`] callback
/// after every item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// Items finished so far, however they ended.
    pub processed: usize,
    /// Items whose operation ran and committed in this run.
    pub executed: usize,
    /// Items whose key had committed already (in an earlier run, or an
    /// earlier item of this run with the same id); their operation did not
    /// run.
    pub replayed: usize,
    /// Items that failed; nothing of theirs was committed.
    pub failed: usize,
    /// How many items there are, when the item iterator knows its length.
    pub total: Option<usize>,
}

/// An item that failed, and why. Nothing of it was committed; a rerun of the
/// job tries it again.
#[derive(Debug)]
#[non_exhaustive]
pub struct FailedItem<E> {
    /// The item's [`Item::id`].
    pub id: String,
    /// The error of its idempotent call; the operation's own error is
    /// [`Error::Operation`].
    pub error: Error<E>,
}

/// What a run did with every item.
#[derive(Debug)]
#[non_exhaustive]
pub struct Processed<E> {
    /// Items whose operation ran and committed in this run.
    pub executed: usize,
    /// Items whose key had committed already (in an earlier run, or an
    /// earlier item of this run with the same id); they were answered from
    /// storage.
    pub replayed: usize,
    /// Items that failed, in the order the items were given.
    pub failed: Vec<FailedItem<E>>,
}

impl<E> Processed<E> {
    /// How many items the run processed: executed, replayed and failed.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use diesel::r2d2::{ConnectionManager, Pool};
    /// # use diesel::SqliteConnection;
    /// # let dir = tempfile::tempdir()?;
    /// # let url = dir.path().join("jobs.db").to_str().ok_or("path is not utf-8")?.to_owned();
    /// # let pool = Pool::builder().max_size(1).build(ConnectionManager::<SqliteConnection>::new(&url))?;
    /// # idempotency::run_migrations(&mut pool.get()?)?;
    /// let runner = idempotency::batch::Runner::new(pool);
    /// let report = runner.run("job-1", ["a", "b", "c"], |_tx, item| {
    ///     if *item == "b" { Err("b is broken") } else { Ok(()) }
    /// })?;
    /// assert_eq!(report.total(), 3);
    /// assert_eq!(report.failed[0].id, "b");
    /// # Ok(())
    /// # }
    /// ```
    pub fn total(&self) -> usize {
        self.executed + self.replayed + self.failed.len()
    }
}

/// Why a run could not start. Failures of single items never end a run; they
/// are collected in [`Processed::failed`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use diesel::SqliteConnection;
/// use idempotency::batch::{RunError, Runner};
///
/// # let dir = tempfile::tempdir()?;
/// # let url = dir.path().join("jobs.db").to_str().ok_or("path is not utf-8")?.to_owned();
/// let pool = Pool::builder().max_size(1).build(ConnectionManager::<SqliteConnection>::new(&url))?;
/// let runner = Runner::new(pool).scope("billing run");
/// let refused = runner.run("job-1", [1_i64, 2, 3], |_tx, _item| Ok::<_, std::convert::Infallible>(()));
/// assert!(matches!(refused, Err(RunError::InvalidScope(_))));
/// assert_eq!(refused.unwrap_err().to_string(), "invalid batch scope: byte 7 is not visible ascii");
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// The runner's scope breaks the key rules; no item ran.
    InvalidScope(KeyError),
    /// No worker could check a connection out of the pool; no item ran.
    Pool(PoolError),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::InvalidScope(reason) => write!(f, "invalid batch scope: {reason}"),
            RunError::Pool(_) => f.write_str("no database connection for the batch job"),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // The reason is part of the message already.
            RunError::InvalidScope(_) => None,
            RunError::Pool(error) => Some(error),
        }
    }
}

type ProgressCallback = Box<dyn Fn(&Progress) + Send + Sync>;

/// Runs the items of a batch job over a connection pool, each item as its own
/// idempotent call, with a bounded number of worker threads.
///
/// | setting | default |
/// | --- | --- |
/// | [`workers`](Runner::workers) | 4, at most the pool's size |
/// | [`scope`](Runner::scope) | `"batch"` |
/// | [`config`](Runner::config) | [`Config::default()`] |
/// | [`on_progress`](Runner::on_progress) | none |
///
/// Each worker keeps one pooled connection for the whole run; when an item
/// fails and the connection no longer answers (a failover, a restarted
/// server), the worker gives it back, takes a fresh one from the pool and
/// runs the item once more, under the same key. An item for which the pool
/// has no connection within its timeout fails with a storage error, which
/// [`Error::is_retryable`] calls retryable. On SQLite all
/// workers write through the one database lock, so more than one worker
/// helps only when the operation spends time outside the database; enable
/// WAL (`PRAGMA journal_mode = WAL`) so that replays read while another
/// worker writes. On PostgreSQL and MySQL items run truly in parallel.
pub struct Runner<C: R2D2Connection + 'static> {
    pool: Pool<ConnectionManager<C>>,
    workers: usize,
    scope: String,
    config: Config,
    progress: Option<ProgressCallback>,
}

impl<C: R2D2Connection + 'static> fmt::Debug for Runner<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("workers", &self.workers)
            .field("scope", &self.scope)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The counters behind [`Progress`] and the failures of a run, updated under
/// one lock so that progress callbacks see every count once and in order.
struct Tally<E> {
    progress: Progress,
    failed: Vec<(usize, FailedItem<E>)>,
}

/// Tells the other workers to stop taking items when its worker unwinds.
struct StopOnPanic<'a>(&'a AtomicBool);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// The longest scope that the calls of a run accept on connections `C`.
fn scope_len_limit<C: StoreConnection>(config: &Config) -> usize {
    config.key_len_limit::<crate::backend::RulesOf<C::Raw>>()
}

impl<C> Runner<C>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
{
    /// A runner over `pool`, with the defaults in the table above.
    pub fn new(pool: Pool<ConnectionManager<C>>) -> Self {
        Runner {
            pool,
            workers: 4,
            scope: String::from("batch"),
            config: Config::default(),
            progress: None,
        }
    }

    /// How many items run at the same time, each on a connection of its own
    /// (default 4). Never more than the pool's `max_size`.
    ///
    /// # Panics
    ///
    /// If `workers` is zero.
    pub fn workers(mut self, workers: usize) -> Self {
        assert!(workers > 0, "workers must be positive");
        self.workers = workers;
        self
    }

    /// The scope of the items' keys (default `"batch"`). Keys are derived
    /// from the job id and the item id, so one scope serves many jobs.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// The policy of the items' idempotent calls (default
    /// [`Config::default()`]). Its retention bounds how long after a crash a
    /// rerun still replays.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use diesel::SqliteConnection;
    /// use idempotency::{batch::Runner, Config};
    ///
    /// # let dir = tempfile::tempdir()?;
    /// # let url = dir.path().join("jobs.db").to_str().ok_or("path is not utf-8")?.to_owned();
    /// # let pool = Pool::builder().max_size(1).build(ConnectionManager::<SqliteConnection>::new(&url))?;
    /// # idempotency::run_migrations(&mut pool.get()?)?;
    /// // A monthly job may be rerun weeks after a crash: keep its keys for 90 days.
    /// let runner = Runner::new(pool).config(Config::default().retention(Duration::days(90)));
    /// let report = runner.run("invoices-2026-11", 1..=3_i64, |_tx, _customer| Ok::<_, std::convert::Infallible>(()))?;
    /// assert_eq!(report.executed, 3);
    /// # Ok(())
    /// # }
    /// ```
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Calls `callback` after every item with the counts so far. Calls come
    /// from the worker threads one at a time, in the order of `processed`;
    /// keep the callback quick, since workers wait for it.
    pub fn on_progress(mut self, callback: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Box::new(callback));
        self
    }

    /// Runs `op` once for every item of the job `job_id` and reports what
    /// happened to each.
    ///
    /// Every item is an idempotent call in its own transaction, under the key
    /// [`key::derive`]`(&[job_id, &item.id()])` with the item as request. An
    /// item that an earlier run of the same `job_id` committed is replayed
    /// without calling `op`, so a rerun after a crash executes only the items
    /// that did not commit. Items are taken from `items` as workers become
    /// free, so the iterator may be long and lazy.
    ///
    /// An item that fails (`op` returns `Err`, its request mismatches an
    /// earlier run, the database refuses it) is rolled back, recorded in
    /// [`Processed::failed`] and does not stop the others; a later run with the
    /// same `job_id` tries it again.
    ///
    /// # Errors
    ///
    /// - [`RunError::InvalidScope`] when the scope breaks the key rules.
    /// - [`RunError::Pool`] when no worker could check out a connection.
    ///
    /// No item ran in either case.
    ///
    /// # Panics
    ///
    /// A panic in `op` rolls back its item, stops the workers from taking
    /// further items and resumes in the caller once they have finished the
    /// items in hand. Everything committed before stays committed, and a
    /// rerun continues from there.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use diesel::r2d2::{ConnectionManager, Pool};
    /// # use diesel::SqliteConnection;
    /// # let dir = tempfile::tempdir()?;
    /// # let url = dir.path().join("jobs.db").to_str().ok_or("path is not utf-8")?.to_owned();
    /// # let pool = Pool::builder().max_size(4).build(ConnectionManager::<SqliteConnection>::new(&url))?;
    /// # diesel::connection::SimpleConnection::batch_execute(&mut pool.get()?, "PRAGMA journal_mode = WAL")?;
    /// # idempotency::run_migrations(&mut pool.get()?)?;
    /// use idempotency::{batch::Runner, Error};
    ///
    /// let runner = Runner::new(pool).on_progress(|p| {
    ///     if p.processed % 50 == 0 {
    ///         eprintln!("{} of {:?} done", p.processed, p.total);
    ///     }
    /// });
    /// let report = runner.run("reminders-2026-11-29", 1..=200_u64, |_tx, invoice| {
    ///     if invoice % 100 == 0 { Err(format!("invoice {invoice} has no email")) } else { Ok(()) }
    /// })?;
    /// assert_eq!(report.executed, 198);
    /// let failed: Vec<&str> = report.failed.iter().map(|f| f.id.as_str()).collect();
    /// assert_eq!(failed, ["100", "200"]);
    /// assert!(matches!(&report.failed[0].error, Error::Operation(message) if message.contains("no email")));
    /// # Ok(())
    /// # }
    /// ```
    pub fn run<I, T, R, E, F>(&self, job_id: &str, items: I, op: F) -> Result<Processed<E>, RunError>
    where
        I: IntoIterator<Item = T>,
        I::IntoIter: Send,
        T: Item + Send,
        R: Serialize + DeserializeOwned,
        E: Send,
        F: Fn(&mut C, &T) -> Result<R, E> + Sync,
    {
        key::validate_scope(&self.scope, scope_len_limit::<C>(&self.config)).map_err(RunError::InvalidScope)?;
        let items = items.into_iter();
        let total = match items.size_hint() {
            (lower, Some(upper)) if lower == upper => Some(lower),
            _ => None,
        };
        let queue = Mutex::new(items.enumerate());
        let tally = Mutex::new(Tally {
            progress: Progress {
                processed: 0,
                executed: 0,
                replayed: 0,
                failed: 0,
                total,
            },
            failed: Vec::new(),
        });
        let stop = AtomicBool::new(false);
        let workers = self
            .workers
            .min(usize::try_from(self.pool.max_size()).unwrap_or(usize::MAX));

        let ends: Vec<thread::Result<Result<(), PoolError>>> = thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| scope.spawn(|| self.work(job_id, &queue, &tally, &stop, &op)))
                .collect();
            handles.into_iter().map(|handle| handle.join()).collect()
        });

        let mut pool_error = None;
        let mut any_worker_ran = false;
        for end in ends {
            match end {
                Err(payload) => panic::resume_unwind(payload),
                Ok(Err(error)) => pool_error = pool_error.or(Some(error)),
                Ok(Ok(())) => any_worker_ran = true,
            }
        }
        if let (false, Some(error)) = (any_worker_ran, pool_error) {
            return Err(RunError::Pool(error));
        }

        let tally = tally.into_inner().unwrap_or_else(PoisonError::into_inner);
        let mut failed = tally.failed;
        failed.sort_by_key(|(index, _)| *index);
        Ok(Processed {
            executed: tally.progress.executed,
            replayed: tally.progress.replayed,
            failed: failed.into_iter().map(|(_, failure)| failure).collect(),
        })
    }

    /// Runs `run` on the worker's connection, checking a fresh one out of
    /// the pool first when the worker gave its connection back. An item
    /// that gets none fails with a storage error (retryable: the next item
    /// tries the pool again).
    fn run_on<R, E>(
        &self,
        held: &mut Option<PooledConnection<ConnectionManager<C>>>,
        run: impl FnOnce(&mut C) -> Result<Outcome<R>, Error<E>>,
    ) -> Result<Outcome<R>, Error<E>> {
        let conn = match held {
            Some(conn) => conn,
            None => match self.pool.get() {
                Ok(fresh) => held.insert(fresh),
                Err(error) => {
                    return Err(Error::Storage(DieselError::DatabaseError(
                        DatabaseErrorKind::UnableToSendCommand,
                        Box::new(format!("no connection from the pool: {error}")),
                    )));
                }
            },
        };
        run(conn)
    }

    /// One worker: check out a connection, then take items until there are
    /// none left or another worker panicked.
    fn work<It, T, R, E, F>(
        &self,
        job_id: &str,
        queue: &Mutex<It>,
        tally: &Mutex<Tally<E>>,
        stop: &AtomicBool,
        op: &F,
    ) -> Result<(), PoolError>
    where
        It: Iterator<Item = (usize, T)>,
        T: Item,
        R: Serialize + DeserializeOwned,
        F: Fn(&mut C, &T) -> Result<R, E>,
    {
        let _stop_on_panic = StopOnPanic(stop);
        let mut held = Some(self.pool.get()?);
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // Taken alone, so the lock is not held while the item runs.
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            let Some((index, item)) = next else { return Ok(()) };
            let id = item.id();
            let key = key::derive(&[job_id, &id]);
            let run = |conn: &mut C| self.config.run(conn, &self.scope, &key, &item, |tx| op(tx, &item));
            let mut outcome = self.run_on(&mut held, run);
            if outcome.is_err() && held.as_mut().is_some_and(|conn| conn.ping().is_err()) {
                // The connection died under the item (a failover, a restarted
                // server), whether the crate's statements or the operation's
                // own met it: a fresh one from the pool, and the item once
                // more. The same key and request replay it if the lost
                // attempt committed. The dead one goes back first (the pool
                // discards it): with a connection per worker, the pool has
                // none to spare while it is held.
                held = None;
                outcome = self.run_on(&mut held, run);
            }

            let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
            match outcome {
                Ok(Outcome::Executed(_)) => tally.progress.executed += 1,
                Ok(Outcome::Replayed(_)) => tally.progress.replayed += 1,
                Err(error) => {
                    tally.progress.failed += 1;
                    tally.failed.push((index, FailedItem { id, error }));
                }
            }
            tally.progress.processed += 1;
            if let Some(callback) = &self.progress {
                callback(&tally.progress);
            }
        }
    }
}
