//! What a key is bound to over HTTP, through an axum router and
//! `http::run`: a byte-identical retry is never a mismatch, whatever the
//! request type holds, and two requests the application reads apart never
//! replay each other, however their queries are spelled.

use axum::extract::{Path, RawQuery, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::Config;
use idempotency::http::{self, Answer, Failure, IdempotencyKey, Problem, StoredResponse};
use serde_json::Value;

use crate::common::http::{Anyone, seen};
use crate::common::property::{Prng, cases};
use crate::common::{Tagged, percent_decode, tagged_body};

type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;

#[derive(Clone)]
struct App {
    pool: SqlitePool,
    config: Config,
}

type Response = Result<Answer<StoredResponse<Value>>, Failure<Problem>>;

/// Counts a call of the operation, and answers with what the handler read.
fn call(conn: &mut SqliteConnection, read: Value) -> Result<StoredResponse<Value>, Problem> {
    conn.batch_execute("INSERT INTO calls DEFAULT VALUES")
        .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
    Ok(StoredResponse::new(StatusCode::CREATED, read))
}

async fn tag(State(app): State<App>, key: IdempotencyKey<Anyone>, Json(tagged): Json<Tagged>) -> Response {
    http::run(&app.pool, &app.config, &key, tagged, |conn, tagged| {
        call(conn, serde_json::json!(tagged.tags.len()))
    })
    .await
}

/// Reads the path parameter as axum's `Path` decodes it and the query as
/// a form, as axum's `Query` does (through `form_urlencoded`), and answers
/// with them.
async fn item(
    State(app): State<App>,
    Path(id): Path<String>,
    key: IdempotencyKey<Anyone>,
    RawQuery(query): RawQuery,
) -> Response {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .into_owned()
        .collect();
    let read = (id, pairs);
    http::run(&app.pool, &app.config, &key, (), move |conn, ()| {
        call(conn, serde_json::json!(read))
    })
    .await
}

fn app(db: &idempotency::testing::SqliteFile) -> Router {
    db.conn()
        .batch_execute("CREATE TABLE calls (id INTEGER PRIMARY KEY)")
        .expect("create calls");
    let pool = Pool::builder()
        .max_size(2)
        .build(ConnectionManager::new(db.path().to_str().expect("utf-8 path")))
        .expect("a pool");
    Router::new()
        .route("/tags", post(tag))
        .route("/items/{id}", post(item))
        .with_state(App {
            pool,
            config: Config::default(),
        })
}

fn calls(db: &idempotency::testing::SqliteFile) -> i64 {
    diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM calls")
        .get_result(&mut db.conn())
        .expect("count calls")
}

/// The status, whether it was a replay, and the body.
async fn send(app: &Router, uri: &str, key: &str, body: &str) -> (StatusCode, bool, Value) {
    let request = Request::post(uri)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_owned()))
        .expect("a request");
    let seen = seen(app, request).await;
    (seen.status, seen.header("idempotent-replayed").is_some(), seen.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_with_hash_sets_sent_again_byte_for_byte_is_replayed_never_422() {
    let db = idempotency::testing::SqliteFile::new();
    let app = app(&db);
    let body = tagged_body();
    let first = send(&app, "/tags", "sets-1", &body).await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false), "{}", first.2);
    for attempt in 1..10 {
        let retry = send(&app, "/tags", "sets-1", &body).await;
        assert_eq!(retry, (StatusCode::CREATED, true, first.2.clone()), "attempt {attempt}");
    }
    assert_eq!(calls(&db), 1);
}

/// The pairs an application reading the query as a form sees, sorted
/// stably by name.
fn form(query: &str) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}

/// The pairs an application that percent-decodes the raw query sees, `+`
/// a plus, sorted stably by name.
fn percent_decoded(query: &str) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    let mut pairs: Vec<_> = query
        .split('&')
        .filter(|parameter| !parameter.is_empty())
        .map(|parameter| match parameter.split_once('=') {
            Some((name, value)) => (percent_decode(name), Some(percent_decode(value))),
            None => (percent_decode(parameter), None),
        })
        .collect();
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_the_application_reads_apart_never_replay_each_other() {
    let db = idempotency::testing::SqliteFile::new();
    let app = app(&db);
    for (n, (first, second)) in [
        // A stray `%` before escapes that decode to hex digits.
        ("q=%20", "q=%%32%30"),
        ("path=%2F", "path=%%32F"),
        ("v=%AA", "v=%%41%41"),
        // Two spellings of one name, in opposite orders.
        ("a%20b=1&a+b=2", "a+b=2&a%20b=1"),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("query-{n}");
        let read = send(&app, &format!("/items/z?{first}"), &key, "").await;
        assert_eq!((read.0, read.1), (StatusCode::CREATED, false), "{first}: {}", read.2);
        assert_ne!(
            form(first),
            form(second),
            "the application reads {first} and {second} apart"
        );
        let again = send(&app, &format!("/items/z?{second}"), &key, "").await;
        assert_eq!(again.0, StatusCode::UNPROCESSABLE_ENTITY, "{second}: {}", again.2);
    }
    // The documented equivalences hold.
    let first = send(&app, "/items/z?a=1&b=2&b=3", "query-same", "").await;
    let reordered = send(&app, "/items/z?b=2&%61=1&&b=3", "query-same", "").await;
    assert_eq!(reordered, (StatusCode::CREATED, true, first.2));
    assert_eq!(calls(&db), 5);
}

/// The pieces the sampled queries are made of: every character that
/// matters to a query's parsing, and escapes that decode to unreserved,
/// reserved and non-UTF-8 bytes.
const PIECES: &[&str] = &[
    "a", "1", "2", "%", "+", "=", "&", "%20", "%2B", "%2b", "%41", "%B0", "%61",
];

/// What path segments are made of here: characters and their escapes,
/// `+`, and an escaped `/`, which axum's `Path` decodes.
const PATH_PIECES: &[&str] = &["a", "A", "%41", "%61", "1", "+", "%2B", "%20", "%2F"];

/// A random path segment.
fn segment(prng: &mut Prng) -> String {
    (0..1 + prng.below(3))
        .map(|_| PATH_PIECES[prng.below(PATH_PIECES.len())])
        .collect()
}

/// A path segment as axum's `Path` decodes it.
fn path_decoded(segment: &str) -> Vec<u8> {
    percent_decoded(segment).remove(0).0
}

/// Random pairs of a path parameter and a query, and a respelling or a
/// change of them, sent with one key: where the second is replayed, the
/// application reads both alike, the path parameter as axum decodes it and
/// the query as a form and as percent-decoded text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_queries_replay_each_other_only_when_read_alike() {
    let db = idempotency::testing::SqliteFile::new();
    let app = app(&db);
    let mut prng = Prng(0x0b1d_0001);
    let mut replays = 0;
    for case in 0..cases(150) {
        let query: Vec<&str> = (0..1 + prng.below(8))
            .map(|_| PIECES[prng.below(PIECES.len())])
            .collect();
        let mut changed = query.clone();
        for _ in 0..1 + prng.below(2) {
            let at = prng.below(changed.len());
            match prng.below(3) {
                0 => changed[at] = PIECES[prng.below(PIECES.len())],
                1 => {
                    let other = prng.below(changed.len());
                    changed.swap(at, other);
                }
                _ => changed.insert(at, PIECES[prng.below(PIECES.len())]),
            }
        }
        let (query, changed) = (query.concat(), changed.concat());
        let path = segment(&mut prng);
        let other_path = if prng.below(2) == 0 {
            path.clone()
        } else {
            segment(&mut prng)
        };
        let key = format!("sample-{case}");
        let first = send(&app, &format!("/items/{path}?{query}"), &key, "").await;
        assert_eq!(first.0, StatusCode::CREATED, "{path}?{query}: {}", first.2);
        let second = send(&app, &format!("/items/{other_path}?{changed}"), &key, "").await;
        if second.1 {
            replays += 1;
            assert_eq!(
                path_decoded(&path),
                path_decoded(&other_path),
                "{path} replayed for {other_path}"
            );
            assert_eq!(form(&query), form(&changed), "{query} replayed for {changed}");
            assert_eq!(
                percent_decoded(&query),
                percent_decoded(&changed),
                "{query} replayed for {changed}"
            );
        } else {
            assert_eq!(
                second.0,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{query}, then {changed}: {}",
                second.2
            );
        }
    }
    assert!(replays > 0, "some changes were respellings");
}

/// Two fields a proxy joined into one with a bare comma: two keys, which
/// neither syntax takes for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_header_of_two_joined_fields_is_400_in_both_syntaxes() {
    let db = idempotency::testing::SqliteFile::new();
    let lenient = app(&db);
    let strict = lenient
        .clone()
        .layer(axum::Extension(http::KeyHeader::default().strict()));
    for app in [&lenient, &strict] {
        for joined in ["abc,def", "abc, def"] {
            let (status, _, problem) = send(app, "/items/z", joined, "").await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{joined}: {problem}");
        }
    }
    assert_eq!(calls(&db), 0);
    let (status, _, _) = send(&lenient, "/items/z", r#""abc,def""#, "").await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "a comma inside an sf-string is part of the key"
    );
}
