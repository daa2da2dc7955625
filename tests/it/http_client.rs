//! What HTTP clients and API designers ask of the HTTP layer, through a
//! router: problems a machine tells apart, the header names accepted, the
//! status of a key.

use std::collections::HashSet;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::http::{self, Failure, IdempotencyKey, Problem, Problems, StoredResponse};
use idempotency::{Config, InFlight, Outcome};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common::http::Anyone;

type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;

#[derive(Clone)]
struct Notes {
    pool: SqlitePool,
    config: Config,
}

/// Adds a note and answers with the count; a body of `"taken"` is the
/// application's own 409, as an already-refunded order would be.
async fn post_note(State(notes): State<Notes>, key: IdempotencyKey<Anyone>, body: String) -> Response {
    let outcome: Result<Outcome<StoredResponse<i64>>, Failure<Problem>> =
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
    db.conn()
        .batch_execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY)")
        .expect("create notes");
    let pool = Pool::builder()
        .max_size(pool_size)
        .connection_timeout(Duration::from_millis(200))
        .build(ConnectionManager::new(db.path().to_str().expect("utf-8 path")))
        .expect("a pool");
    let app = Router::new().route("/notes", post(post_note)).with_state(Notes {
        pool: pool.clone(),
        config,
    });
    (app, pool)
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
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().expect("ascii").to_owned());
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("a body");
    (
        status,
        content_type,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
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
            assert_eq!(body["type"], format!("{}{name}", Problems::DEFAULT_BASE), "{body}");
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
        assert_eq!(
            body["type"],
            format!("{}idempotency-key-invalid", Problems::DEFAULT_BASE)
        );
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
            assert_eq!(
                body["type"],
                format!("{}idempotency-key-invalid", Problems::DEFAULT_BASE)
            );
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
        assert_eq!(
            body["type"],
            format!("{}idempotency-key-missing", Problems::DEFAULT_BASE)
        );
        assert_eq!(count_notes(&db), 0);
    }
}
