//! A phased operation's attempt: the claim or takeover of its lease, and its
//! steps.

use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::time::Instant;

use chrono::{DateTime, Duration, NaiveDateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::backend::phases::{COMPLETED, Lease, NewOperation, OperationRow, PARKED, PhaseStore, RUNNING};
use crate::backend::{KeyStore, StoreConnection, transaction_depth};
use crate::clock::{Reading, assert_duration};
use crate::config::Config;
use crate::config::call::{key_transaction, stored_json};
use crate::error::Error;
use crate::outcome::Outcome;
use crate::telemetry::CallTrace;
use crate::{codec, id, key, telemetry};

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
    name: String,
    pub(crate) config: Config,
    lease: Duration,
    provider_horizon: Duration,
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
            let (start, clock) = match self.start(conn, scope, key, &request_hash, &token)? {
                Begin::Replay(outcome, expires_at) => return Ok((outcome, expires_at.and_utc())),
                Begin::Attempt(start, clock) => (start, clock),
            };
            let mut steps = Steps {
                phased: self,
                lease: Lease {
                    scope,
                    key,
                    token: &token,
                },
                request_hash: &request_hash,
                request: request_json.as_deref(),
                clock,
                held: start,
                expires_at: None,
                position: 0,
                conn,
            };
            match panic::catch_unwind(AssertUnwindSafe(|| body(&mut steps))) {
                Ok(Ok(Finished(response))) => match (&steps.held, steps.expires_at) {
                    (Held::Done, Some(expires_at)) => Ok((Outcome::Executed(response), expires_at.and_utc())),
                    _ => {
                        // Kept from another operation's `finish`: this operation
                        // stored no response, so it must not answer with one.
                        steps.release("the body returned a result that its finish did not store");
                        panic!(
                            "the body of a phased operation returned a `Finished` that its own `finish` did not make"
                        )
                    }
                },
                Ok(Err(error)) => {
                    steps.release(&describe(&error));
                    Err(error)
                }
                Err(payload) => {
                    steps.release("the attempt panicked");
                    panic::resume_unwind(payload)
                }
            }
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
            if row.status == COMPLETED && row.expires_at.is_some_and(|expires_at| expires_at <= now) {
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
            match row.status.as_str() {
                COMPLETED => {
                    let response = row.response.unwrap_or_default();
                    let value = serde_json::from_str(&response).map_err(Error::Codec)?;
                    if self.config.durable_replays {
                        conn.await_replication()?;
                    }
                    let expires_at = row.expires_at.unwrap_or(now);
                    return Ok(Begin::Replay(Outcome::Replayed(value), expires_at));
                }
                PARKED => return Err(Error::Parked),
                _ => {}
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

/// How this attempt holds the operation.
enum Held {
    /// Nothing committed yet: the first commit claims the key (replacing a
    /// completed operation whose retention ended).
    Unclaimed { replace: bool },
    /// The lease is this attempt's.
    Leased { op_id: String, points: Vec<Point> },
    /// Finished or parked by this attempt; nothing more to release.
    Done,
}

impl Held {
    fn resumed(row: OperationRow) -> Result<Held, serde_json::Error> {
        Ok(Held::Leased {
            op_id: row.op_id,
            points: serde_json::from_str(&row.points)?,
        })
    }
}

/// A recovery point: a finished step with its output (JSON text, so that a
/// deep output does not deepen the list), or a call that was started.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Point {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    output: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since: Option<NaiveDateTime>,
}

/// The recovery points `points` (JSON) without the call at their end that
/// was started and has no result: a requeued operation makes that call again
/// as if for the first time.
pub(super) fn without_unfinished_call(points: &str) -> Result<String, serde_json::Error> {
    let mut points: Vec<Point> = serde_json::from_str(points)?;
    // Nothing commits after a call until its result does, so an unfinished
    // call can only be the last point.
    if points.last().is_some_and(|point| point.output.is_none()) {
        points.pop();
    }
    serde_json::to_string(&points)
}

/// What [`Steps::finish`] returns, and the only way for a phased
/// operation's body to end with success.
#[derive(Debug)]
pub struct Finished<R>(R);

/// The steps of one attempt of a [`Phased`] operation, as its body receives
/// them.
pub struct Steps<'a, C> {
    phased: &'a Phased,
    conn: &'a mut C,
    lease: Lease<'a>,
    request_hash: &'a str,
    request: Option<&'a str>,
    clock: Reading,
    held: Held,
    /// When the stored response's retention ends, once `finish` stored it.
    expires_at: Option<NaiveDateTime>,
    position: usize,
}

impl<C> fmt::Debug for Steps<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steps")
            .field("operation", &self.phased.name)
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

impl<C: PhaseStore> Steps<'_, C> {
    /// Runs `f` in a transaction of its own and commits its output with the
    /// recovery point, or returns the output stored by an earlier attempt
    /// without running `f`.
    ///
    /// # Errors
    ///
    /// [`Error::Operation`] when `f` fails (its writes roll back);
    /// [`Error::InProgress`] when another attempt took the operation over
    /// (the phase rolls back); [`Error::PhaseRenamed`], [`Error::Codec`],
    /// [`Error::Storage`] as for [`Phased::run`].
    pub fn phase<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&mut C) -> Result<T, E>,
    {
        if let Some(point) = self.recorded(name)? {
            return self.stored_output(point);
        }
        let name = name.to_owned();
        let config = &self.phased.config;
        let value = self.commit(|tx, points| {
            let value = f(tx).map_err(Error::Operation)?;
            let output = stored_json(config, &value)?;
            points.push(Point {
                name,
                output: Some(output),
                since: None,
            });
            Ok(value)
        })?;
        self.position += 1;
        Ok(value)
    }

    /// Calls a provider outside any transaction, with a provider key it
    /// deduplicates on, and commits the result; an earlier attempt's
    /// committed result is returned without calling.
    ///
    /// The call is recorded as started before it is first made. A resume
    /// finding it started but without a result calls again with the same
    /// key, up to the [`provider_horizon`](Phased::provider_horizon) after
    /// the first call; past it the operation is parked. A failure the
    /// provider answered definitively (a declined card) should be returned
    /// as `Ok`, so that it is stored and replayed.
    ///
    /// # Errors
    ///
    /// [`Error::Operation`] when `f` fails: the call stays started, a retry
    /// calls again. [`Error::Parked`] past the horizon. Otherwise as
    /// [`phase`](Steps::phase).
    pub fn call<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&str) -> Result<T, E>,
    {
        self.foreign_call(name, f, Repeat::UntilHorizon)
    }

    /// [`call`](Steps::call) for a provider that does not deduplicate: a
    /// resume finding the call started without a result parks the operation
    /// instead of calling again, since the provider may have applied it.
    ///
    /// # Errors
    ///
    /// As [`call`](Steps::call); [`Error::Parked`] for a call that was
    /// interrupted.
    pub fn call_at_most_once<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&str) -> Result<T, E>,
    {
        self.foreign_call(name, f, Repeat::Never)
    }

    /// The provider key of the next call named `name`: derived from the id
    /// minted at the operation's first commit, so the same on every attempt
    /// and unrelated to the client's key. Calls that share a name (one per
    /// card of a loop) get a key each, numbered by how many calls of that
    /// name came before. `None` before the first commit.
    pub fn provider_key(&self, name: &str) -> Option<String> {
        let Held::Leased { op_id, points, .. } = &self.held else {
            return None;
        };
        // Only calls record when they started, phases never do.
        let earlier = points[..self.position.min(points.len())]
            .iter()
            .filter(|point| point.name == name && point.since.is_some())
            .count();
        Some(if earlier == 0 {
            key::derive(&[op_id, name])
        } else {
            key::derive(&[op_id, name, &(earlier + 1).to_string()])
        })
    }

    /// Runs `f` in the last transaction, stores its result as the
    /// operation's response and completes the operation: every later retry
    /// replays it.
    ///
    /// # Errors
    ///
    /// As [`phase`](Steps::phase).
    pub fn finish<R, E, F>(&mut self, f: F) -> Result<Finished<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C) -> Result<R, E>,
    {
        let phased = self.phased;
        let lease = self.lease;
        let expires_at = |now: NaiveDateTime| C::storable_time(now + phased.config.retention);
        let (value, expires_at) = self.transaction(|tx, points, now| {
            let value = f(tx).map_err(Error::Operation)?;
            let response = stored_json(&phased.config, &value)?;
            let points = serde_json::to_string(points).map_err(Error::Codec)?;
            let expires_at = expires_at(now);
            if !tx.complete_operation(lease, &points, &response, expires_at, now)? {
                return Err(fenced());
            }
            Ok((value, expires_at))
        })?;
        self.held = Held::Done;
        self.expires_at = Some(expires_at);
        Ok(Finished(value))
    }

    fn foreign_call<T, E, F>(&mut self, name: &str, f: F, repeat: Repeat) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&str) -> Result<T, E>,
    {
        match self.recorded(name)? {
            Some(point) if point.output.is_some() => return self.stored_output(point),
            Some(point) => {
                let since = point.since.unwrap_or_else(|| self.clock.now());
                if repeat == Repeat::Never {
                    return Err(self.park(&format!("call {name} was interrupted and is never repeated")));
                }
                if self.clock.now() >= since + self.phased.provider_horizon {
                    return Err(self.park(&format!("call {name} is past its provider horizon")));
                }
                tracing::info!(target: telemetry::TARGET, call = name, "repeating an unfinished call");
            }
            None => {
                let name = name.to_owned();
                let now = self.clock.now();
                self.commit(|_, points| {
                    points.push(Point {
                        name,
                        output: None,
                        since: Some(now),
                    });
                    Ok(())
                })?;
            }
        }
        let provider_key = self.provider_key(name).ok_or_else(fenced)?;
        let value = f(&provider_key).map_err(Error::Operation)?;
        let output = stored_json(&self.phased.config, &value)?;
        let position = self.position;
        self.commit(|_, points| {
            points[position].output = Some(output);
            Ok(())
        })?;
        self.position += 1;
        Ok(value)
    }

    /// The point recorded at this position, if any, after checking that it
    /// has this step's name.
    fn recorded<E>(&self, name: &str) -> Result<Option<Point>, Error<E>> {
        let Held::Leased { points, .. } = &self.held else {
            return Ok(None);
        };
        match points.get(self.position) {
            Some(point) if point.name != name => Err(Error::PhaseRenamed {
                position: self.position,
                recorded: point.name.clone(),
                found: name.to_owned(),
            }),
            point => Ok(point.cloned()),
        }
    }

    fn stored_output<T: DeserializeOwned, E>(&mut self, point: Point) -> Result<T, Error<E>> {
        let output = point.output.unwrap_or_default();
        let value = serde_json::from_str(&output).map_err(Error::Codec)?;
        self.position += 1;
        Ok(value)
    }

    /// Commits a change of the recovery points made by `change` (which may
    /// also write through the transaction), claiming the operation first if
    /// this is its first commit, and renewing the lease.
    fn commit<T, E>(
        &mut self,
        change: impl FnOnce(&mut C, &mut Vec<Point>) -> Result<T, Error<E>>,
    ) -> Result<T, Error<E>> {
        let lease = self.lease;
        let until = |now: NaiveDateTime| now + self.phased.lease;
        self.transaction(|tx, points, now| {
            let value = change(tx, points)?;
            let points = serde_json::to_string(points).map_err(Error::Codec)?;
            if !tx.save_points(lease, &points, until(now), now)? {
                return Err(fenced());
            }
            Ok(value)
        })
    }

    /// Runs `work` in a transaction holding the operation's key: the first
    /// commit of an attempt that claimed nothing yet inserts the operation
    /// (running, leased to this attempt) before `work` runs. `work` gets the
    /// recovery points to change; they are kept only if it commits.
    fn transaction<T, E>(
        &mut self,
        work: impl FnOnce(&mut C, &mut Vec<Point>, NaiveDateTime) -> Result<T, Error<E>>,
    ) -> Result<T, Error<E>> {
        let now = self.clock.now();
        let (claim, mut points) = match &self.held {
            Held::Unclaimed { replace } => (Some((*replace, id::new())), Vec::new()),
            Held::Leased { points, .. } => (None, points.clone()),
            Held::Done => return Err(fenced()),
        };
        let new_operation = claim.as_ref().map(|(_, op_id)| NewOperation {
            scope: self.lease.scope,
            idempotency_key: self.lease.key,
            operation: &self.phased.name,
            request_hash: self.request_hash,
            request: self.request,
            op_id,
            status: RUNNING,
            points: "[]",
            lease_token: self.lease.token,
            lease_until: now + self.phased.lease,
            attempts: 1,
            created_at: now,
            updated_at: now,
        });
        let held = (self.lease.scope, self.lease.key);
        let result = key_transaction(self.conn, &self.phased.config, held, None, |tx, guard| {
            if let (Some((replace, _)), Some(operation)) = (&claim, &new_operation) {
                if *replace {
                    tx.delete_expired_operation(operation.scope, operation.idempotency_key, now)?;
                }
                if !tx.insert_operation(operation)? {
                    // Another attempt claimed the key since this one read it.
                    return Err(Error::InProgress);
                }
            }
            // A panic in `work` (the application's step) rolls the
            // transaction back, as an error does, and goes on from
            // `key_transaction`: `run` frees the lease on a connection that
            // is out of its transaction.
            let value = guard.catching_panic(tx, |tx| work(tx, &mut points, now))??;
            guard.committing();
            Ok(value)
        })?;
        match (&mut self.held, claim) {
            (Held::Leased { points: held, .. }, None) => *held = points,
            (held, Some((_, op_id))) => *held = Held::Leased { op_id, points },
            (Held::Done | Held::Unclaimed { .. }, None) => {}
        }
        Ok(result)
    }

    /// Parks the operation for a person and says so.
    fn park<E>(&mut self, reason: &str) -> Error<E> {
        let now = self.clock.now();
        let lease = self.lease;
        match self
            .conn
            .write(self.phased.config.in_flight, |tx| tx.park_operation(lease, reason, now))
        {
            Ok(true) => {
                tracing::warn!(target: telemetry::TARGET, reason, "operation parked for a person");
                self.held = Held::Done;
                Error::Parked
            }
            Ok(false) => fenced(),
            Err(error) => write_failed::<C, E>(error),
        }
    }

    /// Frees the lease after a failed attempt, so that a retry resumes at
    /// once; the failure is noted for operators.
    fn release(&mut self, why: &str) {
        if !matches!(self.held, Held::Leased { .. }) {
            return;
        }
        let now = self.clock.now();
        let lease = self.lease;
        let released = self
            .conn
            .write(self.phased.config.in_flight, |tx| tx.release_operation(lease, why, now));
        if let Err(error) = released {
            tracing::warn!(target: telemetry::TARGET, %error, "could not free the lease; it runs out by itself");
        }
    }
}

/// Whether an unfinished call may be made again.
#[derive(PartialEq, Eq)]
enum Repeat {
    UntilHorizon,
    Never,
}

/// Another attempt took the operation over: this one may commit nothing.
fn fenced<E>() -> Error<E> {
    tracing::info!(target: telemetry::TARGET, "lease taken over by another attempt");
    Error::InProgress
}

/// A write of an attempt that failed: a wait for the write lock that ran
/// out under the in-flight policy is a 409, as for the steps' transactions.
fn write_failed<C: PhaseStore, E>(error: diesel::result::Error) -> Error<E> {
    if C::is_in_flight_timeout(&error) {
        Error::InProgress
    } else {
        Error::Storage(error)
    }
}

/// Why an attempt failed, as operators read it: never the operation's own
/// error text, which may quote the request.
fn describe<E>(error: &Error<E>) -> String {
    match error {
        Error::Operation(_) => String::from("a step failed"),
        Error::Storage(cause) => format!("storage failed: {cause}"),
        Error::Codec(_) => String::from("a value could not be stored as json"),
        Error::InProgress => String::from("another attempt took the operation over"),
        Error::PhaseRenamed { position, .. } => format!("the step at position {position} was renamed"),
        _ => String::from("the attempt failed"),
    }
}
