//! `http::run` on a deadpool-diesel pool: the same call as on r2d2, a 503
//! with `Retry-After` when the pool has no connection in time, and a
//! connection that can run no more transactions taken out of the pool.

use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use deadpool_diesel::Runtime;
type Manager = deadpool_diesel::Manager<diesel::SqliteConnection>;
type Pool = deadpool_diesel::Pool<Manager>;
use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::prelude::*;
use idempotency::Config;
use idempotency::http::{self, IdempotencyKey, Problem, StoredResponse};
use idempotency::testing::SqliteFile;

use crate::common::http::Anyone;

async fn key(value: &str) -> IdempotencyKey<Anyone> {
    let (mut parts, ()) = Request::post("/notes")
        .header("Idempotency-Key", value)
        .body(())
        .expect("a request")
        .into_parts();
    match IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await {
        Ok(key) => key,
        Err(_) => panic!("the key {value} was refused"),
    }
}

/// A pool of `size` connections on a migrated SQLite file with a notes
/// table, waiting at most `wait` for a connection.
fn pool(db: &SqliteFile, size: usize, wait: Duration) -> Pool {
    db.conn()
        .batch_execute("CREATE TABLE notes (id INTEGER PRIMARY KEY)")
        .expect("create notes");
    let manager = Manager::new(db.path().to_str().expect("a utf-8 path"), Runtime::Tokio1);
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(wait))
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool")
}

fn add_note(conn: &mut SqliteConnection) -> Result<StoredResponse<i64>, Problem> {
    let failed = |_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error");
    conn.batch_execute("INSERT INTO notes DEFAULT VALUES").map_err(failed)?;
    let count = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
        .get_result(conn)
        .map_err(failed)?;
    Ok(StoredResponse::new(StatusCode::CREATED, count))
}

fn notes(db: &SqliteFile) -> i64 {
    diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
        .get_result(&mut db.conn())
        .expect("count the notes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_on_a_deadpool_pool_executes_once_and_replays() {
    let db = SqliteFile::new();
    let pool = pool(&db, 2, Duration::from_secs(5));
    let key = key("note-1").await;
    let config = Config::default();

    let first = http::run(&pool, &config, &key, (), |conn, ()| add_note(conn)).await;
    let first = first.into_response();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());

    let retry = http::run(&pool, &config, &key, (), |conn, ()| add_note(conn)).await;
    let retry = retry.into_response();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(notes(&db), 1, "the retry ran nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadpool_pool_without_a_free_connection_answers_503_with_retry_after() {
    let db = SqliteFile::new();
    let pool = pool(&db, 1, Duration::from_millis(200));
    let _held = pool.get().await.expect("the pool's one connection");
    let key = key("note-2").await;

    let answer = http::run(&pool, &Config::default(), &key, (), |conn, ()| add_note(conn)).await;
    let answer = answer.into_response();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.headers().contains_key("retry-after"), "{:?}", answer.headers());
    assert_eq!(notes(&db), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_can_run_no_more_transactions_leaves_the_deadpool_pool() {
    let db = SqliteFile::new();
    let pool = pool(&db, 1, Duration::from_secs(5));
    let key = key("note-3").await;

    // The operation leaves the connection's transaction manager broken, as
    // a rollback that failed on a lost connection does: the commit is never
    // sent, and the call cannot know what becomes of the open transaction.
    let answer = http::run(&pool, &Config::default(), &key, (), |conn, ()| {
        AnsiTransactionManager::transaction_manager_status_mut(conn).set_in_error();
        add_note(conn)
    })
    .await;
    assert_eq!(answer.into_response().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(pool.status().size, 0, "the broken connection left the pool");

    // The retry gets a connection of its own and executes: the dropped
    // connection took its transaction with it.
    let retry = http::run(&pool, &Config::default(), &key, (), |conn, ()| add_note(conn)).await;
    let retry = retry.into_response();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(notes(&db), 1);
}
