//! What HTTP clients and API designers ask of the HTTP layer, through a
//! router: problems a machine tells apart, the header names accepted, the
//! status of a key.

use std::collections::HashSet;

use axum::Router;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use idempotency::http::{self, Answer, Failure, IdempotencyKey, Problem, Problems, StoredResponse};
use idempotency::{Config, InFlight, OnCompleted};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common::http::{Anyone, Notes, SqlitePool, problem_type, seen};

/// Adds a note and answers with the count; a body of `"taken"` is the
/// application's own 409, as an already-refunded order would be.
async fn post_note(State(notes): State<Notes>, key: IdempotencyKey<Anyone>, body: String) -> Response {
    let outcome: Result<Answer<StoredResponse<i64>>, Failure<Problem>> =
        http::run(&notes.pool, &notes.config, &key, body, |conn, body| {
            if body == "taken" {
                return Err(Problem::new(StatusCode::CONFLICT, "Conflict"));
            }
            let internal = |_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error");
            diesel::sql_query("INSERT INTO notes DEFAULT VALUES")
                .execute(conn)
                .map_err(internal)?;
            let count = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
                .get_result(conn)
                .map_err(internal)?;
            Ok(StoredResponse::new(StatusCode::CREATED, count))
        })
        .await;
    outcome.into_response()
}

fn notes_app(db: &idempotency::testing::SqliteFile, pool_size: u32, config: Config) -> (Router, SqlitePool) {
    let notes = Notes::new(db, pool_size, config);
    let pool = notes.pool.clone();
    (Router::new().route("/notes", post(post_note)).with_state(notes), pool)
}

fn note(headers: &[(&str, &str)], body: &'static str) -> Request<axum::body::Body> {
    let mut request = Request::post("/notes");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(axum::body::Body::from(body)).expect("a request")
}

/// The status, the content type and the body, JSON or `null`.
async fn answer(app: &Router, request: Request<axum::body::Body>) -> (StatusCode, Option<String>, Value) {
    let seen = seen(app, request).await;
    let content_type = seen.header("content-type").map(str::to_owned);
    (
        seen.status,
        content_type,
        serde_json::from_slice(&seen.body).unwrap_or(Value::Null),
    )
}

mod problems {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_problem_of_the_crate_has_its_own_type_and_says_whether_to_retry() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, pool) = notes_app(&db, 1, Config::default().in_flight(InFlight::Reject));
        let key = |key: &'static str| [("idempotency-key", key)];
        let mut problems = Vec::new();

        problems.push(answer(&app, note(&[], "a")).await);
        problems.push(answer(&app, note(&key("\"broken"), "a")).await);
        assert_eq!(answer(&app, note(&key("k-1"), "a")).await.0, StatusCode::CREATED);
        problems.push(answer(&app, note(&key("k-1"), "b")).await);
        // Another connection holds SQLite's write lock: the key cannot be
        // claimed, and the policy rejects at once.
        let mut holder = db.conn();
        holder.batch_execute("BEGIN IMMEDIATE").expect("take the write lock");
        problems.push(answer(&app, note(&key("k-2"), "a")).await);
        holder.batch_execute("ROLLBACK").expect("release the write lock");
        let held = pool.get().expect("the pool's one connection");
        problems.push(answer(&app, note(&key("k-3"), "a")).await);
        drop(held);

        let expected = [
            (StatusCode::BAD_REQUEST, "idempotency-key-missing", false),
            (StatusCode::BAD_REQUEST, "idempotency-key-invalid", false),
            (StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused", false),
            (StatusCode::CONFLICT, "idempotency-key-in-progress", true),
            (StatusCode::SERVICE_UNAVAILABLE, "service-unavailable", true),
        ];
        for ((status, content_type, body), (expected_status, name, retryable)) in problems.iter().zip(expected) {
            assert_eq!(*status, expected_status, "{body}");
            assert_eq!(content_type.as_deref(), Some("application/problem+json"));
            assert_eq!(body["type"], problem_type(name), "{body}");
            assert_eq!(body["retryable"], json!(retryable), "{body}");
            assert_eq!(body["status"], json!(expected_status.as_u16()));
        }
        let types: HashSet<_> = problems.iter().map(|(_, _, body)| body["type"].to_string()).collect();
        assert_eq!(types.len(), problems.len(), "every kind has a type of its own");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_crates_in_progress_409_is_told_from_the_applications_own_409() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default().in_flight(InFlight::Reject));

        let (status, _, own) = answer(&app, note(&[("idempotency-key", "k-4")], "taken")).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(own["type"], "about:blank");
        assert_eq!(own.get("retryable"), None);

        let mut holder = db.conn();
        holder.batch_execute("BEGIN IMMEDIATE").expect("take the write lock");
        let (status, _, crates) = answer(&app, note(&[("idempotency-key", "k-4")], "a")).await;
        holder.batch_execute("ROLLBACK").expect("release the write lock");
        assert_eq!(status, StatusCode::CONFLICT);
        assert_ne!(crates["type"], own["type"]);
        assert_eq!(crates["retryable"], json!(true));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completed_key_under_the_reject_policy_is_its_own_409_and_runs_nothing() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default().on_completed(OnCompleted::Reject));
        let (status, _, first) = answer(&app, note(&[("idempotency-key", "k-1")], "a")).await;
        assert_eq!((status, &first), (StatusCode::CREATED, &json!(1)));

        let (status, content_type, body) = answer(&app, note(&[("idempotency-key", "k-1")], "a")).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(content_type.as_deref(), Some("application/problem+json"));
        assert_eq!(body["type"], problem_type("idempotency-key-completed"));
        assert_eq!(body["retryable"], json!(false), "the same request cannot succeed again");
        assert_eq!(count_notes(&db), 1, "nothing ran again");

        // Another body under the key is still the reuse of a key, and a new
        // key still runs.
        let (status, _, body) = answer(&app, note(&[("idempotency-key", "k-1")], "b")).await;
        assert_eq!(
            (status, &body["type"]),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!(problem_type("idempotency-key-reused"))
            )
        );
        let (status, _, second) = answer(&app, note(&[("idempotency-key", "k-2")], "a")).await;
        assert_eq!((status, &second), (StatusCode::CREATED, &json!(2)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn about_blank_is_the_explicit_way_back_to_untyped_problems() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let app = app.layer(axum::Extension(Problems::about_blank()));
        let (status, _, body) = answer(&app, note(&[], "a")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], "about:blank");
        assert_eq!(body["title"], "Bad Request");
        assert_eq!(body["retryable"], json!(false));
    }
}

mod syntax {
    use idempotency::http::KeyHeader;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_with_rfc_9651_date_and_display_string_parameters_is_accepted() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let first = answer(&app, note(&[("idempotency-key", r#""k-1";d=@1700000000"#)], "a")).await;
        assert_eq!(first.0, StatusCode::CREATED, "{}", first.2);
        // The parameters are not part of the key: the same key, replayed.
        let again = answer(&app, note(&[("idempotency-key", r#""k-1";t=%"f%c3%bcr""#)], "a")).await;
        assert_eq!((again.0, again.2), (StatusCode::CREATED, first.2));
        assert_eq!(
            answer(&app, note(&[("idempotency-key", r#""k-1";d=@1.5"#)], "a"))
                .await
                .0,
            StatusCode::BAD_REQUEST
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_strict_syntax_refuses_a_bare_key_and_takes_an_sf_string() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let lenient = app.clone();
        let strict = app.layer(axum::Extension(KeyHeader::default().strict()));

        let (status, content_type, body) = answer(&strict, note(&[("idempotency-key", "k-2")], "a")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(content_type.as_deref(), Some("application/problem+json"));
        assert_eq!(body["type"], problem_type("idempotency-key-invalid"));
        assert_eq!(
            body["detail"],
            "the Idempotency-Key header must be a structured field string: the key in double quotes"
        );
        assert_eq!(count_notes(&db), 0, "nothing ran");

        let quoted = answer(&strict, note(&[("idempotency-key", r#""k-2";d=@1700000000"#)], "a")).await;
        assert_eq!(quoted.0, StatusCode::CREATED);
        // The lenient default takes the bare spelling of the same key.
        let bare = answer(&lenient, note(&[("idempotency-key", "k-2")], "a")).await;
        assert_eq!((bare.0, bare.2), (StatusCode::CREATED, quoted.2));
        assert_eq!(count_notes(&db), 1);
    }
}

fn count_notes(db: &idempotency::testing::SqliteFile) -> i64 {
    diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
        .get_result(&mut db.conn())
        .expect("count notes")
}

mod names {
    use axum::http::HeaderName;
    use idempotency::http::KeyHeader;

    use super::*;

    fn also_x_key() -> KeyHeader {
        KeyHeader::default().also_accept(HeaderName::from_static("x-idempotency-key"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_configured_name_carries_the_same_key_as_idempotency_key() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let app = app.layer(axum::Extension(also_x_key()));

        let first = answer(&app, note(&[("x-idempotency-key", "k-1")], "a")).await;
        assert_eq!(first.0, StatusCode::CREATED);
        let again = answer(&app, note(&[("idempotency-key", r#""k-1""#)], "a")).await;
        assert_eq!((again.0, again.2), (StatusCode::CREATED, first.2));
        assert_eq!(count_notes(&db), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_with_both_names_is_two_keys_and_a_400() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let app = app.layer(axum::Extension(also_x_key()));

        for (case, headers) in [
            (
                "the same key",
                [("idempotency-key", "k-2"), ("x-idempotency-key", "k-2")],
            ),
            ("two keys", [("idempotency-key", "k-2"), ("x-idempotency-key", "k-3")]),
        ] {
            let (status, _, body) = answer(&app, note(&headers, "a")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{case}: {body}");
            assert_eq!(body["type"], problem_type("idempotency-key-invalid"));
            assert_eq!(body["detail"], "the request has more than one idempotency key header");
        }
        assert_eq!(count_notes(&db), 0, "nothing ran");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn by_default_only_idempotency_key_is_read() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        assert_eq!(KeyHeader::default().names(), [http::IDEMPOTENCY_KEY]);

        let (status, _, body) = answer(&app, note(&[("x-idempotency-key", "k-4")], "a")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], problem_type("idempotency-key-missing"));
        assert_eq!(count_notes(&db), 0);
    }
}

mod lookup {
    use std::convert::Infallible;

    use axum::http::Method;
    use axum::routing::get;
    use chrono::Duration as Retention;
    use idempotency::testing::ManualClock;

    use super::*;
    use crate::common::http::Bearer;

    async fn post_charge(State(notes): State<Notes>, key: IdempotencyKey<Bearer>) -> Response {
        let outcome: Result<Answer<StoredResponse<i64>>, Failure<Problem>> =
            http::run(&notes.pool, &notes.config, &key, (), |_, ()| {
                Ok(StoredResponse::new(StatusCode::CREATED, 42))
            })
            .await;
        outcome.into_response()
    }

    async fn charge_status(
        State(notes): State<Notes>,
        key: IdempotencyKey<Bearer>,
    ) -> Result<Answer<StoredResponse<i64>>, Failure<Infallible>> {
        http::lookup(&notes.pool, &notes.config, &key, &[(Method::POST, "/charges")]).await
    }

    fn charges_app(db: &idempotency::testing::SqliteFile, config: Config) -> Router {
        Router::new()
            .route("/charges", post(post_charge))
            .route("/charges/status", get(charge_status))
            .with_state(Notes::new(db, 2, config))
    }

    fn request(method: &str, path: &str, token: Option<&str>, key: &str) -> Request<axum::body::Body> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("idempotency-key", key);
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        request.body(axum::body::Body::empty()).expect("a request")
    }

    async fn replayed(app: &Router, request: Request<axum::body::Body>) -> Option<String> {
        seen(app, request)
            .await
            .header("idempotent-replayed")
            .map(str::to_owned)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_status_of_a_key_is_404_then_the_stored_response_then_410_once_expired() {
        let db = idempotency::testing::SqliteFile::new();
        let clock = ManualClock::new();
        let config = Config::default().retention(Retention::hours(1)).clock(clock.source());
        let app = charges_app(&db, config);
        let status = || request("GET", "/charges/status", Some("acct-1"), "c-1");

        let (code, _, body) = answer(&app, status()).await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert_eq!(body["type"], problem_type("idempotency-key-unknown"));
        assert_eq!(body["retryable"], json!(false));

        let first = answer(&app, request("POST", "/charges", Some("acct-1"), "c-1")).await;
        assert_eq!(first.0, StatusCode::CREATED);
        let found = answer(&app, status()).await;
        assert_eq!((found.0, found.2), (StatusCode::CREATED, json!(42)));
        assert_eq!(replayed(&app, status()).await.as_deref(), Some("true"));

        clock.advance(Retention::hours(1));
        let (code, _, body) = answer(&app, status()).await;
        assert_eq!(code, StatusCode::GONE);
        assert_eq!(body["type"], problem_type("idempotency-key-expired"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_in_progress_is_409_with_retry_after() {
        let db = idempotency::testing::SqliteFile::new();
        let app = charges_app(&db, Config::default());
        // Another connection holds SQLite's write lock, as a call in
        // progress does.
        let mut holder = db.conn();
        holder.batch_execute("BEGIN IMMEDIATE").expect("take the write lock");
        let response = app
            .clone()
            .oneshot(request("GET", "/charges/status", Some("acct-1"), "c-2"))
            .await
            .expect("infallible");
        holder.batch_execute("ROLLBACK").expect("release the write lock");
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()["retry-after"], "1");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        let body: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body["type"], problem_type("idempotency-key-in-progress"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_lookup_authenticates_first_and_sees_only_the_callers_scope() {
        let db = idempotency::testing::SqliteFile::new();
        let app = charges_app(&db, Config::default());
        let first = answer(&app, request("POST", "/charges", Some("acct-1"), "c-3")).await;
        assert_eq!(first.0, StatusCode::CREATED);

        let anonymous = answer(&app, request("GET", "/charges/status", None, "c-3")).await;
        assert_eq!(anonymous.0, StatusCode::UNAUTHORIZED);
        let other = answer(&app, request("GET", "/charges/status", Some("acct-2"), "c-3")).await;
        assert_eq!(other.0, StatusCode::NOT_FOUND, "{}", other.2);
        let own = answer(&app, request("GET", "/charges/status", Some("acct-1"), "c-3")).await;
        assert_eq!((own.0, own.2), (StatusCode::CREATED, json!(42)));
    }
}
