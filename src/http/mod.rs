//! The `Idempotency-Key` header end to end, for axum (feature `axum`) and
//! actix-web (feature `actix`).
//!
//! A client that lost a response retries its POST with the same
//! `Idempotency-Key` header and must get the first response back. This
//! module is the HTTP half of that, following the IETF draft
//! (draft-ietf-httpapi-idempotency-key-header) where it rules and Stripe's
//! API where clients expect it. The rules (the key's syntax, what a key is
//! bound to, the problems, the stored response and its replay, the status
//! of a key) are one set; an adapter per framework reads its request and
//! writes its response, and differs in nothing else. The examples here are
//! axum's; [HTTP with actix-web](crate::guide::actix) has actix-web's.
//!
//! | piece | what it does |
//! | --- | --- |
//! | [`IdempotencyKey<A>`](IdempotencyKey) | extractor: the header as an sf-string or a bare token, paired with the scope of the caller that the authentication extractor `A` resolved ([`Caller`]) |
//! | [`IdempotencyKeyRejection<R>`](IdempotencyKeyRejection) | why the extractor refused a request: the caller's own rejection `R`, or the key header's problem; a handler may match on it |
//! | `OptionalIdempotencyKey<A>` (feature `actix`) | actix-web's extractor of an optional key, which authenticates all the same (axum's is `Option<IdempotencyKey<A>>`) |
//! | [`KeyHeader`] | how the extractor reads the header: the syntax it accepts |
//! | [`run`] | one async call: the key rules checked at once, then a connection from the pool (r2d2's, or deadpool-diesel's with the feature `deadpool`: [`ConnectionPool`]), [`Config::run`](crate::Config::run) on tokio's blocking pool, join; the failures as responses ([`Failure`]) |
//! | [`lookup`] | what became of the caller's own call with a key, at the endpoints named: the stored response, or a 404, 409, 410 or (a parked phased operation) 500 problem; to anyone else, the 404 of an unknown key |
//! | [`run_phased`] | the same for a [phased operation](crate::phased) with a foreign call in the middle |
//! | `run_async`, `run_phased_async` (feature `diesel-async`) | the same on a bb8 or deadpool pool of diesel-async connections ([`AsyncConnectionPool`](crate::AsyncConnectionPool)), the operation or the steps async closures, in the handler's own future |
//! | [`StoredResponse<T>`](StoredResponse) | what an operation returns: status, kept headers, JSON body; stored, and replayed as it was |
//! | [`Answer<R>`](Answer) | what `run` returns: the `Outcome<R>`, whose response is `R`'s plus `Idempotent-Replayed: true` on a replay, and `Idempotency-Expires`, when the key's guarantee ends |
//! | [`openapi`] (feature `openapi`) | the utoipa pieces: header parameter, problem schema and responses, the replay marker |
//! | [`Problem`], [`Problems`] | RFC 9457 `application/problem+json` bodies, with `type` and `title` per API |
//!
//! The answers, by case:
//!
//! | case | status |
//! | --- | --- |
//! | first request | the operation's (`201` with `Location`, say), with `Idempotency-Expires` |
//! | retry with the same key and request | the first response, with `Idempotent-Replayed: true` and the same `Idempotency-Expires` |
//! | no `Idempotency-Key` where one is required | 400 problem |
//! | two `Idempotency-Key` headers, an unparsable value, a key breaking the key rules | 400 problem |
//! | same key, different request, or the same request at another endpoint (method, route, path parameters, query) or from another principal of the scope ([`Caller::principal`]) | 422 problem |
//! | a request with the same key still in progress after the in-flight wait | 409 problem, `Retry-After` |
//! | the operation's own error | the application's response for it; the key stays free |
//! | no database connection in time | 503 problem, `Retry-After` |
//! | a commit whose outcome is unknown ([`Error::OutcomeUnknown`](crate::Error::OutcomeUnknown)) | 503 problem, `Retry-After`: it may or may not have been carried out, and the retry with the same key tells which |
//! | the result is beyond [`Config::max_response_len`](crate::Config::max_response_len) as stored | 500 problem ([`ProblemKind::ResponseTooLarge`]) naming the bound, nothing committed |
//! | storage or JSON failure, a panic in the operation | 500 problem, nothing committed |
//!
//! No problem carries the request body, nor the key.
//!
//! Authentication and authorization come before the call, in the extractor
//! `A` or in the handler: a replay answers the stored response without
//! running the operation, so a check inside it guards the first request
//! only. The scope is a stable id of the caller, never its credential
//! ([the contract](crate::guide::contract#scope-whose-keys-these-are));
//! [HTTP with axum](crate::guide::http#authorization-before-the-call) shows
//! a handler with a permission check.
//!
//! ```
//! # #[cfg(not(feature = "axum"))] fn main() {}
//! # #[cfg(feature = "axum")]
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! use std::borrow::Cow;
//!
//! use axum::extract::{FromRequestParts, State};
//! use axum::http::{header, request::Parts, HeaderValue, Request, StatusCode};
//! use axum::{routing::post, Json, Router};
//! use diesel::prelude::*;
//! use diesel::r2d2::{ConnectionManager, Pool};
//! use idempotency::http::{self, Answer, Caller, Failure, IdempotencyKey, Problem, StoredResponse};
//! use idempotency::Config;
//! use serde::{Deserialize, Serialize};
//! use tower::ServiceExt;
//!
//! /// The caller, by the id its verified credential names.
//! struct Account { id: u64 }
//!
//! /// Your token store or verifier; one fixed token here.
//! fn account_of(token: &str) -> Option<Account> {
//!     (token == "tok-3f9a").then_some(Account { id: 1 })
//! }
//!
//! impl<S: Sync> FromRequestParts<S> for Account {
//!     type Rejection = Problem;
//!
//!     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
//!         parts.headers.get(header::AUTHORIZATION)
//!             .and_then(|value| account_of(value.to_str().ok()?.strip_prefix("Bearer ")?))
//!             .ok_or_else(|| Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized"))
//!     }
//! }
//!
//! impl Caller for Account {
//!     fn scope(&self) -> Cow<'_, str> {
//!         Cow::Owned(format!("acct-{}", self.id))
//!     }
//! }
//!
//! #[derive(Clone)]
//! struct App {
//!     pool: Pool<ConnectionManager<SqliteConnection>>,
//!     config: Config,
//! }
//!
//! #[derive(Serialize, Deserialize)]
//! struct NewOrder { item: String }
//!
//! #[derive(Serialize, Deserialize)]
//! struct Order { id: i64, item: String }
//!
//! #[derive(QueryableByName)]
//! struct Id { #[diesel(sql_type = diesel::sql_types::BigInt)] id: i64 }
//!
//! async fn place_order(
//!     State(app): State<App>,
//!     key: IdempotencyKey<Account>,
//!     Json(order): Json<NewOrder>,
//! ) -> Result<Answer<StoredResponse<Order>>, Failure<Problem>> {
//!     http::run(&app.pool, &app.config, &key, order, |conn, order| {
//!         let Id { id } = diesel::sql_query("INSERT INTO orders (item) VALUES (?) RETURNING id")
//!             .bind::<diesel::sql_types::Text, _>(&order.item)
//!             .get_result(conn)
//!             .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
//!         let location = HeaderValue::try_from(format!("/orders/{id}")).expect("a path of digits");
//!         Ok(StoredResponse::new(StatusCode::CREATED, Order { id, item: order.item.clone() })
//!             .with_header(header::LOCATION, location))
//!     })
//!     .await
//! }
//!
//! let db = idempotency::testing::SqliteFile::new();
//! diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut db.conn())?;
//! let pool = Pool::new(ConnectionManager::new(db.path().to_str().ok_or("utf-8 path")?))?;
//! let app = Router::new()
//!     .route("/orders", post(place_order))
//!     .with_state(App { pool, config: Config::default() });
//!
//! let post_order = |key: &str| {
//!     Request::post("/orders")
//!         .header("authorization", "Bearer tok-3f9a")
//!         .header("idempotency-key", key)
//!         .header("content-type", "application/json")
//!         .body(axum::body::Body::from(r#"{"item": "book"}"#))
//! };
//! let first = app.clone().oneshot(post_order(r#""8e03978e""#)?).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(first.headers()["location"], "/orders/1");
//!
//! // The response was lost; the client retries with the same key, bare this time.
//! let retry = app.clone().oneshot(post_order("8e03978e")?).await?;
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["location"], "/orders/1");
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.headers()["idempotency-expires"], first.headers()["idempotency-expires"]);
//! # Ok(())
//! # })
//! # }
//! ```

#[cfg(feature = "actix")]
mod actix;
mod answer;
#[cfg(feature = "axum")]
mod axum;
mod call;
mod endpoint;
mod failure;
mod gate;
mod header;
mod headers;
mod key;
mod key_header;
mod lookup;
#[cfg(feature = "openapi")]
pub mod openapi;
mod pool;
mod problem;
mod rejection;
mod response;

#[cfg(feature = "actix")]
pub use actix::OptionalIdempotencyKey;
pub use answer::Answer;
pub use call::{run, run_phased};
#[cfg(feature = "diesel-async")]
pub use call::{run_async, run_phased_async};
pub use failure::Failure;
pub use headers::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, ORIGINAL_REQUEST, X_REQUEST_ID};
pub use key::{Caller, IdempotencyKey};
pub use key_header::KeyHeader;
pub use lookup::lookup;
pub use pool::ConnectionPool;
pub use problem::{Problem, ProblemKind, Problems};
pub use rejection::IdempotencyKeyRejection;
pub use response::StoredResponse;
