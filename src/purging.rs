//! Purging as a service: the [`Purger`] runs
//! [`Config::purge_expired`] and
//! [`Relay::purge_delivered`](crate::outbox::Relay::purge_delivered) on a
//! schedule, so that retention takes care of itself.

use std::ops::AddAssign;

use chrono::Duration;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};

use crate::backend::StoreConnection;
use crate::clock::assert_duration;
use crate::config::Config;
use crate::outbox;
use crate::service::{Next, Shutdown, Stopped, serve};

/// Deletes expired key records, completed phased operations past their
/// retention and delivered outbox messages in the background until
/// stopped (under a policy that keeps [tombstones](Config::tombstones),
/// it turns expired key records and completed phased operations into
/// tombstones and deletes them once their grace period has ended), so that a service starts it once at boot and
/// never thinks about retention again. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`interval`](Purger::interval) | 1 minute between rounds |
/// | [`batch_size`](Purger::batch_size) | 1,000 rows per statement |
/// | [`config`](Purger::config) | [`Config::default()`]: its clock decides what has expired |
/// | [`message_retention`](Purger::message_retention) | 7 days for delivered outbox messages, as [`Relay::retention`](crate::outbox::Relay::retention) |
///
/// Each round is [`Config::purge_expired`] (key records and completed
/// [phased operations](crate::phased)) and then
/// [`Relay::purge_delivered`](crate::outbox::Relay::purge_delivered), in batches that are short transactions of
/// their own, so it runs beside live traffic. Running and parked phased
/// operations are never purged. For a cron job, call those two directly.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::thread;
///
/// use chrono::Duration;
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use diesel::SqliteConnection;
/// use idempotency::{Purger, Shutdown};
///
/// # let db = idempotency::testing::SqliteFile::new();
/// # let url = db.path().to_str().ok_or("path is not utf-8")?.to_owned();
/// let pool = Pool::builder().max_size(2).build(ConnectionManager::<SqliteConnection>::new(url))?;
/// let shutdown = Shutdown::new();
/// let purger = {
///     let (pool, shutdown) = (pool.clone(), shutdown.clone());
///     thread::spawn(move || Purger::default().interval(Duration::minutes(5)).serve(&pool, &shutdown))
/// };
/// // ... the service runs ...
/// shutdown.trigger();
/// let stopped = purger.join().map_err(|_| "the purger panicked")?;
/// assert_eq!(stopped.errors, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Purger {
    interval: std::time::Duration,
    batch_size: usize,
    config: Config,
    message_retention: Duration,
}

impl Default for Purger {
    fn default() -> Self {
        Purger {
            interval: std::time::Duration::from_secs(60),
            batch_size: 1_000,
            config: Config::default(),
            message_retention: outbox::DEFAULT_RETENTION,
        }
    }
}

/// What a [`Purger`] deleted until it was stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Purged {
    /// Rounds completed.
    pub rounds: usize,
    /// Expired key records and completed phased operations deleted.
    pub keys: usize,
    /// Expired key records and completed phased operations turned into
    /// tombstones (their responses cleared), where the [`config`](Purger::config) keeps
    /// [tombstones](Config::tombstones); each is counted in
    /// [`keys`](Purged::keys) as well once its grace period ends and it is
    /// deleted.
    pub tombstoned: usize,
    /// Delivered outbox messages deleted.
    pub messages: usize,
}

impl AddAssign for Purged {
    fn add_assign(&mut self, other: Purged) {
        self.rounds += other.rounds;
        self.keys += other.keys;
        self.tombstoned += other.tombstoned;
        self.messages += other.messages;
    }
}

impl Purger {
    /// The pause between two rounds (default 1 minute).
    ///
    /// # Panics
    ///
    /// If `interval` is not positive or longer than 100 years.
    pub fn interval(mut self, interval: Duration) -> Self {
        assert_duration(interval, "interval");
        self.interval = interval.to_std().unwrap_or_default();
        self
    }

    /// Rows deleted per statement (default 1,000). On SQLite each batch holds
    /// the database's write lock while it runs, so this bounds how long a
    /// call may wait behind the purger.
    ///
    /// # Panics
    ///
    /// If `batch_size` is zero.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        self.batch_size = batch_size;
        self
    }

    /// The policy whose clock decides which key records have expired, and
    /// whose in-flight policy bounds a batch's wait for SQLite's write lock
    /// (default [`Config::default()`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// How long a delivered outbox message is kept (default 7 days, as
    /// [`Relay::retention`](crate::outbox::Relay::retention)), on the clock
    /// of [`config`](Purger::config).
    ///
    /// # Panics
    ///
    /// If `retention` is not positive or longer than 100 years.
    pub fn message_retention(mut self, retention: Duration) -> Self {
        assert_duration(retention, "message_retention");
        self.message_retention = retention;
        self
    }

    /// Purges now and then every [`interval`](Purger::interval) until
    /// `shutdown` is triggered; returns what it deleted. A round that fails
    /// is reported (a `tracing` event, counted in [`Stopped::errors`]) and
    /// tried again after a pause that doubles from 100 ms up to 10 s; the
    /// purger never stops on its own. A batch that runs when `shutdown` is
    /// triggered finishes, and the purger stops after it; a wait for a
    /// pooled connection ends at once.
    pub fn serve<C>(&self, pool: &Pool<ConnectionManager<C>>, shutdown: &Shutdown) -> Stopped<Purged>
    where
        C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    {
        let stop = || shutdown.is_triggered();
        // Where the tombstones' pass of the rounds before got to, so that a
        // round clears only what expired since.
        let mut swept = None;
        serve(
            "purger",
            pool,
            shutdown,
            pool.connection_timeout(),
            &stop,
            |conn, purged: &mut Purged| {
                let conn: &mut C = conn;
                let keys = self
                    .config
                    .purge_expired_until(conn, self.batch_size, &stop, &mut swept)?;
                purged.keys += keys.deleted;
                purged.tombstoned += keys.tombstoned;
                if !stop() {
                    purged.messages += outbox::purge_delivered(
                        conn,
                        &self.config.clock,
                        self.message_retention,
                        self.batch_size,
                        &stop,
                    )?;
                }
                purged.rounds += 1;
                Ok(Next::Sleep(self.interval))
            },
        )
    }
}
