//! The HTTP layer driven by a real client over TCP on 127.0.0.1: the order
//! service of `examples/http_orders.rs` served in this process on each
//! backend, the compiled example binary end to end, and the parts of
//! `idempotency::http` the service does not use.
//!
//! Most tests serve the example's router in the test process: they can then
//! hold an order's transaction open (a hook the binary does not set) and
//! watch the handler being dropped. The binary tests run the program that
//! `cargo test` builds next to this test, with the same features, so that
//! what users start is tested too.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::TestDb;
use crate::common::http::*;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::{Request, StatusCode, request::Parts};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Json, Router};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::http::{
    self, Caller, Failure, IdempotencyKey, IdempotencyKeyRejection, Problem, ProblemKind, Problems, StoredResponse,
};
use idempotency::{Config, InFlight};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tower::ServiceExt;

const BODY: &str = r#"{"item": "book", "quantity": 2}"#;

crate::common::backend_tests!(
    async:
    lost_response_is_replayed_with_the_first_status_body_and_location,
    concurrent_posts_with_one_key_place_one_order,
    duplicate_in_progress_is_409_with_retry_after_then_replays,
    client_gone_mid_request_commits_once_and_the_retry_replays,
    panic_in_the_operation_is_500_and_commits_nothing,
    missing_key_is_400,
    two_key_headers_are_400,
    malformed_keys_and_keys_breaking_the_rules_are_400,
    quoted_and_bare_keys_are_one_key,
    reuse_with_another_body_is_422,
    missing_or_malformed_credentials_are_401,
    accounts_neither_see_nor_replay_each_other,
    a_rotated_token_of_one_account_replays_and_no_token_is_stored,
    validation_failure_leaves_the_key_free,
    bad_bodies_are_refused_without_echo_and_leave_the_key_free,
    example_binary_serves_the_lost_response_story_and_stops_on_sigterm,
    requests_refused_by_rule_are_answered_at_once_while_the_pool_is_exhausted,
    no_free_connection_is_503_with_retry_after_on_every_route,
    items_no_backend_can_store_are_422_on_every_backend,
    idle_sockets_do_not_keep_a_new_client_from_being_served,
    a_failed_call_is_logged_with_the_database_message_and_without_the_body,
    a_stalled_request_head_or_body_is_cut_off_by_its_read_timeout,
    duplicates_of_a_slow_request_hold_no_connection_and_other_accounts_are_served,
    example_binary_answers_a_key_reused_at_another_endpoint_with_422,
);

/// How long a request that the server can refuse without its database may
/// take to be answered: generous for an answer computed in microseconds,
/// and well below [`EXHAUSTED_CHECKOUT`], so that a request that waited
/// for a connection cannot pass for one answered at once.
const AT_ONCE: Duration = Duration::from_secs(1);

/// The checkout timeout of the pools that tests hold empty.
const EXHAUSTED_CHECKOUT: Duration = Duration::from_secs(5);

/// How long the example gives a client to send a request's head, as its
/// `server` module documents.
const EXAMPLE_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request may wait for a connection in the example as it is
/// configured: the wait of a web request, not r2d2's default of 30 s.
const WEB_CHECKOUT_BOUND: Duration = Duration::from_secs(10);

/// A database of the test's own and the example service on it, with the
/// default settings.
async fn shop<D: TestDb>() -> (D, Server) {
    let db = database::<D>().await;
    let server = Server::start(&db, Settings::default()).await;
    (db, server)
}
async fn lost_response_is_replayed_with_the_first_status_body_and_location<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let (proxy, lost) = losing_proxy(server.addr()).await;

    let sent = post_order(&client, &format!("http://{proxy}"), "acct-1", &[r#""lost-1""#], BODY)
        .send()
        .await;
    assert!(sent.is_err(), "the response was lost on its way: {sent:?}");
    let first = lost.await.expect("the proxy saw the response");
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);

    let retry = send(post_order(&client, &server.url(""), "acct-1", &[r#""lost-1""#], BODY)).await;
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.location.as_deref(), first.header("location"));
    assert_eq!(retry.content_type.as_deref(), first.header("content-type"));
    let first_body: Value = serde_json::from_slice(&first.body).expect("a JSON body");
    assert_eq!(retry.body, first_body);
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    let id = &retry.body["id"];
    assert_eq!(retry.body, json!({"id": id, "item": "book", "quantity": 2}));
    assert_eq!(retry.location, Some(format!("/orders/{id}")));
    assert_eq!(order_count(&db).await, 1);
}

async fn concurrent_posts_with_one_key_place_one_order<D: TestDb>() {
    const CLIENTS: usize = 32;
    let (db, server) = shop::<D>().await;
    let client = client();
    let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let request = post_order(&client, &server.url(""), "acct-1", &["race-1"], BODY);
        let barrier = barrier.clone();
        requests.spawn(async move {
            barrier.wait().await;
            send(request).await
        });
    }
    let answers = requests.join_all().await;

    for answer in &answers {
        assert_eq!(answer.status, 201, "{answer:?}");
        assert_eq!(answer.body, answers[0].body);
        assert_eq!(answer.location, answers[0].location);
    }
    let executed = answers.iter().filter(|a| a.replayed.is_none()).count();
    assert_eq!(executed, 1, "one request executed, the others replayed");
    assert_eq!(order_count(&db).await, 1);
}

async fn duplicate_in_progress_is_409_with_retry_after_then_replays<D: TestDb>() {
    let db = database::<D>().await;
    let (mut gate, hook) = Gate::new();
    let settings = Settings {
        in_flight: InFlight::Reject,
        before_commit: Some(hook),
        ..Settings::default()
    };
    let server = Server::start(&db, settings).await;
    let client = client();
    let post = || post_order(&client, &server.url(""), "acct-1", &["slow-1"], BODY);

    let first = tokio::spawn(send(post()));
    gate.wait_entered().await;
    let duplicate = send(post()).await.assert_problem(409);
    assert_eq!(duplicate.retry_after.as_deref(), Some("1"));
    assert!(
        duplicate.body["type"]
            .as_str()
            .unwrap()
            .ends_with("/idempotency-key-in-progress")
    );

    gate.release();
    let first = first.await.expect("the first request");
    assert_eq!((first.status, first.replayed.as_deref()), (201, None));
    let later = send(post()).await;
    assert_eq!((later.status, later.replayed.as_deref()), (201, Some("true")));
    assert_eq!(later.body, first.body);
    assert_eq!(order_count(&db).await, 1);
}

/// Sends a message when dropped unless disarmed: tells whether a handler's
/// future ran to its end.
struct DroppedEarly(Option<mpsc::UnboundedSender<()>>);

impl DroppedEarly {
    /// The future ran to its end.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for DroppedEarly {
    fn drop(&mut self) {
        if let Some(dropped) = self.0.take() {
            let _ = dropped.send(());
        }
    }
}

async fn client_gone_mid_request_commits_once_and_the_retry_replays<D: TestDb>() {
    let db = database::<D>().await;
    let (mut gate, hook) = Gate::new();
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel();
    let watch_handlers = move |router: Router| {
        router.layer(axum::middleware::from_fn(move |request, next: Next| {
            let mut guard = DroppedEarly(Some(dropped_tx.clone()));
            async move {
                let response = next.run(request).await;
                guard.disarm();
                response
            }
        }))
    };
    let settings = Settings {
        before_commit: Some(hook),
        ..Settings::default()
    };
    let server = Server::start_with(&db, settings, watch_handlers).await;

    let mut connection = tokio::net::TcpStream::connect(server.addr()).await.expect("connect");
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer acct-1\r\nidempotency-key: gone-1\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
        server.addr(),
        BODY.len()
    );
    connection
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    gate.wait_entered().await;
    drop(connection);
    tokio::time::timeout(PATIENCE, dropped.recv())
        .await
        .expect("the server dropped the handler of the departed client");

    // Only now may the transaction commit: its handler is gone.
    gate.release();
    let client = client();
    let retry = send(post_order(&client, &server.url(""), "acct-1", &["gone-1"], BODY)).await;
    assert_eq!((retry.status, retry.replayed.as_deref()), (201, Some("true")));
    assert_eq!(order_count(&db).await, 1);
    assert_eq!(key_count(&db).await, 1);
}

async fn panic_in_the_operation_is_500_and_commits_nothing<D: TestDb>() {
    let db = database::<D>().await;
    let panicked = Arc::new(AtomicBool::new(false));
    let hook = {
        let panicked = panicked.clone();
        move || {
            if !panicked.swap(true, Ordering::SeqCst) {
                panic!("the operation fails after writing the order");
            }
        }
    };
    let settings = Settings {
        before_commit: Some(Arc::new(hook)),
        ..Settings::default()
    };
    let server = Server::start(&db, settings).await;
    let client = client();
    let post = || post_order(&client, &server.url(""), "acct-1", &["panic-1"], BODY);

    let failed = send(post()).await.assert_problem(500);
    assert!(!failed.body.to_string().contains("fails after"), "{failed:?}");
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);

    let retry = send(post()).await;
    assert_eq!((retry.status, retry.replayed.as_deref()), (201, None));
    assert_eq!(order_count(&db).await, 1);
}

async fn missing_key_is_400<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    send(post_order(&client(), &server.url(""), "acct-1", &[], BODY))
        .await
        .assert_problem_of(400, "idempotency-key-missing");
    assert_eq!(order_count(&db).await, 0);
}

async fn two_key_headers_are_400<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    for keys in [["a-1", "a-2"], ["a-1", "a-1"]] {
        send(post_order(&client, &server.url(""), "acct-1", &keys, BODY))
            .await
            .assert_problem_of(400, "idempotency-key-invalid");
    }
    assert_eq!(order_count(&db).await, 0);
}

async fn malformed_keys_and_keys_breaking_the_rules_are_400<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let too_long = "k".repeat(256);
    for key in [
        r#""unterminated"#,
        r#""bad \n escape""#,
        r#""k-1";Bad=1"#,
        r#""k-1" trailing"#,
        "two words",
        r#""""#,
        r#""with space""#,
        "4111111111111111",
        &too_long,
    ] {
        let answer = send(post_order(&client, &server.url(""), "acct-1", &[key], BODY))
            .await
            .assert_problem(400);
        let detail = answer.body["detail"].as_str().expect("a detail");
        let bare = key.trim_matches('"');
        assert!(
            bare.is_empty() || !detail.contains(bare),
            "the key is not echoed: {detail}"
        );
    }
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);
}

async fn quoted_and_bare_keys_are_one_key<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let first = send(post_order(&client, &server.url(""), "acct-1", &[r#""k-7""#], BODY)).await;
    assert_eq!((first.status, first.replayed.as_deref()), (201, None));
    for spelling in ["k-7", r#""k-7";v=1"#, r#" "k-7" "#] {
        let again = send(post_order(&client, &server.url(""), "acct-1", &[spelling], BODY)).await;
        assert_eq!(again.replayed.as_deref(), Some("true"), "{spelling}");
        assert_eq!((again.status, &again.body), (201, &first.body), "{spelling}");
    }
    assert_eq!(order_count(&db).await, 1);
}

async fn reuse_with_another_body_is_422<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let first = send(post_order(&client, &server.url(""), "acct-1", &["k-8"], BODY)).await;
    assert_eq!(first.status, 201);

    let other = r#"{"item": "book", "quantity": 3}"#;
    let reused = send(post_order(&client, &server.url(""), "acct-1", &["k-8"], other))
        .await
        .assert_problem_of(422, "idempotency-key-reused");
    assert!(!reused.body.to_string().contains("book"), "{reused:?}");

    // The first result stays replayable.
    let again = send(post_order(&client, &server.url(""), "acct-1", &["k-8"], BODY)).await;
    assert_eq!((again.status, again.replayed.as_deref()), (201, Some("true")));
    assert_eq!(order_count(&db).await, 1);
}

async fn missing_or_malformed_credentials_are_401<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let without = client
        .post(server.url("/orders"))
        .header("idempotency-key", "k-9")
        .header("content-type", "application/json")
        .body(BODY);
    Answer::of(without.send().await.expect("send"))
        .await
        .assert_problem_of(401, "unauthorized");
    for authorization in [
        "Basic YWxhZGRpbjpvcGVuc2VzYW1l",
        "Bearer",
        "Bearer ",
        "bearer a b",
        "Bearer .no-account",
    ] {
        let request = client
            .post(server.url("/orders"))
            .header("authorization", authorization)
            .header("idempotency-key", "k-9")
            .header("content-type", "application/json")
            .body(BODY);
        let response = request.send().await.expect("send");
        assert_eq!(response.headers()["www-authenticate"], "Bearer", "{authorization}");
        Answer::of(response).await.assert_problem(401);
    }
    let listing = client.get(server.url("/orders")).send().await.expect("send");
    Answer::of(listing).await.assert_problem(401);
    assert_eq!(order_count(&db).await, 0);
}

async fn accounts_neither_see_nor_replay_each_other<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let alice = send(post_order(&client, &server.url(""), "alice", &["shared-1"], BODY)).await;
    assert_eq!(alice.status, 201);

    // Same key, same body, another account: its own order, not a replay.
    let bob = send(post_order(&client, &server.url(""), "bob", &["shared-1"], BODY)).await;
    assert_eq!((bob.status, bob.replayed.as_deref()), (201, None));
    assert_ne!(bob.body["id"], alice.body["id"]);
    // Same key, another body: no mismatch with alice's request either.
    let other = r#"{"item": "pen", "quantity": 1}"#;
    let bob_again = send(post_order(&client, &server.url(""), "mallory", &["shared-1"], other)).await;
    assert_eq!((bob_again.status, bob_again.replayed.as_deref()), (201, None));

    let alice_order = alice.location.as_deref().expect("a location");
    let peek = client.get(server.url(alice_order)).bearer_auth("bob");
    send(peek).await.assert_problem(404);
    let own = send(client.get(server.url(alice_order)).bearer_auth("alice")).await;
    assert_eq!((own.status, &own.body), (200, &alice.body));
    let listed = send(client.get(server.url("/orders")).bearer_auth("bob")).await;
    assert_eq!(listed.body, json!([bob.body]));
    send(client.get(server.url("/orders/not-a-number")).bearer_auth("bob"))
        .await
        .assert_problem(404);
    assert_eq!(order_count(&db).await, 3);
}

async fn a_rotated_token_of_one_account_replays_and_no_token_is_stored<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let first = send(post_order(
        &client,
        &server.url(""),
        "acct-1.token-before",
        &["rotate-1"],
        BODY,
    ))
    .await;
    assert_eq!((first.status, first.replayed.as_deref()), (201, None));

    // The token was rotated between the lost response and the retry: the
    // same account, so the same scope, and the first order comes back.
    let retry = send(post_order(
        &client,
        &server.url(""),
        "acct-1.token-after",
        &["rotate-1"],
        BODY,
    ))
    .await;
    assert_eq!((retry.status, retry.replayed.as_deref()), (201, Some("true")));
    assert_eq!(retry.body, first.body);
    assert_eq!(order_count(&db).await, 1);

    // The one key record is in the account's scope: no token is stored.
    assert_eq!(key_count(&db).await, 1);
    let in_account = tokio::task::block_in_place(|| D::keys_in_scope(&mut db.conn(), "acct-1"));
    assert_eq!(in_account, ["rotate-1"]);
    let listed = send(client.get(server.url("/orders")).bearer_auth("acct-1.token-after")).await;
    assert_eq!(listed.body, json!([first.body]));
}

async fn validation_failure_leaves_the_key_free<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let zero = r#"{"item": "book", "quantity": 0}"#;
    send(post_order(&client, &server.url(""), "acct-1", &["fix-1"], zero))
        .await
        .assert_problem_of(422, "invalid-order");
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);

    let corrected = send(post_order(&client, &server.url(""), "acct-1", &["fix-1"], BODY)).await;
    assert_eq!((corrected.status, corrected.replayed.as_deref()), (201, None));
    assert_eq!(corrected.body["quantity"], 2);
    assert_eq!(order_count(&db).await, 1);
}

async fn bad_bodies_are_refused_without_echo_and_leave_the_key_free<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let nested = format!(
        r#"{{"item": {}"secret-123"{}, "quantity": 1}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let cases = [
        (r#"{"item": "secret-123", "quantity": "#.to_owned(), 400),
        (r#"{"item": "secret-123"}"#.to_owned(), 422),
        (r#"{"item": "x", "quantity": "secret-123"}"#.to_owned(), 422),
        (
            r#"{"item": "x", "quantity": 1.5, "note": "secret-123"}"#.to_owned(),
            422,
        ),
        (r#"{"item": "x", "quantity": 1, "note": "secret-123"}"#.to_owned(), 422),
        (nested, 422),
    ];
    for (body, status) in cases {
        let answer = send(post_order(&client, &server.url(""), "acct-1", &["body-1"], &body))
            .await
            .assert_problem(status);
        assert!(!answer.body.to_string().contains("secret-123"), "{answer:?}");
    }
    let huge = format!(r#"{{"item": "secret-123{}", "quantity": 1}}"#, "x".repeat(10 << 20));
    let headers = [
        ("authorization", "Bearer acct-1"),
        ("idempotency-key", "body-1"),
        ("content-type", "application/json"),
    ];
    let refused = post_raw(server.addr(), "/orders", &headers, huge).await;
    assert_eq!(refused.status, 413);
    assert_eq!(refused.header("content-type"), Some("application/problem+json"));
    assert!(!String::from_utf8_lossy(&refused.body).contains("secret-123"));
    let no_type = client
        .post(server.url("/orders"))
        .bearer_auth("acct-1")
        .header("idempotency-key", "body-1")
        .body(BODY);
    send(no_type).await.assert_problem(415);
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);

    let corrected = send(post_order(&client, &server.url(""), "acct-1", &["body-1"], BODY)).await;
    assert_eq!((corrected.status, corrected.replayed.as_deref()), (201, None));
}

async fn example_binary_serves_the_lost_response_story_and_stops_on_sigterm<D: TestDb>() {
    let db = database::<D>().await;
    let args = [
        "--addr",
        "127.0.0.1:0",
        "--database",
        db.url(),
        "--in-flight-wait",
        "2000",
    ];
    let service = ExampleProcess::start(args.iter().map(|arg| arg.to_string()).collect()).await;
    let client = client();

    let (proxy, lost) = losing_proxy(service.addr()).await;
    let sent = post_order(&client, &format!("http://{proxy}"), "acct-1.token-1", &["bin-1"], BODY)
        .send()
        .await;
    assert!(sent.is_err(), "the response was lost on its way: {sent:?}");
    let first = lost.await.expect("the proxy saw the response");
    assert_eq!(first.status, 201);

    // The client refreshed its token before it retried: the same account.
    let retry = send(post_order(&client, &service.base, "acct-1.token-2", &["bin-1"], BODY)).await;
    assert_eq!((retry.status, retry.replayed.as_deref()), (201, Some("true")));
    assert_eq!(retry.location.as_deref(), first.header("location"));
    assert_eq!(retry.body, serde_json::from_slice::<Value>(&first.body).expect("JSON"));
    let expires = first.header("idempotency-expires");
    assert!(expires.is_some(), "the first response says when its guarantee ends");
    let again = post_order(&client, &service.base, "acct-1", &["bin-1"], BODY)
        .send()
        .await
        .expect("another retry");
    let again_expires = again
        .headers()
        .get("idempotency-expires")
        .map(|value| value.to_str().ok());
    assert_eq!(again_expires, Some(expires), "a replay names the same end");
    let other = r#"{"item": "book", "quantity": 5}"#;
    let reused = send(post_order(&client, &service.base, "acct-1", &["bin-1"], other))
        .await
        .assert_problem(422);
    let kind = reused.body["type"].as_str().unwrap_or_default();
    assert!(kind.ends_with("idempotency-key-reused"), "a type of its own: {kind}");
    assert_eq!(reused.body["retryable"], false, "the same request cannot succeed");
    send(client.get(format!("{}/orders", service.base)))
        .await
        .assert_problem(401);

    let (success, more_output) = service.terminate().await;
    assert!(success, "the service exits with success on SIGTERM");
    assert_eq!(more_output, "", "one line on stdout, no more");
    assert_eq!(order_count(&db).await, 1);
}

async fn requests_refused_by_rule_are_answered_at_once_while_the_pool_is_exhausted<D: TestDb>() {
    let db = database::<D>().await;
    let settings = Settings {
        checkout_timeout: EXHAUSTED_CHECKOUT,
        ..Settings::default()
    };
    let (server, _held) = Server::start_exhausted(&db, settings).await;
    let client = client();
    let base = server.url("");
    // Sent first and answered last: the pool stays exhausted throughout.
    let valid = tokio::spawn(send(post_order(&client, &base, "acct-1", &["valid-1"], BODY)));

    let long_key = "k".repeat(300);
    let long_token = "t".repeat(256);
    let nul_item = r#"{"item": "a\u0000b", "quantity": 1}"#;
    let long_item = format!(r#"{{"item": "{}", "quantity": 1}}"#, "x".repeat(65_536));
    let cases = [
        ("a 300-character key", "acct-1", vec![long_key.as_str()], BODY, 400),
        (
            "a key like a card number",
            "acct-1",
            vec!["4111111111111111"],
            BODY,
            400,
        ),
        ("a key with a space", "acct-1", vec![r#""with space""#], BODY, 400),
        (
            "a token too long for a scope",
            long_token.as_str(),
            vec!["k-1"],
            BODY,
            401,
        ),
        ("no key", "acct-1", vec![], BODY, 400),
        ("two keys", "acct-1", vec!["k-1", "k-2"], BODY, 400),
        ("a body that is not JSON", "acct-1", vec!["k-1"], r#"{"item": "#, 400),
        (
            "a body without a quantity",
            "acct-1",
            vec!["k-1"],
            r#"{"item": "book"}"#,
            422,
        ),
        (
            "a quantity of 0",
            "acct-1",
            vec!["k-1"],
            r#"{"item": "book", "quantity": 0}"#,
            422,
        ),
        ("an item with NUL", "acct-1", vec!["k-1"], nul_item, 422),
        ("an item of 65,536 bytes", "acct-1", vec!["k-1"], &long_item, 422),
    ];
    for (case, account, keys, body, status) in cases {
        let request = post_order(&client, &base, account, &keys, body);
        let answer = tokio::time::timeout(AT_ONCE, send(request))
            .await
            .unwrap_or_else(|_| panic!("{case}: no answer within {AT_ONCE:?} while the pool was exhausted"));
        assert_eq!(answer.status, status, "{case}: {answer:?}");
        answer.assert_problem(status);
    }

    let valid = valid.await.expect("the valid request").assert_problem(503);
    assert_eq!(valid.retry_after.as_deref(), Some("1"));
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);
}

async fn no_free_connection_is_503_with_retry_after_on_every_route<D: TestDb>() {
    let db = database::<D>().await;
    let (server, _held) = Server::start_exhausted(&db, Settings::default()).await;
    let client = client();
    let routes = [
        (
            "POST /orders",
            post_order(&client, &server.url(""), "acct-1", &["busy-1"], BODY),
        ),
        ("GET /orders", client.get(server.url("/orders")).bearer_auth("acct-1")),
        (
            "GET /orders/1",
            client.get(server.url("/orders/1")).bearer_auth("acct-1"),
        ),
    ];
    // All at once: each waits out the checkout timeout.
    let mut requests = tokio::task::JoinSet::new();
    for (route, request) in routes {
        requests.spawn(async move { (route, tokio::time::timeout(WEB_CHECKOUT_BOUND, send(request)).await) });
    }
    for (route, answer) in requests.join_all().await {
        let answer = answer.unwrap_or_else(|_| {
            panic!("{route}: no answer within {WEB_CHECKOUT_BOUND:?} while the pool was exhausted")
        });
        assert_eq!(answer.status, 503, "{route}: {answer:?}");
        let answer = answer.assert_problem(503);
        assert_eq!(answer.retry_after.as_deref(), Some("1"), "{route}: {answer:?}");
    }
}

async fn items_no_backend_can_store_are_422_on_every_backend<D: TestDb>() {
    let (db, server) = shop::<D>().await;
    let client = client();
    let order = |item: &str| serde_json::to_string(&json!({"item": item, "quantity": 1})).expect("JSON");
    let longest = "\u{1f4e6}".repeat(MAX_ITEM_CHARS);
    let refused = [
        ("an item with NUL", order("a\u{0}b"), "U+0000"),
        ("an item of 65,536 bytes", order(&"x".repeat(65_536)), "1000 characters"),
        (
            "an item one character too long",
            order(&"x".repeat(MAX_ITEM_CHARS + 1)),
            "1000 characters",
        ),
    ];
    for (case, body, detail) in refused {
        let answer = send(post_order(&client, &server.url(""), "acct-1", &["item-1"], &body)).await;
        assert_eq!(answer.status, 422, "{case}: {answer:?}");
        let answer = answer.assert_problem(422);
        assert_eq!(
            answer.body["type"], "https://orders.example/problems/invalid-order",
            "{case}"
        );
        let said = answer.body["detail"].as_str().expect("a detail");
        assert!(said.contains(detail), "{case}: {said}");
    }
    assert_eq!(order_count(&db).await, 0);
    assert_eq!(key_count(&db).await, 0);

    // The longest item, in four-byte characters, is stored and replayed.
    let body = order(&longest);
    let first = send(post_order(&client, &server.url(""), "acct-1", &["item-1"], &body)).await;
    assert_eq!(
        (first.status, first.replayed.as_deref()),
        (201, None),
        "{:?}",
        first.status
    );
    assert_eq!(first.body["item"], longest);
    let again = send(post_order(&client, &server.url(""), "acct-1", &["item-1"], &body)).await;
    assert_eq!((again.status, again.replayed.as_deref()), (201, Some("true")));
    assert_eq!(again.body, first.body);
    let location = first.location.as_deref().expect("a location");
    let stored = send(client.get(server.url(location)).bearer_auth("acct-1")).await;
    assert_eq!(stored.body["item"], longest);
}

async fn idle_sockets_do_not_keep_a_new_client_from_being_served<D: TestDb>() {
    const IDLE_SOCKETS: usize = 300;
    const OPEN_FILES: u64 = 256;
    /// Below the example's header read timeout: the new client is served
    /// because an idle socket made room, not because one timed out.
    const SERVED_WITHIN: Duration = Duration::from_secs(5);
    assert!(SERVED_WITHIN < EXAMPLE_HEADER_READ_TIMEOUT);
    let db = database::<D>().await;
    let args = ["--addr", "127.0.0.1:0", "--database", db.url()];
    let launch = Launch {
        max_open_files: Some(OPEN_FILES),
        ..Launch::default()
    };
    let service = ExampleProcess::start_with(args.iter().map(|arg| arg.to_string()).collect(), launch).await;

    let mut connecting = tokio::task::JoinSet::new();
    for _ in 0..IDLE_SOCKETS {
        let addr = service.addr();
        connecting.spawn(async move { tokio::time::timeout(PATIENCE, tokio::net::TcpStream::connect(addr)).await });
    }
    let idle: Vec<_> = connecting
        .join_all()
        .await
        .into_iter()
        .map(|connected| {
            connected
                .unwrap_or_else(|_| panic!("an idle socket connected within {PATIENCE:?}"))
                .expect("connect an idle socket")
        })
        .collect();

    let fresh = client();
    let served = tokio::time::timeout(
        SERVED_WITHIN,
        send(post_order(&fresh, &service.base, "acct-1", &["fresh-1"], BODY)),
    )
    .await
    .unwrap_or_else(|_| {
        panic!("a new client was not served within {SERVED_WITHIN:?} while {IDLE_SOCKETS} idle sockets were open")
    });
    assert_eq!(served.status, 201, "{served:?}");
    drop(idle);

    let (success, _) = service.terminate().await;
    assert!(success, "the service exits with success on SIGTERM");
    assert_eq!(order_count(&db).await, 1);
}

async fn a_failed_call_is_logged_with_the_database_message_and_without_the_body<D: TestDb>() {
    let db = database::<D>().await;
    let args = ["--addr", "127.0.0.1:0", "--database", db.url()];
    let launch = Launch {
        capture_stderr: true,
        ..Launch::default()
    };
    let mut service = ExampleProcess::start_with(args.iter().map(|arg| arg.to_string()).collect(), launch).await;
    let client = client();
    let secret = r#"{"item": "secret-123", "quantity": 1}"#;

    drop_table(&db, "idempotency_keys").await;
    send(post_order(&client, &service.base, "acct-1", &["log-1"], secret))
        .await
        .assert_problem(500);
    let line = service.log_line("\"log-1\"").await;
    let missing = missing_table::<D>("idempotency_keys");
    assert!(
        line.contains(&missing),
        "the database's message ({missing}) is logged: {line}"
    );

    drop_table(&db, "orders").await;
    send(client.get(format!("{}/orders", service.base)).bearer_auth("acct-1"))
        .await
        .assert_problem(500);
    let line = service.log_line("reading orders failed").await;
    let missing = missing_table::<D>("orders");
    assert!(
        line.contains(&missing),
        "the database's message ({missing}) is logged: {line}"
    );

    let (success, logged) = service.terminate_and_read_log().await;
    assert!(success, "the service exits with success on SIGTERM");
    for line in logged {
        assert!(!line.contains("secret-123"), "no body in the log: {line}");
    }
}

/// What backend `D` says of a statement on a table that does not exist.
fn missing_table<D: TestDb>(table: &str) -> String {
    match D::BACKEND {
        "sqlite" => format!("no such table: {table}"),
        "postgres" => format!("relation \"{table}\" does not exist"),
        "mysql" => format!(".{table}' doesn't exist"),
        other => panic!("no message known for a missing table on {other}"),
    }
}

async fn a_stalled_request_head_or_body_is_cut_off_by_its_read_timeout<D: TestDb>() {
    let db = database::<D>().await;
    let limits = Limits {
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
    };
    let server = Server::start_limited(&db, limits).await;

    let mut head_only = tokio::net::TcpStream::connect(server.addr()).await.expect("connect");
    head_only
        .write_all(b"POST /orders HTTP/1.1\r\nhost: orders\r\n")
        .await
        .expect("send part of a head");
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, head_only.read_to_end(&mut rest))
        .await
        .unwrap_or_else(|_| panic!("the connection of a stalled head was not closed within {PATIENCE:?}"))
        .expect("read to the end");
    assert!(
        rest.is_empty() || rest.starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&rest)
    );

    let mut half_body = tokio::net::TcpStream::connect(server.addr()).await.expect("connect");
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: orders\r\nauthorization: Bearer acct-1\r\nidempotency-key: stall-1\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        BODY.len()
    );
    half_body.write_all(head.as_bytes()).await.expect("send the head");
    half_body
        .write_all(&BODY.as_bytes()[..10])
        .await
        .expect("send part of the body");
    let answer = tokio::time::timeout(PATIENCE, read_response(&mut half_body))
        .await
        .unwrap_or_else(|_| panic!("a stalled body was not answered within {PATIENCE:?}"));
    assert_eq!(answer.status, 408, "{answer:?}");
    assert_eq!(answer.header("content-type"), Some("application/problem+json"));
    assert_eq!(key_count(&db).await, 0);
}

/// The scope the example gives the keys of `token`'s account, as its own
/// authentication resolves it.
async fn scope_of(token: &str) -> String {
    let (mut parts, ()) = Request::get("/orders")
        .header("authorization", format!("Bearer {token}"))
        .body(())
        .expect("a request")
        .into_parts();
    match Account::from_request_parts(&mut parts, &()).await {
        Ok(account) => account.scope().into_owned(),
        Err(_) => panic!("{token} is no account"),
    }
}

async fn duplicates_of_a_slow_request_hold_no_connection_and_other_accounts_are_served<D: TestDb>() {
    // More than the example's pool holds on any backend.
    const DUPLICATES: usize = 24;
    turn_waits::count();
    let db = database::<D>().await;
    let executions = Arc::new(AtomicUsize::new(0));
    let (mut gate, hold) = Gate::new();
    let counted = {
        let executions = executions.clone();
        Arc::new(move || {
            executions.fetch_add(1, Ordering::SeqCst);
            hold()
        })
    };
    let settings = Settings {
        in_flight: InFlight::Wait(chrono::Duration::from_std(PATIENCE).expect("a duration")),
        before_commit: Some(counted),
        ..Settings::default()
    };
    let server = Server::start(&db, settings).await;
    let client = client();
    let account = format!("acct-turns-{}", D::BACKEND);
    let post = || post_order(&client, &server.url(""), &account, &["slow-turn"], BODY);

    let first = tokio::spawn(send(post()));
    gate.wait_entered().await;
    let duplicates: Vec<_> = (0..DUPLICATES).map(|_| tokio::spawn(send(post()))).collect();
    turn_waits::wait_for(&scope_of(&account).await, DUPLICATES).await;

    // Every duplicate waits; the pool still serves everyone else.
    let read = send(client.get(server.url("/orders")).bearer_auth("acct-other")).await;
    assert_eq!((read.status, &read.body), (200, &json!([])), "{read:?}");
    // On SQLite the held order holds the database's one write lock.
    let other_orders = usize::from(D::BACKEND != "sqlite");
    for _ in 0..other_orders {
        let other = send(post_order(&client, &server.url(""), "acct-other", &["other-1"], BODY)).await;
        assert_eq!((other.status, other.replayed.as_deref()), (201, None), "{other:?}");
    }

    gate.release();
    let first = first.await.expect("the first request");
    assert_eq!((first.status, first.replayed.as_deref()), (201, None), "{first:?}");
    for duplicate in duplicates {
        let duplicate = duplicate.await.expect("a duplicate");
        assert_eq!(
            (duplicate.status, duplicate.replayed.as_deref()),
            (201, Some("true")),
            "{duplicate:?}"
        );
        assert_eq!(duplicate.body, first.body);
    }
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1 + other_orders,
        "the slow order was placed once, the other account's once"
    );
}

async fn example_binary_answers_a_key_reused_at_another_endpoint_with_422<D: TestDb>() {
    let db = database::<D>().await;
    let args = ["--addr", "127.0.0.1:0", "--database", db.url()];
    let service = ExampleProcess::start(args.iter().map(|arg| arg.to_string()).collect()).await;
    let client = client();

    let first = send(post_order(&client, &service.base, "acct-1", &["endpoint-1"], BODY)).await;
    assert_eq!((first.status, first.replayed.as_deref()), (201, None));
    // The same key and body, sent to `/orders?gift=true`: another endpoint.
    let gift = client
        .post(format!("{}/orders?gift=true", service.base))
        .bearer_auth("acct-1")
        .header("idempotency-key", "endpoint-1")
        .header("content-type", "application/json")
        .body(BODY);
    let refused = send(gift).await.assert_problem(422);
    assert!(
        refused.body["type"]
            .as_str()
            .expect("a type")
            .ends_with("/idempotency-key-reused"),
        "{refused:?}"
    );
    let retry = send(post_order(&client, &service.base, "acct-1", &["endpoint-1"], BODY)).await;
    assert_eq!((retry.status, retry.replayed.as_deref()), (201, Some("true")));

    let (success, _) = service.terminate().await;
    assert!(success, "the service exits with success on SIGTERM");
    assert_eq!(order_count(&db).await, 1);
}

/// The parts of `idempotency::http` that the service leaves out, on a
/// small router of their own.
mod library {
    use super::*;

    type NoteResponse = Result<http::Answer<StoredResponse<i64>>, Failure<Problem>>;

    fn add_note(conn: &mut SqliteConnection) -> Result<StoredResponse<i64>, Problem> {
        diesel::sql_query("INSERT INTO notes DEFAULT VALUES")
            .execute(conn)
            .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
        let count = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
            .get_result(conn)
            .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
        Ok(StoredResponse::new(StatusCode::CREATED, count))
    }

    /// Idempotent with a key, plain without one.
    async fn post_note(State(notes): State<Notes>, key: Option<IdempotencyKey<Anyone>>) -> axum::response::Response {
        match key {
            Some(key) => {
                let outcome: NoteResponse =
                    http::run(&notes.pool, &notes.config, &key, (), |conn, ()| add_note(conn)).await;
                outcome.into_response()
            }
            None => {
                let pool = notes.pool.clone();
                let added = tokio::task::spawn_blocking(move || add_note(&mut pool.get().expect("a connection")));
                added.await.expect("no panic").into_response()
            }
        }
    }

    fn notes_app(db: &idempotency::testing::SqliteFile, pool_size: u32, config: Config) -> (Router, SqlitePool) {
        let notes = Notes::new(db, pool_size, config);
        let pool = notes.pool.clone();
        (Router::new().route("/notes", post(post_note)).with_state(notes), pool)
    }

    fn note(key: Option<&str>) -> Request<axum::body::Body> {
        let mut request = Request::post("/notes");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(axum::body::Body::empty()).expect("a request")
    }

    async fn answer(app: &Router, request: Request<axum::body::Body>) -> (StatusCode, Option<String>, Value) {
        let seen = seen(app, request).await;
        let extra = seen
            .header("idempotent-replayed")
            .or_else(|| seen.header("retry-after"));
        (seen.status, extra.map(str::to_owned), seen.json())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn optional_key_runs_plain_without_and_idempotent_with_it() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        assert_eq!(answer(&app, note(None)).await, (StatusCode::CREATED, None, json!(1)));
        assert_eq!(answer(&app, note(None)).await, (StatusCode::CREATED, None, json!(2)));
        assert_eq!(
            answer(&app, note(Some("n-1"))).await,
            (StatusCode::CREATED, None, json!(3))
        );
        let replay = answer(&app, note(Some("n-1"))).await;
        assert_eq!(replay, (StatusCode::CREATED, Some("true".to_owned()), json!(3)));
        // Present but broken is refused, not taken for absent.
        assert_eq!(answer(&app, note(Some(r#""n-1"#))).await.0, StatusCode::BAD_REQUEST);
    }

    /// The expiry header of a response, if it has one.
    async fn expiry_of(app: &Router, request: Request<axum::body::Body>, name: &str) -> (StatusCode, Option<String>) {
        let seen = seen(app, request).await;
        (seen.status, seen.header(name).map(str::to_owned))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn first_response_and_replay_advertise_one_expiry_and_refusals_none() {
        use chrono::TimeZone;
        let db = idempotency::testing::SqliteFile::new();
        let start = chrono::Utc
            .with_ymd_and_hms(2030, 6, 1, 12, 0, 0)
            .single()
            .expect("a date");
        let clock = idempotency::testing::ManualClock::at(start);
        let config = Config::default()
            .clock(clock.source())
            .retention(chrono::Duration::hours(2));
        let (app, _) = notes_app(&db, 2, config);

        let first = expiry_of(&app, note(Some("n-expiry")), "idempotency-expires").await;
        assert_eq!(
            first,
            (StatusCode::CREATED, Some("Sat, 01 Jun 2030 14:00:00 GMT".to_owned()))
        );
        clock.advance(chrono::Duration::minutes(10));
        let replay = app.clone().oneshot(note(Some("n-expiry"))).await.expect("infallible");
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(
            replay
                .headers()
                .get("idempotency-expires")
                .and_then(|v| v.to_str().ok()),
            first.1.as_deref(),
            "a replay advertises the first response's expiry"
        );
        // A key the rules refuse spends nothing, so nothing expires.
        assert_eq!(
            expiry_of(&app, note(Some(r#""n-1"#)), "idempotency-expires").await,
            (StatusCode::BAD_REQUEST, None)
        );
        // Nor does a request without a key on an endpoint that runs it plainly.
        assert_eq!(
            expiry_of(&app, note(None), "idempotency-expires").await,
            (StatusCode::CREATED, None)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_expiry_header_is_sent_under_the_configured_name() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let renamed = http::KeyHeader::default().expiry_header(axum::http::HeaderName::from_static("x-key-expires"));
        let app = app.layer(Extension(renamed));
        let response = app.clone().oneshot(note(Some("n-renamed"))).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED);
        assert!(response.headers().get("idempotency-expires").is_none());
        let expiry = response.headers()["x-key-expires"].to_str().expect("ascii");
        let expires_at = chrono::DateTime::parse_from_rfc2822(expiry).expect("an HTTP-date");
        let left = expires_at.with_timezone(&chrono::Utc) - chrono::Utc::now();
        assert!(
            left > chrono::Duration::hours(23) && left <= chrono::Duration::hours(24),
            "the default retention, 24 h: {left:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_is_marked_under_the_configured_name_and_first_responses_only_when_asked() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default());
        let renamed =
            http::KeyHeader::default().replay_header(axum::http::HeaderName::from_static("idempotency-replay"));
        let app = app.layer(Extension(renamed));
        let first = app
            .clone()
            .oneshot(note(Some("n-replay-named")))
            .await
            .expect("infallible");
        assert_eq!(first.status(), StatusCode::CREATED);
        for name in ["idempotency-replay", "idempotent-replayed", "idempotency-key"] {
            assert!(
                first.headers().get(name).is_none(),
                "{name} on a first response by default"
            );
        }
        let replay = app
            .clone()
            .oneshot(note(Some("n-replay-named")))
            .await
            .expect("infallible");
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotency-replay"], "true");
        assert!(
            replay.headers().get("idempotent-replayed").is_none(),
            "only the configured name"
        );

        let (app, _) = notes_app(&db, 2, Config::default());
        let app = app.layer(Extension(http::KeyHeader::default().mark_first_responses(true)));
        let first = app
            .clone()
            .oneshot(note(Some(r#""n-\\marked""#)))
            .await
            .expect("infallible");
        assert_eq!(first.status(), StatusCode::CREATED);
        assert_eq!(first.headers()["idempotent-replayed"], "false");
        assert_eq!(
            first.headers()["idempotency-key"],
            r#""n-\\marked""#,
            "the key, as the client sent it"
        );
        let replay = app
            .clone()
            .oneshot(note(Some(r#""n-\\marked""#)))
            .await
            .expect("infallible");
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.headers()["idempotency-key"], r#""n-\\marked""#);
        let bare = app.clone().oneshot(note(Some("n-bare"))).await.expect("infallible");
        assert_eq!(
            bare.headers()["idempotency-key"],
            r#""n-bare""#,
            "echoed as an sf-string"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_response_beyond_the_bound_is_a_500_problem_naming_it_and_spends_no_key() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, _) = notes_app(&db, 2, Config::default().max_response_len(8));
        let (status, _, body) = answer(&app, note(Some("n-large"))).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body["type"], problem_type("response-too-large"));
        assert_eq!(body["retryable"], json!(false));
        let detail = body["detail"].as_str().expect("a detail");
        assert!(detail.contains("8 bytes"), "{detail}");
        let count = |table: &str| {
            diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!("SELECT count(*) FROM {table}"))
                .get_result::<i64>(&mut db.conn())
                .expect("count")
        };
        assert_eq!(count("notes"), 0, "the note was rolled back");
        assert_eq!(count("idempotency_keys"), 0, "the key is free");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn problems_follow_the_settings_of_the_api() {
        let db = idempotency::testing::SqliteFile::new();
        let problems = Problems::documented_at("https://api.example/errors/")
            .title(ProblemKind::InProgress, "Busy with this key")
            .retry_after(chrono::Duration::seconds(3));
        let (app, _) = notes_app(&db, 2, Config::default().in_flight(InFlight::Reject));
        let app = app.layer(Extension(problems));

        let (status, _, body) = answer(&app, note(Some(""))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], "https://api.example/errors/idempotency-key-invalid");
        assert_eq!(body["title"], "Invalid Idempotency-Key header");

        // Another connection holds SQLite's write lock: the key cannot be
        // claimed, and the policy rejects at once.
        let mut holder = db.conn();
        holder.batch_execute("BEGIN IMMEDIATE").expect("take the write lock");
        let (status, retry_after, body) = answer(&app, note(Some("n-2"))).await;
        holder.batch_execute("ROLLBACK").expect("release the write lock");
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(retry_after.as_deref(), Some("3"));
        assert_eq!(body["type"], "https://api.example/errors/idempotency-key-in-progress");
        assert_eq!(body["title"], "Busy with this key");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_free_connection_is_503_with_retry_after() {
        let db = idempotency::testing::SqliteFile::new();
        let (app, pool) = notes_app(&db, 1, Config::default());
        let held = pool.get().expect("the pool's one connection");
        let (status, retry_after, body) = answer(&app, note(Some("n-3"))).await;
        drop(held);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after.as_deref(), Some("1"));
        assert_eq!(body["type"], problem_type("service-unavailable"));
        assert_eq!(body["title"], "Service unavailable");
        assert_eq!(answer(&app, note(Some("n-3"))).await.0, StatusCode::CREATED);
    }

    /// A caller whose scope breaks the key rules: the application's
    /// mistake, not the client's.
    struct Misnamed;

    impl<S: Sync> FromRequestParts<S> for Misnamed {
        type Rejection = StatusCode;

        async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
            Ok(Misnamed)
        }
    }

    impl Caller for Misnamed {
        fn scope(&self) -> Cow<'_, str> {
            Cow::Borrowed("two words")
        }
    }

    async fn post_misnamed_note(State(notes): State<Notes>, key: IdempotencyKey<Misnamed>) -> axum::response::Response {
        let outcome: NoteResponse = http::run(&notes.pool, &notes.config, &key, (), |conn, ()| add_note(conn)).await;
        outcome.into_response()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_and_scopes_the_rules_refuse_are_answered_at_once_while_the_pool_is_exhausted() {
        let db = idempotency::testing::SqliteFile::new();
        db.conn()
            .batch_execute("CREATE TABLE notes (id INTEGER PRIMARY KEY)")
            .expect("create notes");
        let pool = Pool::builder()
            .max_size(1)
            .connection_timeout(EXHAUSTED_CHECKOUT)
            .build(ConnectionManager::new(db.path().to_str().expect("utf-8 path")))
            .expect("a pool");
        let notes = Notes {
            pool: pool.clone(),
            config: Config::default(),
        };
        let charges = Charges {
            pool: pool.clone(),
            provider: Provider::default(),
        };
        let app = Router::new()
            .route("/notes", post(post_note))
            .route("/misnamed-notes", post(post_misnamed_note))
            .with_state(notes)
            .merge(Router::new().route("/charges", post(post_charge)).with_state(charges));
        let _held = pool.get().expect("the pool's one connection");

        let long_key = "k".repeat(300);
        let misnamed = Request::post("/misnamed-notes")
            .header("idempotency-key", "n-5")
            .body(axum::body::Body::empty())
            .expect("a request");
        let cases = [
            ("a 300-character key", note(Some(&long_key)), StatusCode::BAD_REQUEST),
            (
                "a key like a card number",
                note(Some("4111111111111111")),
                StatusCode::BAD_REQUEST,
            ),
            ("a scope with a space", misnamed, StatusCode::INTERNAL_SERVER_ERROR),
            (
                "a phased call's 300-character key",
                Request::post("/charges")
                    .header("idempotency-key", &long_key)
                    .body(axum::body::Body::empty())
                    .expect("a request"),
                StatusCode::BAD_REQUEST,
            ),
        ];
        let refused = async {
            for (case, request, status) in cases {
                let (answered, retry_after, body) = tokio::time::timeout(AT_ONCE, answer(&app, request))
                    .await
                    .unwrap_or_else(|_| panic!("{case}: no answer within {AT_ONCE:?} while the pool was exhausted"));
                assert_eq!((answered, retry_after), (status, None), "{case}: {body}");
            }
        };
        // The valid request is sent first and answered last: the pool
        // stays exhausted throughout.
        let valid = async {
            tokio::time::timeout(PATIENCE, answer(&app, note(Some("n-4"))))
                .await
                .unwrap_or_else(|_| panic!("the valid request was not answered within {PATIENCE:?}"))
        };
        let ((status, retry_after, _), ()) = tokio::join!(valid, refused);
        assert_eq!(
            (status, retry_after.as_deref()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("1"))
        );
    }

    /// A payment provider that deduplicates on its key, fails its first
    /// call when told to, and records every key it applied.
    #[derive(Clone, Default)]
    struct Provider {
        fail_first: Arc<AtomicBool>,
        applied: Arc<std::sync::Mutex<Vec<String>>>,
    }

    impl Provider {
        fn charge(&self, provider_key: &str) -> Result<String, Problem> {
            if self.fail_first.swap(false, Ordering::SeqCst) {
                return Err(Problem::new(StatusCode::BAD_GATEWAY, "Bad Gateway"));
            }
            let mut applied = self.applied.lock().expect("no panic while locked");
            if !applied.iter().any(|key| key == provider_key) {
                applied.push(provider_key.to_owned());
            }
            Ok(format!("ch_{}", &provider_key[..12]))
        }
    }

    #[derive(Clone)]
    struct Charges {
        pool: SqlitePool,
        provider: Provider,
    }

    async fn post_charge(State(charges): State<Charges>, key: IdempotencyKey<Anyone>) -> axum::response::Response {
        let provider = charges.provider.clone();
        let phased = idempotency::phased::Phased::new("charge");
        let outcome: Result<http::Answer<StoredResponse<(i64, String)>>, Failure<Problem>> =
            http::run_phased(&charges.pool, &phased, &key, 20_00, move |s, _cents| {
                let note = s.phase("noted", |tx| add_note(tx).map(|response| *response.body()))?;
                let charge = s.call("charged", |provider_key| provider.charge(provider_key))?;
                s.finish(|_| Ok(StoredResponse::new(StatusCode::CREATED, (note, charge))))
            })
            .await;
        outcome.into_response()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn phased_operation_resumes_and_replays_over_http() {
        let db = idempotency::testing::SqliteFile::new();
        let pool = notes_pool(&db, 2);
        let provider = Provider::default();
        provider.fail_first.store(true, Ordering::SeqCst);
        let app = Router::new().route("/charges", post(post_charge)).with_state(Charges {
            pool,
            provider: provider.clone(),
        });
        let charge = || {
            Request::post("/charges")
                .header("idempotency-key", "charge-1")
                .body(axum::body::Body::empty())
                .expect("a request")
        };

        // The provider fails: the operation's own error, its first phase kept.
        let (status, _, _) = answer(&app, charge()).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        // The retry resumes after the first phase and calls again.
        let (status, replayed, first) = answer(&app, charge()).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, None));
        assert_eq!(first[0], json!(1), "the first phase ran once");
        let (status, replayed, again) = answer(&app, charge()).await;
        assert_eq!(
            (status, replayed.as_deref(), &again),
            (StatusCode::CREATED, Some("true"), &first)
        );
        let (_, first_expiry) = expiry_of(&app, charge(), "idempotency-expires").await;
        assert!(
            first_expiry.is_some(),
            "a phased operation's replay advertises its expiry"
        );
        assert_eq!(
            provider.applied.lock().expect("no panic").len(),
            1,
            "one charge applied"
        );
        let notes: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
            .get_result(&mut db.conn())
            .expect("count notes");
        assert_eq!(notes, 1);
    }

    /// Money moved by endpoints that take the same body, `{"cents": n}`:
    /// each move a row naming its endpoint and account.
    #[derive(Clone)]
    struct Ledger {
        pool: SqlitePool,
        config: Config,
    }

    type MoveResponse = Result<http::Answer<StoredResponse<Value>>, Failure<Problem>>;

    fn record(
        conn: &mut SqliteConnection,
        kind: &str,
        account: i64,
        body: &Value,
    ) -> Result<StoredResponse<Value>, Problem> {
        let cents = body["cents"].as_i64().unwrap_or(0);
        diesel::sql_query("INSERT INTO moves (kind, account, cents) VALUES (?, ?, ?)")
            .bind::<diesel::sql_types::Text, _>(kind)
            .bind::<diesel::sql_types::BigInt, _>(account)
            .bind::<diesel::sql_types::BigInt, _>(cents)
            .execute(conn)
            .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
        let moved = json!({"kind": kind, "account": account, "cents": cents});
        Ok(StoredResponse::new(StatusCode::CREATED, moved))
    }

    /// Records a move of `kind` for `account` under `key`.
    async fn moved(
        ledger: Ledger,
        key: &IdempotencyKey<Anyone>,
        body: Value,
        kind: &'static str,
        account: i64,
    ) -> MoveResponse {
        http::run(&ledger.pool, &ledger.config, key, body, move |conn, body| {
            record(conn, kind, account, body)
        })
        .await
    }

    async fn transfer(
        State(ledger): State<Ledger>,
        Path(account): Path<i64>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        moved(ledger, &key, body, "transfer", account).await
    }

    async fn charge(
        State(ledger): State<Ledger>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        moved(ledger, &key, body, "charge", 0).await
    }

    async fn refund(
        State(ledger): State<Ledger>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        moved(ledger, &key, body, "refund", 0).await
    }

    /// A charge whose keys span endpoints.
    async fn shared_charge(
        State(ledger): State<Ledger>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        moved(ledger, &key.across_endpoints(), body, "charge", 0).await
    }

    async fn shared_refund(
        State(ledger): State<Ledger>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        moved(ledger, &key.across_endpoints(), body, "refund", 0).await
    }

    async fn phased_transfer(
        State(ledger): State<Ledger>,
        Path(account): Path<i64>,
        key: IdempotencyKey<Anyone>,
        Json(body): Json<Value>,
    ) -> MoveResponse {
        let phased = idempotency::phased::Phased::new("transfer");
        http::run_phased(&ledger.pool, &phased, &key, body, move |s, body| {
            let moved = s.phase("moved", |tx| {
                record(tx, "transfer", account, body).map(|r| r.into_body())
            })?;
            s.finish(|_| Ok(StoredResponse::new(StatusCode::CREATED, moved)))
        })
        .await
    }

    fn ledger(db: &idempotency::testing::SqliteFile) -> Router {
        db.conn()
            .batch_execute(
                "CREATE TABLE moves (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, account INTEGER NOT NULL, cents INTEGER NOT NULL)",
            )
            .expect("create moves");
        idempotency::run_migrations(&mut db.conn()).expect("migrate");
        let pool = Pool::builder()
            .max_size(2)
            .build(ConnectionManager::new(db.path().to_str().expect("utf-8 path")))
            .expect("a pool");
        Router::new()
            .route("/accounts/{id}/transfers", post(transfer))
            .route("/phased/accounts/{id}/transfers", post(phased_transfer))
            .route("/charges", post(charge).put(charge))
            .route("/refunds", post(refund))
            .route("/shared/charges", post(shared_charge))
            .route("/shared/refunds", post(shared_refund))
            .with_state(Ledger {
                pool,
                config: Config::default(),
            })
    }

    fn send_move(method: &str, uri: &str, key: &str, cents: i64) -> Request<axum::body::Body> {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(json!({"cents": cents}).to_string()))
            .expect("a request")
    }

    fn moves(db: &idempotency::testing::SqliteFile, kind: &str, account: i64) -> i64 {
        diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM moves WHERE kind = ")
            .bind::<diesel::sql_types::Text, _>(kind)
            .sql(" AND account = ")
            .bind::<diesel::sql_types::BigInt, _>(account)
            .get_result(&mut db.conn())
            .expect("count moves")
    }

    /// Asserts a 422 problem that says the key was reused.
    fn assert_reused((status, _, body): (StatusCode, Option<String>, Value)) {
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(
            body["detail"],
            "this idempotency key was first used with a different request"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn key_reused_for_another_account_is_422_and_moves_nothing() {
        let db = idempotency::testing::SqliteFile::new();
        let app = ledger(&db);
        let first = answer(&app, send_move("POST", "/accounts/1/transfers", "t-1", 100)).await;
        assert_eq!((first.0, &first.1), (StatusCode::CREATED, &None));

        assert_reused(answer(&app, send_move("POST", "/accounts/2/transfers", "t-1", 100)).await);
        assert_eq!(moves(&db, "transfer", 2), 0, "account 2 untouched");

        let retry = answer(&app, send_move("POST", "/accounts/1/transfers", "t-1", 100)).await;
        assert_eq!(retry, (StatusCode::CREATED, Some("true".to_owned()), first.2));
        assert_eq!(moves(&db, "transfer", 1), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn key_reused_on_another_route_or_method_is_422() {
        let db = idempotency::testing::SqliteFile::new();
        let app = ledger(&db);
        assert_eq!(
            answer(&app, send_move("POST", "/charges", "c-1", 500)).await.0,
            StatusCode::CREATED
        );

        assert_reused(answer(&app, send_move("POST", "/refunds", "c-1", 500)).await);
        assert_reused(answer(&app, send_move("PUT", "/charges", "c-1", 500)).await);
        assert_eq!(moves(&db, "refund", 0), 0, "no refund");
        assert_eq!(moves(&db, "charge", 0), 1, "one charge");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn key_reused_with_another_query_is_422_and_reordered_parameters_are_one_request() {
        let db = idempotency::testing::SqliteFile::new();
        let app = ledger(&db);
        let first = answer(&app, send_move("POST", "/charges?currency=eur&note=a%20b", "q-1", 500)).await;
        assert_eq!((first.0, &first.1), (StatusCode::CREATED, &None));

        // The same parameters, reordered and spelled otherwise.
        let reordered = answer(
            &app,
            send_move("POST", "/charges?note=a%20b&&currency=%65ur", "q-1", 500),
        )
        .await;
        assert_eq!(reordered, (StatusCode::CREATED, Some("true".to_owned()), first.2));

        for other in [
            "/charges?currency=usd&note=a%20b",
            // `+` is a space to some parsers and a plus to others.
            "/charges?currency=eur&note=a+b",
            "/charges?currency=eur&note=a%20b&note=c",
            "/charges?currency=eur",
            "/charges",
        ] {
            assert_reused(answer(&app, send_move("POST", other, "q-1", 500)).await);
        }
        assert_eq!(moves(&db, "charge", 0), 1, "one charge");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn key_across_endpoints_replays_on_another_route() {
        let db = idempotency::testing::SqliteFile::new();
        let app = ledger(&db);
        let first = answer(&app, send_move("POST", "/shared/charges", "s-1", 500)).await;
        assert_eq!((first.0, &first.1), (StatusCode::CREATED, &None));

        let replayed = answer(&app, send_move("POST", "/shared/refunds", "s-1", 500)).await;
        assert_eq!(replayed, (StatusCode::CREATED, Some("true".to_owned()), first.2));
        assert_eq!(moves(&db, "refund", 0), 0, "the refund replayed the charge");
        // Its records are not those of a bound key.
        assert_reused(answer(&app, send_move("POST", "/charges", "s-1", 500)).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn phased_key_reused_for_another_account_is_422_and_moves_nothing() {
        let db = idempotency::testing::SqliteFile::new();
        let app = ledger(&db);
        let first = answer(&app, send_move("POST", "/phased/accounts/1/transfers", "p-1", 100)).await;
        assert_eq!((first.0, &first.1), (StatusCode::CREATED, &None));

        assert_reused(answer(&app, send_move("POST", "/phased/accounts/2/transfers", "p-1", 100)).await);
        assert_eq!(moves(&db, "transfer", 2), 0, "account 2 untouched");
        let retry = answer(&app, send_move("POST", "/phased/accounts/1/transfers", "p-1", 100)).await;
        assert_eq!(retry, (StatusCode::CREATED, Some("true".to_owned()), first.2));
    }

    /// Idempotent with a key, plain without one; authenticated either way.
    async fn post_private_note(
        State(notes): State<Notes>,
        key: Option<IdempotencyKey<Bearer>>,
    ) -> axum::response::Response {
        match key {
            Some(key) => {
                let outcome: NoteResponse =
                    http::run(&notes.pool, &notes.config, &key, (), |conn, ()| add_note(conn)).await;
                outcome.into_response()
            }
            None => {
                let pool = notes.pool.clone();
                let added = tokio::task::spawn_blocking(move || add_note(&mut pool.get().expect("a connection")));
                added.await.expect("no panic").into_response()
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn optional_key_authenticates_with_or_without_the_header() {
        let db = idempotency::testing::SqliteFile::new();
        let app = Router::new()
            .route("/notes", post(post_private_note))
            .with_state(Notes::new(&db, 2, Config::default()));
        let request = |key: Option<&str>, token: Option<&str>| {
            let mut request = Request::post("/notes");
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            request.body(axum::body::Body::empty()).expect("a request")
        };
        let status = |request: Request<axum::body::Body>| {
            let app = app.clone();
            async move { app.oneshot(request).await.expect("infallible").status() }
        };
        assert_eq!(status(request(None, None)).await, StatusCode::UNAUTHORIZED);
        assert_eq!(status(request(Some("n-1"), None)).await, StatusCode::UNAUTHORIZED);
        assert_eq!(status(request(None, Some("t-1"))).await, StatusCode::CREATED);
        assert_eq!(status(request(Some("n-1"), Some("t-1"))).await, StatusCode::CREATED);
        let notes: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
            .get_result(&mut db.conn())
            .expect("count notes");
        assert_eq!(notes, 2, "only authenticated requests wrote");
    }

    /// A request to `app` and what came back: status, `Content-Type`, body.
    async fn raw_answer(app: &Router, request: Request<axum::body::Body>) -> (StatusCode, Option<String>, String) {
        let seen = seen(app, request).await;
        let content_type = seen.header("content-type").map(str::to_owned);
        (seen.status, content_type, String::from_utf8(seen.body).expect("UTF-8"))
    }

    /// A request with a bearer token and the given key fields.
    fn private_note(uri: &str, token: Option<&str>, keys: &[&str]) -> Request<axum::body::Body> {
        let mut request = Request::post(uri);
        for key in keys {
            request = request.header("idempotency-key", *key);
        }
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        request.body(axum::body::Body::empty()).expect("a request")
    }

    /// Requires a key; the path parameter is bound with it.
    async fn post_required_note(
        State(notes): State<Notes>,
        Path(_): Path<String>,
        key: IdempotencyKey<Bearer>,
    ) -> axum::response::Response {
        let outcome: NoteResponse = http::run(&notes.pool, &notes.config, &key, (), |conn, ()| add_note(conn)).await;
        outcome.into_response()
    }

    fn required_and_optional_notes(db: &idempotency::testing::SqliteFile) -> Router {
        Router::new()
            .route("/notes/{book}", post(post_required_note))
            .route("/notes", post(post_private_note))
            .with_state(Notes::new(db, 2, Config::default()))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_key_rejections_answer_with_their_problems_and_the_callers_own_response() {
        let db = idempotency::testing::SqliteFile::new();
        let app = required_and_optional_notes(&db);
        let problem = |slug: &str, title: &str, detail: &str| {
            let body = json!({
                "type": problem_type(slug),
                "title": title,
                "status": 400,
                "detail": detail,
                "retryable": false,
            });
            (
                StatusCode::BAD_REQUEST,
                Some("application/problem+json".to_owned()),
                body.to_string(),
            )
        };
        assert_eq!(
            raw_answer(&app, private_note("/notes/b-1", Some("t-1"), &[])).await,
            problem(
                "idempotency-key-missing",
                "Idempotency-Key header missing",
                "this endpoint requires an Idempotency-Key header"
            )
        );
        let repeated = problem(
            "idempotency-key-invalid",
            "Invalid Idempotency-Key header",
            "the request has more than one idempotency key header",
        );
        assert_eq!(
            raw_answer(&app, private_note("/notes/b-1", Some("t-1"), &["a", "b"])).await,
            repeated
        );
        assert_eq!(
            raw_answer(&app, private_note("/notes", Some("t-1"), &["a", "b"])).await,
            repeated,
            "an optional key is refused alike"
        );
        let unauthorized = (StatusCode::UNAUTHORIZED, None, String::new());
        for uri in ["/notes/b-1", "/notes"] {
            assert_eq!(
                raw_answer(&app, private_note(uri, None, &["n-1"])).await,
                unauthorized,
                "{uri}: the caller's own rejection, unchanged"
            );
        }
        let (status, content_type, body) = raw_answer(&app, private_note("/notes/%FF", Some("t-1"), &["n-1"])).await;
        assert_eq!(
            (status, content_type.as_deref()),
            (StatusCode::BAD_REQUEST, Some("text/plain; charset=utf-8"))
        );
        assert!(body.contains("UTF-8"), "axum's own words: {body}");
        let notes: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM notes")
            .get_result(&mut db.conn())
            .expect("count notes");
        assert_eq!(notes, 0, "no rejected request wrote");
    }

    /// Answers a request without a key with 428 and a problem of its own,
    /// a caller without credentials with a challenge; every other
    /// rejection as the extractor answers it.
    async fn post_note_or_explain(
        State(notes): State<Notes>,
        key: Result<IdempotencyKey<Bearer>, IdempotencyKeyRejection<StatusCode>>,
    ) -> axum::response::Response {
        match key {
            Ok(key) => {
                let outcome: NoteResponse =
                    http::run(&notes.pool, &notes.config, &key, (), |conn, ()| add_note(conn)).await;
                outcome.into_response()
            }
            Err(IdempotencyKeyRejection::MissingKey(problem)) => {
                assert_eq!(problem.status(), StatusCode::BAD_REQUEST);
                Problem::new(StatusCode::PRECONDITION_REQUIRED, "Precondition Required")
                    .with_detail(problem.to_string())
                    .into_response()
            }
            Err(IdempotencyKeyRejection::Caller(status)) => (status, [("www-authenticate", "Bearer")]).into_response(),
            Err(other) => other.into_response(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_answers_each_rejection_of_the_key_its_own_way() {
        let db = idempotency::testing::SqliteFile::new();
        let app = Router::new()
            .route("/notes", post(post_note_or_explain))
            .with_state(Notes::new(&db, 2, Config::default()));

        let (status, _, body) = answer(&app, private_note("/notes", Some("t-1"), &[])).await;
        assert_eq!(status, StatusCode::PRECONDITION_REQUIRED);
        assert_eq!(body["detail"], "this endpoint requires an Idempotency-Key header");

        let response = app
            .clone()
            .oneshot(private_note("/notes", None, &["n-1"]))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()["www-authenticate"], "Bearer");

        let (status, _, body) = answer(&app, private_note("/notes", Some("t-1"), &["a b"])).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], problem_type("idempotency-key-invalid"));

        let (status, _, _) = answer(&app, private_note("/notes", Some("t-1"), &["n-1"])).await;
        assert_eq!(status, StatusCode::CREATED);
    }

    /// A note whose stored response carries the header that the request's
    /// `x-store` names (request headers are no part of the fingerprint, so a
    /// retry with the same key may name another).
    async fn post_note_with_header(
        State(notes): State<Notes>,
        key: IdempotencyKey<Anyone>,
        headers: axum::http::HeaderMap,
    ) -> axum::response::Response {
        let store = headers.get("x-store").map(|v| v.to_str().expect("ascii").to_owned());
        let outcome: NoteResponse = http::run(&notes.pool, &notes.config, &key, (), move |conn, ()| {
            let note = add_note(conn)?;
            let value = axum::http::HeaderValue::from_static("chunked");
            Ok(match store.as_deref() {
                Some("cookie") => note.with_cookie(axum::http::HeaderValue::from_static("cart=7")),
                Some(name) => note.with_header(axum::http::HeaderName::try_from(name).expect("a name"), value),
                None => note,
            })
        })
        .await;
        outcome.into_response()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn per_connection_headers_and_unchosen_cookies_are_not_stored_and_leave_the_key_free() {
        let db = idempotency::testing::SqliteFile::new();
        let app = Router::new()
            .route("/notes", post(post_note_with_header))
            .with_state(Notes::new(&db, 2, Config::default()));
        let request = |key: &str, store: Option<&str>| {
            let mut request = Request::post("/notes").header("idempotency-key", key);
            if let Some(store) = store {
                request = request.header("x-store", store);
            }
            request.body(axum::body::Body::empty()).expect("a request")
        };
        for name in [
            "transfer-encoding",
            "content-length",
            "connection",
            "te",
            "upgrade",
            "set-cookie",
        ] {
            let (status, _, body) = answer(&app, request("h-1", Some(name))).await;
            assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{name}: {body}");
        }
        // Nothing was stored: the key is free and the note was rolled back.
        assert_eq!(
            answer(&app, request("h-1", None)).await,
            (StatusCode::CREATED, None, json!(1))
        );

        let chosen = app
            .clone()
            .oneshot(request("h-2", Some("cookie")))
            .await
            .expect("infallible");
        assert_eq!(chosen.headers()["set-cookie"], "cart=7");
        let replayed = app
            .clone()
            .oneshot(request("h-2", Some("cookie")))
            .await
            .expect("infallible");
        assert_eq!(replayed.headers()["set-cookie"], "cart=7");
        assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    }

    #[cfg(feature = "deadpool")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadpool_pool_without_a_wait_timeout_answers_503_with_retry_after() {
        use deadpool_diesel::Runtime;
        type Manager = deadpool_diesel::Manager<diesel::SqliteConnection>;
        type Pool = deadpool_diesel::Pool<Manager>;

        let db = idempotency::testing::SqliteFile::new();
        db.conn()
            .batch_execute("CREATE TABLE notes (id INTEGER PRIMARY KEY)")
            .expect("create notes");
        let manager = Manager::new(db.path().to_str().expect("a utf-8 path"), Runtime::Tokio1);
        let pool = Pool::builder(manager).max_size(1).build().expect("a pool");
        assert_eq!(pool.timeouts().wait, None, "a pool that would wait for ever");
        let _held = pool.get().await.expect("the pool's one connection");
        let (mut parts, ()) = Request::post("/notes")
            .header("idempotency-key", "d-1")
            .body(())
            .expect("a request")
            .into_parts();
        let Ok(key) = IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await else {
            panic!("the key was refused");
        };
        let config = Config::default();
        let call = http::run(&pool, &config, &key, (), |conn, ()| add_note(conn));
        let outcome = tokio::time::timeout(PATIENCE, call)
            .await
            .expect("an answer, not a wait for ever");
        let response = outcome.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn failure_and_the_key_rejection_are_errors_that_cross_threads() {
        fn assert_error<E: std::error::Error + Send + Sync + 'static>() {}
        assert_error::<Failure<std::io::Error>>();
        assert_error::<IdempotencyKeyRejection<std::io::Error>>();
        assert_error::<IdempotencyKeyRejection<Problem>>();
    }
}
