//! A phased operation: its name and policy, and the start of an attempt,
//! which replays a finished operation or takes its lease (fresh, or over
//! from an attempt whose lease ran out) and hands the body to its
//! [`Steps`].

use std::time::Instant;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::steps::{Finished, Held, Steps, write_failed};
use crate::backend::phases::{Lease, PhaseStore};
use crate::backend::{KeyStore, StoreConnection, transaction_depth};
use crate::clock::{Reading, assert_duration};
use crate::config::Config;
use crate::error::Error;
use crate::outcome::Outcome;
use crate::row_status::OperationStatus;
use crate::telemetry::CallTrace;
use crate::{codec, id, telemetry};

/// How often a retry looks again while another attempt holds the lease.
const LEASE_POLL: std::time::Duration = std::time::Duration::from_millis(25);

/// An operation in phases, named for the [`Completer`](super::Completer),
/// and its policy. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`config`](Phased::config) | [`Config::default()`]: retention, in-flight policy, key length, clock |
/// | [`lease`](Phased::lease) | 90 seconds |
/// | [`provider_horizon`](Phased::provider_horizon) | 23 hours |
/// | [`store_requests`](Phased::store_requests) | `false` |
///
/// See the [module docs](super) for the contract.
///
/// ```
/// use chrono::Duration;
/// use idempotency::phased::Phased;
///
/// let create_ride = Phased::new("create-ride")
///     .lease(Duration::seconds(60))
///     .provider_horizon(Duration::hours(20))
///     .store_requests(true);
/// # let _ = create_ride;
/// ```
#[derive(Debug, Clone)]
pub struct Phased {
    pub(super) name: String,
    pub(crate) config: Config,
    pub(super) lease: Duration,
    pub(super) provider_horizon: Duration,
    store_requests: bool,
}

impl Phased {
    /// An operation named `name`, with the defaults in the table above. The
    /// name is stored with every operation, so that a
    /// [`Completer`](super::Completer) finds the code that finishes it.
    pub fn new(name: impl Into<String>) -> Self {
        Phased {
            name: name.into(),
            config: Config::default(),
            lease: Duration::seconds(90),
            provider_horizon: Duration::hours(23),
            store_requests: false,
        }
    }

    /// The policy for keys, retention, waiting for another attempt and the
    /// clock (default [`Config::default()`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// How long an attempt holds the operation without committing (default
    /// 90 seconds): after it, another attempt may take the operation over.
    /// Every commit renews it. Choose it longer than any step takes, the
    /// foreign call's timeout included.
    ///
    /// # Panics
    ///
    /// If `lease` is not positive or longer than 100 years.
    pub fn lease(mut self, lease: Duration) -> Self {
        assert_duration(lease, "lease");
        self.lease = lease;
        self
    }

    /// How long after a call was first made it may still be repeated
    /// (default 23 hours, under the 24 hours Stripe keeps its idempotency
    /// keys at least). Past it, an unfinished call is never repeated: the
    /// provider may have forgotten the key and would apply it again. The
    /// operation is parked for a person instead.
    ///
    /// # Panics
    ///
    /// If `horizon` is not positive or longer than 100 years.
    pub fn provider_horizon(mut self, horizon: Duration) -> Self {
        assert_duration(horizon, "provider horizon");
        self.provider_horizon = horizon;
        self
    }

    /// Whether the request is stored with the operation (default `false`).
    /// A [`Completer`](super::Completer) needs it to finish operations whose
    /// clients went away; otherwise the crate never stores request bodies,
    /// only their fingerprints. Keep personal data out of requests you store.
    pub fn store_requests(mut self, store: bool) -> Self {
        self.store_requests = store;
        self
    }

    /// Runs the operation `body` for `(scope, key)` at most once, resuming
    /// it from its last recovery point, or replays its stored response.
    ///
    /// `body` receives the [`Steps`] and returns what [`Steps::finish`]
    /// returned. Each step returns `Result<T, Error<E>>`, so `?` passes a
    /// step's failure on. `conn` must not be inside a transaction: every
    /// step commits on its own.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidScope`], [`Error::InvalidKey`]: refused before
    ///   anything was read or written.
    /// - [`Error::Mismatch`]: the key is bound to another request or to
    ///   another operation (another name).
    /// - [`Error::InProgress`]: another attempt holds the operation beyond
    ///   the in-flight policy, or took it over from this one.
    /// - [`Error::Operation`]: a step's closure failed. Before the first
    ///   commit the key stays free; after it the recovery point is kept and
    ///   a retry with the same request resumes.
    /// - [`Error::Parked`]: the operation was given up for a person (a call
    ///   past its provider horizon, an interrupted at-most-once call, too
    ///   many attempts).
    /// - [`Error::PhaseRenamed`]: a step's name differs from the one
    ///   recorded at its position.
    /// - [`Error::Codec`]: a value did not serialize or read back.
    /// - [`Error::Storage`]: the database failed (`AlreadyInTransaction`
    ///   when `conn` is in a transaction).
    ///
    /// # Panics
    ///
    /// A panic in `body` rolls back the step it was in, frees the lease and
    /// resumes; committed recovery points stay. `run` panics itself (after
    /// freeing the lease) when `body` returns a [`Finished`] that its own
    /// [`finish`](Steps::finish) did not make, one kept from another
    /// operation.
    pub fn run<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        body: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut Steps<'_, C::Raw>) -> Result<Finished<R>, Error<E>>,
    {
        self.run_expiring(conn, scope, key, request, body)
            .map(|(outcome, _)| outcome)
    }

    /// [`run`](Phased::run), also telling when the operation's retention
    /// ends: the HTTP layer sends it to the client.
    pub(crate) fn run_expiring<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        body: F,
    ) -> Result<(Outcome<R>, DateTime<Utc>), Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut Steps<'_, C::Raw>) -> Result<Finished<R>, Error<E>>,
    {
        let trace = CallTrace::phased(<C::Raw as KeyStore>::BACKEND, &self.name);
        let conn = conn.raw();
        // In the attempt's span, so that its events carry the operation, the
        // scope, the key and the backend.
        let result = trace.span().in_scope(|| {
            let request_hash = self.config.admit::<C::Raw, Q, E>(scope, key, request, &trace)?;
            let request_json = match self.store_requests {
                true => Some(codec::to_readable_json(request).map_err(Error::Codec)?),
                false => None,
            };
            if transaction_depth(conn)? > 0 {
                return Err(Error::Storage(diesel::result::Error::AlreadyInTransaction));
            }
            // The lease token of this attempt, whether it claims the operation
            // or takes it over.
            let token = id::new();
            let (held, clock) = match self.start(conn, scope, key, &request_hash, &token)? {
                Begin::Replay(outcome, expires_at) => return Ok((outcome, expires_at.and_utc())),
                Begin::Attempt(held, clock) => (held, clock),
            };
            let lease = Lease {
                scope,
                key,
                token: &token,
            };
            Steps::new(self, conn, lease, &request_hash, request_json.as_deref(), held, clock).attempt(body)
        });
        trace.finish_phased(result.as_ref().map(|(outcome, _)| outcome));
        result
    }

    /// Reads the operation and decides: replay it, or attempt it (fresh, or
    /// taken over from an attempt whose lease ran out), waiting for a live
    /// lease as the in-flight policy allows.
    fn start<C: PhaseStore, R: DeserializeOwned, E>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request_hash: &str,
        token: &str,
    ) -> Result<Begin<R>, Error<E>> {
        let wait = std::time::Duration::from_millis(u64::try_from(self.config.in_flight.wait_millis()).unwrap_or(0));
        let deadline = Instant::now() + wait;
        loop {
            let (row, database_now) = conn.read_operation(scope, key)?;
            let now = self.config.clock.or_database(database_now);
            let clock = Reading::new(&self.config.clock, now);
            let Some(row) = row else {
                return Ok(Begin::Attempt(Held::Unclaimed { replace: false }, clock));
            };
            if row.status == OperationStatus::Completed && row.expires_at.is_some_and(|expires_at| expires_at <= now) {
                return Ok(Begin::Attempt(Held::Unclaimed { replace: true }, clock));
            }
            // The key is bound to the operation as well as to the request:
            // another operation's response is not this one's, nor are its
            // recovery points. Compared with the name stored since the first
            // version rather than folded into the fingerprint, so that
            // operations written before keep their fingerprints.
            if row.operation != self.name || row.request_hash != request_hash {
                return Err(Error::Mismatch);
            }
            match row.status {
                OperationStatus::Completed => {
                    let response = row.response.unwrap_or_default();
                    let value = serde_json::from_str(&response).map_err(Error::Codec)?;
                    if self.config.durable_replays {
                        conn.await_replication()?;
                    }
                    let expires_at = row.expires_at.unwrap_or(now);
                    return Ok(Begin::Replay(Outcome::Replayed(value), expires_at));
                }
                OperationStatus::Parked => return Err(Error::Parked),
                OperationStatus::Running => {}
            }
            if row.lease_until.is_none_or(|until| until <= now) {
                let lease = Lease { scope, key, token };
                // The recovery points are read again once the lease is this
                // attempt's: since the read above, another attempt may have
                // taken the operation over, committed steps and let go.
                let taken = conn
                    .write(self.config.in_flight, |tx| {
                        if !tx.take_over(lease, now + self.lease, now)? {
                            return Ok(None);
                        }
                        tx.read_operation(scope, key).map(|(row, _)| row)
                    })
                    .map_err(write_failed::<C, E>)?;
                if let Some(row) = taken {
                    tracing::info!(target: telemetry::TARGET, "resuming from the last recovery point");
                    let held = Held::resumed(row).map_err(Error::Codec)?;
                    return Ok(Begin::Attempt(held, clock));
                }
            } else if Instant::now() >= deadline {
                return Err(Error::InProgress);
            } else {
                std::thread::sleep(LEASE_POLL.min(deadline.saturating_duration_since(Instant::now())));
            }
        }
    }
}

/// What [`Phased::start`] decided.
enum Begin<R> {
    Replay(Outcome<R>, NaiveDateTime),
    Attempt(Held, Reading),
}
