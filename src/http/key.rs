//! The `Idempotency-Key` extractor: the client's key, paired with the scope
//! that the application's authentication resolved for the caller.

use std::borrow::Cow;

use super::answer::Marks;
use super::endpoint::Endpoint;
use super::header::HeaderFields;
use super::{IdempotencyKeyRejection, KeyHeader, ProblemKind, Problems};
use crate::run::Sender;

/// A caller as the application's authentication knows it, naming the
/// idempotency scope its keys live in: a stable id of the principal, the
/// user or API client (composed with its tenant where it has one).
///
/// Implement it on the extractor that authenticates a request (the one that
/// reads and checks `Authorization`). [`IdempotencyKey`] runs that extractor
/// and takes the scope from it, so the scope is the identity the credential
/// was verified to belong to and never anything the client says: two
/// callers that pick the same key get two independent operations, and
/// neither can replay the other's response. The scope is that identity's id,
/// never the credential itself: a token would be stored in every key record
/// and recorded on spans, and a retry sent with a rotated token would land
/// in another scope and execute again (see
/// [the contract](crate::guide::contract#scope-whose-keys-these-are)). The
/// scope does not authorize: check the caller's permission before the call
/// (a replay runs no code of the operation).
///
/// ```
/// use std::borrow::Cow;
/// use idempotency::http::Caller;
///
/// /// An authenticated account, by its id.
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

    /// The principal this caller acts as: who may look up the records of
    /// its calls with [`lookup`](super::lookup). By default the scope,
    /// which is the principal where the scope is the one recommended. Where
    /// the scope is shared (a tenant whose users share its keys), return
    /// the stable id of the user or API client: a call's record is then
    /// answered to that principal's lookups alone, and another principal
    /// of the scope who sends the same key and request gets a 422 (the
    /// principal is part of the request's fingerprint wherever it is not
    /// the scope). Like the scope, an id, never a credential.
    ///
    /// ```
    /// use std::borrow::Cow;
    /// use idempotency::http::Caller;
    ///
    /// /// A user of a tenant; the tenant's users share its keys.
    /// struct Member { tenant: String, user: String }
    ///
    /// impl Caller for Member {
    ///     fn scope(&self) -> Cow<'_, str> {
    ///         Cow::Borrowed(&self.tenant)
    ///     }
    ///
    ///     fn principal(&self) -> Cow<'_, str> {
    ///         Cow::Borrowed(&self.user)
    ///     }
    /// }
    ///
    /// let member = Member { tenant: "acme".into(), user: "user-2".into() };
    /// assert_eq!((member.scope(), member.principal()), ("acme".into(), "user-2".into()));
    /// ```
    fn principal(&self) -> Cow<'_, str> {
        self.scope()
    }
}

/// The `Idempotency-Key` of a request and the caller it belongs to: an axum
/// extractor, and with the feature `actix` an actix-web one (see
/// [HTTP with actix-web](crate::guide::actix), where `A` is a `FromRequest`
/// and the [`KeyHeader`] and [`Problems`] come from `App::app_data`).
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
/// none). The rejection is an [`IdempotencyKeyRejection`], whose variant a
/// handler may match on to answer in its own way. The key rules (length, visible ASCII, no card numbers) are those
/// of the [`Config`](crate::Config) that [`run`](super::run) is given, and
/// `run` answers a key that breaks them with the same 400, before it checks
/// out a connection.
///
/// Where the key is optional, extract `Option<IdempotencyKey<A>>`: `A`
/// runs all the same, header or not, and its rejection goes out unchanged,
/// so whether a request is authenticated never depends on a header the
/// client chooses; then `None` without the header, the same rejections as
/// above otherwise. (A handler that needs the caller without a key
/// extracts `A` beside it.) On actix-web, extract
/// `OptionalIdempotencyKey<A>` instead: actix-web's `Option<T>` turns every
/// rejection into `None`, the caller's included.
///
/// The key is bound to the endpoint it was sent to, captured here from the
/// request: the method, the matched route (axum's
/// [`MatchedPath`](axum::extract::MatchedPath); the request's path where no route matched, as when the
/// extractor runs outside a router), the path parameters and the query.
/// [`run`](super::run) and [`run_phased`](super::run_phased) fingerprint
/// them with the request value, so the same key and body sent to another
/// endpoint is a mismatch (422), never the first endpoint's replay. Path
/// parameters are compared as axum's `Path` decodes them (a parameter that
/// is not UTF-8 once decoded is refused here as `Path` refuses it). Two
/// queries are one request only if every decoding an application applies
/// (a form's, with `+` a space; plain percent-decoding) reads them alike:
/// the query is compared as RFC 3986 normalizes it, and no further. `%65`
/// is `e`, but `+`, `%20` and `%2B` are three spellings, since parsers
/// disagree on what `+` means; `/` and `%2F` are two; and a `%` that begins
/// no escape is a `%`, never part of one (`%%32%30` is not `%20`). Its
/// parameters are sorted by name, stably: the values of a name keep their
/// order, and so do those of names that some decoding reads as one.
/// `?a=1&b=2` and `?b=2&a=1` are one request; `?tag=x&tag=y` and
/// `?tag=y&tag=x` are two, as are `?a%20b=1&a+b=2` and `?a+b=2&a%20b=1`,
/// and `?flag` and `?flag=`. An empty query is no query. An application whose keys are meant to span
/// endpoints says so with [`across_endpoints`](IdempotencyKey::across_endpoints).
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use axum::response::IntoResponse;
/// use idempotency::http::{Caller, IdempotencyKey, IdempotencyKeyRejection};
///
/// /// Everyone is one caller here; real code verifies a credential and
/// /// scopes by the id of the caller it names.
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
/// assert!(matches!(rejection, IdempotencyKeyRejection::InvalidKey(_)));
/// let response = rejection.into_response();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// # Ok(())
/// # })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyKey<A> {
    caller: A,
    scope: String,
    principal: String,
    key: String,
    problems: Problems,
    /// The headers its answers carry.
    marks: Marks,
    endpoint: Endpoint,
    /// Whether the key is bound to `endpoint` (not made
    /// [`across_endpoints`](IdempotencyKey::across_endpoints)).
    bound_to_endpoint: bool,
    /// The request's id, where its header held one the record keeps.
    request_id: Option<String>,
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

    /// The principal, from [`Caller::principal`].
    pub fn principal(&self) -> &str {
        &self.principal
    }

    /// The request's id, read from the header
    /// [`KeyHeader::request_id_header`](super::KeyHeader::request_id_header)
    /// names (`X-Request-Id` by default) where it held one a record keeps;
    /// the record of the call that executes keeps it.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// The authenticated caller.
    pub fn caller(&self) -> &A {
        &self.caller
    }

    /// The authenticated caller, taken out.
    pub fn into_caller(self) -> A {
        self.caller
    }

    /// The same key, bound to the request value that [`run`](super::run)
    /// is given and no longer to the endpoint it was sent to: the way out
    /// for an application whose keys deliberately span endpoints (one
    /// operation reachable under two routes, say). The same key and request
    /// value sent to another endpoint then replays the first endpoint's
    /// response, so the request value must name whatever tells the
    /// operations apart. A key bound this way fingerprints the request
    /// value alone (with the [principal](Caller::principal) where it is not
    /// the scope), as keys did before endpoints were bound, and its records
    /// are not interchangeable with those of a bound key. Its records are
    /// answered to its principal by a [lookup](super::lookup) at any
    /// endpoint.
    ///
    /// ```
    /// # #[cfg(not(feature = "axum"))] fn main() {}
    /// # #[cfg(feature = "axum")]
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
    /// # use std::borrow::Cow;
    /// # use axum::extract::FromRequestParts;
    /// # use axum::http::{request::Parts, Request, StatusCode};
    /// # use idempotency::http::{Caller, IdempotencyKey};
    /// # struct Anyone;
    /// # impl<S: Sync> FromRequestParts<S> for Anyone {
    /// #     type Rejection = StatusCode;
    /// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(Anyone) }
    /// # }
    /// # impl Caller for Anyone { fn scope(&self) -> Cow<'_, str> { Cow::Borrowed("public") } }
    /// let (mut parts, ()) = Request::post("/v1/orders").header("Idempotency-Key", "o-1").body(())?.into_parts();
    /// let Ok(key) = IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await else {
    ///     return Err("the key was refused".into());
    /// };
    /// // `/v1/orders` and `/v2/orders` place the same orders.
    /// let key = key.across_endpoints();
    /// assert_eq!(key.key(), "o-1");
    /// # Ok(())
    /// # })
    /// # }
    /// ```
    pub fn across_endpoints(mut self) -> Self {
        self.bound_to_endpoint = false;
        self
    }

    /// How failures of calls with this key are described.
    pub(super) fn problems(&self) -> &Problems {
        &self.problems
    }

    /// The headers its answers carry besides their own.
    pub(super) fn marks(&self) -> &Marks {
        &self.marks
    }

    /// The endpoint the key is bound to, if it is.
    pub(super) fn endpoint(&self) -> Option<&Endpoint> {
        self.bound_to_endpoint.then_some(&self.endpoint)
    }

    /// The endpoint the request was sent to, bound or not: a lookup's, whose
    /// path parameters it compares.
    pub(super) fn sent_to(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The principal where it is not the scope: what a call's fingerprint
    /// binds beside the request and the endpoint.
    pub(super) fn principal_beside_scope(&self) -> Option<String> {
        (self.principal != self.scope).then(|| self.principal.clone())
    }

    /// Who sends the calls of this key, as the record keeps it: whose
    /// lookups it answers and the request's id.
    pub(super) fn sender(&self) -> KeySender {
        KeySender {
            caller_hash: self.caller_hash(),
            request_id: self.request_id.clone(),
        }
    }

    /// Who may look up the record of a call with this key: the principal,
    /// at the endpoint the key is bound to.
    pub(super) fn caller_hash(&self) -> String {
        match self.endpoint() {
            Some(endpoint) => endpoint.caller_hash(&self.principal),
            None => super::endpoint::caller_hash(&self.principal, None),
        }
    }
}

/// [`IdempotencyKey::sender`]: what a call's record keeps of who sent it,
/// owned, for a call made on the blocking pool.
pub(super) struct KeySender {
    caller_hash: String,
    request_id: Option<String>,
}

impl KeySender {
    /// The sender as the call takes it.
    pub(super) fn as_sender(&self) -> Sender<'_> {
        Sender {
            caller_hash: Some(&self.caller_hash),
            request_id: self.request_id.as_deref(),
        }
    }
}

impl<A: Caller> IdempotencyKey<A> {
    /// The key in a request's header `fields` as `header` reads it: the
    /// first thing an adapter checks once the caller is authenticated.
    ///
    /// # Errors
    ///
    /// The 400 problems of a missing key and of an invalid one, described
    /// by `problems`.
    pub(super) fn read_key<R>(
        fields: &impl HeaderFields,
        header: &KeyHeader,
        problems: &Problems,
    ) -> Result<String, IdempotencyKeyRejection<R>> {
        match header.read(fields) {
            Ok(Some(key)) => Ok(key),
            Ok(None) => {
                let problem = problems
                    .problem(ProblemKind::MissingKey)
                    .with_detail("this endpoint requires an Idempotency-Key header");
                Err(IdempotencyKeyRejection::MissingKey(problem))
            }
            Err(error) => {
                let problem = problems.problem(ProblemKind::InvalidKey).with_detail(error.to_string());
                Err(IdempotencyKeyRejection::InvalidKey(problem))
            }
        }
    }

    /// The `key` of the authenticated `caller`, sent to `endpoint` (to
    /// which it is bound) with the request's `problems`, key `header` and
    /// header `fields`, where its id is read.
    pub(super) fn new(
        caller: A,
        key: String,
        problems: Problems,
        (header, fields): (&KeyHeader, &impl HeaderFields),
        endpoint: Endpoint,
    ) -> Self {
        let scope = caller.scope().into_owned();
        let principal = caller.principal().into_owned();
        let marks = header.marks(&key);
        IdempotencyKey {
            caller,
            scope,
            principal,
            key,
            problems,
            marks,
            endpoint,
            bound_to_endpoint: true,
            request_id: header.read_request_id(fields),
        }
    }
}
