//! Requests of `http::run` whose clients hung up while they waited for a
//! connection of an r2d2 pool: they give up their wait, so none of them
//! ever checks out a connection or runs its operation, and a fresh client
//! is served as soon as a connection is free, not after the abandoned
//! ones. Driven over TCP through a router, with the pool's one connection
//! held by the test while the requests come and go.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use diesel::r2d2::event::CheckoutEvent;
use diesel::r2d2::{ConnectionManager, HandleEvent, Pool};
use idempotency::Config;
use idempotency::http::{self, Caller, Failure, IdempotencyKey, Problem, StoredResponse};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::common::TestDb;
use crate::common::http::{Limits, PATIENCE, Server, read_response, turn_waits};

crate::common::backend_tests!(
    async: requests_abandoned_while_they_wait_for_a_connection_never_take_one_and_a_fresh_client_is_served
);

/// The caller a request names in `x-scope`, so that the requests of each
/// test are told apart in what the crate reports.
struct Named(String);

impl<S: Sync> FromRequestParts<S> for Named {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let scope = parts.headers.get("x-scope").and_then(|value| value.to_str().ok());
        scope
            .map(|scope| Named(scope.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Caller for Named {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// Counts the connections the pool hands out.
#[derive(Debug, Default)]
struct Checkouts(Arc<AtomicUsize>);

impl HandleEvent for Checkouts {
    fn handle_checkout(&self, _: CheckoutEvent) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// What the handlers did: entered, ran their operation, were dropped
/// before their end.
#[derive(Default)]
struct Seen {
    entered: AtomicUsize,
    ran: AtomicUsize,
    dropped: AtomicUsize,
}

/// Counts a handler dropped before its end.
struct DroppedEarly<'a>(Option<&'a AtomicUsize>);

impl Drop for DroppedEarly<'_> {
    fn drop(&mut self) {
        if let Some(dropped) = self.0 {
            dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn requests_abandoned_while_they_wait_for_a_connection_never_take_one_and_a_fresh_client_is_served<D: TestDb>() {
    const ABANDONED: usize = 8;
    turn_waits::count();
    let db = tokio::task::spawn_blocking(D::new).await.expect("a migrated database");
    let checkouts = Arc::new(AtomicUsize::new(0));
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(PATIENCE)
        .event_handler(Box::new(Checkouts(checkouts.clone())))
        .build(ConnectionManager::<D::Conn>::new(db.url()))
        .expect("a pool of one connection");
    let seen = Arc::new(Seen::default());
    let handler = {
        let (pool, seen) = (pool.clone(), seen.clone());
        move |key: IdempotencyKey<Named>, Json(item): Json<String>| async move {
            seen.entered.fetch_add(1, Ordering::SeqCst);
            let mut dropped = DroppedEarly(Some(&seen.dropped));
            let ran = seen.clone();
            let placed: Result<http::Answer<StoredResponse<i64>>, Failure<Problem>> =
                http::run(&pool, &Config::default(), &key, item, move |conn, item: &String| {
                    ran.ran.fetch_add(1, Ordering::SeqCst);
                    let id = D::place_order(conn, item, 1)
                        .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
                    Ok(StoredResponse::new(StatusCode::CREATED, id))
                })
                .await;
            dropped.0 = None;
            placed.into_response()
        }
    };
    let server = Server::serve(Router::new().route("/orders", post(handler)), Limits::default()).await;
    let scope = format!("abandoned-{}", D::BACKEND);
    let held = tokio::task::block_in_place(|| pool.get().expect("the pool's one connection"));

    let mut sockets = Vec::new();
    for n in 0..ABANDONED {
        sockets.push(send(server.addr(), &scope, &format!("k-{n}"), &format!("item-{n}")).await);
    }
    wait_for_count("every request to reach its handler", &seen.entered, ABANDONED).await;
    drop(sockets);
    wait_for_count("every abandoned handler to be dropped", &seen.dropped, ABANDONED).await;
    turn_waits::wait_for_gone(&scope, ABANDONED).await;

    // The fresh client keeps its socket open, half-closed by no one, while
    // it waits.
    let mut fresh = send(server.addr(), &scope, "fresh", "fresh").await;
    let fresh = tokio::spawn(async move { read_response(&mut fresh).await });
    wait_for_count("the fresh request to reach its handler", &seen.entered, ABANDONED + 1).await;
    drop(held);
    let answered = fresh.await.expect("the fresh client");
    assert_eq!(answered.status, 201, "the fresh client is served: {answered:?}");
    assert_eq!(
        seen.ran.load(Ordering::SeqCst),
        1,
        "only the fresh request ran its operation"
    );
    assert_eq!(
        checkouts.load(Ordering::SeqCst),
        2,
        "the test's connection and the fresh request's: no abandoned request checked one out"
    );
    let orders = tokio::task::block_in_place(|| D::orders(&mut db.conn()));
    assert_eq!(orders.len(), 1, "{orders:?}");
}

/// Sends a POST of an order of `item` under `key` for `scope` over a
/// connection of its own, left open for the answer.
async fn send(addr: SocketAddr, scope: &str, key: &str, item: &str) -> TcpStream {
    let body = format!("\"{item}\"");
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nx-scope: {scope}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    socket.write_all(request.as_bytes()).await.expect("send the request");
    socket
}

/// Waits until `count` reaches `n`.
async fn wait_for_count(what: &str, count: &AtomicUsize, n: usize) {
    let reached = async {
        while count.load(Ordering::SeqCst) < n {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    if tokio::time::timeout(PATIENCE, reached).await.is_err() {
        panic!(
            "waited {PATIENCE:?} for {what}: {} of {n}",
            count.load(Ordering::SeqCst)
        );
    }
}
