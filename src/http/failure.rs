//! Why a call over HTTP gave no outcome: each error of the call as the
//! response that tells the client what it may do next.

use std::error::Error as StdError;
use std::fmt;

use super::{Problem, ProblemKind, Problems};
use crate::Error;

/// Why [`run`](super::run) gave no outcome, and the response that says so.
///
/// What committed: nothing, and the key is free, in every case but two
/// [`Failed`](Failure::Failed) ones. After a commit that failed without the
/// database refusing it ([`Error::OutcomeUnknown`], a 503) the operation
/// may or may not have been carried out: the client's retry with the same
/// key replays it if it was, and executes it if it was not. After a replay
/// whose stored response no longer decodes ([`Error::Codec`], a 500) the
/// key stays spent. As a response: the operation's own error through its
/// `IntoResponse` (actix-web: its `ResponseError`), the application's
/// mapping; every other failure as its problem.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure<E> {
    /// The operation returned this error ([`Error::Operation`]). Everything
    /// it wrote was rolled back and the key is still free, so the client may
    /// correct the request and retry with the same key.
    Operation(E),
    /// The request was refused: the key breaks the key rules (400), was
    /// used with another request (422), or is held by a request in progress
    /// (409, with `Retry-After`).
    Refused(Problem),
    /// The call could not be completed: no pooled connection in time (503,
    /// with `Retry-After`), a commit whose outcome is unknown (503, with
    /// `Retry-After`: retry with the same key), storage or JSON failed, or
    /// the operation panicked (500). `cause` is for the server's log; the
    /// problem says nothing about it.
    Failed {
        /// What the client is told.
        problem: Problem,
        /// What went wrong.
        cause: Box<dyn StdError + Send + Sync>,
    },
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Operation(error) => error.fmt(f),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => problem.fmt(f),
        }
    }
}

impl<E: StdError + 'static> StdError for Failure<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            // Shown as this error itself, so its chain goes on with its own source.
            Failure::Operation(error) => error.source(),
            Failure::Refused(_) => None,
            Failure::Failed { cause, .. } => Some(&**cause),
        }
    }
}

/// What a retry and a lookup of a parked operation tell the client.
pub(super) const PARKED: &str = "the request with this idempotency key was stopped partway and waits for the \
     service's operators; sending it again does not help, and sending it under a new key may carry it out twice";

impl<E> Failure<E> {
    /// The failure of a call that ended in `error`, its problem described
    /// by `problems`.
    pub(super) fn of(error: Error<E>, problems: &Problems) -> Self {
        let error = match error.into_operation() {
            Ok(error) => return Failure::Operation(error),
            Err(error) => error,
        };
        let cause = match error {
            Error::InvalidKey(reason) => {
                let problem = problems
                    .problem(ProblemKind::InvalidKey)
                    .with_detail(format!("the idempotency key {reason}"));
                return Failure::Refused(problem);
            }
            Error::Mismatch => {
                let problem = problems
                    .problem(ProblemKind::KeyReused)
                    .with_detail("this idempotency key was first used with a different request");
                return Failure::Refused(problem);
            }
            Error::AlreadyCompleted => {
                let problem = problems.problem(ProblemKind::KeyCompleted).with_detail(
                    "the request with this idempotency key has already completed; a new request takes a new key",
                );
                return Failure::Refused(problem);
            }
            Error::Expired => {
                let problem = problems.problem(ProblemKind::KeyExpired).with_detail(
                    "the request with this idempotency key was carried out, but its result is no longer kept; \
                     a new request takes a new key",
                );
                return Failure::Refused(problem);
            }
            Error::InProgress => {
                let problem = problems
                    .problem(ProblemKind::InProgress)
                    .with_detail("a request with this idempotency key is still being processed; retry later");
                return Failure::Refused(problem);
            }
            cause @ Error::OutcomeUnknown(_) => {
                return Failure::Failed {
                problem: problems.problem(ProblemKind::Unavailable).with_detail(
                    "the request may or may not have been carried out; retry it with the same Idempotency-Key to learn which",
                ),
                cause: Box::new(cause),
            };
            }
            cause @ Error::ResponseTooLarge { max, .. } => {
                return Failure::Failed {
                    problem: problems.problem(ProblemKind::ResponseTooLarge).with_detail(format!(
                        "the response is larger than the {max} bytes the server stores for a key; nothing was done"
                    )),
                    cause: Box::new(cause),
                };
            }
            cause @ Error::Parked => {
                return Failure::Failed {
                    problem: problems.problem(ProblemKind::OperationParked).with_detail(PARKED),
                    cause: Box::new(cause),
                };
            }
            other => other,
        };
        // A storage failure of the moment (a lost connection, a deadlock) may
        // succeed when the same request is sent again; the client is told so.
        Failure::internal(problems, cause.is_retryable(), Box::new(cause))
    }

    /// No connection from the pool in time; nothing was done.
    pub(super) fn unavailable(problems: &Problems, cause: Box<dyn StdError + Send + Sync>) -> Self {
        Failure::Failed {
            problem: problems
                .problem(ProblemKind::Unavailable)
                .with_detail("the server is busy; nothing was done, retry later"),
            cause,
        }
    }

    /// A 500: the server could not complete the call; `retryable` tells the
    /// client whether the same request may succeed when sent again.
    pub(super) fn internal(problems: &Problems, retryable: bool, cause: Box<dyn StdError + Send + Sync>) -> Self {
        Failure::Failed {
            problem: problems
                .problem(ProblemKind::Internal)
                .with_detail("the server could not complete the request")
                .with_retryable(retryable),
            cause,
        }
    }
}
