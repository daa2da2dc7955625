//! The steps of one attempt of a phased operation: each phase, call and
//! finish a commit of its own, the recovery points they leave, and the end
//! of the attempt (its lease freed after a failure).

use std::fmt;
use std::panic::{self, AssertUnwindSafe};

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::Phased;
use crate::backend::phases::{Lease, NewOperation, OperationRow, PhaseStore};
use crate::clock::Reading;
use crate::config::call::{call_error, key_transaction, stored_json};
use crate::error::Error;
use crate::outcome::Outcome;
use crate::row_status::OperationStatus;
use crate::{id, key, telemetry};

/// How this attempt holds the operation.
pub(super) enum Held {
    /// Nothing committed yet: the first commit claims the key (replacing a
    /// completed operation whose retention ended).
    Unclaimed { replace: bool },
    /// The lease is this attempt's.
    Leased { op_id: String, points: Vec<Point> },
    /// Finished or parked by this attempt; nothing more to release.
    Done,
}

impl Held {
    pub(super) fn resumed(row: OperationRow) -> Result<Held, serde_json::Error> {
        Ok(Held::Leased {
            op_id: row.op_id,
            points: serde_json::from_str(&row.points)?,
        })
    }
}

/// A recovery point: a finished step with its output (JSON text, so that a
/// deep output does not deepen the list), or a call that was started.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(super) struct Point {
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

impl<'a, C: PhaseStore> Steps<'a, C> {
    /// The steps of an attempt that [`Phased::run`] started: `held` as the
    /// start found the operation, `clock` read then.
    pub(super) fn new(
        phased: &'a Phased,
        conn: &'a mut C,
        lease: Lease<'a>,
        request_hash: &'a str,
        request: Option<&'a str>,
        held: Held,
        clock: Reading,
    ) -> Self {
        Steps {
            phased,
            conn,
            lease,
            request_hash,
            request,
            clock,
            held,
            expires_at: None,
            position: 0,
        }
    }

    /// Runs `body` on these steps to its end: the response it finished
    /// with and when its retention ends. A failure or a panic frees the
    /// lease first, so that a retry resumes at once.
    pub(super) fn attempt<R, E, F>(mut self, body: F) -> Result<(Outcome<R>, DateTime<Utc>), Error<E>>
    where
        F: FnOnce(&mut Self) -> Result<Finished<R>, Error<E>>,
    {
        match panic::catch_unwind(AssertUnwindSafe(|| body(&mut self))) {
            Ok(Ok(Finished(response))) => match (&self.held, self.expires_at) {
                (Held::Done, Some(expires_at)) => Ok((Outcome::Executed(response), expires_at.and_utc())),
                _ => {
                    // Kept from another operation's `finish`: this operation
                    // stored no response, so it must not answer with one.
                    self.release("the body returned a result that its finish did not store");
                    panic!("the body of a phased operation returned a `Finished` that its own `finish` did not make")
                }
            },
            Ok(Err(error)) => {
                self.release(&describe(&error));
                Err(error)
            }
            Err(payload) => {
                self.release("the attempt panicked");
                panic::resume_unwind(payload)
            }
        }
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
            status: OperationStatus::Running,
            points: "[]",
            lease_token: self.lease.token,
            lease_until: now + self.phased.lease,
            attempts: 1,
            created_at: now,
            updated_at: now,
        });
        let held = (self.lease.scope, self.lease.key);
        let result = key_transaction(self.conn, &self.phased.config, held, None, None, |tx, guard, _| {
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
            let value = guard.catching_panic_now(tx, |tx| work(tx, &mut points, now))??;
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
pub(super) fn write_failed<C: PhaseStore, E>(error: diesel::result::Error) -> Error<E> {
    call_error::<C, E>(Error::Storage(error), false)
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
