//! The whole path in processes of its own, on Redis: orders placed by
//! HTTP POSTs (each sent twice, as by a client that lost the first
//! answer), three relay processes on tokio publishing them, and a consumer
//! process killed between the commit of an effect and its acknowledgement.
//! The consumer reaches Redis through a proxy of the test's, which drops
//! what the consumer sends once the effect is released, so that its
//! acknowledgement never arrives. A second consumer process under the same
//! name takes over. Every order has its effect once, each customer's in
//! order.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use idempotency::Config;
use idempotency::brokers::Publisher;
use idempotency::brokers::redis::{RedisConsumer, RedisPublisher};
use idempotency::http::{self, Answer, Caller, Failure as HttpFailure, IdempotencyKey, StoredResponse};
use idempotency::outbox::{self, Envelope, Message, Relay};
use redis::Commands;
use tokio::runtime::Runtime;
use tower::ServiceExt;

use super::redis::pending_entry_of;
use super::{CUSTOMERS, Effects, ORDERS, Order, Shop, TRACEPARENT, TRACESTATE, effects_inbox};
use crate::common::child::{Child, parent_database};
use crate::common::unique_name;
use crate::common::wait::wait_for;

/// The order whose effect the first consumer commits and never
/// acknowledges.
const HELD: i64 = 20;

/// The consumer group and the consumer's name.
const GROUP: &str = "inbox";
const CONSUMER: &str = "consumer-1";

/// What a child process learns from its parent, beside the shop's
/// database ([`parent_database`]).
const ROLE: &str = "IDEMPOTENCY_TEST_ROLE";
const REDIS: &str = "IDEMPOTENCY_TEST_REDIS";
const STREAM: &str = "IDEMPOTENCY_TEST_STREAM";
const EFFECTS: &str = "IDEMPOTENCY_TEST_EFFECTS";
/// For the first consumer: the file whose existence lets it commit the
/// held order's effect.
const RELEASE: &str = "IDEMPOTENCY_TEST_RELEASE";

const TEST: &str =
    "orders_posted_over_http_reach_a_consumer_process_once_in_order_though_it_is_killed_between_commit_and_ack";

#[test]
fn orders_posted_over_http_reach_a_consumer_process_once_in_order_though_it_is_killed_between_commit_and_ack() {
    if let Some(shop) = parent_database() {
        let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} in the child's environment"));
        let release = std::env::var(RELEASE).ok().map(PathBuf::from);
        match var(ROLE).as_str() {
            "relay" => relay(&shop, &var(REDIS), &var(STREAM)),
            _ => consume(&var(REDIS), &var(STREAM), &var(EFFECTS), release),
        }
    }
    let stream = unique_name("orders");
    let proxy = Proxy::start(REDIS_PORT);
    let mut shop = Shop::with_orders_of("orders", 0, CUSTOMERS);
    shop.orders = ORDERS;
    let shop_path = shop.db.path().to_str().expect("a utf-8 path").to_owned();
    let effects = Effects::new();
    let effects_path = effects.db.path().to_str().expect("a utf-8 path").to_owned();
    let release = effects.db.path().with_extension("release");
    let test = crate::common::test_path(module_path!(), TEST);
    let child = |role: &str, redis: &str, release: Option<&Path>| {
        Child::start_with(&test, &shop_path, |command| {
            command
                .env(ROLE, role)
                .env(REDIS, redis)
                .env(STREAM, &stream)
                .env(EFFECTS, &effects_path);
            if let Some(release) = release {
                command.env(RELEASE, release);
            }
        })
    };

    let relays: Vec<Child> = (0..3).map(|_| child("relay", URL, None)).collect();
    let mut consumer = child("consumer", &proxy.url(), Some(&release));
    let runtime = Runtime::new().expect("a tokio runtime");
    runtime.block_on(post_every_order_twice(&shop_path));

    consumer.wait_for("the held order in its transaction", |line| {
        (line == format!("holding {HELD}")).then_some(())
    });
    // From now on nothing the consumer sends reaches Redis: the
    // acknowledgement that follows the commit is lost.
    proxy.sever();
    std::fs::write(&release, b"").expect("release the held order");
    wait_for("the held order's effect committed", || effects.has(HELD));
    let status = consumer.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "killed, not ended: {status}"
    );

    let mut conn = redis::Client::open(URL)
        .and_then(|client| client.get_connection())
        .expect("Redis on 127.0.0.1:6379 (.ci/run starts it)");
    // The entries read with it in one round are pending as well.
    assert!(
        pending_entry_of(&mut conn, &stream, HELD),
        "the held order's entry, committed, never acknowledged"
    );

    let _second = child("consumer", URL, None);
    wait_for("every order's effect", || {
        effects.count() == usize::try_from(ORDERS).unwrap()
    });
    wait_for("every entry acknowledged", || {
        let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(&stream).expect("XINFO GROUPS");
        groups
            .groups
            .first()
            .is_some_and(|group| (group.lag, group.pending) == (Some(0), 0))
    });
    effects.assert_each_order_once_in_order(&shop);
    let stats = Relay::default().stats(&mut shop.db.conn()).expect("the outbox's stats");
    assert_eq!((stats.pending, stats.dead), (0, 0), "every message delivered");
    drop(relays);
    let _: () = conn.del(&stream).expect("DEL");
}

const REDIS_PORT: u16 = 6379;
const URL: &str = "redis://127.0.0.1:6379";

/// A TCP proxy to Redis that, once severed, drops whatever its clients
/// send, while their connections stay open.
struct Proxy {
    addr: std::net::SocketAddr,
    severed: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let severed = Arc::new(AtomicBool::new(false));
        let dropping = Arc::clone(&severed);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect(("127.0.0.1", upstream)).expect("Redis on 127.0.0.1:6379");
                let (mut from_client, mut to_server) = (
                    client.try_clone().expect("a socket"),
                    server.try_clone().expect("a socket"),
                );
                let (mut from_server, mut to_client) = (server, client);
                let dropping = Arc::clone(&dropping);
                std::thread::spawn(move || {
                    let mut buffer = [0; 8192];
                    while let Ok(read @ 1..) = from_client.read(&mut buffer) {
                        if !dropping.load(Ordering::SeqCst) && to_server.write_all(&buffer[..read]).is_err() {
                            break;
                        }
                    }
                    let _ = to_server.shutdown(std::net::Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_server, &mut to_client);
                    let _ = to_client.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Proxy { addr, severed }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Drops everything the clients send from now on.
    fn sever(&self) {
        self.severed.store(true, Ordering::SeqCst);
    }
}

/// The shop's customer; every request is one.
struct Customer;

impl<S: Sync> FromRequestParts<S> for Customer {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Customer)
    }
}

impl Caller for Customer {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed("shop")
    }
}

/// The shop's handler refused an order: its database failed.
struct NotPlaced(String);

impl From<diesel::result::Error> for NotPlaced {
    fn from(error: diesel::result::Error) -> Self {
        NotPlaced(error.to_string())
    }
}

impl From<outbox::Error> for NotPlaced {
    fn from(error: outbox::Error) -> Self {
        NotPlaced(error.to_string())
    }
}

impl IntoResponse for NotPlaced {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0).into_response()
    }
}

type ShopPool = Pool<ConnectionManager<SqliteConnection>>;

/// `POST /orders`: the order and its message, in one transaction.
async fn place(
    axum::extract::State(pool): axum::extract::State<Arc<ShopPool>>,
    key: IdempotencyKey<Customer>,
    Json(order): Json<Order>,
) -> Result<Answer<StoredResponse<i64>>, HttpFailure<NotPlaced>> {
    http::run(&*pool, &Config::default(), &key, order, |conn, order| {
        diesel::sql_query("INSERT INTO orders (id, customer) VALUES (?, ?)")
            .bind::<BigInt, _>(order.id)
            .bind::<Text, _>(&order.customer)
            .execute(conn)?;
        Envelope::new("orders", order)
            .ordering_key(order.customer.as_str())
            .header("x-order", order.id.to_string())
            .traceparent(TRACEPARENT)
            .tracestate(TRACESTATE)
            .enqueue(conn)?;
        Ok(StoredResponse::new(StatusCode::CREATED, order.id))
    })
    .await
}

/// Posts every order twice with one key, as a client that lost the first
/// answer: the second is a replay, which enqueues nothing.
async fn post_every_order_twice(shop: &str) {
    let pool = Pool::builder()
        .max_size(4)
        .connection_customizer(Box::new(WaitForLocks))
        .build(ConnectionManager::<SqliteConnection>::new(shop))
        .expect("the shop's pool");
    let app = Router::new().route("/orders", post(place)).with_state(Arc::new(pool));
    for id in 1..=ORDERS {
        let order = Order {
            id,
            customer: format!("customer-{}", id % CUSTOMERS),
            poison: false,
        };
        let body = serde_json::to_string(&order).expect("an order's JSON");
        for replayed in [false, true] {
            let request = Request::post("/orders")
                .header("idempotency-key", format!("order-{id}"))
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body.clone()))
                .expect("a request");
            let response = app.clone().oneshot(request).await.expect("an answer");
            assert_eq!(response.status(), StatusCode::CREATED, "order {id}");
            assert_eq!(
                response.headers().contains_key("idempotent-replayed"),
                replayed,
                "order {id}"
            );
        }
    }
}

/// The shop's connections wait for SQLite's write lock, which the relays
/// take for their claims and marks.
#[derive(Debug)]
struct WaitForLocks;

impl diesel::r2d2::CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for WaitForLocks {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        use diesel::connection::SimpleConnection;
        conn.batch_execute("PRAGMA busy_timeout = 10000")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// In a relay process: the async relay on the shop's database, publishing
/// to the stream, until killed.
fn relay(shop: &str, redis: &str, stream: &str) -> ! {
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;

    let runtime = Runtime::new().expect("a tokio runtime");
    let stopped = runtime.block_on(async {
        let manager = AsyncDieselConnectionManager::<SyncConnectionWrapper<SqliteConnection>>::new(shop);
        let pool = crate::common::asynchronous::bb8_pool(manager, 2).await;
        let client = redis::Client::open(redis).expect("a redis url");
        let publisher = Arc::new(
            RedisPublisher::connect(client)
                .await
                .expect("the test's Redis")
                .stream({
                    let stream = stream.to_owned();
                    move |_| stream.clone()
                }),
        );
        let publish = move |message: Message| {
            let publisher = Arc::clone(&publisher);
            async move { publisher.publish(&message).await }
        };
        Relay::default()
            .poll_interval(chrono::Duration::milliseconds(20))
            .backoff(chrono::Duration::milliseconds(50), chrono::Duration::seconds(1))
            .serve_async(&pool, publish, &idempotency::Shutdown::new())
            .await
    });
    panic!("the relay serves until it is killed, yet it stopped: {stopped:?}")
}

/// In a consumer process: the stream's consumer with the effects' inbox,
/// until killed. With `release`, it holds the effect of the held order in
/// its transaction, says so, and commits it once `release` exists.
fn consume(redis: &str, stream: &str, effects: &str, release: Option<PathBuf>) -> ! {
    let inbox = effects_inbox(effects, "orders-inbox", move |order: &Order| {
        if let Some(release) = release.as_ref().filter(|_| order.id == HELD) {
            println!("\nholding {HELD}");
            wait_for("the parent's release", || release.exists());
        }
    });
    let client = redis::Client::open(redis).expect("a redis url");
    let consumer =
        RedisConsumer::new(client, stream, GROUP, CONSUMER, inbox).claim_idle(std::time::Duration::from_millis(50));
    let runtime = Runtime::new().expect("a tokio runtime");
    let ran = runtime.block_on(consumer.run(std::future::pending()));
    panic!("the consumer runs until it is killed, yet it stopped: {ran:?}")
}
