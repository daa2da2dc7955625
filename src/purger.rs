//! The background purger: retention that takes care of itself.

use std::ops::AddAssign;
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};

use crate::backend::StoreConnection;
use crate::config::Config;
use crate::outbox::Relay;
use crate::shutdown::{ErrorBackoff, Shutdown, checkout};
use crate::telemetry;

/// Deletes expired key records, completed phased operations past their
/// retention and delivered outbox messages in the background until
/// stopped, so that a service starts it once at boot and
/// never thinks about retention again. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`interval`](Purger::interval) | 1 minute between rounds |
/// | [`batch_size`](Purger::batch_size) | 1,000 rows per statement |
/// | [`config`](Purger::config) | [`Config::default()`]: its clock decides which keys and operations have expired |
/// | [`relay`](Purger::relay) | [`Relay::default()`]: its retention decides which delivered messages go |
///
/// Each round is [`Config::purge_expired`] (key records and completed
/// [phased operations](crate::phased)) and then
/// [`Relay::purge_delivered`], in batches that are short transactions of
/// their own, so it runs beside live traffic. Running and parked phased
/// operations are never purged. For a cron job, call those two directly.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::thread;
/// use std::time::Duration;
///
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
///     thread::spawn(move || Purger::default().interval(Duration::from_secs(300)).run(&pool, &shutdown))
/// };
/// // ... the service runs ...
/// shutdown.trigger();
/// let purged = purger.join().map_err(|_| "the purger panicked")?;
/// assert_eq!(purged.errors, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Purger {
    interval: Duration,
    batch_size: usize,
    config: Config,
    relay: Relay,
}

impl Default for Purger {
    fn default() -> Self {
        Purger {
            interval: Duration::from_secs(60),
            batch_size: 1_000,
            config: Config::default(),
            relay: Relay::default(),
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
    /// Delivered outbox messages deleted.
    pub messages: usize,
    /// Database errors met; the purger carried on after each.
    pub errors: usize,
}

impl AddAssign for Purged {
    fn add_assign(&mut self, other: Purged) {
        self.rounds += other.rounds;
        self.keys += other.keys;
        self.messages += other.messages;
        self.errors += other.errors;
    }
}

impl Purger {
    /// The pause between two rounds (default 1 minute).
    ///
    /// # Panics
    ///
    /// If `interval` is zero.
    pub fn interval(mut self, interval: Duration) -> Self {
        assert!(!interval.is_zero(), "interval must be positive");
        self.interval = interval;
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

    /// The relay whose retention decides which delivered messages are
    /// deleted (default [`Relay::default()`], 7 days).
    pub fn relay(mut self, relay: Relay) -> Self {
        self.relay = relay;
        self
    }

    /// Purges now and then every [`interval`](Purger::interval) until
    /// `shutdown` is triggered; returns what it deleted. A round that fails
    /// is reported (a `tracing` event, counted in [`Purged::errors`]) and
    /// tried again after a pause that doubles from 100 ms up to 10 s; the
    /// purger never stops on its own. A batch that runs when `shutdown` is
    /// triggered finishes, and the purger stops after it; a wait for a
    /// pooled connection ends at once.
    pub fn run<C>(&self, pool: &Pool<ConnectionManager<C>>, shutdown: &Shutdown) -> Purged
    where
        C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    {
        let mut purged = Purged::default();
        let mut backoff = ErrorBackoff::new();
        while !shutdown.is_triggered() {
            match self.round(pool, shutdown) {
                Ok(round) => {
                    backoff.succeeded();
                    purged += round;
                    shutdown.wait(self.interval);
                }
                Err(error) => {
                    purged.errors += 1;
                    let wait = backoff.failed();
                    telemetry::service_error("purger", &*error, wait);
                    shutdown.wait(wait);
                }
            }
        }
        purged
    }

    /// One round, which ends after the batch that runs when `shutdown` is
    /// triggered.
    fn round<C>(
        &self,
        pool: &Pool<ConnectionManager<C>>,
        shutdown: &Shutdown,
    ) -> Result<Purged, Box<dyn std::error::Error>>
    where
        C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    {
        let Some(mut conn) = checkout(pool, shutdown, pool.connection_timeout())? else {
            return Ok(Purged::default());
        };
        let conn: &mut C = &mut conn;
        let stop = || shutdown.is_triggered();
        let keys = self.config.purge_expired_until(conn, self.batch_size, &stop)?;
        let messages = if stop() {
            0
        } else {
            self.relay.purge_delivered_until(conn, self.batch_size, &stop)?
        };
        Ok(Purged {
            rounds: 1,
            keys,
            messages,
            errors: 0,
        })
    }
}
