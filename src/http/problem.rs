//! RFC 9457 problem details: the body of every error response of the HTTP
//! layer, and how an API names and documents its problem types.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use chrono::Duration;
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::Serialize;

/// The media type of a problem details body.
const PROBLEM_JSON: &str = "application/problem+json";

/// An error response as RFC 9457 describes it: `application/problem+json`
/// with `type`, `title`, `status` and, where it helps, `detail` and the
/// extension member `retryable`, plus a `Retry-After` header when retrying
/// later can succeed.
///
/// The HTTP layer builds its problems from [`Problems`]; applications build
/// their own with [`Problem::new`] so that every error of an API has one
/// shape. A problem never carries a request body: an error built from a
/// parser's message could echo what the client sent, so `detail` is written
/// by the application.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() {
/// use axum::http::StatusCode;
/// use axum::response::IntoResponse;
/// use idempotency::http::Problem;
///
/// let problem = Problem::new(StatusCode::NOT_FOUND, "Order not found")
///     .with_type("https://docs.example.com/problems/order-not-found")
///     .with_detail("there is no order 42 in this account");
/// let response = problem.into_response();
/// assert_eq!(response.status(), StatusCode::NOT_FOUND);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: String,
    #[serde(serialize_with = "status_number")]
    status: StatusCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retryable: Option<bool>,
    #[serde(skip)]
    retry_after: Option<Duration>,
    /// Answered with `Cache-Control: no-store`, as every answer of a
    /// lookup is.
    #[serde(skip)]
    no_store: bool,
}

impl Problem {
    /// A problem with type `about:blank`, so the title should be the
    /// status's reason phrase (RFC 9457 §4.2.1) unless a type is set with
    /// [`with_type`](Problem::with_type).
    pub fn new(status: StatusCode, title: impl Into<String>) -> Self {
        Problem {
            type_uri: String::from("about:blank"),
            title: title.into(),
            status,
            detail: None,
            retryable: None,
            retry_after: None,
            no_store: false,
        }
    }

    /// Sets the `type` URI, which identifies the kind of problem and
    /// usually points to its documentation.
    pub fn with_type(mut self, type_uri: impl Into<String>) -> Self {
        self.type_uri = type_uri.into();
        self
    }

    /// Sets `detail`, the explanation of this occurrence for the client's
    /// developer. Never put the request body or values copied from it here.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Sets the extension member `retryable`: whether sending the same
    /// request again, with the same key, may succeed (`true`), or the client
    /// must change the request first (`false`). Without it the member is
    /// left out.
    pub fn with_retryable(mut self, retryable: bool) -> Self {
        self.retryable = Some(retryable);
        self
    }

    /// Answers with `Retry-After` in whole seconds (rounded up; a negative
    /// duration is 0), telling the client when a retry may succeed.
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The `type` URI.
    pub fn type_uri(&self) -> &str {
        &self.type_uri
    }

    /// The `title`.
    pub fn title(&self) -> &str {
        &self.title
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The `detail`, if any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// The `retryable` member, if set.
    pub fn retryable(&self) -> Option<bool> {
        self.retryable
    }

    /// The `Retry-After`, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The same problem, answered with `Cache-Control: no-store`.
    pub(super) fn not_to_be_stored(mut self) -> Self {
        self.no_store = true;
        self
    }

    /// The headers of the problem's response besides its body's:
    /// `Content-Type: application/problem+json`, `Cache-Control: no-store`
    /// where it is one caller's, and `Retry-After` in whole seconds,
    /// rounded up, where it asks for a retry.
    pub(super) fn response_headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        let mut headers = vec![(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))];
        if self.no_store {
            headers.push((header::CACHE_CONTROL, HeaderValue::from_static("no-store")));
        }
        if let Some(after) = self.retry_after {
            let after = after.to_std().unwrap_or_default();
            let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.push((header::RETRY_AFTER, HeaderValue::from(seconds)));
        }
        headers
    }
}

/// The `detail`, or the `title` where there is none.
impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.detail().unwrap_or(&self.title))
    }
}

impl std::error::Error for Problem {}

fn status_number<S: serde::Serializer>(status: &StatusCode, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u16(status.as_u16())
}

/// The problems the HTTP layer itself answers with, each with its status
/// and whether the same request may be sent again ([`retryable`](ProblemKind::retryable)).
/// [`Problems`] gives each its `type` and `title`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// 400: the endpoint requires an `Idempotency-Key` header and the
    /// request has none (draft §2.7).
    MissingKey,
    /// 400: two `Idempotency-Key` headers, a value that does not parse, or a
    /// key that breaks the key rules.
    InvalidKey,
    /// 422: the key was first used with a different request (draft §2.7).
    KeyReused,
    /// 409: a request with the same key is still being processed (draft
    /// §2.7); answered with `Retry-After`.
    InProgress,
    /// 409: the same request with this key has already completed, and the
    /// API answers that with a problem rather than the stored response
    /// ([`OnCompleted::Reject`](crate::OnCompleted::Reject)). Nothing ran.
    KeyCompleted,
    /// 503: no database connection was free in time; nothing ran. Answered
    /// with `Retry-After`.
    Unavailable,
    /// 404, from a [lookup](super::lookup): no request with this key has
    /// completed and none is in progress, so sending it again is safe.
    KeyUnknown,
    /// 410, from a [lookup](super::lookup): the request ran, but its result
    /// is no longer kept; sending it again would execute it again.
    KeyExpired,
    /// 500: the [phased operation](crate::phased) of this key was stopped
    /// partway and waits for the service's operators
    /// ([`Error::Parked`](crate::Error::Parked)). Some of it may have been
    /// carried out: sending it again does not help, and sending it under a
    /// new key may carry it out twice. Answered to the retry and to a
    /// [lookup](super::lookup) alike.
    OperationParked,
    /// 500: the operation's result is longer than
    /// [`Config::max_response_len`](crate::Config::max_response_len) allows
    /// to store; nothing was done and the key is free, but the same request
    /// fails again.
    ResponseTooLarge,
    /// 500: storage failed, a stored response no longer decodes, or the
    /// operation panicked. Nothing about the cause is sent.
    Internal,
}

impl ProblemKind {
    /// The HTTP status of this kind of problem.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey => StatusCode::BAD_REQUEST,
            ProblemKind::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::InProgress | ProblemKind::KeyCompleted => StatusCode::CONFLICT,
            ProblemKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::KeyUnknown => StatusCode::NOT_FOUND,
            ProblemKind::KeyExpired => StatusCode::GONE,
            ProblemKind::OperationParked | ProblemKind::ResponseTooLarge | ProblemKind::Internal => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// Whether the same request, with the same key, may succeed when sent
    /// again: a 409 of a key in progress (the other request finishes, then
    /// the retry replays it) and a 503 may; a missing or invalid key, a key
    /// reused with another request and a key whose request completed
    /// (where the API rejects those) need a changed request; a lookup's 404 and 410 do not change
    /// by asking again; a 500 may only when its cause was of
    /// the moment ([`Error::is_retryable`](crate::Error::is_retryable)),
    /// which [`run`](super::run) tells per failure.
    pub fn retryable(self) -> bool {
        matches!(self, ProblemKind::InProgress | ProblemKind::Unavailable)
    }

    /// The last segment of the `type` URI under a documentation base.
    fn slug(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "idempotency-key-missing",
            ProblemKind::InvalidKey => "idempotency-key-invalid",
            ProblemKind::KeyReused => "idempotency-key-reused",
            ProblemKind::InProgress => "idempotency-key-in-progress",
            ProblemKind::KeyCompleted => "idempotency-key-completed",
            ProblemKind::Unavailable => "service-unavailable",
            ProblemKind::KeyUnknown => "idempotency-key-unknown",
            ProblemKind::KeyExpired => "idempotency-key-expired",
            ProblemKind::OperationParked => "idempotency-key-parked",
            ProblemKind::ResponseTooLarge => "response-too-large",
            ProblemKind::Internal => "internal-error",
        }
    }

    /// The title of this kind under a documentation base.
    fn specific_title(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "Idempotency-Key header missing",
            ProblemKind::InvalidKey => "Invalid Idempotency-Key header",
            ProblemKind::KeyReused => "Idempotency key reused with a different request",
            ProblemKind::InProgress => "Request with this idempotency key in progress",
            ProblemKind::KeyCompleted => "Request with this idempotency key already completed",
            ProblemKind::Unavailable => "Service unavailable",
            ProblemKind::KeyUnknown => "No request with this idempotency key",
            ProblemKind::KeyExpired => "Idempotency key expired",
            ProblemKind::OperationParked => "Operation with this idempotency key parked",
            ProblemKind::ResponseTooLarge => "Response too large to store",
            ProblemKind::Internal => "Internal server error",
        }
    }
}

#[derive(Debug, Clone)]
struct Settings {
    /// `None`: every problem is `about:blank`.
    base: Option<String>,
    titles: HashMap<ProblemKind, String>,
    retry_after: Duration,
}

/// How the HTTP layer describes its own problems: the `type` URI and
/// `title` of each [`ProblemKind`], its `retryable` member, and the
/// `Retry-After` of a 409 or 503.
///
/// | setting | default |
/// | --- | --- |
/// | `type` | a distinct URI per kind: [`DEFAULT_BASE`](Problems::DEFAULT_BASE) + the kind's name, each documented in the [HTTP guide](crate::guide::http#problem-types) |
/// | `title` | a specific title per kind, the summary of its type |
/// | [`documented_at`](Problems::documented_at) | the same names under your own documentation |
/// | [`about_blank`](Problems::about_blank) | every `type` `about:blank`, titled with the status's reason phrase (RFC 9457 §4.2.1) |
/// | [`title`](Problems::title) | per kind, overrides the above |
/// | `retryable` | always sent: [`ProblemKind::retryable`] |
/// | [`retry_after`](Problems::retry_after) | 1 second |
///
/// The names are `idempotency-key-missing`, `idempotency-key-invalid`,
/// `idempotency-key-reused`, `idempotency-key-in-progress`,
/// `idempotency-key-completed`,
/// `service-unavailable`, `idempotency-key-unknown`,
/// `idempotency-key-expired`, `idempotency-key-parked`, `response-too-large`
/// and `internal-error`;
/// they are stable.
///
/// An API sets its `Problems` once, as a request extension for its routes
/// (`router.layer(axum::Extension(problems))`; on actix-web as app data,
/// `App::app_data(problems)`);
/// [`IdempotencyKey`](super::IdempotencyKey) picks it up there (or uses the
/// default when there is none) and [`run`](super::run) answers with it, so
/// the key's rejection and the call's failures share one description. A
/// clone is cheap.
///
/// ```
/// use http::StatusCode;
/// use chrono::Duration;
/// use idempotency::http::{ProblemKind, Problems};
///
/// let problem = Problems::default().problem(ProblemKind::InProgress);
/// assert_eq!(problem.type_uri(), format!("{}idempotency-key-in-progress", Problems::DEFAULT_BASE));
/// assert_eq!(problem.retryable(), Some(true));
///
/// let problems = Problems::documented_at("https://docs.example.com/problems/")
///     .title(ProblemKind::KeyReused, "Key already used")
///     .retry_after(Duration::seconds(2));
///
/// let problem = problems.problem(ProblemKind::InProgress);
/// assert_eq!(problem.status(), StatusCode::CONFLICT);
/// assert_eq!(problem.type_uri(), "https://docs.example.com/problems/idempotency-key-in-progress");
/// assert_eq!(problem.retry_after(), Some(Duration::seconds(2)));
/// assert_eq!(problems.problem(ProblemKind::KeyReused).title(), "Key already used");
/// assert_eq!(problems.problem(ProblemKind::KeyReused).retryable(), Some(false));
///
/// let plain = Problems::about_blank().problem(ProblemKind::KeyReused);
/// assert_eq!((plain.type_uri(), plain.title()), ("about:blank", "Unprocessable Entity"));
/// ```
#[derive(Debug, Clone)]
pub struct Problems {
    settings: Arc<Settings>,
}

impl Default for Problems {
    fn default() -> Self {
        Problems {
            settings: Arc::new(Settings {
                base: Some(Problems::DEFAULT_BASE.to_owned()),
                titles: HashMap::new(),
                retry_after: Duration::seconds(1),
            }),
        }
    }
}

impl Problems {
    /// The base of the default `type` URIs: the HTTP guide of this crate on
    /// docs.rs, where each kind's name is the anchor of its section.
    pub const DEFAULT_BASE: &'static str = "https://docs.rs/idempotency/latest/idempotency/guide/http/index.html#";

    /// Problems whose `type` is `about:blank`, titled with the status's
    /// reason phrase: for an API that documents no problem types. Clients
    /// then tell the crate's 409 from the application's own 409 only by
    /// `retryable` and `Retry-After`.
    pub fn about_blank() -> Self {
        let mut problems = Problems::default();
        Arc::make_mut(&mut problems.settings).base = None;
        problems
    }

    /// Problems whose `type` is `base` followed by the kind's name, such as
    /// `https://docs.example.com/problems/idempotency-key-reused`; `base`
    /// usually ends with `/`.
    pub fn documented_at(base: impl Into<String>) -> Self {
        let mut problems = Problems::default();
        Arc::make_mut(&mut problems.settings).base = Some(base.into());
        problems
    }

    /// Sets the `title` of one kind of problem.
    pub fn title(mut self, kind: ProblemKind, title: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.settings).titles.insert(kind, title.into());
        self
    }

    /// Sets the `Retry-After` of a 409 (key in progress) and a 503 (no
    /// connection free); default 1 second. Match it to how long your
    /// operations take. A `chrono::Duration`, as every duration the crate's
    /// builders take.
    pub fn retry_after(mut self, after: Duration) -> Self {
        Arc::make_mut(&mut self.settings).retry_after = after;
        self
    }

    /// The problem of `kind`, without `detail`.
    pub fn problem(&self, kind: ProblemKind) -> Problem {
        let settings = &*self.settings;
        let status = kind.status();
        let title = match (settings.titles.get(&kind), &settings.base) {
            (Some(title), _) => title.clone(),
            (None, Some(_)) => kind.specific_title().to_owned(),
            (None, None) => status.canonical_reason().unwrap_or_default().to_owned(),
        };
        let mut problem = Problem::new(status, title).with_retryable(kind.retryable());
        if let Some(base) = &settings.base {
            problem = problem.with_type(format!("{base}{}", kind.slug()));
        }
        match kind {
            ProblemKind::InProgress | ProblemKind::Unavailable => problem.with_retry_after(settings.retry_after),
            _ => problem,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_rounded_up_to_whole_seconds() {
        let retry_after = |after| {
            let problem = Problem::new(StatusCode::CONFLICT, "Conflict").with_retry_after(after);
            let headers = problem.response_headers();
            let found = headers.into_iter().find(|(name, _)| name == header::RETRY_AFTER);
            found.map(|(_, value)| value)
        };
        assert_eq!(retry_after(Duration::milliseconds(1500)).unwrap(), "2");
        assert_eq!(retry_after(Duration::seconds(-3)).unwrap(), "0");
    }

    #[test]
    fn only_in_progress_and_unavailable_ask_for_a_retry() {
        let problems = Problems::default();
        assert!(problems.problem(ProblemKind::InProgress).retry_after().is_some());
        assert!(problems.problem(ProblemKind::Unavailable).retry_after().is_some());
        assert!(problems.problem(ProblemKind::KeyReused).retry_after().is_none());
        assert!(problems.problem(ProblemKind::Internal).retry_after().is_none());
    }

    #[test]
    fn body_has_the_rfc_9457_members_only() {
        let problem = Problem::new(StatusCode::BAD_REQUEST, "Bad Request")
            .with_detail("why")
            .with_retry_after(Duration::seconds(1));
        let body = serde_json::to_value(&problem).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"type": "about:blank", "title": "Bad Request", "status": 400, "detail": "why"})
        );
    }
}
