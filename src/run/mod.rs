//! The combinator: [`run_idempotent`] and the calls made under a
//! [`Config`], from the read to the commit. A call's path is in `call`
//! (read, hold, execute, store), the lookup of what became of a key in
//! `status`; the entry points here check the key rules, fingerprint the
//! request and drive the path, a synchronous one with `block_on`.

use std::convert::Infallible;

use chrono::NaiveDateTime;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{self, BackendRules, BlockingPhaseStore, BlockingStore, RulesOf, StoreConnection, block_on};
use crate::config::Config;
use crate::error::Error;
use crate::fingerprint;
use crate::outcome::{Outcome, Recorded};
use crate::telemetry::CallTrace;

pub(crate) mod call;
mod status;

pub(crate) use call::Sender;
pub use status::KeyStatus;
use status::Reader;

/// Runs `op` at most once for `(scope, key)` with [`Config::default()`]; see
/// [`Config::run`].
///
/// # Errors
///
/// As [`Config::run`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::{run_idempotent, Outcome};
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
///
/// let place = |conn: &mut SqliteConnection| {
///     run_idempotent(conn, "orders", "3f6c1f2e-retry-me", &"one book", |tx| {
///         diesel::sql_query("INSERT INTO orders (item) VALUES ('book')").execute(tx)?;
///         Ok::<_, diesel::result::Error>(String::from("order 1 placed"))
///     })
/// };
///
/// assert_eq!(place(&mut conn)?, Outcome::Executed(String::from("order 1 placed")));
/// // The response was lost; the client retries with the same key.
/// assert_eq!(place(&mut conn)?, Outcome::Replayed(String::from("order 1 placed")));
///
/// #[derive(QueryableByName)]
/// struct Count { #[diesel(sql_type = diesel::sql_types::BigInt)] n: i64 }
/// let orders: Count = diesel::sql_query("SELECT count(*) AS n FROM orders").get_result(&mut conn)?;
/// assert_eq!(orders.n, 1);
/// # Ok(())
/// # }
/// ```
pub fn run_idempotent<C, Q, R, E, F>(
    conn: &mut C,
    scope: &str,
    key: &str,
    request: &Q,
    op: F,
) -> Result<Outcome<R>, Error<E>>
where
    C: StoreConnection,
    Q: Serialize + ?Sized,
    R: Serialize + DeserializeOwned,
    F: FnOnce(&mut C::Raw) -> Result<R, E>,
{
    Config::default().run(conn, scope, key, request, op)
}

/// Runs `op` at most once for `(scope, key)` on a diesel-async connection
/// with [`Config::default()`]; see [`Config::run_async`].
///
/// # Errors
///
/// As [`Config::run`].
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::SqliteConnection;
/// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
/// use idempotency::{run_idempotent_async, Outcome};
///
/// type Conn = SyncConnectionWrapper<SqliteConnection>;
/// let mut conn = idempotency::testing::sqlite_memory_async();
/// for expected in [Outcome::Executed(1), Outcome::Replayed(1)] {
///     let outcome = run_idempotent_async(&mut conn, "orders", "3f6c1f2e", &"one book", async |_: &mut Conn| {
///         Ok::<_, std::convert::Infallible>(1)
///     })
///     .await?;
///     assert_eq!(outcome, expected);
/// }
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub async fn run_idempotent_async<C, Q, R, E, F>(
    conn: &mut C,
    scope: &str,
    key: &str,
    request: &Q,
    op: F,
) -> Result<Outcome<R>, Error<E>>
where
    C: backend::AsyncStoreConnection,
    Q: Serialize + ?Sized,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut C) -> Result<R, E>,
{
    Config::default().run_async(conn, scope, key, request, op).await
}

impl Config {
    /// Runs `op` at most once for `(scope, key)` and returns its result on
    /// this and every later call with the same key and request.
    ///
    /// The key record and everything `op` writes through its connection are
    /// committed in one transaction (a savepoint when `conn` is already in
    /// one), so either both exist or neither does:
    ///
    /// 1. `scope` and `key` are checked: non-empty, at most
    ///    [`max_key_len`](Config::max_key_len) bytes, visible ASCII; a key
    ///    that looks like a payment card number is refused.
    /// 2. `request` is fingerprinted: SHA-256 of its canonical JSON.
    /// 3. A completed, unexpired record for `(scope, key)` is answered from
    ///    storage with one read: [`Outcome::Replayed`] when the fingerprints
    ///    match, [`Error::Mismatch`] when they do not. `op` is not called.
    /// 4. Otherwise the key is claimed in a write transaction, waiting for a
    ///    transaction that holds it as the [`InFlight`](crate::InFlight)
    ///    policy allows. `op` runs on the same connection, its result is
    ///    stored as JSON, and the transaction commits: [`Outcome::Executed`].
    ///
    /// The fingerprint covers `request` alone. Where one scope serves several
    /// operations, put the operation's name in the request or in the scope,
    /// or one operation's key would replay another's result.
    ///
    /// A record whose retention has ended is taken over as new, so after
    /// [`retention`](Config::retention) a key may execute again; where the
    /// policy keeps [tombstones](Config::tombstones), only once their grace
    /// period has ended too, and before that the same request is
    /// [`Error::Expired`].
    ///
    /// # Errors
    ///
    /// No error writes anything: a free key stays free, a spent one stays as
    /// it was. Only [`Error::OutcomeUnknown`] may have committed.
    ///
    /// - [`Error::InvalidScope`], [`Error::InvalidKey`]: refused before
    ///   anything was read or written.
    /// - [`Error::Mismatch`]: the key was used with another request.
    /// - [`Error::AlreadyCompleted`]: the same request completed, and the
    ///   policy rejects completed keys ([`Config::on_completed`]).
    /// - [`Error::Expired`]: the same request completed, its retention has
    ///   ended, and the policy keeps its [tombstone](Config::tombstones)
    ///   for a grace period that runs.
    /// - [`Error::InProgress`]: another transaction still holds the key when
    ///   the in-flight policy ran out.
    /// - [`Error::Operation`]: `op` failed; its writes were rolled back.
    /// - [`Error::Codec`]: the request or the result did not serialize
    ///   (rolled back), or a stored response no longer decodes into `R`
    ///   (`op` is not run again).
    /// - [`Error::ResponseTooLarge`]: the result's JSON is longer than
    ///   [`max_response_len`](Config::max_response_len); rolled back.
    /// - [`Error::Storage`]: the database failed; rolled back.
    /// - [`Error::OutcomeUnknown`]: the commit failed without the database
    ///   refusing it (usually a lost connection); it may or may not have
    ///   committed. Retry with the same key and request: the retry replays
    ///   or executes, never both.
    ///
    /// # Panics
    ///
    /// A panic in `op` rolls the transaction (or savepoint) back and then
    /// resumes; the key stays free and the connection is left as it was
    /// before the call: outside a transaction, or in the caller's.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::{Config, Error};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let config = Config::default();
    /// let charge = |conn: &mut _, cents: u32| {
    ///     config.run(conn, "payments", "charge-7f3a", &cents, |_tx| Ok::<_, std::convert::Infallible>(cents))
    /// };
    ///
    /// assert_eq!(charge(&mut conn, 500)?.into_inner(), 500);
    /// assert!(matches!(charge(&mut conn, 900), Err(Error::Mismatch)));
    /// assert!(charge(&mut conn, 500)?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    pub fn run<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        op: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C::Raw) -> Result<R, E>,
    {
        self.run_recorded(conn, scope, key, request, op)
            .map(|recorded| recorded.outcome)
    }

    /// [`run`](Config::run), also telling when the key record was created
    /// and when it expires: an HTTP layer can send the expiry to the client,
    /// and tests can check it.
    ///
    /// # Errors
    ///
    /// As [`run`](Config::run).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::{testing::ManualClock, Config};
    ///
    /// let clock = ManualClock::new();
    /// let config = Config::default().clock(clock.source()).retention(Duration::hours(2));
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let first = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(1))?;
    /// assert_eq!((first.created_at, first.expires_at), (clock.now(), clock.now() + Duration::hours(2)));
    ///
    /// clock.advance(Duration::minutes(10));
    /// let retry = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(2))?;
    /// assert!(retry.outcome.is_replayed());
    /// assert_eq!(retry.expires_at, first.expires_at, "a replay does not extend the retention");
    /// # Ok(())
    /// # }
    /// ```
    pub fn run_recorded<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        op: F,
    ) -> Result<Recorded<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C::Raw) -> Result<R, E>,
    {
        self.run_recorded_by(conn, scope, key, request, Sender::default(), op)
    }

    /// [`run_recorded`](Config::run_recorded) for `sender`: the record
    /// answered to the lookups of its caller alone (the HTTP layer's
    /// lookup), and keeping its request id.
    pub(crate) fn run_recorded_by<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        sender: Sender<'_>,
        op: F,
    ) -> Result<Recorded<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C::Raw) -> Result<R, E>,
    {
        let trace = CallTrace::start(RulesOf::<C::Raw>::NAME);
        let conn = conn.raw();
        // In the call's span, so that its events carry the scope, the key
        // and the backend.
        let result = trace.span().in_scope(|| {
            let request_hash = self.admit::<RulesOf<C::Raw>, Q, E>(scope, key, request, &trace)?;
            let op = async |tx: &mut C::Raw| op(tx);
            backend::block_on(call::recorded(
                self,
                conn,
                scope,
                key,
                (&request_hash, sender),
                &trace,
                op,
            ))
        });
        trace.finish(&result);
        result
    }

    /// [`run`](Config::run) on a diesel-async connection (feature
    /// `diesel-async`): `op` is an async closure, run on the same
    /// connection inside the call's transaction, and the call's statements
    /// are awaited, never blocking the thread. The contract is
    /// [`run`](Config::run)'s on every point; what a dropped future does is
    /// in the [async guide](crate::guide::asynchronous).
    ///
    /// # Errors
    ///
    /// As [`run`](Config::run).
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::SqliteConnection;
    /// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
    /// use idempotency::{Config, Error, InFlight};
    ///
    /// type Conn = SyncConnectionWrapper<SqliteConnection>;
    /// let mut conn = idempotency::testing::sqlite_memory_async();
    ///
    /// let config = Config::default().in_flight(InFlight::Reject);
    /// let charge = async |conn: &mut Conn, cents: u32| {
    ///     config.run_async(conn, "payments", "charge-7f3a", &cents, async |_: &mut Conn| Ok::<_, std::convert::Infallible>(cents)).await
    /// };
    /// assert_eq!(charge(&mut conn, 500).await?.into_inner(), 500);
    /// assert!(matches!(charge(&mut conn, 900).await, Err(Error::Mismatch)));
    /// assert!(charge(&mut conn, 500).await?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "diesel-async")]
    pub async fn run_async<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        op: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: backend::AsyncStoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut C) -> Result<R, E>,
    {
        self.run_recorded_async(conn, scope, key, request, op)
            .await
            .map(|recorded| recorded.outcome)
    }

    /// [`run_recorded`](Config::run_recorded) on a diesel-async connection:
    /// [`run_async`](Config::run_async), also telling when the key record
    /// was created and when it expires.
    ///
    /// # Errors
    ///
    /// As [`run`](Config::run).
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use diesel::SqliteConnection;
    /// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
    /// use idempotency::{testing::ManualClock, Config};
    ///
    /// type Conn = SyncConnectionWrapper<SqliteConnection>;
    /// let mut conn = idempotency::testing::sqlite_memory_async();
    /// let clock = ManualClock::new();
    /// let config = Config::default().clock(clock.source()).retention(Duration::hours(2));
    /// let first = config.run_recorded_async(&mut conn, "shop", "order-1", &"book", async |_: &mut Conn| Ok::<_, std::convert::Infallible>(1)).await?;
    /// assert_eq!(first.expires_at, clock.now() + Duration::hours(2));
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "diesel-async")]
    pub async fn run_recorded_async<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        op: F,
    ) -> Result<Recorded<R>, Error<E>>
    where
        C: backend::AsyncStoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut C) -> Result<R, E>,
    {
        self.run_recorded_by_async(conn, scope, key, request, Sender::default(), op)
            .await
    }

    /// [`run_recorded_async`](Config::run_recorded_async) for `sender`, as
    /// [`run_recorded_by`](Config::run_recorded_by).
    #[cfg(feature = "diesel-async")]
    pub(crate) async fn run_recorded_by_async<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        sender: Sender<'_>,
        op: F,
    ) -> Result<Recorded<R>, Error<E>>
    where
        C: backend::AsyncStoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut C) -> Result<R, E>,
    {
        use tracing::Instrument;

        let trace = CallTrace::start(C::Rules::NAME);
        let span = trace.span().clone();
        // Boxed: the call's future nests a future for each layer of the
        // protocol, and a caller's future that holds it whole would be
        // deeper than rustc lays out by default.
        let result = Box::pin(
            async {
                let request_hash = self.admit::<C::Rules, Q, E>(scope, key, request, &trace)?;
                call::recorded(self, conn, scope, key, (&request_hash, sender), &trace, op).await
            }
            .instrument(span),
        )
        .await;
        trace.finish(&result);
        result
    }

    /// What became of the call for `request` under `key` in `scope`: no
    /// record, in progress, completed with its stored result, expired, or
    /// (where the policy keeps [tombstones](Config::tombstones)) expired
    /// and still refusing its retries. It never runs an operation and never
    /// writes.
    ///
    /// The lookup answers only what a replay would: the stored result is
    /// [`Completed`](KeyStatus::Completed) only when `request` has the
    /// fingerprint of the request that was carried out, and a record of
    /// another request is [`NoRecord`](KeyStatus::NoRecord), exactly as a
    /// key without a record, so that knowing a key is not enough to read
    /// another caller's result. Lookups are by `(scope, key)`: take the
    /// scope from the authenticated caller and check its permission first,
    /// as for every call. An operation in phases is looked up with
    /// [`Phased::status`](crate::phased::Phased::status), and a record
    /// written by the HTTP layer (whose fingerprint binds its endpoint)
    /// with [`http::lookup`](crate::guide::http#the-status-of-a-key).
    ///
    /// A completed, unexpired record is answered with one read. Otherwise
    /// the lookup tries to hold the key as a call would, without waiting
    /// (whatever the [`InFlight`](crate::InFlight) policy): a holder makes it
    /// [`InProgress`](KeyStatus::InProgress); held, the record is read
    /// again, so a call that committed meanwhile is seen.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidScope`] and [`Error::InvalidKey`] where the key
    /// rules refuse them; [`Error::Codec`] when `request` cannot be
    /// fingerprinted or the stored result does not decode into `R`;
    /// [`Error::Storage`] when the database fails.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use idempotency::testing::ManualClock;
    /// use idempotency::{Config, KeyStatus};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let clock = ManualClock::new();
    /// let config = Config::default().retention(Duration::hours(1)).clock(clock.source());
    /// assert_eq!(config.status::<_, i32>(&mut conn, "shop", "order-1", &"book")?, KeyStatus::NoRecord);
    ///
    /// let first = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(7))?;
    /// let KeyStatus::Completed { response, expires_at, .. } = config.status::<_, i32>(&mut conn, "shop", "order-1", &"book")? else {
    ///     return Err("not completed".into());
    /// };
    /// assert_eq!((response, expires_at), (7, first.expires_at));
    /// // Another request under the key, or another scope, learns nothing.
    /// assert_eq!(config.status::<_, i32>(&mut conn, "shop", "order-1", &"lamp")?, KeyStatus::NoRecord);
    /// assert_eq!(config.status::<_, i32>(&mut conn, "other", "order-1", &"book")?, KeyStatus::NoRecord);
    ///
    /// clock.advance(Duration::hours(1));
    /// assert_eq!(
    ///     config.status::<_, i32>(&mut conn, "shop", "order-1", &"book")?,
    ///     KeyStatus::Expired { expired_at: first.expires_at }
    /// );
    /// # Ok(())
    /// # }
    /// ```
    pub fn status<C, R>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &(impl Serialize + ?Sized),
    ) -> Result<KeyStatus<R>, Error>
    where
        C: StoreConnection,
        R: DeserializeOwned,
    {
        self.request_status(conn, scope, key, None, request)
    }

    /// [`status`](Config::status) as a reader that has no request: of
    /// the records, single calls' and phased operations' alike, whose caller
    /// hash is one of `callers` (the HTTP layer's lookup).
    #[cfg(any(feature = "axum", feature = "actix"))]
    pub(crate) fn status_for_callers<C, R>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        callers: &[String],
    ) -> Result<KeyStatus<R>, Error>
    where
        C: StoreConnection,
        R: DeserializeOwned,
    {
        self.check_rules::<RulesOf<C::Raw>, Infallible>(scope, key, None)?;
        block_on(status::look_up(self, conn.raw(), scope, key, &Reader::Callers(callers)))
    }

    /// [`status`](Config::status) for `request`: of a single call's record,
    /// or with `operation`, of an operation in phases of that name.
    pub(crate) fn request_status<C, R>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        operation: Option<&str>,
        request: &(impl Serialize + ?Sized),
    ) -> Result<KeyStatus<R>, Error>
    where
        C: StoreConnection,
        R: DeserializeOwned,
    {
        self.check_rules::<RulesOf<C::Raw>, Infallible>(scope, key, None)?;
        let request_hash = fingerprint::of(request).map_err(Error::Codec)?;
        let reader = Reader::Request {
            request_hash: &request_hash,
            operation,
        };
        block_on(status::look_up(self, conn.raw(), scope, key, &reader))
    }

    /// Deletes every record whose retention has ended (`expires_at <= now`),
    /// key records and completed [phased operations](crate::phased) alike,
    /// `batch_size` rows per statement, each statement its own short
    /// transaction, so it can run beside live traffic. Returns how many rows
    /// were deleted in all.
    ///
    /// Where the policy keeps [tombstones](Config::tombstones), a key
    /// record or completed phased operation is deleted only once its grace
    /// period has ended too; before that the purge turns it into a
    /// tombstone, clearing its stored response (and an operation's stored
    /// request and recovery points), and counts it among the rows it
    /// returns.
    ///
    /// Called inside an open transaction, the batches become part of it.
    /// On PostgreSQL and MySQL rows that a live request is taking over are
    /// skipped, not waited for.
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
    /// use idempotency::{testing::ManualClock, Config};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let clock = ManualClock::new();
    /// let config = Config::default().clock(clock.source());
    /// config.run(&mut conn, "orders", "key-1", &"request", |_| Ok::<_, std::convert::Infallible>(1))?;
    ///
    /// assert_eq!(config.purge_expired(&mut conn, 500)?, 0);
    /// clock.advance(Duration::hours(24));
    /// assert_eq!(config.purge_expired(&mut conn, 500)?, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn purge_expired<C: StoreConnection>(&self, conn: &mut C, batch_size: usize) -> Result<usize, Error> {
        let purged = self.purge_expired_until(conn, batch_size, &|| false, &mut None)?;
        Ok(purged.deleted + purged.tombstoned)
    }

    /// [`purge_expired`](Config::purge_expired), ending after the batch in
    /// which `stop` becomes true. `swept`: the time up to which an earlier
    /// purge on this policy turned every expired record into a tombstone
    /// (`None` where unknown); the tombstones' pass begins after it, and
    /// a complete pass moves it on.
    pub(crate) fn purge_expired_until<C: StoreConnection>(
        &self,
        conn: &mut C,
        batch_size: usize,
        stop: &dyn Fn() -> bool,
        swept: &mut Option<NaiveDateTime>,
    ) -> Result<KeysPurged, Error> {
        let conn = conn.raw();
        // One fixed cut-off, so the loop ends even while records keep
        // expiring under it.
        let cutoff = self.clock.now(conn)?;
        let reusable_by = self.reusable_by(cutoff);
        // Where the tombstones' pass of the rounds before got to: records
        // and operations that expired up to then were cleared by it. One a
        // live call held then (passed over, not waited for) keeps its
        // response until it is deleted, which costs space, not correctness:
        // a call answers an expired record as a tombstone whether or not
        // its response was cleared.
        let after = swept.map_or(reusable_by, |swept| swept.max(reusable_by));
        let mut purged = KeysPurged::default();
        purged.deleted += backend::purge_in_batches("idempotency_keys", batch_size, stop, |limit| {
            conn.write_now(self.in_flight, |conn| conn.purge_batch(reusable_by, limit))
        })?;
        if self.tombstones.is_some() && !stop() {
            purged.tombstoned += backend::purge_in_batches("idempotency_keys_tombstoned", batch_size, stop, |limit| {
                conn.write_now(self.in_flight, |conn| conn.tombstone_batch(after, cutoff, limit))
            })?;
        }
        if stop() {
            return Ok(purged);
        }
        purged.deleted += backend::purge_in_batches("idempotency_phases", batch_size, stop, |limit| {
            conn.write_now(self.in_flight, |conn| conn.purge_operations_batch(reusable_by, limit))
        })?;
        if self.tombstones.is_some() && !stop() {
            purged.tombstoned +=
                backend::purge_in_batches("idempotency_phases_tombstoned", batch_size, stop, |limit| {
                    conn.write_now(self.in_flight, |conn| {
                        conn.tombstone_operations_batch(after, cutoff, limit)
                    })
                })?;
            if !stop() {
                *swept = Some(cutoff);
            }
        }
        Ok(purged)
    }
}

/// What one purge of [`Config::purge_expired_until`] did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeysPurged {
    /// Key records and phased operations deleted.
    pub(crate) deleted: usize,
    /// Key records and phased operations turned into tombstones.
    pub(crate) tombstoned: usize,
}
