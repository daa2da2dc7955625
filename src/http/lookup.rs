//! The status of a key over HTTP: what became of a request whose response
//! the client lost, asked with the same key and credentials, answered only
//! to the principal and at the endpoints the request was bound to.

use std::convert::Infallible;

use serde::Serialize;
use serde::de::DeserializeOwned;

use http::Method;

use super::call::blocking;
use super::endpoint::{Route, caller_hash};
use super::failure::PARKED;
use super::{Answer, ConnectionPool, Failure, IdempotencyKey, ProblemKind, StoredResponse};
use crate::{Config, InFlight, KeyStatus, Outcome};

/// Answers what became of the request's key in the caller's scope, from an
/// async handler: the caller's own record, as a replay would answer it, on
/// tokio's blocking pool, each status as a response.
///
/// `calls` names the endpoints whose records this lookup answers for: the
/// method and the route of each, as axum or actix-web matched it (the
/// route pattern with its parameters in braces, under any prefix the
/// router was nested at, or the scopes' prefixes on actix-web). A record is answered only to the principal whose call wrote it
/// ([`Caller::principal`](super::Caller::principal)), and only where it was
/// written at one of `calls` with the lookup's own path parameters: a
/// lookup route carries the parameters of its calls' routes
/// (`GET /accounts/{account}/refunds/status` for
/// `POST /accounts/{account}/refunds`). A record of a key made
/// [`across_endpoints`](IdempotencyKey::across_endpoints) is answered to its
/// principal at any lookup. Anything else (another principal's record,
/// another endpoint's, another account's, a record written outside the HTTP
/// layer by [`Config::run`] or before caller hashes were stored) is
/// answered exactly as a key never used is, status, headers and body, so a
/// lookup is no oracle of other callers' keys. Check the caller's
/// permission before the lookup, as before the calls it looks up: a
/// lookup answers what a replay would, and a replay runs none of the
/// operation's code.
///
/// The key comes as for [`run`](super::run): from the `Idempotency-Key`
/// header, through [`IdempotencyKey`], whose authentication extractor runs
/// first. The lookup runs nothing and writes nothing. Single calls and
/// [phased operations](crate::phased) are looked up alike.
///
/// | status | answer |
/// | --- | --- |
/// | completed | the stored response as it was first sent, with `Idempotent-Replayed: true` and the expiry header ([`Answer`]) |
/// | in progress | 409 problem ([`ProblemKind::InProgress`]), `Retry-After`: ask again later; a phased operation that has not finished is in progress |
/// | parked | 500 problem ([`ProblemKind::OperationParked`]): a phased operation stopped partway waits for the service's operators; never send it under a new key |
/// | no record | 404 problem ([`ProblemKind::KeyUnknown`]): nothing was done for this caller here, sending the request again with the key is safe |
/// | expired | 410 problem ([`ProblemKind::KeyExpired`]): it ran, its result is no longer kept; under [`Config::tombstones`] a retry inside the grace period is refused with the same 410 |
///
/// Every answer, the failures below included, carries
/// `Cache-Control: no-store`: it is one caller's, and it changes.
///
/// A key held by a call in flight whose record no read can see yet (the
/// write of a call that takes the key's lock before it writes) is a 409
/// whoever asks: no more than that call itself answers any caller of the
/// scope who sends the key. Where a record is there, it decides.
///
/// The stored response is decoded as `StoredResponse<T>`; a handler that
/// looks up keys of several endpoints takes `T = serde_json::Value`.
///
/// # Errors
///
/// [`Failure::Refused`] for the 404, 409, 410 and 500 (parked) above and
/// for a key the key rules refuse (400, before a connection is checked
/// out); [`Failure::Failed`] with a 503 when no connection is free in
/// time, a 500 when storage fails or the stored response does not decode.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # tokio::runtime::Runtime::new()?.block_on(async {
/// use std::borrow::Cow;
/// use std::convert::Infallible;
/// use axum::extract::{FromRequestParts, State};
/// use axum::http::{request::Parts, Method, Request, StatusCode};
/// use axum::routing::{get, post};
/// use axum::Router;
/// use diesel::prelude::*;
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use idempotency::http::{self, Answer, Caller, Failure, IdempotencyKey, Problem, StoredResponse};
/// use idempotency::Config;
/// use tower::ServiceExt;
///
/// # struct Account;
/// # impl<S: Sync> FromRequestParts<S> for Account {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(Account) }
/// # }
/// # impl Caller for Account { fn scope(&self) -> Cow<'_, str> { Cow::Borrowed("acct-1") } }
/// type Db = Pool<ConnectionManager<SqliteConnection>>;
///
/// async fn charge(State(pool): State<Db>, key: IdempotencyKey<Account>) -> Result<Answer<StoredResponse<u32>>, Failure<Problem>> {
///     http::run(&pool, &Config::default(), &key, (), |_, ()| Ok(StoredResponse::new(StatusCode::CREATED, 500))).await
/// }
///
/// /// `GET /charges/status` with the key and the credentials of the charge:
/// /// what became of a `POST /charges`.
/// async fn charge_status(State(pool): State<Db>, key: IdempotencyKey<Account>) -> Result<Answer<StoredResponse<u32>>, Failure<Infallible>> {
///     http::lookup(&pool, &Config::default(), &key, &[(Method::POST, "/charges")]).await
/// }
///
/// let db = idempotency::testing::SqliteFile::new();
/// let pool = Pool::new(ConnectionManager::new(db.path().to_str().ok_or("utf-8 path")?))?;
/// let app = Router::new()
///     .route("/charges", post(charge))
///     .route("/charges/status", get(charge_status))
///     .with_state(pool);
/// let status = || Request::get("/charges/status").header("idempotency-key", "c-1").body(axum::body::Body::empty());
///
/// let unknown = app.clone().oneshot(status()?).await?;
/// assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
/// assert_eq!(unknown.headers()["cache-control"], "no-store");
/// let charged = Request::post("/charges").header("idempotency-key", "c-1").body(axum::body::Body::empty())?;
/// let charged = app.clone().oneshot(charged).await?;
/// assert_eq!(charged.status(), StatusCode::CREATED);
/// let found = app.clone().oneshot(status()?).await?;
/// assert_eq!(found.status(), StatusCode::CREATED);
/// assert_eq!(found.headers()["idempotent-replayed"], "true");
/// assert_eq!(found.headers()["idempotency-expires"], charged.headers()["idempotency-expires"]);
/// assert_eq!(found.headers()["cache-control"], "no-store");
/// # Ok(())
/// # })
/// # }
/// ```
pub async fn lookup<A, P, T>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    calls: &[(Method, &str)],
) -> Result<Answer<StoredResponse<T>>, Failure<Infallible>>
where
    P: ConnectionPool,
    T: Serialize + DeserializeOwned + Send + 'static,
{
    let looked = look_up(pool, config, key, calls).await;
    looked.map(Answer::not_to_be_stored).map_err(|failure| match failure {
        Failure::Refused(problem) => Failure::Refused(problem.not_to_be_stored()),
        Failure::Failed { problem, cause } => Failure::Failed {
            problem: problem.not_to_be_stored(),
            cause,
        },
        Failure::Operation(never) => match never {},
    })
}

/// [`lookup`], its answers as they are before `Cache-Control` is set.
async fn look_up<A, P, T>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
    calls: &[(Method, &str)],
) -> Result<Answer<StoredResponse<T>>, Failure<Infallible>>
where
    P: ConnectionPool,
    T: Serialize + DeserializeOwned + Send + 'static,
{
    let owned = config.clone();
    // The callers a record may have been written for that this lookup
    // answers: the principal at each of `calls` with the lookup's path
    // parameters, and the principal across endpoints.
    let principal = key.principal();
    let path = key.sent_to().path();
    let callers: Vec<String> = calls
        .iter()
        .map(|(method, route)| {
            let route = Route {
                method: method.as_str(),
                route,
                path,
            };
            caller_hash(principal, Some(route))
        })
        .chain([caller_hash(principal, None)])
        .collect();
    // A lookup waits for no call in progress (it answers 409), so it takes
    // no turn behind the process's duplicates of the key.
    let status = blocking(pool, config, InFlight::Reject, key, move |conn, scope, key| {
        owned.status_for_callers::<_, StoredResponse<T>>(conn, scope, key, &callers)
    })
    .await?;
    let problems = key.problems();
    let refused = |kind, detail: &str| Err(Failure::Refused(problems.problem(kind).with_detail(detail)));
    match status {
        KeyStatus::Completed {
            response,
            expires_at,
            origin,
            ..
        } => Ok(Answer::marked(
            (Outcome::Replayed(response), expires_at, origin),
            key.marks().clone(),
        )),
        KeyStatus::InProgress => refused(
            ProblemKind::InProgress,
            "a request with this idempotency key is still being processed; look again later",
        ),
        KeyStatus::Parked => refused(ProblemKind::OperationParked, PARKED),
        // A retry is refused as expired until the grace period ends, and
        // the lookup says what a retry would hear.
        KeyStatus::Tombstoned { .. } => refused(
            ProblemKind::KeyExpired,
            "the request with this idempotency key was carried out, but its result is no longer kept; \
             sending it again with the key is refused",
        ),
        KeyStatus::Expired { .. } => refused(
            ProblemKind::KeyExpired,
            "the request with this idempotency key was carried out, but its result is no longer kept",
        ),
        KeyStatus::NoRecord => refused(
            ProblemKind::KeyUnknown,
            "no request with this idempotency key was carried out; sending it again with the key is safe",
        ),
    }
}
