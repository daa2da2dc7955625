//! The HTTP layer on actix-web: a shop served by actix-web on a free port
//! of 127.0.0.1, in a thread of its own, driven over real TCP by reqwest,
//! on every backend's r2d2 pool. The rules are the axum layer's; these
//! tests prove that the actix adapter reads the request and writes the
//! response as they ask.

use std::borrow::Cow;
use std::future::{Ready, ready};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use actix_web::dev::{Payload, ServerHandle};
use actix_web::{App, Either, FromRequest, HttpRequest, HttpResponse, HttpServer, web};
use diesel::r2d2::{ConnectionManager, Pool};
use http::{HeaderValue, Method, StatusCode, header};
use idempotency::http::{
    self as idem, Answer, Caller, Failure, IdempotencyKey, OptionalIdempotencyKey, Problem, StoredResponse,
};
use idempotency::{Config, InFlight};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::common::TestDb;

crate::common::backend_tests!(
    async:
    a_first_call_executes_and_its_retry_replays_it_byte_for_byte,
    another_body_with_the_same_key_is_a_422_problem,
    a_request_in_progress_runs_once_and_its_duplicate_gets_409_with_retry_after,
    a_missing_or_invalid_key_is_a_400_problem_and_runs_nothing,
    a_key_sent_to_another_endpoint_is_refused,
    another_principal_of_the_scope_is_refused_and_cannot_look_the_call_up,
    an_optional_key_still_authenticates,
    a_lookup_answers_the_stored_response_and_the_first_request_to_its_caller,
    a_request_whose_client_hung_up_still_runs_once_and_its_retry_replays_it,
);

/// What the handlers of a test saw: how many entered.
struct Seen<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    entered: AtomicUsize,
    ran: Arc<AtomicUsize>,
}

async fn place_counted<D: TestDb>(
    seen: web::Data<Seen<D>>,
    key: IdempotencyKey<Member>,
    item: web::Json<String>,
) -> Result<Answer<StoredResponse<i64>>, Failure<Problem>> {
    seen.entered.fetch_add(1, Ordering::SeqCst);
    let ran = seen.ran.clone();
    idem::run(
        &seen.pool,
        &Config::default(),
        &key,
        item.into_inner(),
        move |conn, item| {
            ran.fetch_add(1, Ordering::SeqCst);
            let id = D::place_order(conn, item, 1)
                .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
            Ok(StoredResponse::new(StatusCode::CREATED, id))
        },
    )
    .await
}

/// Waits until `count` reaches `n`, as long as the suite's patience lasts.
async fn wait_for_count(what: &str, count: &AtomicUsize, n: usize) {
    let reached = async {
        while count.load(Ordering::SeqCst) < n {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    if tokio::time::timeout(crate::common::wait::PATIENCE, reached)
        .await
        .is_err()
    {
        panic!("waited for {what}: {} of {n}", count.load(Ordering::SeqCst));
    }
}

/// actix-web keeps the handler of a client that hung up running (unlike
/// axum, whose dropped handler gives up its wait for a connection): the
/// request waits for its connection and runs its operation once, and the
/// client's retry with the key replays what it did.
async fn a_request_whose_client_hung_up_still_runs_once_and_its_retry_replays_it<D: TestDb>() {
    const ABANDONED: usize = 2;
    let db = tokio::task::spawn_blocking(D::new).await.expect("create the database");
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(crate::common::wait::PATIENCE)
        .build(ConnectionManager::<D::Conn>::new(db.url()))
        .expect("a pool of one connection");
    let ran = Arc::new(AtomicUsize::new(0));
    let seen = web::Data::new(Seen::<D> {
        pool: pool.clone(),
        entered: AtomicUsize::new(0),
        ran: ran.clone(),
    });
    let handlers = seen.clone();
    let routes = move |routes: &mut web::ServiceConfig| {
        routes
            .app_data(handlers.clone())
            .route("/orders", web::post().to(place_counted::<D>));
    };
    let server = Server::serve(routes, ran);
    let held = tokio::task::block_in_place(|| pool.get().expect("the pool's one connection"));

    let mut sockets = Vec::new();
    for n in 0..ABANDONED {
        let body = format!("\"item-{n}\"");
        let request = format!(
            "POST /orders HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer hung-up/u\r\nidempotency-key: k-{n}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            server.addr,
            body.len()
        );
        let mut socket = tokio::net::TcpStream::connect(server.addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut socket, request.as_bytes())
            .await
            .expect("send the request");
        sockets.push(socket);
    }
    wait_for_count("every request to reach its handler", &seen.entered, ABANDONED).await;
    drop(sockets);
    drop(held);
    wait_for_count(
        "the requests of the clients that hung up to run",
        &server.calls,
        ABANDONED,
    )
    .await;

    let retry = post(
        server.url("/orders"),
        &[("authorization", "Bearer hung-up/u"), JSON, ("idempotency-key", "k-0")],
        "\"item-0\"",
    )
    .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(server.calls(), ABANDONED, "each request ran once");
    assert_eq!(order_count(&db).await, 2);
}

/// The HTTP tests' real clients, with their own retries, through the proxy
/// that loses the first response (`real_clients`, which the axum layer's
/// tests share).
#[cfg(feature = "axum")]
mod real_clients {
    use super::{Config, Server, TestDb};
    use crate::real_clients::{curl_retries_a_lost_response, urllib3_retries_a_lost_response};

    crate::common::backend_tests!(
        async:
        curl_retrying_a_lost_response_gets_the_first_answer_and_one_order,
        urllib3_retrying_a_lost_response_gets_the_first_answer_and_one_order,
    );

    async fn curl_retrying_a_lost_response_gets_the_first_answer_and_one_order<D: TestDb>() {
        let db = tokio::task::spawn_blocking(D::new).await.expect("create the database");
        let server = Server::start(&db, Config::default(), None);
        curl_retries_a_lost_response(&db, server.addr()).await;
        assert_eq!(server.calls(), 1);
    }

    async fn urllib3_retrying_a_lost_response_gets_the_first_answer_and_one_order<D: TestDb>() {
        let db = tokio::task::spawn_blocking(D::new).await.expect("create the database");
        let server = Server::start(&db, Config::default(), None);
        urllib3_retries_a_lost_response(&db, server.addr()).await;
        assert_eq!(server.calls(), 1);
    }
}

/// A member of a tenant, from `Authorization: Bearer <tenant>/<user>`:
/// the tenant's users share its keys, each is a principal of its own. A
/// token without a tenant (`Bearer acct-1`, as the real clients send) is
/// a user who is a tenant of its own.
struct Member {
    tenant: String,
    user: String,
}

impl FromRequest for Member {
    type Error = Problem;
    type Future = Ready<Result<Member, Problem>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let credential = req
            .headers()
            .get("authorization")
            .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
            .map(|token| token.split_once('/').unwrap_or((token, token)));
        ready(match credential {
            Some((tenant, user)) => Ok(Member {
                tenant: tenant.to_owned(),
                user: user.to_owned(),
            }),
            None => Err(Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized")),
        })
    }
}

impl Caller for Member {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.tenant)
    }

    fn principal(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.user)
    }
}

#[derive(Serialize, Deserialize)]
struct NewOrder {
    item: String,
    quantity: i32,
}

/// What the shop's handlers share: the pool, the policy, how many times an
/// operation ran, and, where a test holds the first call open, the barrier
/// it meets the test at on entering and again before it goes on.
struct Shop<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    config: Config,
    calls: Arc<AtomicUsize>,
    hold_first: Option<Arc<Barrier>>,
}

/// Places an order under the key at the shop the path names (`main` at
/// `/orders`): 201 with its `Location`.
async fn place_order<D: TestDb>(
    shop: web::Data<Shop<D>>,
    key: IdempotencyKey<Member>,
    req: HttpRequest,
    order: web::Json<NewOrder>,
) -> Result<Answer<StoredResponse<Value>>, Failure<Problem>> {
    let (calls, hold) = (shop.calls.clone(), shop.hold_first.clone());
    let shop_name = req.match_info().get("shop").unwrap_or("main").to_owned();
    idem::run(
        &shop.pool,
        &shop.config,
        &key,
        order.into_inner(),
        move |conn, order| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            if let Some(barrier) = hold.filter(|_| first) {
                // Entered, inside the transaction; then held until the test
                // has seen what a duplicate gets meanwhile.
                barrier.wait();
                barrier.wait();
            }
            let id = D::place_order(conn, &order.item, order.quantity)
                .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
            let location = HeaderValue::try_from(format!("/shops/{shop_name}/orders/{id}")).expect("a visible path");
            let body = json!({"id": id, "shop": shop_name, "item": order.item, "quantity": order.quantity});
            Ok(StoredResponse::new(StatusCode::CREATED, body).with_header(header::LOCATION, location))
        },
    )
    .await
}

/// A note, with or without a key: without one, the handler's own answer
/// (a 202 here, nothing placed).
async fn place_note<D: TestDb>(
    shop: web::Data<Shop<D>>,
    key: OptionalIdempotencyKey<Member>,
    body: String,
) -> Result<Either<Answer<StoredResponse<i64>>, HttpResponse>, Failure<Problem>> {
    let OptionalIdempotencyKey(Some(key)) = key else {
        return Ok(Either::Right(HttpResponse::Accepted().finish()));
    };
    idem::run(&shop.pool, &shop.config, &key, body, |conn, body| {
        let id = D::place_order(conn, body, 1)
            .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
        Ok(StoredResponse::new(StatusCode::CREATED, id))
    })
    .await
    .map(Either::Left)
}

/// What became of the caller's order with the key, at this shop.
async fn order_status<D: TestDb>(
    shop: web::Data<Shop<D>>,
    key: IdempotencyKey<Member>,
) -> Result<Answer<StoredResponse<Value>>, Failure<std::convert::Infallible>> {
    idem::lookup(
        &shop.pool,
        &shop.config,
        &key,
        &[(Method::POST, "/shops/{shop}/orders")],
    )
    .await
}

/// The shop served by actix-web on a free port until dropped, and the
/// count of operations run.
struct Server {
    addr: SocketAddr,
    handle: ServerHandle,
    calls: Arc<AtomicUsize>,
}

impl Server {
    /// The shop on `db`'s r2d2 pool under `config`, its first operation
    /// held at `hold_first` where a test holds it.
    fn start<D: TestDb>(db: &D, config: Config, hold_first: Option<Arc<Barrier>>) -> Server {
        let calls = Arc::new(AtomicUsize::new(0));
        let shop = web::Data::new(Shop::<D> {
            pool: db.pool(4),
            config,
            calls: calls.clone(),
            hold_first,
        });
        let routes = move |routes: &mut web::ServiceConfig| {
            routes
                .app_data(shop.clone())
                .route("/orders", web::post().to(place_order::<D>))
                .route("/shops/{shop}/orders", web::post().to(place_order::<D>))
                .route("/shops/{shop}/refunds", web::post().to(place_order::<D>))
                .service(web::scope("/v2").route("/shops/{shop}/orders", web::post().to(place_order::<D>)))
                .route("/shops/{shop}/orders/status", web::get().to(order_status::<D>))
                .route("/notes", web::post().to(place_note::<D>));
        };
        Server::serve(routes, calls)
    }

    /// Serves the `routes` on a free port, in a thread of its own with its
    /// actix-web system, until dropped; `calls` counts the operations run.
    fn serve(routes: impl Fn(&mut web::ServiceConfig) + Clone + Send + 'static, calls: Arc<AtomicUsize>) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen on a free port");
        let addr = listener.local_addr().expect("the listening address");
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(move || App::new().configure(routes.clone()))
                    .workers(2)
                    .disable_signals()
                    .listen(listener)
                    .expect("serve on the listener")
                    .run();
                handle_tx.send(server.handle()).expect("the test waits for the handle");
                server.await.expect("the server ran");
            });
        });
        let handle = handle_rx.recv().expect("the server started");
        Server { addr, handle, calls }
    }

    #[cfg(feature = "axum")]
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The command is sent at once; the server's thread ends with it.
        drop(self.handle.stop(false));
    }
}

/// A response as it came: status, headers and the body's bytes.
struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// Asserts an RFC 9457 problem of `status` and returns its body.
    fn problem(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", String::from_utf8_lossy(&self.body));
        assert_eq!(self.header("content-type"), Some("application/problem+json"));
        let problem = self.json();
        assert_eq!(problem["status"], status);
        problem
    }
}

async fn post(url: String, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut request = reqwest::Client::new().post(url).body(body.to_owned());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    reply(request).await
}

async fn reply(request: reqwest::RequestBuilder) -> Reply {
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await.expect("the body").to_vec();
    Reply { status, headers, body }
}

const ALICE: (&str, &str) = ("authorization", "Bearer acme/alice");
const JSON: (&str, &str) = ("content-type", "application/json");
const ORDER: &str = r#"{"item": "book", "quantity": 2}"#;

async fn shop<D: TestDb>(config: Config) -> (D, Server) {
    let db = tokio::task::spawn_blocking(D::new).await.expect("create the database");
    let server = Server::start(&db, config, None);
    (db, server)
}

async fn order_count<D: TestDb>(db: &D) -> i64 {
    tokio::task::block_in_place(|| D::order_count(&mut db.conn()))
}

async fn a_first_call_executes_and_its_retry_replays_it_byte_for_byte<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let url = server.url("/shops/north/orders");
    let first = post(url.clone(), &[ALICE, JSON, ("idempotency-key", "\"o-1\"")], ORDER).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert!(
        first
            .header("idempotency-expires")
            .is_some_and(|date| date.ends_with(" GMT"))
    );
    let location = first.header("location").expect("a location").to_owned();
    assert_eq!(first.json()["item"], "book");

    // The bare token is the same key.
    let retry = post(url, &[ALICE, JSON, ("idempotency-key", "o-1")], ORDER).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("location"), Some(location.as_str()));
    assert_eq!(retry.header("idempotency-expires"), first.header("idempotency-expires"));
    assert_eq!(retry.body, first.body, "the replay is the first body, byte for byte");
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn another_body_with_the_same_key_is_a_422_problem<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let url = server.url("/shops/north/orders");
    let key = ("idempotency-key", "o-2");
    assert_eq!(post(url.clone(), &[ALICE, JSON, key], ORDER).await.status, 201);
    let other = post(url, &[ALICE, JSON, key], r#"{"item": "pen", "quantity": 2}"#).await;
    let problem = other.problem(422);
    assert!(problem["type"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_request_in_progress_runs_once_and_its_duplicate_gets_409_with_retry_after<D: TestDb>() {
    let db = tokio::task::spawn_blocking(D::new).await.expect("create the database");
    let held = Arc::new(Barrier::new(2));
    // The duplicate is answered at once rather than after a wait.
    let server = Server::start(&db, Config::default().in_flight(InFlight::Reject), Some(held.clone()));
    let url = server.url("/shops/north/orders");
    let key = ("idempotency-key", "o-3");
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(url, &[ALICE, JSON, key], ORDER).await }
    });
    let meet = || {
        let held = held.clone();
        tokio::task::spawn_blocking(move || {
            held.wait();
        })
    };
    meet().await.expect("the first call entered its operation");

    let duplicate = post(url.clone(), &[ALICE, JSON, key], ORDER).await;
    duplicate.problem(409);
    assert!(
        duplicate
            .header("retry-after")
            .is_some_and(|after| after.parse::<u64>().is_ok())
    );

    meet().await.expect("the first call goes on");
    let first = first.await.expect("the first call's task");
    assert_eq!(first.status, 201);
    assert_eq!(server.calls(), 1, "the operation ran once");
    let retry = post(url, &[ALICE, JSON, key], ORDER).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_missing_or_invalid_key_is_a_400_problem_and_runs_nothing<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let url = server.url("/shops/north/orders");
    let missing = post(url.clone(), &[ALICE, JSON], ORDER).await;
    let problem = missing.problem(400);
    assert_eq!(problem["detail"], "this endpoint requires an Idempotency-Key header");
    for invalid in ["\"unterminated", "two,keys"] {
        let refused = post(url.clone(), &[ALICE, JSON, ("idempotency-key", invalid)], ORDER).await;
        refused.problem(400);
    }
    // A byte beyond ASCII.
    let request = reqwest::Client::new()
        .post(url.clone())
        .header(ALICE.0, ALICE.1)
        .header(JSON.0, JSON.1)
        .header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"),
        )
        .body(ORDER);
    reply(request).await.problem(400);
    // Two fields.
    let request = reqwest::Client::new()
        .post(url.clone())
        .header(ALICE.0, ALICE.1)
        .header(JSON.0, JSON.1)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(ORDER);
    reply(request).await.problem(400);
    // A card number is no key: refused by the key rules before the call.
    let card = post(
        url.clone(),
        &[ALICE, JSON, ("idempotency-key", "4111111111111111")],
        ORDER,
    )
    .await;
    card.problem(400);
    // No credentials: the caller's own 401, key or no key.
    let anonymous = post(url, &[JSON, ("idempotency-key", "o-4")], ORDER).await;
    anonymous.problem(401);
    assert_eq!(server.calls(), 0);
    assert_eq!(order_count(&db).await, 0);
}

async fn a_key_sent_to_another_endpoint_is_refused<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let key = ("idempotency-key", "o-5");
    let first = post(server.url("/shops/north/orders"), &[ALICE, JSON, key], ORDER).await;
    assert_eq!(first.status, 201);
    // Another route (under a scope too, whose prefix the pattern holds),
    // another path parameter, another query: each its own request.
    for elsewhere in [
        "/shops/north/refunds",
        "/v2/shops/north/orders",
        "/shops/south/orders",
        "/shops/north/orders?gift=1",
    ] {
        let refused = post(server.url(elsewhere), &[ALICE, JSON, key], ORDER).await;
        refused.problem(422);
    }
    // The path parameter as actix-web's `Path` decodes it: `%6Eorth` is `north`.
    let respelled = post(server.url("/shops/%6Eorth/orders"), &[ALICE, JSON, key], ORDER).await;
    assert_eq!(respelled.header("idempotent-replayed"), Some("true"));
    assert_eq!(respelled.body, first.body);
    // A path that is not UTF-8 once decoded is no path to bind a key to.
    let broken = post(server.url("/shops/%FF/orders"), &[ALICE, JSON, key], ORDER).await;
    broken.problem(400);
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn another_principal_of_the_scope_is_refused_and_cannot_look_the_call_up<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let key = ("idempotency-key", "o-6");
    let bob = ("authorization", "Bearer acme/bob");
    assert_eq!(
        post(server.url("/shops/north/orders"), &[ALICE, JSON, key], ORDER)
            .await
            .status,
        201
    );
    // Bob shares acme's keys, but the call was Alice's.
    post(server.url("/shops/north/orders"), &[bob, JSON, key], ORDER)
        .await
        .problem(422);
    let status = |who: (&'static str, &'static str)| {
        reqwest::Client::new()
            .get(server.url("/shops/north/orders/status"))
            .header(who.0, who.1)
            .header(key.0, key.1)
    };
    let looked = reply(status(bob)).await;
    looked.problem(404);
    assert_eq!(looked.header("cache-control"), Some("no-store"));
    // Another tenant's user with the same key runs a call of its own.
    let other = post(
        server.url("/shops/north/orders"),
        &[("authorization", "Bearer globex/alice"), JSON, key],
        ORDER,
    )
    .await;
    assert_eq!(other.status, 201);
    assert_eq!(other.header("idempotent-replayed"), None);
    assert_eq!(server.calls(), 2);
    assert_eq!(order_count(&db).await, 2);
}

async fn an_optional_key_still_authenticates<D: TestDb>() {
    let (db, server) = shop::<D>(Config::default()).await;
    let url = server.url("/notes");
    // Without credentials, refused whether a key is sent or not.
    post(url.clone(), &[], "n").await.problem(401);
    post(url.clone(), &[("idempotency-key", "n-1")], "n").await.problem(401);
    // With them and no key: the handler's own way (a 202 here).
    assert_eq!(post(url.clone(), &[ALICE], "n").await.status, 202);
    // With a key: the call, and its replay.
    let first = post(url.clone(), &[ALICE, ("idempotency-key", "n-1")], "n").await;
    assert_eq!(first.status, 201);
    let retry = post(url.clone(), &[ALICE, ("idempotency-key", "n-1")], "n").await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    // An invalid key is refused, not ignored.
    post(url, &[ALICE, ("idempotency-key", "\"broken")], "n")
        .await
        .problem(400);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_lookup_answers_the_stored_response_and_the_first_request_to_its_caller<D: TestDb>() {
    let (_db, server) = shop::<D>(Config::default()).await;
    let key = ("idempotency-key", "o-7");
    let status = |shop: &str| {
        reqwest::Client::new()
            .get(server.url(&format!("/shops/{shop}/orders/status")))
            .header(ALICE.0, ALICE.1)
            .header(key.0, key.1)
    };
    reply(status("north")).await.problem(404);
    let first = post(
        server.url("/shops/north/orders"),
        &[ALICE, JSON, key, ("x-request-id", "req-1")],
        ORDER,
    )
    .await;
    assert_eq!(first.header("original-request"), None);
    let retry = post(
        server.url("/shops/north/orders"),
        &[ALICE, JSON, key, ("x-request-id", "req-2")],
        ORDER,
    )
    .await;
    assert_eq!(
        retry.header("original-request"),
        Some("req-1"),
        "the replay names the first request"
    );
    let looked = reply(status("north")).await;
    assert_eq!(looked.status, 201);
    assert_eq!(looked.header("idempotent-replayed"), Some("true"));
    assert_eq!(looked.header("original-request"), Some("req-1"));
    assert_eq!(looked.header("cache-control"), Some("no-store"));
    assert_eq!(looked.header("location"), first.header("location"));
    assert_eq!(looked.body, first.body);
    // Another shop's lookup does not answer the north shop's call.
    reply(status("south")).await.problem(404);
    assert_eq!(server.calls(), 1);
}

/// `http::run_async` from an actix-web handler, on a bb8 pool of each
/// server backend's diesel-async connections: the operation awaited in the
/// handler's own future, nothing on the blocking pool. SQLite's wrapper is
/// refused on actix-web's current-thread workers, before any statement.
#[cfg(feature = "diesel-async")]
mod diesel_async_pools {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use actix_web::web;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use http::StatusCode;
    use idempotency::http::{self as idem, Answer, Failure, IdempotencyKey, Problem, StoredResponse};
    use idempotency::{AsyncConnectionPool, Config};
    use serde_json::{Value, json};

    use super::{ALICE, JSON, Member, NewOrder, ORDER, Server, order_count, post};
    use crate::common::TestDb;
    use crate::common::asynchronous::AsyncDb;

    struct AsyncShop<P> {
        pool: P,
        config: Config,
        calls: Arc<AtomicUsize>,
    }

    async fn place_order<D, P>(
        shop: web::Data<AsyncShop<P>>,
        key: IdempotencyKey<Member>,
        order: web::Json<NewOrder>,
    ) -> Result<Answer<StoredResponse<Value>>, Failure<Problem>>
    where
        D: AsyncDb,
        P: AsyncConnectionPool<Connection = D::Async>,
    {
        let calls = shop.calls.clone();
        idem::run_async(
            &shop.pool,
            &shop.config,
            &key,
            order.into_inner(),
            async |conn, order| {
                calls.fetch_add(1, Ordering::SeqCst);
                D::insert_order(conn, &order.item)
                    .await
                    .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"))?;
                Ok(StoredResponse::new(StatusCode::CREATED, json!({"item": order.item})))
            },
        )
        .await
    }

    /// A first call, its byte-identical replay and a 422 for another body,
    /// with the operation run once, on `pool` of `db`'s async connections.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    async fn an_async_operation_executes_once_and_its_retry_replays_it<D, P>(db: D, pool: P)
    where
        D: AsyncDb,
        P: AsyncConnectionPool<Connection = D::Async> + 'static,
    {
        let server = serve::<D, P>(pool);
        let key = ("idempotency-key", "a-1");
        let first = post(server.url("/orders"), &[ALICE, JSON, key], ORDER).await;
        assert_eq!(first.status, 201);
        assert_eq!(first.header("idempotent-replayed"), None);
        let retry = post(server.url("/orders"), &[ALICE, JSON, key], ORDER).await;
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        assert_eq!(retry.body, first.body);
        post(
            server.url("/orders"),
            &[ALICE, JSON, key],
            r#"{"item": "pen", "quantity": 1}"#,
        )
        .await
        .problem(422);
        assert_eq!(server.calls(), 1);
        assert_eq!(order_count(&db).await, 1);
    }

    /// The async shop on `pool`, served by actix-web.
    fn serve<D, P>(pool: P) -> Server
    where
        D: AsyncDb,
        P: AsyncConnectionPool<Connection = D::Async> + 'static,
    {
        let calls = Arc::new(AtomicUsize::new(0));
        let shop = web::Data::new(AsyncShop {
            pool,
            config: Config::default(),
            calls: calls.clone(),
        });
        let routes = move |routes: &mut web::ServiceConfig| {
            routes
                .app_data(shop.clone())
                .route("/orders", web::post().to(place_order::<D, P>));
        };
        Server::serve(routes, calls)
    }

    /// actix-web runs each worker on a current-thread runtime, where
    /// `SyncConnectionWrapper` cannot wait for a statement of a dropped
    /// future: the call is refused before its first statement, a 500 with
    /// nothing run or written. SQLite serves actix-web through `http::run`
    /// on r2d2.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_through_the_async_wrapper_is_refused_on_actix_workers_and_runs_nothing() {
        type Wrapper = diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>;
        type Db = crate::common::sqlite::Db;
        let db = tokio::task::spawn_blocking(Db::new).await.expect("create the database");
        let server = serve::<Db, _>(bb8_pool::<Wrapper, _>(&db).await);
        let refused = post(server.url("/orders"), &[ALICE, JSON, ("idempotency-key", "a-2")], ORDER).await;
        refused.problem(500);
        assert_eq!(server.calls(), 0);
        assert_eq!(order_count(&db).await, 0);
        let keys = tokio::task::block_in_place(|| Db::key_count(&mut db.conn()));
        assert_eq!(keys, 0);
    }

    /// A bb8 pool of `db`'s async connections `C`.
    async fn bb8_pool<C, D: TestDb>(db: &D) -> diesel_async::pooled_connection::bb8::Pool<C>
    where
        C: diesel_async::pooled_connection::PoolableConnection + 'static,
        AsyncDieselConnectionManager<C>: bb8::ManageConnection<Connection = C>,
    {
        bb8::Pool::builder()
            .max_size(2)
            .build(AsyncDieselConnectionManager::new(db.url()))
            .await
            .expect("a bb8 pool")
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    macro_rules! on_bb8 {
        ($backend:ident, $db:ty, $conn:ty) => {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $backend() {
                let db = tokio::task::spawn_blocking(<$db>::new)
                    .await
                    .expect("create the database");
                let pool = bb8_pool::<$conn, _>(&db).await;
                an_async_operation_executes_once_and_its_retry_replays_it(db, pool).await;
            }
        };
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    mod an_async_operation_executes_once_and_its_retry_replays_it_on_bb8 {
        use super::*;

        #[cfg(feature = "postgres")]
        on_bb8!(postgres, crate::common::pg::Db, diesel_async::AsyncPgConnection);
        #[cfg(feature = "mysql")]
        on_bb8!(mysql, crate::common::mysql::Db, diesel_async::AsyncMysqlConnection);
    }
}
