//! `http::lookup` through a router, on every backend: a lookup answers only
//! what a replay would answer the same caller at the same endpoint (to
//! anyone else it is byte for byte the answer for an unknown key), it sees
//! phased operations as well as single calls, and no answer of it is kept
//! by a cache.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequestParts, State};
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::http::{self, Answer, Caller, Failure, IdempotencyKey, KeyHeader, Problem, StoredResponse};
use idempotency::phased::Phased;
use idempotency::{Config, InFlight};
use serde_json::{Value, json};

use crate::common::TestDb;
use crate::common::http::{Seen, bearer_token, problem_type, seen};
use crate::common::wait::Barrier;

crate::common::backend_tests!(
    async:
    another_user_of_the_tenant_is_refused_the_call_and_told_the_key_is_unknown,
    a_lookup_does_not_answer_the_record_of_another_endpoint,
    a_lookup_compares_its_own_path_parameters,
    a_key_across_endpoints_is_answered_to_its_principal_at_any_lookup,
    a_record_written_outside_http_is_an_unknown_key_over_http,
    a_phased_operation_is_in_progress_while_it_runs_then_its_response,
    a_parked_phased_operation_says_so,
    every_lookup_answer_is_not_to_be_stored,
    a_replay_and_a_lookup_name_the_request_that_executed,
    a_request_id_the_record_cannot_keep_is_left_out_and_one_with_quotes_is_kept_as_sent,
    the_request_id_header_is_the_apis_to_name,
);

/// A user of a tenant, as `Authorization: Bearer tenant:user` names it:
/// keys live in the tenant's scope, and the user is the principal.
struct User {
    tenant: String,
    user: String,
}

impl<S: Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let token = bearer_token(parts).ok_or(StatusCode::UNAUTHORIZED)?;
        let (tenant, user) = token.split_once(':').ok_or(StatusCode::UNAUTHORIZED)?;
        Ok(User {
            tenant: tenant.to_owned(),
            user: user.to_owned(),
        })
    }
}

impl Caller for User {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.tenant)
    }

    fn principal(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.user)
    }
}

/// The refunds service of the tests: refunds (also under an account),
/// payouts (an endpoint of its own), transfers (keys across endpoints) and
/// rides (a phased operation), each with its lookup.
struct App<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    config: Config,
    /// Where a ride whose request is `"hold"` waits in its foreign call:
    /// it arrives, then waits to be let go.
    ride_gate: Arc<Barrier>,
}

impl<D: TestDb> Clone for App<D> {
    fn clone(&self) -> Self {
        App {
            pool: self.pool.clone(),
            config: self.config.clone(),
            ride_gate: self.ride_gate.clone(),
        }
    }
}

type Looked = Result<Answer<StoredResponse<Value>>, Failure<Infallible>>;

async fn stored<D: TestDb>(app: &App<D>, key: &IdempotencyKey<User>, reference: &'static str) -> Response {
    let outcome: Result<Answer<StoredResponse<Value>>, Failure<Problem>> =
        http::run(&app.pool, &app.config, key, (), move |_, ()| {
            Ok(StoredResponse::new(
                StatusCode::CREATED,
                json!({ "reference": reference }),
            ))
        })
        .await;
    outcome.into_response()
}

async fn refund<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Response {
    stored(&app, &key, "re_1").await
}

async fn payout<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Response {
    stored(&app, &key, "po_1").await
}

async fn transfer<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Response {
    stored(&app, &key.across_endpoints(), "tr_1").await
}

async fn ride<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>, body: String) -> Response {
    let phased = Phased::new("ride").config(app.config.clone());
    let gate = app.ride_gate.clone();
    let outcome: Result<Answer<StoredResponse<Value>>, Failure<Problem>> =
        http::run_phased(&app.pool, &phased, &key, body, move |s, body| {
            let charge = s.call_at_most_once("charged", |provider_key| match body.as_str() {
                "fail" => Err(Problem::new(StatusCode::BAD_GATEWAY, "Bad Gateway")),
                "hold" => {
                    gate.wait();
                    gate.wait();
                    Ok(format!("ch_{}", &provider_key[..8]))
                }
                _ => Ok(format!("ch_{}", &provider_key[..8])),
            })?;
            s.finish(|_| Ok::<_, Problem>(StoredResponse::new(StatusCode::CREATED, json!({ "charge": charge }))))
        })
        .await;
    outcome.into_response()
}

async fn refund_status<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Looked {
    http::lookup(&app.pool, &app.config, &key, &[(Method::POST, "/refunds")]).await
}

async fn account_refund_status<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Looked {
    http::lookup(
        &app.pool,
        &app.config,
        &key,
        &[(Method::POST, "/accounts/{account}/refunds")],
    )
    .await
}

async fn ride_status<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Looked {
    http::lookup(&app.pool, &app.config, &key, &[(Method::POST, "/rides")]).await
}

fn app<D: TestDb>(db: &D) -> Router {
    let app = App::<D> {
        pool: db.pool(4),
        config: Config::default().in_flight(InFlight::Reject),
        ride_gate: Arc::new(Barrier::new(2)),
    };
    app_on(app)
}

fn app_on<D: TestDb>(app: App<D>) -> Router {
    Router::new()
        .route("/refunds", post(refund::<D>))
        .route("/refunds/status", get(refund_status::<D>))
        .route("/accounts/{account}/refunds", post(refund::<D>))
        .route("/accounts/{account}/refunds/status", get(account_refund_status::<D>))
        .route("/payouts", post(payout::<D>))
        .route("/transfers", post(transfer::<D>))
        .route("/rides", post(ride::<D>))
        .route("/rides/status", get(ride_status::<D>))
        .with_state(app)
}

async fn send(app: &Router, method: Method, path: &str, token: &str, key: &str, body: &'static str) -> Seen {
    send_with(app, method, path, (token, key), &[], body).await
}

/// [`send`], with the request header fields `fields` besides the
/// credentials and the key.
async fn send_with(
    app: &Router,
    method: Method,
    path: &str,
    (token, key): (&str, &str),
    fields: &[(&str, &[u8])],
    body: &'static str,
) -> Seen {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key);
    for (name, value) in fields {
        request = request.header(*name, HeaderValue::from_bytes(value).expect("a header value"));
    }
    seen(app, request.body(Body::from(body)).expect("a request")).await
}

async fn post_to(app: &Router, path: &str, token: &str, key: &str) -> Seen {
    send(app, Method::POST, path, token, key, "").await
}

/// A call through `app` that creates what it posts.
async fn created(app: &Router, path: &str, token: &str, key: &str) -> Seen {
    let seen = post_to(app, path, token, key).await;
    assert_eq!(seen.status, StatusCode::CREATED, "{path} {key}");
    seen
}

/// A lookup, whose every answer must say that it is not to be stored.
async fn look_up(app: &Router, path: &str, token: &str, key: &str) -> Seen {
    let seen = send(app, Method::GET, path, token, key, "").await;
    assert_eq!(
        seen.headers
            .get("cache-control")
            .map(|value| value.to_str().expect("ascii")),
        Some("no-store"),
        "{path} answered {} without no-store",
        seen.status
    );
    seen
}

/// What `token` is told about a key never used: the answer every lookup of
/// a record that is not the caller's must be, byte for byte.
async fn unknown(app: &Router, path: &str, token: &str) -> Seen {
    let seen = look_up(app, path, token, "never-used").await;
    assert_eq!(seen.status, StatusCode::NOT_FOUND);
    assert_eq!(seen.json()["type"], problem_type("idempotency-key-unknown"));
    seen
}

/// Asserts that `token`'s lookup of `key` at `path` is answered as the
/// lookup of a key never used, byte for byte.
async fn assert_answered_as_unknown(app: &Router, path: &str, token: &str, key: &str) {
    let seen = look_up(app, path, token, key).await;
    assert_eq!(
        seen,
        unknown(app, path, token).await,
        "{token}'s lookup of {key} at {path}"
    );
}

fn assert_replayed(seen: &Seen, body: Value) {
    assert_eq!(
        seen.status,
        StatusCode::CREATED,
        "{:?}",
        String::from_utf8_lossy(&seen.body)
    );
    assert_eq!(seen.json(), body);
    assert_eq!(seen.headers["idempotent-replayed"], "true");
}

async fn another_user_of_the_tenant_is_refused_the_call_and_told_the_key_is_unknown<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    let first = created(&app, "/refunds", "acme:user-1", "refund-1").await;

    let reused = post_to(&app, "/refunds", "acme:user-2", "refund-1").await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY, "never user-1's replay");
    assert_answered_as_unknown(&app, "/refunds/status", "acme:user-2", "refund-1").await;

    let own = look_up(&app, "/refunds/status", "acme:user-1", "refund-1").await;
    assert_replayed(&own, json!({ "reference": "re_1" }));
    assert_eq!(own.headers["idempotency-expires"], first.headers["idempotency-expires"]);
}

async fn a_lookup_does_not_answer_the_record_of_another_endpoint<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    created(&app, "/payouts", "acme:user-1", "k-1").await;
    assert_answered_as_unknown(&app, "/refunds/status", "acme:user-1", "k-1").await;
}

async fn a_lookup_compares_its_own_path_parameters<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    created(&app, "/accounts/a-1/refunds", "acme:user-1", "k-2").await;
    let own = look_up(&app, "/accounts/a-1/refunds/status", "acme:user-1", "k-2").await;
    assert_replayed(&own, json!({ "reference": "re_1" }));
    assert_answered_as_unknown(&app, "/accounts/a-2/refunds/status", "acme:user-1", "k-2").await;
    assert_answered_as_unknown(&app, "/refunds/status", "acme:user-1", "k-2").await;
}

async fn a_key_across_endpoints_is_answered_to_its_principal_at_any_lookup<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    created(&app, "/transfers", "acme:user-1", "k-3").await;
    let own = look_up(&app, "/refunds/status", "acme:user-1", "k-3").await;
    assert_replayed(&own, json!({ "reference": "tr_1" }));
    assert_answered_as_unknown(&app, "/refunds/status", "acme:user-2", "k-3").await;
}

async fn a_record_written_outside_http_is_an_unknown_key_over_http<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    let config = Config::default();
    tokio::task::block_in_place(|| {
        config.run(&mut db.conn(), "acme", "k-4", &(), |_| {
            Ok::<_, Infallible>(StoredResponse::new(
                StatusCode::CREATED,
                json!({ "reference": "re_core" }),
            ))
        })
    })
    .expect("a call outside HTTP");
    assert_answered_as_unknown(&app, "/refunds/status", "acme:user-1", "k-4").await;
}

async fn a_phased_operation_is_in_progress_while_it_runs_then_its_response<D: TestDb>() {
    let db = D::new();
    let gate = Arc::new(Barrier::new(2));
    let app = app_on(App::<D> {
        pool: db.pool(4),
        config: Config::default().in_flight(InFlight::Reject),
        ride_gate: gate.clone(),
    });
    let unknown_ride = unknown(&app, "/rides/status", "acme:user-1").await;
    assert_eq!(
        look_up(&app, "/rides/status", "acme:user-1", "ride-1").await,
        unknown_ride
    );

    let held = tokio::spawn({
        let app = app.clone();
        async move { send(&app, Method::POST, "/rides", "acme:user-1", "ride-1", "hold").await }
    });
    // The ride is in its foreign call, its lease held.
    tokio::task::block_in_place(|| gate.wait());
    let running = look_up(&app, "/rides/status", "acme:user-1", "ride-1").await;
    let foreign = look_up(&app, "/rides/status", "acme:user-2", "ride-1").await;
    tokio::task::block_in_place(|| gate.wait());
    let first = held.await.expect("the ride");

    assert_eq!(
        running.status,
        StatusCode::CONFLICT,
        "{:?}",
        String::from_utf8_lossy(&running.body)
    );
    assert_eq!(running.json()["type"], problem_type("idempotency-key-in-progress"));
    assert!(running.headers.contains_key("retry-after"));
    assert_eq!(foreign, unknown(&app, "/rides/status", "acme:user-2").await);

    assert_eq!(first.status, StatusCode::CREATED);
    let finished = look_up(&app, "/rides/status", "acme:user-1", "ride-1").await;
    assert_replayed(&finished, first.json());
    assert_eq!(
        finished.headers["idempotency-expires"],
        first.headers["idempotency-expires"]
    );
    assert_answered_as_unknown(&app, "/rides/status", "acme:user-2", "ride-1").await;
}

async fn a_parked_phased_operation_says_so<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    // The call fails once it was recorded as started; a call made at most
    // once is then never made again, and the retry parks the operation.
    let failed = send(&app, Method::POST, "/rides", "acme:user-1", "ride-2", "fail").await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    let stopped = look_up(&app, "/rides/status", "acme:user-1", "ride-2").await;
    assert_eq!(
        stopped.status,
        StatusCode::CONFLICT,
        "started, not finished: in progress"
    );
    let parked = send(&app, Method::POST, "/rides", "acme:user-1", "ride-2", "fail").await;

    let looked = look_up(&app, "/rides/status", "acme:user-1", "ride-2").await;
    assert_eq!(looked.status, parked.status);
    assert_eq!(looked.json()["type"], problem_type("idempotency-key-parked"));
    assert_eq!(looked.json()["type"], parked.json()["type"]);
    assert_eq!(looked.json()["retryable"], json!(false));
    assert_answered_as_unknown(&app, "/rides/status", "acme:user-2", "ride-2").await;
}

async fn every_lookup_answer_is_not_to_be_stored<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    // `look_up` checks the header on each: the unknown key, the stored
    // response, a key the rules refuse.
    unknown(&app, "/refunds/status", "acme:user-1").await;
    created(&app, "/refunds", "acme:user-1", "k-5").await;
    assert_eq!(
        look_up(&app, "/refunds/status", "acme:user-1", "k-5").await.status,
        StatusCode::CREATED
    );
    let refused = look_up(&app, "/refunds/status", "acme:user-1", "4111111111111111").await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    // The call's own answers are the application's to cache or not.
    let replay = post_to(&app, "/refunds", "acme:user-1", "k-5").await;
    assert!(!replay.headers.contains_key("cache-control"));
}

/// The `Original-Request` header of `seen`, if any.
fn original_request(seen: &Seen) -> Option<&str> {
    seen.header("original-request")
}

async fn a_replay_and_a_lookup_name_the_request_that_executed<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    // A single call and an operation in phases.
    for (path, status_path) in [("/refunds", "/refunds/status"), ("/rides", "/rides/status")] {
        // Unique: PostgreSQL's key locks span every schema of the database.
        let key = crate::common::own::unique_name("request");
        let send = async |method: Method, path: &str, request_id: &[u8]| {
            let fields: &[(&str, &[u8])] = &[("x-request-id", request_id)];
            send_with(&app, method, path, ("acme:ann", &key), fields, "").await
        };
        let first = send(Method::POST, path, b"req-1").await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}");
        assert_eq!(
            original_request(&first),
            None,
            "a first response names no other request"
        );
        let retry = send(Method::POST, path, b"req-2").await;
        assert_eq!((retry.status, &retry.body), (first.status, &first.body), "{path}");
        assert_eq!(original_request(&retry), Some("req-1"), "{path}");
        let looked = send(Method::GET, status_path, b"req-3").await;
        assert_eq!(looked.status, StatusCode::CREATED);
        assert_eq!(original_request(&looked), Some("req-1"), "{status_path}");
        // Another user of the tenant learns nothing, the request id included.
        assert_answered_as_unknown(&app, status_path, "acme:bob", &key).await;
    }
}

async fn a_request_id_the_record_cannot_keep_is_left_out_and_one_with_quotes_is_kept_as_sent<D: TestDb>() {
    let db = D::new();
    let app = app(&db);
    // No space: a request id is visible ASCII.
    let quoted: &[u8] = br#"O'Brien\";DROP/**/TABLE/**/idempotency_keys;--"#;
    let too_long = [b'r'; 129];
    let longest = [b'r'; 128];
    // A case: its name, the request's header fields, the id kept.
    type Case<'a> = (&'a str, Vec<(&'a str, &'a [u8])>, Option<&'a [u8]>);
    let cases: [Case<'_>; 6] = [
        ("quoted", vec![("x-request-id", quoted)], Some(quoted)),
        ("longest", vec![("x-request-id", &longest)], Some(&longest)),
        ("too-long", vec![("x-request-id", &too_long)], None),
        ("non-ascii", vec![("x-request-id", "réq-1".as_bytes())], None),
        ("space", vec![("x-request-id", b"req 1")], None),
        (
            "two-fields",
            vec![("x-request-id", b"req-1"), ("x-request-id", b"req-2")],
            None,
        ),
    ];
    for (case, fields, kept) in cases {
        let key = crate::common::own::unique_name(case);
        let first = send_with(&app, Method::POST, "/refunds", ("acme:ann", &key), &fields, "").await;
        assert_eq!(first.status, StatusCode::CREATED, "{case}: the request goes on");
        let retry = post_to(&app, "/refunds", "acme:ann", &key).await;
        assert_replayed(&retry, json!({ "reference": "re_1" }));
        let kept = kept.map(|id| std::str::from_utf8(id).expect("ASCII"));
        assert_eq!(original_request(&retry), kept, "{case}");
        let looked = look_up(&app, "/refunds/status", "acme:ann", &key).await;
        assert_eq!(original_request(&looked), kept, "{case}");
    }
    assert_eq!(D::key_count(&mut db.conn()), 6, "one record per case, the table intact");
}

async fn the_request_id_header_is_the_apis_to_name<D: TestDb>() {
    let db = D::new();
    let config = Config::default().in_flight(InFlight::Reject);
    let named = |header: KeyHeader| {
        let app = App::<D> {
            pool: db.pool(2),
            config: config.clone(),
            ride_gate: Arc::new(Barrier::new(2)),
        };
        app_on(app).layer(axum::Extension(header))
    };
    let fields: &[(&str, &[u8])] = &[("x-request-id", b"x-1"), ("request-id", b"r-1")];
    for (header, kept) in [
        (
            KeyHeader::default().request_id_header(HeaderName::from_static("request-id")),
            Some("r-1"),
        ),
        (KeyHeader::default().request_id_header(None), None),
    ] {
        let app = named(header);
        let key = crate::common::own::unique_name("refund");
        let first = send_with(&app, Method::POST, "/refunds", ("acme:ann", &key), fields, "").await;
        assert_eq!(first.status, StatusCode::CREATED);
        let retry = post_to(&app, "/refunds", "acme:ann", &key).await;
        assert_eq!(original_request(&retry), kept);
    }
}
