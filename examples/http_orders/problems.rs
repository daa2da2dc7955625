//! What the service answers when it cannot do what was asked: RFC 9457
//! problems, and log lines that carry an error's causes but never a body.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idempotency::http::{Problem, Problems};

/// Where the problems of this API are documented: each `type` is this
/// followed by the problem's name.
const PROBLEMS: &str = "https://orders.example/problems/";

/// A problem of this API.
pub(super) fn problem(status: StatusCode, name: &str, title: &str) -> Problem {
    Problem::new(status, title).with_type(format!("{PROBLEMS}{name}"))
}

/// How the service describes the problems `idempotency::http` finds.
pub(super) fn problems() -> Problems {
    Problems::documented_at(PROBLEMS)
}

pub(super) fn internal_error() -> Problem {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal-error",
        "Internal server error",
    )
    .with_detail("the server could not complete the request")
}

/// The JSON body of a request, with problems for what is wrong with it.
/// They never quote the body: a parser's message would.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(body)) => Ok(Body(body)),
            Err(rejection) if stalled(&rejection) => {
                Err(
                    problem(StatusCode::REQUEST_TIMEOUT, "body-timeout", "Request body timed out")
                        .with_detail("the body stopped arriving; send it again"),
                )
            }
            Err(rejection) => {
                let detail = match &rejection {
                    JsonRejection::JsonDataError(_) => {
                        "the body does not have the expected fields and types: item (string), quantity (integer)"
                    }
                    JsonRejection::JsonSyntaxError(_) => "the body is not valid JSON",
                    JsonRejection::MissingJsonContentType(_) => "send the body as Content-Type: application/json",
                    _ if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => "the body is too large",
                    _ => "the body could not be read",
                };
                Err(problem(rejection.status(), "invalid-body", "Invalid request body").with_detail(detail))
            }
        }
    }
}

/// Whether `error` comes from a body that stopped arriving for longer than
/// the body read timeout of [`super::server::serve`].
fn stalled(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        next = error.source();
    }
    false
}

/// Why an order was not placed. Nothing is stored and the key stays free
/// for the corrected request or the retry.
#[derive(Debug)]
pub(super) enum OrderError {
    /// The order breaks a rule ([`super::orders::NewOrder::refusal`]);
    /// found before the idempotent call.
    Invalid(&'static str),
    /// The operation's statements failed.
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for OrderError {
    fn from(error: diesel::result::Error) -> Self {
        OrderError::Database(error)
    }
}

impl IntoResponse for OrderError {
    fn into_response(self) -> Response {
        match self {
            OrderError::Invalid(detail) => problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-order", "Invalid order")
                .with_detail(detail)
                .into_response(),
            OrderError::Database(error) => {
                eprintln!("placing an order failed: {}", causes(&error));
                internal_error().into_response()
            }
        }
    }
}

/// `error` and each of its sources, joined by `: `, so that a log line
/// carries the database's own message and not only the failure it caused.
/// A JSON error is shown by its category and position: its message may
/// quote the body it was reading.
pub(super) fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut next = Some(error);
    while let Some(error) = next {
        if !line.is_empty() {
            line.push_str(": ");
        }
        match error.downcast_ref::<serde_json::Error>() {
            Some(json) => line.push_str(&format!(
                "JSON {:?} error at line {} column {}",
                json.classify(),
                json.line(),
                json.column()
            )),
            None => line.push_str(&error.to_string()),
        }
        next = error.source();
    }
    line
}
