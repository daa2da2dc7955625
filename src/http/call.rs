//! The idempotent call from an async handler: the key rules checked at
//! once, then a turn among this process's duplicates of the key, then the
//! sync diesel work on a pooled connection on tokio's blocking pool; its
//! errors as responses.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::endpoint::BoundRequest;
use super::gate;
use super::pool::sealed::Unavailable;
use super::{Answer, ConnectionPool, Failure, IdempotencyKey};
use crate::backend::{BackendRules, RulesOf};
use crate::outcome::{Answered, Recorded};
use crate::phased::{Finished, Phased, Steps};
use crate::telemetry::CallTrace;
use crate::{Config, Error, InFlight, StoreConnection};

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
/// The key is bound to the caller's scope, to `request`, to the endpoint
/// the [`IdempotencyKey`] was sent to (method, matched route, path
/// parameters, query) and to the caller's
/// [`principal`](super::Caller::principal) where it is not the scope: the
/// fingerprint covers them all, so the same key and body sent to another
/// endpoint, or by another user of a tenant's scope, is a 422, never a
/// replay of the first one's response. A key made
/// [`across_endpoints`](IdempotencyKey::across_endpoints) is bound to
/// `request` (and the principal) alone. `request` is bound as it
/// serializes, hash sets in it with their elements sorted, so the same body
/// sent again is replayed; it must be a function of the body
/// ([what a request type must be](crate::guide::contract#what-a-request-type-must-be)).
/// The record is stored with its principal and endpoint, so that
/// [`lookup`](super::lookup) answers it to that principal at that endpoint
/// alone.
///
/// How it behaves, and why:
///
/// - **What the key rules refuse is answered at once.** The scope and the
///   key are checked against the rules of `config` before a connection is
///   checked out: a request that can never succeed gets its 400 (or, for
///   the scope, 500) even while the pool is exhausted, not a 503 that tells
///   the client to retry it.
/// - **Duplicates wait without a connection.** Under
///   [`InFlight::Wait`], requests with one scope and
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
///   others as problems described by the [`Problems`](super::Problems) that came with the key.
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
/// | [`Failure::Failed`] | 500, [`ProblemKind::ResponseTooLarge`](super::ProblemKind::ResponseTooLarge) | the result is beyond [`Config::max_response_len`]; nothing committed |
/// | [`Failure::Failed`] | 500 | storage or JSON failed (a [`StoredResponse`](super::StoredResponse) with a header it refuses, too), an invalid scope (checked before the checkout), or `op` panicked |
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
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
    let owned = config.clone();
    let sent = key.sender();
    bound_call(pool, config, key, request, move |conn, scope, key, bound| {
        let recorded =
            owned.run_recorded_by(conn, scope, key, bound, sent.as_sender(), |tx| op(tx, bound.request()))?;
        Ok((recorded.outcome, recorded.expires_at, recorded.origin))
    })
    .await
}

/// [`run`] on a pool of diesel-async connections (feature
/// `diesel-async`): `op` is an async closure, run on the connection inside
/// the transaction that also holds the key record, and nothing runs on the
/// blocking pool. The key rules, the turns of duplicates, the endpoint the
/// key is bound to, the answers and the failures are [`run`]'s.
///
/// One thing differs, by design: the call runs in the handler's own
/// future, so a client that goes away before the call has committed drops
/// it, and the transaction rolls back as a whole: the key stays free, and
/// the client's retry executes. (The blocking call of [`run`] goes on and
/// commits, and the retry replays.) Either way nothing is left by halves,
/// and the connection of a dropped call never goes back to the pool inside
/// its transaction; see [`AsyncConnectionPool`](crate::AsyncConnectionPool)
/// and the [async guide](crate::guide::asynchronous).
///
/// # Errors
///
/// As [`run`]; a panic in `op` rolls the transaction back and is a 500.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use axum::response::IntoResponse;
/// use diesel::SqliteConnection;
/// use diesel_async::pooled_connection::{bb8::Pool, AsyncDieselConnectionManager};
/// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
/// use idempotency::http::{self, Caller, IdempotencyKey, StoredResponse};
/// use idempotency::Config;
///
/// # struct Anyone;
/// # impl<S: Sync> FromRequestParts<S> for Anyone {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(Anyone) }
/// # }
/// # impl Caller for Anyone { fn scope(&self) -> Cow<'_, str> { Cow::Borrowed("public") } }
/// type Conn = SyncConnectionWrapper<SqliteConnection>;
/// let db = idempotency::testing::SqliteFile::new();
/// let url = db.path().to_str().ok_or("utf-8 path")?;
/// idempotency::run_migrations(&mut <SqliteConnection as diesel::Connection>::establish(url)?)?;
/// let pool = Pool::<Conn>::builder().build(AsyncDieselConnectionManager::new(url)).await?;
/// let config = Config::default();
/// let (mut parts, ()) = Request::post("/charges").header("Idempotency-Key", "c-1").body(())?.into_parts();
/// let Ok(key) = IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await else {
///     return Err("the key was refused".into());
/// };
///
/// let charge = async |cents: u32| {
///     http::run_async(&pool, &config, &key, cents, async |_: &mut Conn, cents: &u32| {
///         Ok::<_, StatusCode>(StoredResponse::new(StatusCode::CREATED, format!("charged {cents}")))
///     })
///     .await
/// };
/// assert_eq!(charge(500).await.into_response().status(), StatusCode::CREATED);
/// let retry = charge(500).await.into_response();
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub async fn run_async<A, P, Q, R, E, F>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    request: Q,
    op: F,
) -> Result<Answer<R>, Failure<E>>
where
    P: crate::AsyncConnectionPool,
    Q: Serialize,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut P::Connection, &Q) -> Result<R, E>,
{
    lent_call(
        pool,
        config,
        key,
        request,
        async |conn: &mut P::Connection, bound: &BoundRequest<Q>| {
            let sent = key.sender();
            let recorded = config
                .run_recorded_by_async(
                    conn,
                    key.scope(),
                    key.key(),
                    bound,
                    sent.as_sender(),
                    async |tx: &mut P::Connection| op(tx, bound.request()).await,
                )
                .await?;
            Ok((recorded.outcome, recorded.expires_at, recorded.origin))
        },
    )
    .await
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
    let owned = phased.clone();
    let sent = key.sender();
    bound_call(pool, &phased.config, key, request, move |conn, scope, key, bound| {
        owned.run_recorded(conn, scope, key, bound, sent.as_sender(), |steps| {
            body(steps, bound.request())
        })
    })
    .await
}

/// [`run_phased`] on a pool of diesel-async connections (feature
/// `diesel-async`): `body` is an async closure that gets the
/// [`AsyncSteps`](crate::phased::AsyncSteps) and the request, every step is
/// awaited in the handler's own future, and the foreign call awaits its
/// provider; nothing runs on the blocking pool. The key rules, the turns of
/// duplicates, the endpoint the key is bound to, the answers and the
/// failures are [`run_phased`]'s.
///
/// A client that goes away drops the attempt where it stands: a step that
/// had not committed rolls back as a whole (its connection never goes back
/// to the pool inside its transaction), the committed recovery points stay,
/// and the attempt's lease stays held until it runs out
/// ([`Phased::lease`]), as a crashed worker's would. A retry within the
/// lease is a 409 with `Retry-After`; after it, the retry resumes from the
/// last recovery point, and a call that was cut off is made again with its
/// provider key. See the [async guide](crate::guide::asynchronous).
///
/// # Errors
///
/// As [`run_phased`]; a panic in `body` frees the lease and is a 500.
#[cfg(feature = "diesel-async")]
pub async fn run_phased_async<A, P, Q, R, E, F>(
    pool: &P,
    phased: &Phased,
    key: &IdempotencyKey<A>,
    request: Q,
    body: F,
) -> Result<Answer<R>, Failure<E>>
where
    P: crate::AsyncConnectionPool,
    Q: Serialize,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut crate::phased::AsyncSteps<'_, P::Connection>, &Q) -> Result<Finished<R>, Error<E>>,
{
    use crate::phased::AsyncSteps;

    lent_call(
        pool,
        &phased.config,
        key,
        request,
        async |conn: &mut P::Connection, bound: &BoundRequest<Q>| {
            let sent = key.sender();
            phased
                .run_recorded_async(
                    conn,
                    key.scope(),
                    key.key(),
                    bound,
                    sent.as_sender(),
                    async |steps: &mut AsyncSteps<'_, P::Connection>| body(steps, bound.request()).await,
                )
                .await
        },
    )
    .await
}

/// The path that [`run_async`] and [`run_phased_async`] share, in the
/// handler's own future: the key rules of `config` and the key's turn in
/// this process, then `call` with a connection lent by `pool` and the
/// request bound to the key's endpoint; its outcome answered with the key's
/// expiry header, its failures and a panic as responses.
#[cfg(feature = "diesel-async")]
async fn lent_call<A, P, Q, R, E>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    request: Q,
    call: impl AsyncFnOnce(&mut P::Connection, &BoundRequest<Q>) -> Result<Answered<R>, Error<E>>,
) -> Result<Answer<R>, Failure<E>>
where
    P: crate::AsyncConnectionPool,
{
    type Rules<P> = RulesOf<<P as crate::AsyncConnectionPool>::Connection>;
    refuse_by_rules_of::<Rules<P>, A, E>(config, key)?;
    let problems = key.problems();
    let Ok(_turn) = gate::turn(Rules::<P>::NAME, key.scope(), key.key(), config.in_flight).await else {
        return Err(Failure::of(Error::InProgress, problems));
    };
    let mut conn = pool
        .lend()
        .await
        .map_err(|cause| Failure::unavailable(problems, cause))?;
    let bound = BoundRequest::new(key.endpoint().cloned(), key.principal_beside_scope(), request);
    match crate::backend::catch_unwind(call(&mut *conn, &bound)).await {
        Ok(Ok(answered)) => Ok(Answer::marked(answered, key.marks().clone())),
        Ok(Err(error)) => Err(Failure::of(error, problems)),
        // The transaction the panic was in rolled back before the panic
        // went on: a single call committed nothing; a phased operation
        // keeps the recovery points it committed before, with its lease
        // freed.
        Err(_) => Err(Failure::internal(problems, false, "the operation panicked".into())),
    }
}

/// The path that [`run`] and [`run_phased`] share: `call` gets the
/// request bound to the key's endpoint (what the key is fingerprinted
/// with), is made on the blocking pool by [`blocking`], and its outcome is
/// answered with the key's expiry header.
async fn bound_call<A, P, Q, R, E, F>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    request: Q,
    call: F,
) -> Result<Answer<R>, Failure<E>>
where
    P: ConnectionPool,
    Q: Serialize + Send + 'static,
    R: Send + 'static,
    E: Send + 'static,
    F: FnOnce(&mut P::Connection, &str, &str, &BoundRequest<Q>) -> Result<Answered<R>, Error<E>> + Send + 'static,
{
    let bound = BoundRequest::new(key.endpoint().cloned(), key.principal_beside_scope(), request);
    let answered = blocking(pool, config, config.in_flight, key, move |conn, scope, key| {
        call(conn, scope, key, &bound)
    })
    .await?;
    Ok(Answer::marked(answered, key.marks().clone()))
}

/// Makes `call` with a connection of `pool` and the key on tokio's blocking
/// pool, once the key rules of `config` pass and the key's turn in this
/// process comes (as long as `in_flight` waits); the failures as responses.
pub(super) async fn blocking<A, P, T, E, F>(
    pool: &P,
    config: &Config,
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
    refuse_by_rule::<P::Connection, A, E>(config, key)?;
    let problems = key.problems();
    let (scope, idempotency_key) = (key.scope().to_owned(), key.key().to_owned());
    let Ok(turn) = gate::turn(backend_name::<P::Connection>(), &scope, &idempotency_key, in_flight).await else {
        return Err(Failure::of(Error::InProgress, problems));
    };
    let called = pool
        .clone()
        .with_connection(
            scope.clone(),
            Box::new(move |conn| {
                // The turn ends with the call, also when the handler is gone.
                let _turn = turn;
                call(conn, &scope, &idempotency_key)
            }),
        )
        .await;
    match called {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(Failure::of(error, problems)),
        Err(Unavailable::Checkout(cause)) => Err(Failure::unavailable(problems, cause)),
        // A panic in the operation, or a runtime shutting down before the
        // task started: either way nothing was committed.
        Err(Unavailable::Aborted(cause)) => Err(Failure::internal(problems, false, cause)),
    }
}

/// Refuses a scope or key that breaks the key rules of `config` on the
/// backend of `C` before any connection is checked out. Such a request can
/// never succeed, so it must not wait for a busy pool and then be told to
/// retry (503 with `Retry-After`): it gets its answer at once, traced and
/// counted as the call would have been.
fn refuse_by_rule<C: StoreConnection, A, E>(config: &Config, key: &IdempotencyKey<A>) -> Result<(), Failure<E>> {
    refuse_by_rules_of::<RulesOf<C::Raw>, A, E>(config, key)
}

/// The name of the backend of connections `C`.
fn backend_name<C: StoreConnection>() -> &'static str {
    RulesOf::<C::Raw>::NAME
}

/// [`refuse_by_rule`] by the rules of the backend of `C`.
fn refuse_by_rules_of<R: BackendRules, A, E>(config: &Config, key: &IdempotencyKey<A>) -> Result<(), Failure<E>> {
    let Err(broken) = config.check_rules::<R, E>(key.scope(), key.key(), None) else {
        return Ok(());
    };
    let refused: Result<Recorded<()>, Error<E>> = Err(broken);
    CallTrace::start(R::NAME).finish(&refused);
    refused.map(drop).map_err(|error| Failure::of(error, key.problems()))
}
