//! The idempotent call from an async handler: the sync diesel work on
//! tokio's blocking pool, its errors as HTTP responses.

use std::error::Error as StdError;
use std::fmt;

use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde::ser::{SerializeStruct, Serializer};

use super::gate;
use super::key::Endpoint;
use super::pool::sealed::Unavailable;
use super::{Answer, ConnectionPool, IdempotencyKey, Problem, ProblemKind, Problems};
use crate::backend::KeyStore;
use crate::outcome::Recorded;
use crate::phased::{Finished, Phased, Steps};
use crate::telemetry::CallTrace;
use crate::{Config, Error, InFlight, StoreConnection};

/// Why [`run`] gave no outcome, and the response that says so.
///
/// What committed: nothing, and the key is free, in every case but two
/// [`Failed`](Failure::Failed) ones. After a commit that failed without the
/// database refusing it ([`Error::OutcomeUnknown`], a 503) the operation
/// may or may not have been carried out: the client's retry with the same
/// key replays it if it was, and executes it if it was not. After a replay
/// whose stored response no longer decodes ([`Error::Codec`], a 500) the
/// key stays spent. As a response: the operation's own error through its
/// `IntoResponse`, the application's mapping; every other failure as its
/// problem.
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

impl<E: IntoResponse> IntoResponse for Failure<E> {
    fn into_response(self) -> Response {
        match self {
            Failure::Operation(error) => error.into_response(),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => problem.into_response(),
        }
    }
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Operation(error) => error.fmt(f),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => {
                f.write_str(problem.detail().unwrap_or(problem.title()))
            }
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

/// Runs `op` at most once for the key, as [`Config::run`] does, from an
/// async handler: a connection is checked out of `pool` and the call made
/// on tokio's blocking pool, and the result comes back as something a
/// handler returns: an [`Answer`], the [`Outcome`](crate::Outcome) with
/// the expiry header.
///
/// `op` gets the connection, inside the transaction that also holds the
/// key record, and the request. Return the response to store, usually a
/// [`StoredResponse`](super::StoredResponse); an `Err` rolls everything
/// back and leaves the key free.
///
/// The key is bound to the caller's scope, to `request` and to the endpoint
/// the [`IdempotencyKey`] was sent to (method, matched route, path
/// parameters, query): the fingerprint covers them all, so the same key and
/// body sent to another endpoint is a 422, never that endpoint's replay of
/// the first one's response. A key made
/// [`across_endpoints`](IdempotencyKey::across_endpoints) is bound to
/// `request` alone.
///
/// How it behaves, and why:
///
/// - **What the key rules refuse is answered at once.** The scope and the
///   key are checked against the rules of `config` before a connection is
///   checked out: a request that can never succeed gets its 400 (or, for
///   the scope, 500) even while the pool is exhausted, not a 503 that tells
///   the client to retry it.
/// - **Duplicates wait without a connection.** Under
///   [`InFlight::Wait`](crate::InFlight::Wait), requests with one scope and
///   key in this process pass one at a time, and the others wait for their
///   turn before checking out a connection, as long as the wait allows
///   (then a 409). A flood of duplicates of one slow request thus holds one
///   pooled connection, not the pool, and every other request is served
///   meanwhile. Each in turn then asks the database, which decides as ever
///   (replay, mismatch, or a holder in another process to wait for).
///   Turns are per backend, not per pool: two databases of one backend
///   served by one process share the turns of a scope and key. Under
///   `InFlight::Reject` no one waits, and the database answers at once.
/// - **No async worker blocks.** Checkout, the transaction and any wait
///   at the database for a request in progress with the same key all
///   happen on a blocking thread, the pattern of axum's diesel example.
/// - **A client that goes away changes nothing.** The blocking task is not
///   cancelled when the handler's future is dropped: the transaction commits
///   or rolls back as a whole, and the client's retry replays the result.
/// - **A panic in `op`** rolls the transaction back (nothing is committed,
///   the key stays free) and becomes a 500.
/// - **Errors** become [`Failure`]: `op`'s own error as
///   [`Failure::Operation`], answered through `E`'s `IntoResponse`; the
///   others as problems described by the [`Problems`] that came with the key.
///   The scope comes from the server's own authentication ([`Caller`](super::Caller)),
///   so an invalid scope is the server's mistake: a 500, not the 400 of
///   [`Error::status_code`], whose generic mapping assumes a scope the
///   client may have chosen.
///
/// # Errors
///
/// | failure | status | when |
/// | --- | --- | --- |
/// | [`Failure::Operation`] | `E`'s | `op` returned `Err` |
/// | [`Failure::Refused`] | 400 | the key breaks the key rules of `config` (checked before the checkout) |
/// | [`Failure::Refused`] | 422 | the key was used with a different request |
/// | [`Failure::Refused`] | 422 | the key was used at another endpoint (unless [`across_endpoints`](IdempotencyKey::across_endpoints)) |
/// | [`Failure::Refused`] | 409 + `Retry-After` | a request with the key is in progress beyond the in-flight wait, in this process or at the database (on SQLite, any write that holds the database that long) |
/// | [`Failure::Failed`] | 503 + `Retry-After` | no connection from `pool` within its connection timeout (for a deadpool pool without a wait timeout, 5 s) |
/// | [`Failure::Failed`] | 503 + `Retry-After` | [`Error::OutcomeUnknown`]: the commit failed without the database refusing it, so the operation may or may not have been carried out; the retry with the same key tells which |
/// | [`Failure::Failed`] | 500, [`ProblemKind::ResponseTooLarge`] | the result is beyond [`Config::max_response_len`]; nothing committed |
/// | [`Failure::Failed`] | 500 | storage or JSON failed (a [`StoredResponse`](super::StoredResponse) with a header it refuses, too), an invalid scope (checked before the checkout), or `op` panicked |
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # tokio::runtime::Runtime::new()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use axum::response::IntoResponse;
/// use diesel::prelude::*;
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use idempotency::http::{self, Caller, IdempotencyKey, Problem, StoredResponse};
/// use idempotency::Config;
///
/// # struct Anyone;
/// # impl<S: Sync> FromRequestParts<S> for Anyone {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(Anyone) }
/// # }
/// # impl Caller for Anyone { fn scope(&self) -> Cow<'_, str> { Cow::Borrowed("public") } }
/// let db = idempotency::testing::SqliteFile::new();
/// let pool = Pool::new(ConnectionManager::<SqliteConnection>::new(db.path().to_str().ok_or("utf-8 path")?))?;
/// let config = Config::default();
/// let (mut parts, ()) = Request::post("/charges").header("Idempotency-Key", "c-1").body(())?.into_parts();
/// let Ok(key) = IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await else {
///     return Err("the key was refused".into());
/// };
///
/// let charge = |cents: u32| {
///     http::run(&pool, &config, &key, cents, |_conn, cents| {
///         if *cents == 0 {
///             return Err(Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "Unprocessable Entity"));
///         }
///         Ok(StoredResponse::new(StatusCode::CREATED, format!("charged {cents}")))
///     })
/// };
///
/// // Refused by the operation: nothing stored, the key stays free.
/// assert_eq!(charge(0).await.into_response().status(), StatusCode::UNPROCESSABLE_ENTITY);
///
/// let first = charge(500).await.into_response();
/// assert_eq!(first.status(), StatusCode::CREATED);
/// let retry = charge(500).await.into_response();
/// assert_eq!(retry.status(), StatusCode::CREATED);
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// assert_eq!(retry.headers()["idempotency-expires"], first.headers()["idempotency-expires"]);
///
/// // The same key with another request.
/// assert_eq!(charge(900).await.into_response().status(), StatusCode::UNPROCESSABLE_ENTITY);
/// # Ok(())
/// # })
/// # }
/// ```
pub async fn run<A, P, Q, R, E, F>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    request: Q,
    op: F,
) -> Result<Answer<R>, Failure<E>>
where
    P: ConnectionPool,
    Q: Serialize + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
    F: FnOnce(&mut P::Connection, &Q) -> Result<R, E> + Send + 'static,
{
    refuse_by_rule::<P::Connection, A, E>(config, key)?;
    let config = config.clone();
    let endpoint = key.endpoint().cloned();
    let recorded = blocking(pool, config.in_flight, key, move |conn, scope, key| {
        let bound = Bound::new(endpoint.as_ref(), &request);
        config.run_recorded(conn, scope, key, &bound, |tx| op(tx, &request))
    })
    .await?;
    Ok(Answer::new(
        recorded.outcome,
        recorded.expires_at,
        key.expiry_header().clone(),
    ))
}

/// Runs a [phased operation](crate::phased) for the key from an async
/// handler, as [`run`] does for a single call: checkout and every step on
/// tokio's blocking pool, the failures as responses. `body` gets the
/// [`Steps`] and the request.
///
/// A phased operation's foreign call blocks its blocking thread while it
/// runs, never an async worker. A client that goes away changes nothing:
/// the attempt goes on and commits its recovery points.
///
/// # Errors
///
/// As [`run`], and [`Error::Parked`] and [`Error::PhaseRenamed`] as 500
/// problems. [`Failure::Operation`] after the operation's first commit
/// keeps its recovery point: the client retries the same request.
pub async fn run_phased<A, P, Q, R, E, F>(
    pool: &P,
    phased: &Phased,
    key: &IdempotencyKey<A>,
    request: Q,
    body: F,
) -> Result<Answer<R>, Failure<E>>
where
    P: ConnectionPool,
    Q: Serialize + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
    F: FnOnce(&mut Steps<'_, P::Connection>, &Q) -> Result<Finished<R>, Error<E>> + Send + 'static,
{
    refuse_by_rule::<P::Connection, A, E>(&phased.config, key)?;
    let phased = phased.clone();
    let endpoint = key.endpoint().cloned();
    let (outcome, expires_at) = blocking(pool, phased.config.in_flight, key, move |conn, scope, key| {
        let bound = Bound::new(endpoint.as_ref(), &request);
        phased.run_expiring(conn, scope, key, &bound, |steps| body(steps, &request))
    })
    .await?;
    Ok(Answer::new(outcome, expires_at, key.expiry_header().clone()))
}

/// What a key is bound to: the request value, with the endpoint it was
/// sent to unless the key spans endpoints. Without an endpoint it is the
/// request value itself, so the fingerprint is the one the request alone
/// has.
struct Bound<'a, Q> {
    endpoint: Option<&'a Endpoint>,
    request: &'a Q,
}

impl<'a, Q> Bound<'a, Q> {
    fn new(endpoint: Option<&'a Endpoint>, request: &'a Q) -> Self {
        Bound { endpoint, request }
    }
}

impl<Q: Serialize> Serialize for Bound<'_, Q> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Some(endpoint) = self.endpoint else {
            return self.request.serialize(serializer);
        };
        let mut bound = serializer.serialize_struct("Bound", 2)?;
        bound.serialize_field("endpoint", endpoint)?;
        bound.serialize_field("request", self.request)?;
        bound.end()
    }
}

/// Refuses a scope or key that breaks the key rules of `config` on the
/// backend of `C` before any connection is checked out. Such a request can never
/// succeed, so it must not wait for a busy pool and then be told to retry
/// (503 with `Retry-After`): it gets its answer at once, traced and counted
/// as the call would have been.
pub(super) fn refuse_by_rule<C: StoreConnection, A, E>(
    config: &Config,
    key: &IdempotencyKey<A>,
) -> Result<(), Failure<E>> {
    let Err(broken) = config.check_rules::<C::Raw, E>(key.scope(), key.key(), None) else {
        return Ok(());
    };
    let refused: Result<Recorded<()>, Error<E>> = Err(broken);
    CallTrace::start(<C::Raw as KeyStore>::BACKEND).finish(&refused);
    refused.map(drop).map_err(|error| failure(error, key.problems()))
}

/// Makes `call` with a connection of `pool` and the key on tokio's blocking
/// pool; the failures as responses.
pub(super) async fn blocking<A, P, T, E, F>(
    pool: &P,
    in_flight: InFlight,
    key: &IdempotencyKey<A>,
    call: F,
) -> Result<T, Failure<E>>
where
    P: ConnectionPool,
    T: Send + 'static,
    E: Send + 'static,
    F: FnOnce(&mut P::Connection, &str, &str) -> Result<T, Error<E>> + Send + 'static,
{
    let problems = key.problems();
    let (scope, idempotency_key) = (key.scope().to_owned(), key.key().to_owned());
    let Ok(turn) = gate::turn::<P::Connection>(&scope, &idempotency_key, in_flight).await else {
        return Err(failure(Error::InProgress, problems));
    };
    let called = pool
        .clone()
        .with_connection(Box::new(move |conn| {
            // The turn ends with the call, also when the handler is gone.
            let _turn = turn;
            call(conn, &scope, &idempotency_key)
        }))
        .await;
    match called {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(failure(error, problems)),
        Err(Unavailable::Checkout(cause)) => Err(Failure::Failed {
            problem: problems
                .problem(ProblemKind::Unavailable)
                .with_detail("the server is busy; nothing was done, retry later"),
            cause,
        }),
        // A panic in the operation, or a runtime shutting down before the
        // task started: either way nothing was committed.
        Err(Unavailable::Aborted(cause)) => Err(internal(problems, false, cause)),
    }
}

fn failure<E>(error: Error<E>, problems: &Problems) -> Failure<E> {
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
                problem: problems.problem(ProblemKind::Internal).with_detail(
                    "the operation was stopped and waits for the service's operators; retrying does not help",
                ),
                cause: Box::new(cause),
            };
        }
        other => other,
    };
    // A storage failure of the moment (a lost connection, a deadlock) may
    // succeed when the same request is sent again; the client is told so.
    internal(problems, cause.is_retryable(), Box::new(cause))
}

fn internal<E>(problems: &Problems, retryable: bool, cause: Box<dyn StdError + Send + Sync>) -> Failure<E> {
    Failure::Failed {
        problem: problems
            .problem(ProblemKind::Internal)
            .with_detail("the server could not complete the request")
            .with_retryable(retryable),
        cause,
    }
}
