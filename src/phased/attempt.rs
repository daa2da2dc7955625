//! One attempt of a phased operation: each phase, call and finish a commit
//! of its own, the recovery points they leave, and the end of the attempt
//! (its lease freed after a failure).
//!
//! Written once for both kinds of connection, as the single call's
//! protocol is: an [`Attempt`] is async over a [`PhaseStore`], whose
//! statements on a synchronous connection complete as they are sent, so
//! [`Steps`](super::Steps) drives it in one poll and
//! [`AsyncSteps`](super::AsyncSteps) awaits it.

use std::panic;

use chrono::NaiveDateTime;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::definition::{Admitted, Phased};
use crate::backend::phases::{Lease, NewOperation, OperationRow, PhaseStore};
use crate::backend::{BackendRules, KeyStore, Panic};
use crate::clock::Reading;
use crate::error::Error;
use crate::outcome::{Answered, Origin, Outcome};
use crate::row_status::OperationStatus;
use crate::run::call::{call_error, stored_json, within_key};
use crate::{codec, id, key, telemetry};

/// How this attempt holds the operation.
pub(super) enum OperationHold {
    /// Nothing committed yet: the first commit claims the key (replacing a
    /// completed operation whose retention ended).
    Unclaimed { replace: bool },
    /// The lease is this attempt's.
    Leased { op_id: String, points: Vec<Point> },
    /// Finished or parked by this attempt; nothing more to release.
    Done,
}

impl OperationHold {
    pub(super) fn resumed(row: OperationRow) -> Result<OperationHold, serde_json::Error> {
        Ok(OperationHold::Leased {
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

/// What [`Steps::finish`](super::Steps::finish) (or `AsyncSteps::finish`,
/// feature `diesel-async`) returns, and the only way for a phased
/// operation's body to end with success.
#[derive(Debug)]
pub struct Finished<R>(R);

/// Whether an unfinished call may be made again.
#[derive(PartialEq, Eq, Clone, Copy)]
pub(super) enum Repeat {
    UntilHorizon,
    Never,
}

/// One attempt of a [`Phased`] operation on `C`, from its start to its end.
pub(super) struct Attempt<'a, C> {
    phased: &'a Phased,
    conn: &'a mut C,
    lease: Lease<'a>,
    request_hash: &'a str,
    request: Option<&'a str>,
    caller_hash: Option<&'a str>,
    /// Where the operation's result comes from: the attempt that claimed it.
    origin: Origin,
    clock: Reading,
    held: OperationHold,
    /// When the stored response's retention ends, once `finish` stored it.
    expires_at: Option<NaiveDateTime>,
    position: usize,
}

impl<C> Attempt<'_, C> {
    /// The operation's name and the position of the next step, for `Debug`.
    pub(super) fn describe(&self) -> (&str, usize) {
        (&self.phased.name, self.position)
    }
}

impl<'a, C: PhaseStore> Attempt<'a, C> {
    /// The attempt that [`Phased`]'s start began: `held` as the start found
    /// the operation, `clock` read then.
    pub(super) fn new(
        phased: &'a Phased,
        conn: &'a mut C,
        lease: Lease<'a>,
        admitted: &'a Admitted,
        (held, origin): (OperationHold, Origin),
        clock: Reading,
    ) -> Self {
        Attempt {
            phased,
            conn,
            lease,
            request_hash: &admitted.request_hash,
            request: admitted.request.as_deref(),
            caller_hash: admitted.caller_hash.as_deref(),
            origin,
            clock,
            held,
            expires_at: None,
            position: 0,
        }
    }

    /// Ends the attempt with what its body `ended` with: the response it
    /// finished with and when its retention ends. A failure or a panic
    /// frees the lease first, so that a retry resumes at once; the panic
    /// then goes on.
    pub(super) async fn end<R, E>(
        &mut self,
        ended: Result<Result<Finished<R>, Error<E>>, Panic>,
    ) -> Result<Answered<R>, Error<E>> {
        match ended {
            Ok(Ok(Finished(response))) => match (&self.held, self.expires_at) {
                (OperationHold::Done, Some(expires_at)) => {
                    Ok((Outcome::Executed(response), expires_at.and_utc(), self.origin.clone()))
                }
                _ => {
                    // Kept from another operation's `finish`: this operation
                    // stored no response, so it must not answer with one.
                    self.release("the body returned a result that its finish did not store")
                        .await;
                    panic!("the body of a phased operation returned a `Finished` that its own `finish` did not make")
                }
            },
            Ok(Err(error)) => {
                self.release(&failure(&error)).await;
                Err(error)
            }
            Err(payload) => {
                self.release("the attempt panicked").await;
                panic::resume_unwind(payload)
            }
        }
    }

    /// [`Steps::phase`](super::Steps::phase), `f` awaited.
    pub(super) async fn phase<T, E>(
        &mut self,
        name: &str,
        f: impl AsyncFnOnce(&mut C) -> Result<T, E>,
    ) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        if let Some(point) = self.recorded(name)? {
            return self.stored_output(point);
        }
        let name = name.to_owned();
        let config = &self.phased.config;
        let value = self
            .commit(async |tx, points| {
                let value = f(tx).await.map_err(Error::Operation)?;
                let output = stored_json(config, &value)?;
                points.push(Point {
                    name,
                    output: Some(output),
                    since: None,
                });
                Ok(value)
            })
            .await?;
        self.position += 1;
        Ok(value)
    }

    /// [`Steps::call`](super::Steps::call) and
    /// [`Steps::call_at_most_once`](super::Steps::call_at_most_once), as
    /// `repeat` says, `f` awaited.
    pub(super) async fn call<T, E>(
        &mut self,
        name: &str,
        f: impl AsyncFnOnce(&str) -> Result<T, E>,
        repeat: Repeat,
    ) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        match self.recorded(name)? {
            Some(point) if point.output.is_some() => return self.stored_output(point),
            Some(point) => {
                let since = point.since.unwrap_or_else(|| self.clock.now());
                if repeat == Repeat::Never {
                    return Err(self
                        .park(&format!("call {name} was interrupted and is never repeated"))
                        .await);
                }
                if self.clock.now() >= since + self.phased.provider_horizon {
                    return Err(self.park(&format!("call {name} is past its provider horizon")).await);
                }
                tracing::info!(target: telemetry::TARGET, call = name, "repeating an unfinished call");
            }
            None => {
                let name = name.to_owned();
                let now = self.clock.now();
                self.commit(async |_, points| {
                    points.push(Point {
                        name,
                        output: None,
                        since: Some(now),
                    });
                    Ok(())
                })
                .await?;
            }
        }
        let provider_key = self.provider_key(name).ok_or_else(fenced)?;
        let value = f(&provider_key).await.map_err(Error::Operation)?;
        // The call was made: its result is recorded whatever its size, since
        // refusing it would make the call again on the next attempt (or park
        // an at-most-once call). A result that cannot be stored at all parks
        // the operation, which then never makes the call again by itself.
        let output = match codec::to_replayable_json(&value) {
            Ok(output) => output,
            Err(_) => {
                return Err(self
                    .park(&format!("the result of call {name} cannot be stored as json"))
                    .await);
            }
        };
        if output.len() > self.phased.config.max_response_len {
            tracing::warn!(
                target: telemetry::TARGET,
                call = name,
                len = output.len(),
                max = self.phased.config.max_response_len,
                "a call's result beyond max_response_len is recorded: the call was made"
            );
        }
        let position = self.position;
        self.commit(async |_, points| {
            points[position].output = Some(output);
            Ok(())
        })
        .await?;
        self.position += 1;
        Ok(value)
    }

    /// [`Steps::provider_key`](super::Steps::provider_key).
    pub(super) fn provider_key(&self, name: &str) -> Option<String> {
        let OperationHold::Leased { op_id, points, .. } = &self.held else {
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

    /// [`Steps::finish`](super::Steps::finish), `f` awaited.
    pub(super) async fn finish<R, E>(
        &mut self,
        f: impl AsyncFnOnce(&mut C) -> Result<R, E>,
    ) -> Result<Finished<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned,
    {
        let phased = self.phased;
        let lease = self.lease;
        let expires_at = |now: NaiveDateTime| C::Rules::storable_time(now + phased.config.retention);
        let (value, expires_at) = self
            .transaction(async |tx, points, now| {
                let value = f(tx).await.map_err(Error::Operation)?;
                let response = stored_json(&phased.config, &value)?;
                let points = serde_json::to_string(points).map_err(Error::Codec)?;
                let expires_at = expires_at(now);
                if !tx
                    .complete_operation(lease, &points, &response, expires_at, now)
                    .await?
                {
                    return Err(fenced());
                }
                Ok((value, expires_at))
            })
            .await?;
        self.held = OperationHold::Done;
        self.expires_at = Some(expires_at);
        Ok(Finished(value))
    }

    /// The point recorded at this position, if any, after checking that it
    /// has this step's name.
    fn recorded<E>(&self, name: &str) -> Result<Option<Point>, Error<E>> {
        let OperationHold::Leased { points, .. } = &self.held else {
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
    async fn commit<T, E>(
        &mut self,
        change: impl AsyncFnOnce(&mut C, &mut Vec<Point>) -> Result<T, Error<E>>,
    ) -> Result<T, Error<E>> {
        let lease = self.lease;
        let until = self.phased.lease;
        self.transaction(async |tx, points, now| {
            let value = change(tx, points).await?;
            let points = serde_json::to_string(points).map_err(Error::Codec)?;
            if !tx.save_points(lease, &points, now + until, now).await? {
                return Err(fenced());
            }
            Ok(value)
        })
        .await
    }

    /// Runs `work` in a transaction holding the operation's key: the first
    /// commit of an attempt that claimed nothing yet inserts the operation
    /// (running, leased to this attempt) before `work` runs. `work` gets the
    /// recovery points to change; they are kept only if it commits.
    async fn transaction<T, E>(
        &mut self,
        work: impl AsyncFnOnce(&mut C, &mut Vec<Point>, NaiveDateTime) -> Result<T, Error<E>>,
    ) -> Result<T, Error<E>> {
        let now = self.clock.now();
        let (claim, mut points) = match &self.held {
            OperationHold::Unclaimed { replace } => (Some((*replace, id::new())), Vec::new()),
            OperationHold::Leased { points, .. } => (None, points.clone()),
            OperationHold::Done => return Err(fenced()),
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
            caller_hash: self.caller_hash,
            traceparent: self.origin.traceparent.as_deref(),
            request_id: self.origin.request_id.as_deref(),
        });
        // A completed operation this attempt replaces expired by then (its
        // tombstone's grace period ended too, where the policy keeps one).
        let reusable_by = self.phased.config.reusable_by(now);
        let held = (self.lease.scope, self.lease.key);
        let points_kept = &mut points;
        let result = within_key(
            self.conn,
            &self.phased.config,
            held,
            None,
            None,
            async |tx, guard, _| {
                if let (Some((replace, _)), Some(operation)) = (&claim, &new_operation) {
                    if *replace {
                        tx.delete_expired_operation(operation.scope, operation.idempotency_key, reusable_by)
                            .await?;
                    }
                    if !tx.insert_operation(operation).await? {
                        // Another attempt claimed the key since this one read it.
                        return Err(Error::InProgress);
                    }
                }
                // A panic in `work` (the application's step) rolls the
                // transaction back, as an error does, and goes on from
                // `within_key`: the attempt's end frees the lease on a
                // connection that is out of its transaction.
                let value = guard
                    .catching_panic(tx, async |tx| work(tx, points_kept, now).await)
                    .await??;
                guard.committing();
                Ok(value)
            },
        )
        .await?;
        match (&mut self.held, claim) {
            (OperationHold::Leased { points: held, .. }, None) => *held = points,
            (held, Some((_, op_id))) => *held = OperationHold::Leased { op_id, points },
            (OperationHold::Done | OperationHold::Unclaimed { .. }, None) => {}
        }
        Ok(result)
    }

    /// Parks the operation for a person and says so.
    async fn park<E>(&mut self, reason: &str) -> Error<E> {
        let now = self.clock.now();
        let lease = self.lease;
        let parked = self
            .conn
            .write(self.phased.config.in_flight, async |tx| {
                tx.park_operation(lease, reason, now).await
            })
            .await;
        match parked {
            Ok(true) => {
                tracing::warn!(target: telemetry::TARGET, reason, "operation parked for a person");
                self.held = OperationHold::Done;
                Error::Parked
            }
            Ok(false) => fenced(),
            Err(error) => write_failed::<C, E>(error),
        }
    }

    /// Frees the lease after a failed attempt, so that a retry resumes at
    /// once; the failure is noted for operators.
    async fn release(&mut self, why: &str) {
        if !matches!(self.held, OperationHold::Leased { .. }) {
            return;
        }
        let now = self.clock.now();
        let lease = self.lease;
        let released = self
            .conn
            .write(self.phased.config.in_flight, async |tx| {
                tx.release_operation(lease, why, now).await
            })
            .await;
        if let Err(error) = released {
            tracing::warn!(target: telemetry::TARGET, %error, "could not free the lease; it runs out by itself");
        }
    }
}

/// Another attempt took the operation over: this one may commit nothing.
fn fenced<E>() -> Error<E> {
    tracing::info!(target: telemetry::TARGET, "lease taken over by another attempt");
    Error::InProgress
}

/// A write of an attempt that failed: a wait for the write lock that ran
/// out under the in-flight policy is a 409, as for the steps' transactions.
pub(super) fn write_failed<C: KeyStore, E>(error: diesel::result::Error) -> Error<E> {
    call_error::<C::Rules, E>(Error::Storage(error), false)
}

/// Why an attempt failed, as operators read it: never the operation's own
/// error text, which may quote the request.
fn failure<E>(error: &Error<E>) -> String {
    match error {
        Error::Operation(_) => String::from("a step failed"),
        Error::Storage(cause) => format!("storage failed: {cause}"),
        Error::Codec(_) => String::from("a value could not be stored as json"),
        Error::InProgress => String::from("another attempt took the operation over"),
        Error::PhaseRenamed { position, .. } => format!("the step at position {position} was renamed"),
        _ => String::from("the attempt failed"),
    }
}
