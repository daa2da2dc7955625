//! The combinator: validate, fingerprint, claim, run the operation, store.

use std::panic;
use std::time::Instant;

use chrono::{Duration, NaiveDateTime, SubsecRound};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{self, HeldKey, Hold, KeyStore, Read, Record, StoreConnection, Stored};
use crate::config::Config;
use crate::error::Error;
use crate::executing::Executing;
use crate::outcome::{Outcome, Recorded};
use crate::row_status::RecordStatus;
use crate::telemetry::CallTrace;

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
    /// [`retention`](Config::retention) a key may execute again.
    ///
    /// # Errors
    ///
    /// No error writes anything: a free key stays free, a spent one stays as
    /// it was. Only [`Error::OutcomeUnknown`] may have committed.
    ///
    /// - [`Error::InvalidScope`], [`Error::InvalidKey`]: refused before
    ///   anything was read or written.
    /// - [`Error::Mismatch`]: the key was used with another request.
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
        let trace = CallTrace::start(C::Raw::BACKEND);
        let conn = conn.raw();
        // In the call's span, so that its events carry the scope, the key
        // and the backend.
        let result = trace.span().in_scope(|| {
            let request_hash = self.admit::<C::Raw, Q, E>(scope, key, request, &trace)?;
            // The record this call writes if it executes, claimed as of `now`:
            // to the microsecond, as PostgreSQL keeps times, so that the times
            // an execution reports are the ones its replays read back.
            let claim = |now: NaiveDateTime| {
                let now = now.trunc_subsecs(6);
                Record {
                    scope,
                    idempotency_key: key,
                    request_hash: &request_hash,
                    status: RecordStatus::Processing,
                    response: None,
                    created_at: now,
                    completed_at: None,
                    expires_at: C::Raw::storable_time(now + self.retention),
                }
            };
            let recorded = match conn.read(scope, key) {
                Ok(Read {
                    record,
                    now,
                    claims_first,
                }) => {
                    let now = self.clock.or_database(now);
                    match record {
                        Some(stored) if stored.status == RecordStatus::Completed && stored.expires_at > now => {
                            if self.durable_replays {
                                conn.await_replication()?;
                            }
                            replay(stored, &request_hash)
                        }
                        _ => self.execute(conn, claim(now), claims_first, op, &trace),
                    }
                }
                // A reader kept out by a writer (SQLite outside WAL mode) takes
                // the write path, which waits as the in-flight policy allows and
                // reads again once it holds the lock.
                Err(error) if C::Raw::is_in_flight_timeout(&error) => {
                    let now = self.clock.now(conn)?;
                    self.execute(conn, claim(now), false, op, &trace)
                }
                Err(error) => Err(Error::Storage(error)),
            };
            recorded.map_err(|error| backend::call_error::<C::Raw, E>(error, false))
        });
        trace.finish(&result);
        result
    }

    /// The write path: hold the key (by a claim at once where the read
    /// found that the database `claims_first`), then replay what another
    /// call stored meanwhile, or run `op` and store its result.
    fn execute<C, R, E, F>(
        &self,
        conn: &mut C,
        record: Record<'_>,
        claims_first: bool,
        op: F,
        trace: &CallTrace,
    ) -> Result<Recorded<R>, Error<E>>
    where
        C: KeyStore,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C) -> Result<R, E>,
    {
        let (scope, key) = (record.scope, record.idempotency_key);
        // An enclosing call on this connection that executes the same key
        // has written nothing yet for a nested call to find.
        let Some(_executing) = Executing::enter(conn, scope, key) else {
            return Err(Error::InProgress);
        };
        let started = Instant::now();
        // Whether this call's own transaction commits the record: then a
        // commit that fails without the server refusing it leaves the
        // outcome unknown. (A nested call's savepoint commits nothing by
        // itself.)
        let commits = backend::transaction_depth(conn)? == 0;
        let mut committing = false;
        // A panic in `op` is carried out of the transaction, so that it
        // rolls back before the panic goes on.
        let mut panicked = None;
        let result = conn.key_transaction(
            HeldKey {
                scope,
                key,
                in_flight: self.in_flight,
                idle_timeout: self.idle_timeout,
            },
            |tx| {
                trace.waited(started.elapsed());
                let hold = match tx.hold(&record, claims_first)? {
                    Hold::Recorded(stored) => {
                        if self.durable_replays {
                            tx.await_replication()?;
                        }
                        return replay(stored, record.request_hash);
                    }
                    Hold::ClaimedElsewhere => return Err(Error::InProgress),
                    hold @ (Hold::Expired | Hold::Claimed { took_over: true }) => {
                        trace.took_over();
                        hold
                    }
                    hold => hold,
                };
                let value = backend::catching_panic(tx, &mut panicked, op)?.map_err(Error::Operation)?;
                let response = self.stored_json(&value)?;
                let elapsed = Duration::from_std(started.elapsed()).unwrap_or(Duration::zero());
                tx.store(
                    hold,
                    &Record {
                        status: RecordStatus::Completed,
                        response: Some(&response),
                        completed_at: Some(record.created_at + elapsed),
                        ..record
                    },
                )?;
                committing = true;
                Ok(Recorded::new(
                    Outcome::Executed(value),
                    record.created_at,
                    record.expires_at,
                ))
            },
        );
        if let Some(payload) = panicked {
            panic::resume_unwind(payload);
        }
        if matches!(&result, Err(Error::Storage(error)) if C::is_in_flight_timeout(error)) {
            trace.waited(started.elapsed());
        }
        result.map_err(|error| backend::call_error::<C, E>(error, commits && committing))
    }
}

/// The answer from a stored record: its response when the request matches.
fn replay<R: DeserializeOwned, E>(stored: Stored, request_hash: &str) -> Result<Recorded<R>, Error<E>> {
    if stored.request_hash != request_hash {
        return Err(Error::Mismatch);
    }
    match stored.response {
        Some(response) if stored.status == RecordStatus::Completed => serde_json::from_str(&response)
            .map(|value| Recorded::new(Outcome::Replayed(value), stored.created_at, stored.expires_at))
            .map_err(Error::Codec),
        // Claimed by an enclosing call on this same connection whose
        // operation has not finished.
        _ => Err(Error::InProgress),
    }
}
