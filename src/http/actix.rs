//! The actix-web adapter: how the HTTP layer's rules read an actix-web
//! request (the key extractor, the endpoint from the resource that
//! matched) and write an actix-web response (`Responder` and
//! `ResponseError` for everything a handler returns). The rules themselves
//! are the framework's neighbours' in this module.
//!
//! actix-web 4 speaks the `http` crate's 0.2 types, the rules its 1.x
//! ones: names, values and statuses cross over here, by their bytes.

use std::future::Future;
use std::pin::Pin;

use actix_web::body::BoxBody;
use actix_web::dev::Payload;
use actix_web::http::StatusCode as ActixStatus;
use actix_web::http::header::{self as actix_header, HeaderName as ActixName, HeaderValue as ActixValue};
use actix_web::{FromRequest, HttpRequest, HttpResponse, Responder, ResponseError};
use http::{HeaderName, HeaderValue, StatusCode};
use serde::Serialize;

use super::endpoint::Endpoint;
use super::header::HeaderFields;
use super::response::allows_content;
use super::{
    Answer, Caller, Failure, IDEMPOTENT_REPLAYED, IdempotencyKey, IdempotencyKeyRejection, KeyHeader, Problem,
    Problems, StoredResponse,
};
use crate::Outcome;

impl HeaderFields for actix_header::HeaderMap {
    fn values<'a>(&'a self, name: &HeaderName) -> impl Iterator<Item = &'a [u8]> {
        self.get_all(name.as_str()).map(ActixValue::as_bytes)
    }
}

/// The `Idempotency-Key` of a request and its authenticated caller, as an
/// actix-web extractor: `A` (the application's authentication) runs first
/// and its error goes out unchanged, then the header is read as
/// [`IdempotencyKey`] describes, with the [`KeyHeader`] and the
/// [`Problems`] the application registered with `App::app_data` (the
/// defaults where it did not). The key is bound to the method, the
/// pattern of the resource that matched (`HttpRequest::match_pattern`,
/// under its scopes' prefixes; the path where none matched), the path
/// parameters as actix-web's `Path` decodes them, and the query.
///
/// A path that is not UTF-8 once percent-decoded is refused with a 400
/// problem ([`IdempotencyKeyRejection::InvalidPath`]): actix-web reads it
/// with replacement characters, which would bind two paths alike.
impl<A> FromRequest for IdempotencyKey<A>
where
    A: FromRequest + Caller + 'static,
{
    type Error = IdempotencyKeyRejection<A::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let caller = A::from_request(req, payload);
        let req = req.clone();
        Box::pin(async move {
            let caller = caller.await.map_err(IdempotencyKeyRejection::Caller)?;
            read(caller, &req)
        })
    }
}

/// An optional `Idempotency-Key`, as an actix-web extractor: `None`
/// without the header, the key with it, and the same rejections as
/// [`IdempotencyKey`]'s otherwise.
///
/// The authentication extractor `A` runs all the same, header or not, and
/// its error goes out unchanged, so whether a request is authenticated
/// never depends on a header the client chooses. (actix-web's own
/// `Option<T>` extractor turns every error of `T` into `None`, the
/// caller's included: it would let a request without credentials through
/// whenever it sent no key. This type is the one to use.)
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # actix_web::rt::System::new().block_on(async {
/// use std::borrow::Cow;
/// use std::future::{ready, Ready};
///
/// use actix_web::{dev::Payload, test, FromRequest, HttpRequest};
/// use idempotency::http::{Caller, IdempotencyKeyRejection, OptionalIdempotencyKey, Problem};
///
/// /// Whoever shows the one token there is.
/// struct Account;
///
/// impl FromRequest for Account {
///     type Error = Problem;
///     type Future = Ready<Result<Account, Problem>>;
///
///     fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
///         let token = req.headers().get("authorization").and_then(|value| value.to_str().ok());
///         ready(match token {
///             Some("Bearer tok-3f9a") => Ok(Account),
///             _ => Err(Problem::new(http::StatusCode::UNAUTHORIZED, "Unauthorized")),
///         })
///     }
/// }
///
/// impl Caller for Account {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Borrowed("acct-1")
///     }
/// }
///
/// let signed = || test::TestRequest::post().insert_header(("authorization", "Bearer tok-3f9a"));
/// let OptionalIdempotencyKey(none) = OptionalIdempotencyKey::<Account>::extract(&signed().to_http_request()).await?;
/// assert!(none.is_none());
///
/// let keyed = signed().insert_header(("idempotency-key", "o-1")).to_http_request();
/// let OptionalIdempotencyKey(Some(key)) = OptionalIdempotencyKey::<Account>::extract(&keyed).await? else {
///     return Err("the key was not read".into());
/// };
/// assert_eq!((key.scope(), key.key()), ("acct-1", "o-1"));
///
/// // No credentials, no key: refused all the same.
/// let anonymous = test::TestRequest::post().to_http_request();
/// let refused = OptionalIdempotencyKey::<Account>::extract(&anonymous).await;
/// assert!(matches!(refused, Err(IdempotencyKeyRejection::Caller(_))));
/// # Ok(())
/// # })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct OptionalIdempotencyKey<A>(pub Option<IdempotencyKey<A>>);

impl<A> FromRequest for OptionalIdempotencyKey<A>
where
    A: FromRequest + Caller + 'static,
{
    type Error = IdempotencyKeyRejection<A::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let caller = A::from_request(req, payload);
        let req = req.clone();
        Box::pin(async move {
            // Before looking at the header: authentication must not depend
            // on whether the client sent one.
            let caller = caller.await.map_err(IdempotencyKeyRejection::Caller)?;
            let header = req.app_data::<KeyHeader>().cloned().unwrap_or_default();
            if !header.is_present(req.headers()) {
                return Ok(OptionalIdempotencyKey(None));
            }
            read(caller, &req).map(|key| OptionalIdempotencyKey(Some(key)))
        })
    }
}

/// The key of `req`, for the authenticated `caller`.
fn read<A: Caller, R>(caller: A, req: &HttpRequest) -> Result<IdempotencyKey<A>, IdempotencyKeyRejection<R>> {
    let problems = req.app_data::<Problems>().cloned().unwrap_or_default();
    let header = req.app_data::<KeyHeader>().cloned().unwrap_or_default();
    let key = IdempotencyKey::<A>::read_key(req.headers(), &header, &problems)?;
    let Some(endpoint) = endpoint(req) else {
        let problem = Problem::new(StatusCode::BAD_REQUEST, "Bad Request")
            .with_detail("the request's path is not UTF-8 once percent-decoded");
        return Err(IdempotencyKeyRejection::InvalidPath(problem));
    };
    Ok(IdempotencyKey::new(
        caller,
        key,
        problems,
        (&header, req.headers()),
        endpoint,
    ))
}

/// The endpoint of `req`: the pattern of the resource that matched (the
/// path where none did) and the path parameters decoded as actix-web's
/// `Path` decodes them; `None` for a path that is not UTF-8 once decoded.
fn endpoint(req: &HttpRequest) -> Option<Endpoint> {
    let raw = req.uri().path();
    // actix-web matched the path with every escape decoded but those of
    // `%`, `/` and `+`, and bytes that are not UTF-8 replaced: the raw
    // path tells whether there were any.
    String::from_utf8(percent_decoded(raw)).ok()?;
    let route = req.match_pattern().unwrap_or_else(|| raw.to_owned());
    let path = req
        .match_info()
        .iter()
        .map(|(name, value)| Some((name.to_owned(), String::from_utf8(percent_decoded(value)).ok()?)))
        .collect::<Option<Vec<_>>>()?;
    Some(Endpoint::new(req.method().as_str(), route, path, req.uri().query()))
}

/// `text` with every `%XX` escape decoded; a `%` that begins none is
/// itself.
fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escape = bytes
            .get(at + 1..at + 3)
            .filter(|_| bytes[at] == b'%')
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
            // `from_str_radix` alone would take `+1` for a number.
            .filter(|_| bytes[at + 1..at + 3].iter().all(u8::is_ascii_hexdigit));
        match escape {
            Some(byte) => {
                out.push(byte);
                at += 3;
            }
            None => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    out
}

impl<R: Into<actix_web::Error>> From<IdempotencyKeyRejection<R>> for actix_web::Error {
    /// The caller's own error unchanged; the key's problems as themselves.
    fn from(rejection: IdempotencyKeyRejection<R>) -> Self {
        match rejection {
            IdempotencyKeyRejection::Caller(rejection) => rejection.into(),
            IdempotencyKeyRejection::MissingKey(problem)
            | IdempotencyKeyRejection::InvalidKey(problem)
            | IdempotencyKeyRejection::InvalidPath(problem) => problem.into(),
            // Not made by this adapter; answered as axum answers it.
            #[cfg(feature = "axum")]
            IdempotencyKeyRejection::PathParams(rejection) => actix_web::error::ErrorBadRequest(rejection.body_text()),
        }
    }
}

/// The status in actix-web's type. Both crates take the same range of
/// codes, 100 to 999.
fn status(status: StatusCode) -> ActixStatus {
    ActixStatus::from_u16(status.as_u16()).expect("a status code is one in both crates")
}

/// The header field in actix-web's types. Both crates check names and
/// values by the same grammar (RFC 9110): what one holds the other takes.
fn field(name: &HeaderName, value: &HeaderValue) -> (ActixName, ActixValue) {
    let name = actix_name(name);
    let value = ActixValue::from_bytes(value.as_bytes()).expect("a header value is one in both crates");
    (name, value)
}

/// The header name in actix-web's type, as [`field`] converts it.
fn actix_name(name: &HeaderName) -> ActixName {
    ActixName::from_bytes(name.as_str().as_bytes()).expect("a header name is one in both crates")
}

/// `body` as the JSON of a response of `status`, or the 500 of a body that
/// does not serialize (as axum's `Json` answers it).
fn json(status: ActixStatus, body: &impl Serialize) -> HttpResponse {
    match serde_json::to_vec(body) {
        Ok(bytes) => HttpResponse::build(status)
            .insert_header((actix_header::CONTENT_TYPE, "application/json"))
            .body(bytes),
        Err(error) => HttpResponse::InternalServerError()
            .insert_header((actix_header::CONTENT_TYPE, "text/plain; charset=utf-8"))
            .body(error.to_string()),
    }
}

/// A problem answers as `application/problem+json` with its status, and
/// with `Retry-After` and `Cache-Control: no-store` where it has them; a
/// handler or an extractor returns it as its error.
impl ResponseError for Problem {
    fn status_code(&self) -> ActixStatus {
        status(self.status())
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = json(self.status_code(), self);
        for (name, value) in self.response_headers() {
            let (name, value) = field(&name, &value);
            response.headers_mut().insert(name, value);
        }
        response
    }
}

/// The operation's own error through its `ResponseError`, the
/// application's mapping; every other failure as its problem.
impl<E: ResponseError> ResponseError for Failure<E> {
    fn status_code(&self) -> ActixStatus {
        match self {
            Failure::Operation(error) => error.status_code(),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => problem.status_code(),
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            Failure::Operation(error) => error.error_response(),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => problem.error_response(),
        }
    }
}

/// The stored status, the JSON body (none for a status that allows no
/// content) and the stored headers, which replace any the body set.
impl<T: Serialize> Responder for StoredResponse<T> {
    type Body = BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        let mut response = if allows_content(self.status()) {
            json(status(self.status()), self.body())
        } else {
            HttpResponse::new(status(self.status()))
        };
        let headers = response.headers_mut();
        for name in self.headers().keys() {
            headers.remove(actix_name(name));
        }
        for (name, value) in self.headers() {
            let (name, value) = field(name, value);
            headers.append(name, value);
        }
        response
    }
}

/// The response of `R`; a replay adds `Idempotent-Replayed: true`.
impl<R: Responder> Responder for Outcome<R> {
    type Body = BoxBody;

    fn respond_to(self, req: &HttpRequest) -> HttpResponse {
        match self {
            Outcome::Executed(response) => response.respond_to(req).map_into_boxed_body(),
            Outcome::Replayed(response) => {
                let mut response = response.respond_to(req).map_into_boxed_body();
                let (name, value) = field(&IDEMPOTENT_REPLAYED, &HeaderValue::from_static("true"));
                response.headers_mut().insert(name, value);
                response
            }
        }
    }
}

/// The outcome's response plus the expiry header, and for a lookup
/// `Cache-Control: no-store`.
impl<R: Responder> Responder for Answer<R> {
    type Body = BoxBody;

    fn respond_to(self, req: &HttpRequest) -> HttpResponse {
        let (response, added) = self.into_parts();
        let mut response = response.respond_to(req).map_into_boxed_body();
        for (name, value) in added {
            let (name, value) = field(&name, &value);
            response.headers_mut().insert(name, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::percent_decoded;

    #[test]
    fn every_escape_is_decoded_once_and_a_stray_percent_is_itself() {
        assert_eq!(percent_decoded("a%2Fb%25%32%30"), b"a/b%20");
        assert_eq!(percent_decoded("caf%C3%a9"), "café".as_bytes());
        for unchanged in ["100%", "%+1", "%zz", "%4", "a+b"] {
            assert_eq!(percent_decoded(unchanged), unchanged.as_bytes(), "{unchanged}");
        }
        assert_eq!(percent_decoded("%FF"), [0xFF]);
    }
}
