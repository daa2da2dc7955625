//! The status of a key over HTTP: what became of a request whose response
//! the client lost, asked with the same key and credentials.

use std::convert::Infallible;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::call::blocking;
use super::{Answer, ConnectionPool, Failure, IdempotencyKey, ProblemKind, StoredResponse};
use crate::{Config, InFlight, KeyStatus, Outcome};

/// Answers what became of the request's key in the caller's scope, from an
/// async handler: [`Config::status`] on tokio's blocking pool, each status
/// as a response.
///
/// The key comes as for [`run`](super::run): from the `Idempotency-Key`
/// header, through [`IdempotencyKey`], whose authentication extractor runs
/// first, so a caller only ever learns of the keys of its own scope. The
/// lookup runs nothing and writes nothing.
///
/// | status | answer |
/// | --- | --- |
/// | completed | the stored response as it was first sent, with `Idempotent-Replayed: true` and the expiry header ([`Answer`]) |
/// | in progress | 409 problem ([`ProblemKind::InProgress`]), `Retry-After`: ask again later |
/// | no record | 404 problem ([`ProblemKind::KeyUnknown`]): nothing was done, sending the request again with the key is safe |
/// | expired | 410 problem ([`ProblemKind::KeyExpired`]): it ran, its result is no longer kept |
///
/// The stored response is decoded as `StoredResponse<T>`; a handler that
/// looks up keys of several endpoints takes `T = serde_json::Value`.
///
/// # Errors
///
/// [`Failure::Refused`] for the 404, 409 and 410 above and for a key the
/// key rules refuse (400, before a connection is checked out);
/// [`Failure::Failed`] with a 503 when no connection is free in time, a
/// 500 when storage fails or the stored response does not decode.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # tokio::runtime::Runtime::new()?.block_on(async {
/// use std::borrow::Cow;
/// use std::convert::Infallible;
/// use axum::extract::{FromRequestParts, State};
/// use axum::http::{request::Parts, Request, StatusCode};
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
/// /// `GET /charges/status` with the key and the credentials of the charge.
/// async fn charge_status(State(pool): State<Db>, key: IdempotencyKey<Account>) -> Result<Answer<StoredResponse<u32>>, Failure<Infallible>> {
///     http::lookup(&pool, &Config::default(), &key).await
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
/// assert_eq!(app.clone().oneshot(status()?).await?.status(), StatusCode::NOT_FOUND);
/// let charged = Request::post("/charges").header("idempotency-key", "c-1").body(axum::body::Body::empty())?;
/// let charged = app.clone().oneshot(charged).await?;
/// assert_eq!(charged.status(), StatusCode::CREATED);
/// let found = app.clone().oneshot(status()?).await?;
/// assert_eq!(found.status(), StatusCode::CREATED);
/// assert_eq!(found.headers()["idempotent-replayed"], "true");
/// assert_eq!(found.headers()["idempotency-expires"], charged.headers()["idempotency-expires"]);
/// # Ok(())
/// # })
/// # }
/// ```
pub async fn lookup<A, P, T>(
    pool: &P,
    config: &Config,
    key: &IdempotencyKey<A>,
) -> Result<Answer<StoredResponse<T>>, Failure<Infallible>>
where
    P: ConnectionPool,
    T: Serialize + DeserializeOwned + Send + 'static,
{
    let owned = config.clone();
    // A lookup waits for no call in progress (it answers 409), so it takes
    // no turn behind the process's duplicates of the key.
    let status = blocking(pool, config, InFlight::Reject, key, move |conn, scope, key| {
        owned.status::<_, StoredResponse<T>>(conn, scope, key)
    })
    .await?;
    let problems = key.problems();
    let refused = |kind, detail: &str| Err(Failure::Refused(problems.problem(kind).with_detail(detail)));
    match status {
        KeyStatus::Completed {
            response, expires_at, ..
        } => Ok(Answer::new(
            Outcome::Replayed(response),
            expires_at,
            key.expiry_header().clone(),
        )),
        KeyStatus::InProgress => refused(
            ProblemKind::InProgress,
            "a request with this idempotency key is still being processed; look again later",
        ),
        KeyStatus::NoRecord => refused(
            ProblemKind::KeyUnknown,
            "no request with this idempotency key was carried out; sending it again with the key is safe",
        ),
        KeyStatus::Expired { .. } => refused(
            ProblemKind::KeyExpired,
            "the request with this idempotency key was carried out, but its result is no longer kept",
        ),
    }
}
