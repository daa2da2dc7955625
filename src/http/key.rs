//! The `Idempotency-Key` extractor: the client's key, paired with the scope
//! that the application's authentication resolved for the caller.

use std::borrow::Cow;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};

use super::{KeyHeader, ProblemKind, Problems};

/// A caller as the application's authentication knows it, naming the
/// idempotency scope its keys live in: its account, tenant or API client.
///
/// Implement it on the extractor that authenticates a request (the one that
/// reads and checks `Authorization`). [`IdempotencyKey`] runs that extractor
/// and takes the scope from it, so the scope comes from the credential and
/// never from anything else the client says: two accounts that pick the same
/// key get two independent operations, and neither can replay the other's
/// response.
///
/// ```
/// use std::borrow::Cow;
/// use idempotency::http::Caller;
///
/// /// An authenticated account.
/// struct Account { id: u64 }
///
/// impl Caller for Account {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Owned(format!("account-{}", self.id))
///     }
/// }
///
/// assert_eq!(Account { id: 7 }.scope(), "account-7");
/// ```
pub trait Caller {
    /// The scope of this caller's keys. It follows the key rules (visible
    /// ASCII, at most [`Config::max_key_len`](crate::Config::max_key_len)
    /// bytes); a scope that breaks them fails the call with a 500, as a
    /// server-side mistake.
    fn scope(&self) -> Cow<'_, str>;
}

/// The `Idempotency-Key` of a request and the caller it belongs to: an axum
/// extractor.
///
/// Extraction runs the authentication extractor `A` first (its rejection,
/// such as a 401, goes out unchanged), then reads the header:
///
/// - one `Idempotency-Key` field (or one of another name the [`KeyHeader`]
///   accepts) holding an RFC 9651 sf-string
///   (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`), as the
///   IETF draft (§2.1) specifies. Parameters after the string
///   (`"abc";v=1`) are checked for syntax and ignored: the draft defines
///   none;
/// - or, unless the [`KeyHeader`] among the request's extensions is
///   strict, the bare value that Stripe's and most other clients send
///   unquoted (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`),
///   taken as it is. The two spellings of one key are the same key.
///
/// No header, two headers, or a value that is neither: 400 with a problem
/// ([`ProblemKind::MissingKey`], [`ProblemKind::InvalidKey`]), described by
/// the [`Problems`] found among the request's extensions (the default if
/// none). The key rules (length, visible ASCII, no card numbers) are those
/// of the [`Config`](crate::Config) that [`run`](super::run) is given, and
/// `run` answers a key that breaks them with the same 400, before it checks
/// out a connection.
///
/// Where the key is optional, extract `Option<IdempotencyKey<A>>`: `None`
/// without the header (authentication is then left to the handler), the
/// same rejections otherwise.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use idempotency::http::{Caller, IdempotencyKey};
///
/// /// Everyone is one caller here; real code reads a credential.
/// struct Anyone;
///
/// impl<S: Sync> FromRequestParts<S> for Anyone {
///     type Rejection = StatusCode;
///     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
///         Ok(Anyone)
///     }
/// }
///
/// impl Caller for Anyone {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Borrowed("public")
///     }
/// }
///
/// let extract = async |value: &str| {
///     let (mut parts, ()) = Request::post("/orders").header("Idempotency-Key", value).body(())?.into_parts();
///     Ok::<_, axum::http::Error>(IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await)
/// };
///
/// let Ok(key) = extract(r#""order-2b9c""#).await? else { return Err("the sf-string was refused".into()) };
/// assert_eq!((key.scope(), key.key()), ("public", "order-2b9c"));
///
/// let Ok(bare) = extract("order-2b9c").await? else { return Err("the bare token was refused".into()) };
/// assert_eq!(bare.key(), key.key());
///
/// let Err(rejection) = extract(r#""unterminated"#).await? else { return Err("a broken string was taken".into()) };
/// assert_eq!(rejection.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(rejection.headers()["content-type"], "application/problem+json");
/// # Ok(())
/// # })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyKey<A> {
    caller: A,
    scope: String,
    key: String,
    problems: Problems,
}

impl<A> IdempotencyKey<A> {
    /// The key, unquoted and unescaped.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope, from [`Caller::scope`].
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The authenticated caller.
    pub fn caller(&self) -> &A {
        &self.caller
    }

    /// The authenticated caller, taken out.
    pub fn into_caller(self) -> A {
        self.caller
    }

    /// How failures of calls with this key are described.
    pub(crate) fn problems(&self) -> &Problems {
        &self.problems
    }
}

impl<S, A> FromRequestParts<S> for IdempotencyKey<A>
where
    S: Send + Sync,
    A: FromRequestParts<S> + Caller + Send,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let caller = A::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let problems = parts.extensions.get::<Problems>().cloned().unwrap_or_default();
        let header = parts.extensions.get::<KeyHeader>().cloned().unwrap_or_default();
        let key = match header.read(&parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let problem = problems
                    .problem(ProblemKind::MissingKey)
                    .with_detail("this endpoint requires an Idempotency-Key header");
                return Err(problem.into_response());
            }
            Err(error) => {
                let problem = problems.problem(ProblemKind::InvalidKey).with_detail(error.to_string());
                return Err(problem.into_response());
            }
        };
        let scope = caller.scope().into_owned();
        Ok(IdempotencyKey {
            caller,
            scope,
            key,
            problems,
        })
    }
}

impl<S, A> OptionalFromRequestParts<S> for IdempotencyKey<A>
where
    S: Send + Sync,
    A: FromRequestParts<S> + Caller + Send,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Option<Self>, Response> {
        let header = parts.extensions.get::<KeyHeader>().cloned().unwrap_or_default();
        if !header.is_present(&parts.headers) {
            return Ok(None);
        }
        <Self as FromRequestParts<S>>::from_request_parts(parts, state)
            .await
            .map(Some)
    }
}
