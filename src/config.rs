//! [`Config`], the policy of idempotent calls: retention, in-flight
//! handling, key and response length, the clock, durable replays; and the
//! key rules every call checks first. The calls made under it are in
//! `run`.

use std::fmt;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};
use serde::Serialize;

use crate::backend::BackendRules;
use crate::clock::{Clock, assert_duration};
use crate::error::Error;
use crate::in_flight::InFlight;
use crate::telemetry::CallTrace;
use crate::{fingerprint, key};

/// What a call answers when the request of a key has already completed and
/// the same request comes again: [`Config::on_completed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnCompleted {
    /// The stored result, as [`Outcome::Replayed`](crate::Outcome::Replayed):
    /// the contract's answer to a retry.
    #[default]
    Replay,
    /// [`Error::AlreadyCompleted`](crate::Error::AlreadyCompleted): the key
    /// was spent, and its result is not handed out again.
    Reject,
}

/// The policy for idempotent calls, built with consuming builder methods.
///
/// | setting | default |
/// | --- | --- |
/// | [`retention`](Config::retention) | 24 hours |
/// | [`in_flight`](Config::in_flight) | `InFlight::Wait(5 s)` |
/// | [`idle_timeout`](Config::idle_timeout) | 30 seconds |
/// | [`max_key_len`](Config::max_key_len) | 255 bytes |
/// | [`max_response_len`](Config::max_response_len) | 64 KiB |
/// | [`clock`](Config::clock) | the database's clock |
/// | [`durable_replays`](Config::durable_replays) | `false` |
/// | [`on_completed`](Config::on_completed) | [`OnCompleted::Replay`] |
/// | [`read_before_transaction`](Config::read_before_transaction) | the backend's: no on PostgreSQL, yes on SQLite, MySQL and MariaDB |
/// | [`tombstones`](Config::tombstones) | none: after its retention a key executes again |
///
/// A `Config` is cheap to clone and can be shared between threads; build it
/// once at start-up.
///
/// ```
/// use chrono::Duration;
/// use idempotency::{Config, InFlight};
///
/// let config = Config::default()
///     .retention(Duration::hours(48))
///     .in_flight(InFlight::Reject)
///     .max_key_len(64);
/// assert_eq!(config.retention_period(), Duration::hours(48));
/// ```
#[derive(Clone)]
pub struct Config {
    pub(crate) retention: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) max_key_len: usize,
    pub(crate) max_response_len: usize,
    pub(crate) clock: Clock,
    pub(crate) durable_replays: bool,
    pub(crate) on_completed: OnCompleted,
    /// `None`: the backend's choice.
    pub(crate) read_before_transaction: Option<bool>,
    /// The grace period of [`tombstones`](Config::tombstones); `None`
    /// without them.
    pub(crate) tombstones: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            retention: Duration::hours(24),
            in_flight: InFlight::default(),
            idle_timeout: Some(Duration::seconds(30)),
            max_key_len: 255,
            max_response_len: Config::DEFAULT_MAX_RESPONSE_LEN,
            clock: Clock::Database,
            durable_replays: false,
            on_completed: OnCompleted::Replay,
            read_before_transaction: None,
            tombstones: None,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("retention", &self.retention)
            .field("in_flight", &self.in_flight)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_key_len", &self.max_key_len)
            .field("max_response_len", &self.max_response_len)
            .field("durable_replays", &self.durable_replays)
            .field("on_completed", &self.on_completed)
            .field("read_before_transaction", &self.read_before_transaction)
            .field("tombstones", &self.tombstones)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The default of [`max_response_len`](Config::max_response_len): 64 KiB.
    pub const DEFAULT_MAX_RESPONSE_LEN: usize = 64 * 1024;

    /// How long a completed key is remembered (default 24 hours). After it,
    /// the key may execute again as new: this is the retention contract, so
    /// choose it longer than any client keeps retrying.
    ///
    /// # Panics
    ///
    /// If `retention` is not positive or longer than 100 years.
    pub fn retention(mut self, retention: Duration) -> Self {
        assert_duration(retention, "retention");
        self.retention = retention;
        self
    }

    /// What a request does when another transaction holds its key (default
    /// `InFlight::Wait(5 s)`).
    ///
    /// # Panics
    ///
    /// If the wait is negative.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        if let InFlight::Wait(wait) = in_flight {
            assert!(wait >= Duration::zero(), "in-flight wait must not be negative");
        }
        self.in_flight = in_flight;
        self
    }

    /// How long a call's transaction may hold its key while its client
    /// sends the server nothing (default 30 seconds); `None` leaves it to
    /// the session's own settings.
    ///
    /// A host that loses power or its network mid-call closes no socket, and
    /// the server would keep its transaction, and the key, until TCP gives
    /// up on the peer (hours). With this bound the server ends such a
    /// session once it has waited this long for the client's next
    /// statement, which rolls its transaction back and frees the key: a
    /// retry then executes. On PostgreSQL it is the transaction's
    /// `idle_in_transaction_session_timeout`, on MySQL and MariaDB the
    /// session's `wait_timeout` from the key's lock to its release, put back
    /// afterwards; a session whose own setting is lower keeps it. SQLite
    /// runs in the caller's process, and a dead process holds nothing.
    ///
    /// A call's transaction is silent while its operation works outside
    /// the database: an operation that waits longer than this between two
    /// statements (a slow foreign call inside the transaction) loses its
    /// session, and the call fails with [`Error::Storage`] having committed
    /// nothing. 30 seconds is longer than the gaps of any transaction that
    /// serves a web request, whose clients and proxies give up after 30 to
    /// 60 seconds. MySQL counts in whole seconds, rounded up; a bound beyond
    /// what the server takes is shortened to it (about 24.8 days on
    /// PostgreSQL, a year on MySQL).
    ///
    /// ```
    /// use chrono::Duration;
    /// use idempotency::Config;
    ///
    /// // Operations that call a slow provider inside their transaction.
    /// let patient = Config::default().idle_timeout(Duration::minutes(2));
    /// // The session's own settings only: a host cut off mid-call may hold
    /// // its key until the server notices by itself.
    /// let unbounded = Config::default().idle_timeout(None);
    /// # let _ = (patient, unbounded);
    /// ```
    ///
    /// # Panics
    ///
    /// If the timeout is not positive or longer than 100 years.
    pub fn idle_timeout(mut self, idle_timeout: impl Into<Option<Duration>>) -> Self {
        let idle_timeout = idle_timeout.into();
        if let Some(timeout) = idle_timeout {
            assert_duration(timeout, "idle timeout");
        }
        self.idle_timeout = idle_timeout;
        self
    }

    /// The longest key or scope accepted, in bytes (default 255). Where the
    /// key table cannot index longer ones, a larger value is lowered: to 255
    /// on MySQL (the key columns' size) and to 1300 on PostgreSQL (the scope
    /// and the key share one B-tree entry of at most 2704 bytes).
    ///
    /// # Panics
    ///
    /// If `max_key_len` is zero.
    pub fn max_key_len(mut self, max_key_len: usize) -> Self {
        assert!(max_key_len > 0, "max_key_len must be positive");
        self.max_key_len = max_key_len;
        self
    }

    /// The largest result stored for a key, in bytes of its stored JSON
    /// (default 64 KiB, [`DEFAULT_MAX_RESPONSE_LEN`](Config::DEFAULT_MAX_RESPONSE_LEN)).
    ///
    /// A result beyond it is refused before the commit with
    /// [`Error::ResponseTooLarge`]: the operation's writes roll back and the
    /// key stays free. The bound holds for every stored value the
    /// application chooses: a call's result, and a
    /// [phased operation](crate::phased)'s phase outputs and final
    /// response. A phased operation's foreign call is the exception: its
    /// result is recorded whatever its size, since the call was made and
    /// refusing its result would make it again. The result of a write, what a replay answers, says
    /// what was done (an id, a status, a link to the resource): a few KiB.
    /// 64 KiB leaves room many times over while it keeps every key record a
    /// small row and every replay a small read; a list or a document belongs
    /// to a resource the client reads with a `GET`. Raise it where results
    /// are larger by design.
    ///
    /// ```
    /// use idempotency::{Config, Error};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let config = Config::default().max_response_len(16);
    /// let refused = config.run(&mut conn, "shop", "k", &1, |_| Ok::<_, std::convert::Infallible>("x".repeat(20)));
    /// assert!(matches!(refused, Err(Error::ResponseTooLarge { len: 22, max: 16 })));
    /// // Nothing was stored: the key is free for a smaller result.
    /// assert!(!config.run(&mut conn, "shop", "k", &1, |_| Ok::<_, std::convert::Infallible>(String::from("ok")))?.is_replayed());
    /// # Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    /// ```
    ///
    /// # Panics
    ///
    /// If `max_response_len` is zero.
    pub fn max_response_len(mut self, max_response_len: usize) -> Self {
        assert!(max_response_len > 0, "max_response_len must be positive");
        self.max_response_len = max_response_len;
        self
    }

    /// The time source for `created_at` and expiry (default: the database's
    /// clock). Tests inject a [`ManualClock`](crate::testing::ManualClock) to
    /// move through the retention window without waiting.
    ///
    /// Expiry compares a time one process wrote with the time another reads,
    /// so all of them must agree on the time. By default they ask the
    /// database, in the statement that reads the record anyway: on PostgreSQL
    /// and MySQL every application server then uses the server's clock,
    /// however far its own has drifted. (SQLite runs in-process; its clock is
    /// the machine's.) An injected clock is used as it is, by every process that
    /// injects it: a process whose clock runs ahead by `d` shortens the
    /// retention it sees by `d`, and can execute a key again that the others
    /// still replay. Inject clocks in tests, not in production.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::{Duration, TimeZone, Utc};
    /// use idempotency::{testing::ManualClock, Config};
    ///
    /// let clock = ManualClock::at(Utc.with_ymd_and_hms(2030, 6, 1, 12, 0, 0).single().ok_or("date")?);
    /// let config = Config::default().clock(clock.source()).retention(Duration::hours(1));
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let mut runs = 0;
    /// let mut call = |conn: &mut _| config.run(conn, "shop", "k", &1, |_| { runs += 1; Ok::<_, std::convert::Infallible>(runs) });
    ///
    /// assert!(!call(&mut conn)?.is_replayed());
    /// clock.advance(Duration::minutes(59));
    /// assert!(call(&mut conn)?.is_replayed());
    /// clock.advance(Duration::minutes(1));
    /// assert_eq!(call(&mut conn)?.into_inner(), 2, "expired: executes again");
    /// # Ok(())
    /// # }
    /// ```
    pub fn clock(mut self, clock: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.clock = Clock::injected(clock);
        self
    }

    /// Whether a replay waits until the record it answers from is safe on
    /// PostgreSQL's synchronous standbys (default `false`).
    ///
    /// A commit that waits for a synchronous standby is already visible to
    /// sessions on a primary that crashed and restarted in place, whether
    /// the standby got it or not; if the standby is promoted afterwards, the
    /// record is gone. A replay read from it would acknowledge a result the
    /// database no longer has. With durable replays, a replay is answered
    /// only after a commit of its own that waits for the synchronous
    /// standbys, and so for everything written before it: the replay costs a
    /// commit and a round trip to the standby. Turn it on where PostgreSQL
    /// runs with synchronous replication and automatic failover. It has no
    /// effect on SQLite, which has no standby, nor on MySQL and MariaDB.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::Config;
    ///
    /// let config = Config::default().durable_replays(true);
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// config.run(&mut conn, "shop", "k", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
    /// assert!(config.run(&mut conn, "shop", "k", &1, |_| Ok::<_, std::convert::Infallible>(1))?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    pub fn durable_replays(mut self, durable: bool) -> Self {
        self.durable_replays = durable;
        self
    }

    /// Whether a call reads its key's record before it opens its write
    /// transaction (default: the backend's, below).
    ///
    /// With the read, a retry of a completed request is answered by that
    /// one read, and every first call pays its round trip. Without it, a
    /// first call goes straight to its write transaction, and a retry finds
    /// the key taken there and then reads. Which serves better depends on
    /// how many calls are retries: on PostgreSQL and MariaDB the read pays
    /// for itself only where more than about 40 % of calls are retries of
    /// completed keys (the [performance guide](crate::guide::performance)
    /// has the figures).
    ///
    /// - **PostgreSQL**: no read by default. A first call claims its key at
    ///   the database's time in the round trip that takes the key's lock,
    ///   as many round trips as the same transaction with one insert of the
    ///   record; a retry costs that round trip, its rollback and the read.
    ///   Turn the read on for traffic that is mostly retries, such as a
    ///   consumer of redelivered messages. A call with an injected
    ///   [`clock`](Config::clock) claims at the clock's time instead, and a
    ///   call inside a caller's transaction holds its key by a savepoint
    ///   either way.
    /// - **SQLite**: the read by default: it runs in the process, and it
    ///   keeps replays off the database's write lock, which every write
    ///   transaction takes.
    /// - **MySQL and MariaDB**: the read by default, and without it the
    ///   call reads the database's time instead, a round trip as well: the
    ///   claim there is a bound statement after the key's named lock, and
    ///   it needs that time.
    ///
    /// Either way a call runs its operation at most once and answers as
    /// the contract says; only where the round trips fall changes.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::Config;
    ///
    /// // A consumer whose messages are redelivered often: replays first.
    /// let config = Config::default().read_before_transaction(true);
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// config.run(&mut conn, "inbox", "m-1", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
    /// assert!(config.run(&mut conn, "inbox", "m-1", &1, |_| Ok::<_, std::convert::Infallible>(1))?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    pub fn read_before_transaction(mut self, read: bool) -> Self {
        self.read_before_transaction = Some(read);
        self
    }

    /// What a call answers when the request of a key has already completed
    /// and the same request comes again (default
    /// [`OnCompleted::Replay`]: the stored result, as the contract says).
    ///
    /// [`OnCompleted::Reject`] answers it with
    /// [`Error::AlreadyCompleted`](crate::Error::AlreadyCompleted) instead,
    /// for callers that treat a second use of a key as a bug of their own
    /// and want to hear of it rather than get the first result again. It
    /// changes nothing else: the operation still runs at most once, a key
    /// used with another request is still
    /// [`Error::Mismatch`](crate::Error::Mismatch), a key in progress still
    /// [`Error::InProgress`](crate::Error::InProgress), and once the
    /// retention has ended the key executes anew. A
    /// [lookup](Config::status) still answers the stored result. The same
    /// holds for [phased operations](crate::phased) run under this `Config`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::{Config, Error, OnCompleted};
    ///
    /// let config = Config::default().on_completed(OnCompleted::Reject);
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let charge = |conn: &mut _| config.run(conn, "payments", "charge-1", &500, |_| Ok::<_, std::convert::Infallible>(500));
    ///
    /// assert!(!charge(&mut conn)?.is_replayed());
    /// assert!(matches!(charge(&mut conn), Err(Error::AlreadyCompleted)));
    /// # Ok(())
    /// # }
    /// ```
    pub fn on_completed(mut self, on_completed: OnCompleted) -> Self {
        self.on_completed = on_completed;
        self
    }

    /// Keeps a tombstone of every key whose retention has ended for a
    /// further `grace` period, and answers a retry inside it with
    /// [`Error::Expired`] instead of executing it again (default: no
    /// tombstones, so a key executes again as soon as its retention ends).
    ///
    /// For operations where a late retry must never run twice: a client
    /// that retries after the retention gets an error it can act on (HTTP
    /// 410), not a second execution. The tombstone is the key's record
    /// with its response cleared: its scope, key, request fingerprint and
    /// the time its retention ended. A retry with the same request inside
    /// the grace period is [`Error::Expired`]; the same key with another
    /// request is [`Error::Mismatch`], as during the retention; nothing is
    /// run or written for either. Once `retention + grace` has passed, the
    /// key executes again, as without tombstones.
    ///
    /// The policy is read when a record is read, not when it is written:
    /// a record whose retention ended is a tombstone whether or not a purge
    /// has cleared its response yet. Every process that shares the key
    /// table must run with the same policy, as with the same retention; a
    /// process without it executes a key whose retention has ended. A
    /// [purge](Config::purge_expired) under this policy clears the response
    /// of each expired record and deletes the record once its grace period
    /// is over. [Phased operations](crate::phased) under this `Config`
    /// follow the same policy (see
    /// [the contract](crate::guide::contract#tombstones-fail-closed-expiry)).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::testing::ManualClock;
    /// use idempotency::{Config, Error};
    ///
    /// let clock = ManualClock::new();
    /// let config = Config::default()
    ///     .retention(Duration::hours(24))
    ///     .tombstones(Duration::days(7))
    ///     .clock(clock.source());
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let pay = |conn: &mut _| config.run(conn, "payments", "pay-1", &500, |_| Ok::<_, std::convert::Infallible>(500));
    ///
    /// assert!(!pay(&mut conn)?.is_replayed());
    /// clock.advance(Duration::hours(25));
    /// assert!(matches!(pay(&mut conn), Err(Error::Expired)), "fails closed");
    /// clock.advance(Duration::days(7));
    /// assert!(!pay(&mut conn)?.is_replayed(), "after the grace period it executes again");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Panics
    ///
    /// If `grace` is not positive or longer than 100 years.
    pub fn tombstones(mut self, grace: Duration) -> Self {
        assert_duration(grace, "tombstone grace period");
        self.tombstones = Some(grace);
        self
    }

    /// The configured retention.
    pub fn retention_period(&self) -> Duration {
        self.retention
    }

    /// The grace period of [`tombstones`](Config::tombstones), if the
    /// policy keeps them.
    pub fn tombstone_grace(&self) -> Option<Duration> {
        self.tombstones
    }

    /// The time at or before which a record must have expired for a call at
    /// `now` to take its key over: `now` itself, or, with tombstones, the
    /// start of the grace period that ends at `now`.
    pub(crate) fn reusable_by(&self, now: NaiveDateTime) -> NaiveDateTime {
        self.tombstones.map_or(now, |grace| now - grace)
    }

    /// The longest key or scope accepted on backend `R`: the configured
    /// [`max_key_len`](Config::max_key_len), or less where the backend's key
    /// table holds less.
    pub(crate) fn key_len_limit<R: BackendRules>(&self) -> usize {
        R::MAX_KEY_LEN.map_or(self.max_key_len, |limit| limit.min(self.max_key_len))
    }

    /// The key rules of this policy on backend `R`: the scope's, then the
    /// key's. With a `trace`, each value is recorded on the call's span
    /// once it passed (a refused value never reaches the span).
    pub(crate) fn check_rules<R: BackendRules, E>(
        &self,
        scope: &str,
        key: &str,
        trace: Option<&CallTrace>,
    ) -> Result<(), Error<E>> {
        let max_len = self.key_len_limit::<R>();
        key::validate_scope(scope, max_len).map_err(Error::InvalidScope)?;
        if let Some(trace) = trace {
            trace.scope(scope);
        }
        key::validate_key(key, max_len).map_err(Error::InvalidKey)?;
        if let Some(trace) = trace {
            trace.key(key);
        }
        Ok(())
    }

    /// What every call does first, a single call and a phased operation
    /// alike: the key rules, then the request's fingerprint.
    pub(crate) fn admit<R: BackendRules, Q: Serialize + ?Sized, E>(
        &self,
        scope: &str,
        key: &str,
        request: &Q,
        trace: &CallTrace,
    ) -> Result<String, Error<E>> {
        self.check_rules::<R, E>(scope, key, Some(trace))?;
        fingerprint::of(request).map_err(Error::Codec)
    }
}
