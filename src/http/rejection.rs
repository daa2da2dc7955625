//! Why the `Idempotency-Key` extractor refused a request.

use std::error::Error as StdError;
use std::fmt;

#[cfg(feature = "axum")]
use axum::extract::rejection::RawPathParamsRejection;

use super::Problem;

/// Why [`IdempotencyKey`](super::IdempotencyKey) refused a request: the
/// rejection of the extractor and of `Option<IdempotencyKey<A>>`, where `R`
/// is the rejection of the authentication extractor `A`.
///
/// A handler that extracts `Result<IdempotencyKey<A>, IdempotencyKeyRejection<A::Rejection>>`
/// can answer each case its own way; otherwise the framework sends the
/// response of the rejection (axum's `IntoResponse`; on actix-web, where
/// an optional key is an `OptionalIdempotencyKey`,
/// its conversion into `actix_web::Error`):
///
/// | variant | response |
/// | --- | --- |
/// | [`Caller`](IdempotencyKeyRejection::Caller) | `R`'s own (a 401, say), unchanged |
/// | [`MissingKey`](IdempotencyKeyRejection::MissingKey) | the 400 problem [`ProblemKind::MissingKey`](super::ProblemKind::MissingKey) |
/// | [`InvalidKey`](IdempotencyKeyRejection::InvalidKey) | the 400 problem [`ProblemKind::InvalidKey`](super::ProblemKind::InvalidKey) |
/// | `PathParams` (axum) | axum's 400 for path parameters it cannot decode, as `Path` answers |
/// | `InvalidPath` (actix-web) | a 400 problem for a path that is not UTF-8 once decoded |
///
/// The problems are described by the [`Problems`](super::Problems) among
/// the request's extensions (actix-web: the app data), as the failures of
/// [`run`](super::run) are.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use idempotency::http::{Caller, IdempotencyKey, IdempotencyKeyRejection};
///
/// /// Whoever shows a bearer token.
/// struct Bearer(String);
///
/// impl<S: Sync> FromRequestParts<S> for Bearer {
///     type Rejection = StatusCode;
///     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
///         let token = parts.headers.get("authorization").and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "));
///         token.map(|token| Bearer(token.to_owned())).ok_or(StatusCode::UNAUTHORIZED)
///     }
/// }
///
/// impl Caller for Bearer {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Owned(format!("bearer-{}", self.0))
///     }
/// }
///
/// let (mut parts, ()) = Request::post("/orders").header("authorization", "Bearer t-1").body(())?.into_parts();
/// match IdempotencyKey::<Bearer>::from_request_parts(&mut parts, &()).await {
///     Err(IdempotencyKeyRejection::MissingKey(problem)) => {
///         assert_eq!(problem.status(), StatusCode::BAD_REQUEST);
///         assert_eq!(problem.detail(), Some("this endpoint requires an Idempotency-Key header"));
///     }
///     _ => return Err("a request without a key must miss it".into()),
/// }
///
/// let (mut parts, ()) = Request::post("/orders").header("idempotency-key", "o-1").body(())?.into_parts();
/// let rejection = IdempotencyKey::<Bearer>::from_request_parts(&mut parts, &()).await.err().ok_or("no credentials")?;
/// assert!(matches!(rejection, IdempotencyKeyRejection::Caller(StatusCode::UNAUTHORIZED)));
/// # Ok(())
/// # })
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum IdempotencyKeyRejection<R> {
    /// The authentication extractor refused the request; its rejection goes
    /// out unchanged. It runs before the header is read, so a request
    /// without credentials is refused as such, key or no key.
    Caller(R),
    /// The endpoint requires an `Idempotency-Key` header and the request
    /// has none (draft §2.7): a 400 problem.
    MissingKey(Problem),
    /// The request has two key headers, or a value that is neither an
    /// sf-string nor (unless the [`KeyHeader`](super::KeyHeader) is strict)
    /// a bare token of visible ASCII: a 400 problem whose detail says which,
    /// never repeating the value.
    InvalidKey(Problem),
    /// The path parameters, which the key is bound to, are not UTF-8 once
    /// decoded: axum's own rejection.
    #[cfg(feature = "axum")]
    PathParams(RawPathParamsRejection),
    /// The request's path, whose parameters the key is bound to, is not
    /// UTF-8 once percent-decoded (actix-web, which reads such a path
    /// with replacement characters, where two paths would read alike): a
    /// 400 problem.
    #[cfg(feature = "actix")]
    InvalidPath(Problem),
}

impl<R: fmt::Display> fmt::Display for IdempotencyKeyRejection<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdempotencyKeyRejection::Caller(rejection) => rejection.fmt(f),
            IdempotencyKeyRejection::MissingKey(problem) | IdempotencyKeyRejection::InvalidKey(problem) => {
                problem.fmt(f)
            }
            #[cfg(feature = "axum")]
            IdempotencyKeyRejection::PathParams(rejection) => rejection.fmt(f),
            #[cfg(feature = "actix")]
            IdempotencyKeyRejection::InvalidPath(problem) => problem.fmt(f),
        }
    }
}

impl<R: StdError + 'static> StdError for IdempotencyKeyRejection<R> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        // Each is shown as the rejection itself, so its chain goes on with
        // that rejection's source.
        match self {
            IdempotencyKeyRejection::Caller(rejection) => rejection.source(),
            IdempotencyKeyRejection::MissingKey(_) | IdempotencyKeyRejection::InvalidKey(_) => None,
            #[cfg(feature = "axum")]
            IdempotencyKeyRejection::PathParams(rejection) => rejection.source(),
            #[cfg(feature = "actix")]
            IdempotencyKeyRejection::InvalidPath(_) => None,
        }
    }
}
