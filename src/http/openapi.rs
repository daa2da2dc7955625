//! OpenAPI pieces for handlers that take an [`IdempotencyKey`](super::IdempotencyKey)
//! (feature `openapi`, utoipa 5): the header parameter, the problem schema,
//! the problem responses, and the replay marker, for a handler's
//! `#[utoipa::path]` and the API's `#[derive(OpenApi)]` to name.

use std::collections::BTreeMap;

use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{ObjectBuilder, Ref, Schema, SchemaFormat, Type};
use utoipa::openapi::{ComponentsBuilder, OpenApi, RefOr, Required};
use utoipa::{IntoParams, IntoResponses, Modify, PartialSchema, ToSchema};

use super::headers::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use super::problem::{Problem, ProblemKind};

/// The media type of a problem details body.
const PROBLEM_JSON: &str = "application/problem+json";

/// The `Idempotency-Key` request header as an OpenAPI parameter:
/// `#[utoipa::path(params(IdempotencyKeyHeader))]`. Required, a string of
/// 1 to 255 characters (the default [`Config::max_key_len`](crate::Config::max_key_len)).
///
/// ```
/// use idempotency::http::openapi::IdempotencyKeyHeader;
/// use utoipa::IntoParams;
///
/// let params = IdempotencyKeyHeader::into_params(|| None);
/// assert_eq!(params[0].name, "Idempotency-Key");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyKeyHeader;

impl IntoParams for IdempotencyKeyHeader {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        let schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(255))
            .examples([r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#]);
        vec![
            ParameterBuilder::new()
                .name(header_name(&IDEMPOTENCY_KEY))
                .parameter_in(ParameterIn::Header)
                .required(Required::True)
                .description(Some(
                    "A key unique to this operation, sent unchanged on every retry of it: an \
                     RFC 9651 sf-string (or, unless the API is strict, the bare key). A retry \
                     with the same key and request gets the first response again, marked \
                     `Idempotent-Replayed: true`.",
                ))
                .schema(Some(schema))
                .build(),
        ]
    }
}

/// The schema of a problem details body (RFC 9457), named `Problem`:
/// `type`, `title`, `status`, and where given `detail` and `retryable`.
///
/// ```
/// use idempotency::http::Problem;
/// use utoipa::ToSchema;
///
/// assert_eq!(Problem::name(), "Problem");
/// ```
impl PartialSchema for Problem {
    fn schema() -> RefOr<Schema> {
        let string = |description: &str| {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(description))
        };
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some("A problem details body (RFC 9457), as application/problem+json."))
            .property(
                "type",
                string("Identifies the kind of problem; compare it whole.")
                    .format(Some(SchemaFormat::Custom("uri-reference".to_owned()))),
            )
            .required("type")
            .property("title", string("A summary of the kind of problem."))
            .required("title")
            .property(
                "status",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .description(Some("The HTTP status.")),
            )
            .required("status")
            .property("detail", string("What happened in this occurrence."))
            .property(
                "retryable",
                ObjectBuilder::new().schema_type(Type::Boolean).description(Some(
                    "Whether the same request, with the same key, may succeed when sent again.",
                )),
            )
            .into()
    }
}

impl ToSchema for Problem {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("Problem")
    }
}

/// The problem responses of a handler that calls [`run`](super::run) or
/// [`run_phased`](super::run_phased): 400, 409 (with `Retry-After`), 422,
/// 500 and 503 (with `Retry-After`), each `application/problem+json` with
/// the [`Problem`] schema. `#[utoipa::path(responses((status = 201, ...), IdempotencyProblems))]`.
///
/// ```
/// use idempotency::http::openapi::IdempotencyProblems;
/// use utoipa::IntoResponses;
///
/// let statuses: Vec<String> = IdempotencyProblems::responses().into_keys().collect();
/// assert_eq!(statuses, ["400", "409", "422", "500", "503"]);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyProblems;

impl IntoResponses for IdempotencyProblems {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problem_responses(&[
            (
                ProblemKind::InvalidKey,
                "The Idempotency-Key header is missing, repeated or invalid.",
            ),
            (
                ProblemKind::InProgress,
                "A request with this key is still in progress: retry after Retry-After.",
            ),
            (
                ProblemKind::KeyReused,
                "The key was first used with a different request.",
            ),
            (ProblemKind::Internal, "The request failed; nothing was committed."),
            (
                ProblemKind::Unavailable,
                "Nothing ran, or the outcome is unknown: retry after Retry-After with the same key.",
            ),
        ])
    }
}

/// The problem responses of a handler that calls [`lookup`](super::lookup):
/// 400, 404, 409 (with `Retry-After`), 410, 500 and 503 (with
/// `Retry-After`).
///
/// ```
/// use idempotency::http::openapi::LookupProblems;
/// use utoipa::IntoResponses;
///
/// let statuses: Vec<String> = LookupProblems::responses().into_keys().collect();
/// assert_eq!(statuses, ["400", "404", "409", "410", "500", "503"]);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct LookupProblems;

impl IntoResponses for LookupProblems {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problem_responses(&[
            (
                ProblemKind::InvalidKey,
                "The Idempotency-Key header is missing, repeated or invalid.",
            ),
            (
                ProblemKind::KeyUnknown,
                "No request with this key was carried out for this caller at this endpoint: sending it again is safe.",
            ),
            (
                ProblemKind::InProgress,
                "A request with this key is still in progress: look again after Retry-After.",
            ),
            (
                ProblemKind::KeyExpired,
                "The request ran, but its result is no longer kept.",
            ),
            (
                ProblemKind::Internal,
                "The lookup failed, or the operation with this key was stopped partway for the service's \
                 operators: never send it under a new key.",
            ),
            (
                ProblemKind::Unavailable,
                "No database connection was free: retry after Retry-After.",
            ),
        ])
    }
}

fn problem_responses(kinds: &[(ProblemKind, &str)]) -> BTreeMap<String, RefOr<Response>> {
    kinds
        .iter()
        .map(|&(kind, description)| {
            let mut response = ResponseBuilder::new().description(description).content(
                PROBLEM_JSON,
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name(Problem::name())))
                    .build(),
            );
            if kind.retryable() {
                let seconds = ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0));
                response = response.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(seconds)
                        .description(Some("Seconds to wait before sending the request again."))
                        .build(),
                );
            }
            (kind.status().as_str().to_owned(), response.into())
        })
        .collect()
}

/// Completes a spec for idempotent handlers, as `#[openapi(modifiers(&IdempotentReplays))]`:
/// adds the [`Problem`] schema that the problem responses refer to, and the
/// `Idempotent-Replayed` and `Idempotency-Expires` headers (the default
/// names) to every 2xx response of every operation that takes the
/// [`IdempotencyKeyHeader`].
#[derive(Debug, Clone, Copy)]
pub struct IdempotentReplays;

impl Modify for IdempotentReplays {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi
            .components
            .get_or_insert_with(|| ComponentsBuilder::new().build());
        components
            .schemas
            .entry(Problem::name().into_owned())
            .or_insert_with(Problem::schema);
        let key = header_name(&IDEMPOTENCY_KEY);
        let operations = openapi.paths.paths.values_mut().flat_map(|item| {
            [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ]
            .into_iter()
            .flatten()
        });
        for operation in operations {
            let takes_key = operation.parameters.iter().flatten().any(|parameter| {
                parameter.parameter_in == ParameterIn::Header && parameter.name.eq_ignore_ascii_case(&key)
            });
            if !takes_key {
                continue;
            }
            for (status, response) in &mut operation.responses.responses {
                if let (true, RefOr::T(response)) = (status.starts_with('2'), response) {
                    let marker = HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::Boolean))
                        .description(Some("`true` when this is the stored response of an earlier request with the same key; absent otherwise."))
                        .build();
                    response.headers.insert(header_name(&IDEMPOTENT_REPLAYED), marker);
                    let expiry = HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::String))
                        .description(Some("When the key's guarantee ends, as an HTTP-date (RFC 9110 IMF-fixdate): the same on the first response and every replay; from then on the key executes again."))
                        .build();
                    response.headers.insert(header_name(&IDEMPOTENCY_EXPIRES), expiry);
                }
            }
        }
    }
}

/// A header's name as specifications spell it, each word capitalised.
fn header_name(name: &http::HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join("-")
}
