//! `http::run_async` on bb8 and deadpool pools of diesel-async connections,
//! served over real TCP: a first request executes, its retry replays, the
//! same key with another body is a 422; and a client that hangs up while
//! its operation runs leaves nothing behind, no connection in the pool
//! inside a transaction, and its retry executes once. `http::run_phased_async`
//! runs each step once and replays; a client that hangs up during its call
//! leaves the lease held until it runs out, and the retry then resumes.
//! Both are looked up by `http::lookup` on a pool of sync connections, at
//! their own endpoints only.
//!
//! An axum handler's future must be `Send`, which the compiler proves only
//! for a concrete connection: each backend and pool gets its module from
//! one macro.

use axum::http::StatusCode;
use idempotency::Config;
use tokio::io::AsyncWriteExt;

/// The item whose operation waits for ever once it has inserted its order:
/// a request its client gives up on.
const HANGS: &str = "hangs";

/// The item whose operation panics once it has inserted its order.
const PANICS: &str = "panics";

/// The longest key the service's policy accepts: shorter than the
/// extractor's limit, so that the policy refuses keys the header allows.
const MAX_KEY_LEN: usize = 32;

#[derive(serde::Serialize, serde::Deserialize)]
struct NewOrder {
    item: String,
}

fn config() -> Config {
    Config::default()
        .in_flight(idempotency::InFlight::Wait(chrono::Duration::seconds(5)))
        .max_key_len(MAX_KEY_LEN)
}

/// The key a test's `key` is sent as to the server at `addr`: prefixed with
/// its port, so that tests that run at once never share a key. They share
/// one database server, whose key locks on PostgreSQL span every schema,
/// and a lookup or a call under `InFlight::Reject` meeting another test's
/// call of the same key would answer 409.
fn sent_key(addr: std::net::SocketAddr, key: &str) -> String {
    format!("{}-{key}", addr.port())
}

/// Sends `POST /orders` with `key` and the order of `item` to `addr`;
/// returns the status and whether the answer is a replay.
async fn post(addr: std::net::SocketAddr, key: &str, item: &str) -> (StatusCode, bool) {
    post_to(addr, "/orders", key, item).await
}

/// Sends `GET path` with `key`; returns the status and whether the answer
/// is a replay.
async fn look_up(addr: std::net::SocketAddr, path: &str, key: &str) -> (StatusCode, bool) {
    let response = crate::common::http::client()
        .get(format!("http://{addr}{path}"))
        .header("Idempotency-Key", sent_key(addr, key))
        .send()
        .await
        .expect("an answer");
    let replayed = response.headers().get("idempotent-replayed").is_some();
    (
        StatusCode::from_u16(response.status().as_u16()).expect("a status"),
        replayed,
    )
}

/// [`post`] to `path`.
async fn post_to(addr: std::net::SocketAddr, path: &str, key: &str, item: &str) -> (StatusCode, bool) {
    let response = crate::common::http::client()
        .post(format!("http://{addr}{path}"))
        .header("Idempotency-Key", sent_key(addr, key))
        .json(&NewOrder { item: item.to_owned() })
        .send()
        .await
        .expect("an answer");
    let replayed = response.headers().get("idempotent-replayed").is_some();
    (
        StatusCode::from_u16(response.status().as_u16()).expect("a status"),
        replayed,
    )
}

/// Sends `POST /orders` for `item` with `key` over a socket of its own and
/// closes the socket once `inside` says the operation runs: a client that
/// hangs up.
async fn hang_up(addr: std::net::SocketAddr, key: &str, item: &str, inside: &tokio::sync::Notify) {
    hang_up_at(addr, "/orders", key, item, inside).await;
}

/// [`hang_up`] at `path`.
async fn hang_up_at(addr: std::net::SocketAddr, path: &str, key: &str, item: &str, inside: &tokio::sync::Notify) {
    let body = serde_json::to_string(&NewOrder { item: item.to_owned() }).expect("json");
    let key = sent_key(addr, key);
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = tokio::net::TcpStream::connect(addr).await.expect("connect");
    socket.write_all(request.as_bytes()).await.expect("send the request");
    inside.notified().await;
    drop(socket);
}

macro_rules! async_http_tests {
    ($module:ident, $db:ty, $conn:ty, $pool:ty, $build:expr, $connections:expr) => {
        mod $module {
            use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
            use std::sync::{Arc, Mutex};

            use axum::extract::State;
            use axum::http::{Method, StatusCode};
            use axum::response::{IntoResponse, Response};
            use axum::routing::{get, post};
            use axum::{Json, Router};
            use diesel_async::pooled_connection::AsyncDieselConnectionManager;
            use idempotency::http::{self, Answer, Failure, IdempotencyKey, StoredResponse};
            use idempotency::phased::{AsyncSteps, Phased};
            use idempotency::testing::ManualClock;
            use idempotency::{Config, InFlight};
            use tokio::sync::Notify;

            use super::{HANGS, MAX_KEY_LEN, NewOrder, PANICS};
            use crate::common::TestDb;
            use crate::common::asynchronous::AsyncDb;
            use crate::common::http::Anyone;
            use crate::common::wait::PATIENCE;

            struct App {
                pool: $pool,
                /// Sync connections to the same database, for lookups.
                lookups: diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<<$db as TestDb>::Conn>>,
                config: Config,
                /// Told when the operation of [`HANGS`] has inserted its order.
                inside: Notify,
                /// The ride operation, on `clock`.
                rides: Phased,
                clock: ManualClock,
                /// The provider keys the ride operation's calls were made
                /// with, one per request to the provider.
                provider_keys: Mutex<Vec<String>>,
                /// Whether the next call to the provider waits for ever.
                provider_hangs: AtomicBool,
                /// The ride handlers that ended, dropped ones included.
                rides_ended: AtomicUsize,
            }

            /// Counts a handler's end when it is dropped, however it ends.
            struct Ends<'a>(&'a AtomicUsize);

            impl Drop for Ends<'_> {
                fn drop(&mut self) {
                    self.0.fetch_add(1, Ordering::SeqCst);
                }
            }

            async fn place(
                State(app): State<Arc<App>>,
                key: IdempotencyKey<Anyone>,
                Json(order): Json<NewOrder>,
            ) -> Response {
                http::run_async(
                    &app.pool,
                    &app.config,
                    &key,
                    order,
                    async |tx: &mut $conn, order: &NewOrder| {
                        <$db as AsyncDb>::insert_order(tx, &order.item)
                            .await
                            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                        if order.item == HANGS {
                            app.inside.notify_one();
                            std::future::pending::<()>().await;
                        }
                        if order.item == PANICS {
                            panic!("the operation panics after its insert");
                        }
                        Ok::<_, StatusCode>(StoredResponse::new(StatusCode::CREATED, order.item.clone()))
                    },
                )
                .await
                .into_response()
            }

            /// A ride: the order is written in a phase, the provider is
            /// called, and the ride is answered with the charge.
            async fn ride(
                State(app): State<Arc<App>>,
                key: IdempotencyKey<Anyone>,
                Json(order): Json<NewOrder>,
            ) -> Response {
                let _ends = Ends(&app.rides_ended);
                http::run_phased_async(
                    &app.pool,
                    &app.rides,
                    &key,
                    order,
                    async |s: &mut AsyncSteps<'_, $conn>, order: &NewOrder| {
                        s.phase("ordered", async |tx: &mut $conn| {
                            <$db as AsyncDb>::insert_order(tx, &order.item)
                                .await
                                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)
                        })
                        .await?;
                        let charge = s
                            .call("charged", async |provider_key: &str| {
                                app.provider_keys
                                    .lock()
                                    .expect("the keys")
                                    .push(provider_key.to_owned());
                                if app.provider_hangs.swap(false, Ordering::SeqCst) {
                                    app.inside.notify_one();
                                    std::future::pending::<()>().await;
                                }
                                Ok::<_, StatusCode>(format!("ch-{}", &provider_key[..8]))
                            })
                            .await?;
                        s.finish(async |_: &mut $conn| Ok(StoredResponse::new(StatusCode::CREATED, charge)))
                            .await
                    },
                )
                .await
                .into_response()
            }

            /// What became of a call with the key at `call`.
            async fn status(
                app: &App,
                key: &IdempotencyKey<Anyone>,
                call: &str,
            ) -> Result<Answer<StoredResponse<String>>, Failure<std::convert::Infallible>> {
                http::lookup(&app.lookups, &app.config, key, &[(Method::POST, call)]).await
            }

            async fn order_status(State(app): State<Arc<App>>, key: IdempotencyKey<Anyone>) -> Response {
                status(&app, &key, "/orders").await.into_response()
            }

            async fn ride_status(State(app): State<Arc<App>>, key: IdempotencyKey<Anyone>) -> Response {
                status(&app, &key, "/rides").await.into_response()
            }

            /// The database, and the service on a pool of `size` connections to it.
            async fn serve(size: u32) -> ($db, std::net::SocketAddr, Arc<App>) {
                let db = <$db as TestDb>::new();
                let manager = AsyncDieselConnectionManager::<$conn>::new(db.url());
                let clock = ManualClock::new();
                let app = Arc::new(App {
                    pool: $build(manager, size).await,
                    lookups: <$db as TestDb>::pool(&db, 2),
                    config: super::config(),
                    inside: Notify::new(),
                    rides: Phased::new("ride")
                        .lease(chrono::Duration::seconds(30))
                        .config(super::config().in_flight(InFlight::Reject).clock(clock.source())),
                    clock,
                    provider_keys: Mutex::new(Vec::new()),
                    provider_hangs: AtomicBool::new(false),
                    rides_ended: AtomicUsize::new(0),
                });
                let router = Router::new()
                    .route("/orders", post(place))
                    .route("/returns", post(place))
                    .route("/rides", post(ride))
                    .route("/orders/status", get(order_status))
                    .route("/rides/status", get(ride_status))
                    .with_state(app.clone());
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("a port");
                let addr = listener.local_addr().expect("its address");
                tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
                (db, addr, app)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_request_executes_once_its_retry_replays_and_another_body_is_refused() {
                let (db, addr, _app) = serve(2).await;
                assert_eq!(
                    super::post(addr, "k-1", "book").await,
                    (StatusCode::CREATED, false)
                );
                assert_eq!(
                    super::post(addr, "k-1", "book").await,
                    (StatusCode::CREATED, true)
                );
                assert_eq!(
                    super::post(addr, "k-1", "lamp").await.0,
                    StatusCode::UNPROCESSABLE_ENTITY
                );
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_items(&mut db.conn()));
                assert_eq!(orders, ["book"]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn async_calls_are_looked_up_at_their_own_endpoints_only() {
                let (_db, addr, _app) = serve(2).await;
                assert_eq!(super::post(addr, "k-1", "book").await.0, StatusCode::CREATED);
                assert_eq!(
                    super::post_to(addr, "/rides", "r-1", "book").await.0,
                    StatusCode::CREATED
                );
                assert_eq!(
                    super::look_up(addr, "/orders/status", "k-1").await,
                    (StatusCode::CREATED, true)
                );
                assert_eq!(
                    super::look_up(addr, "/rides/status", "r-1").await,
                    (StatusCode::CREATED, true)
                );
                assert_eq!(
                    super::look_up(addr, "/rides/status", "k-1").await.0,
                    StatusCode::NOT_FOUND
                );
                assert_eq!(
                    super::look_up(addr, "/orders/status", "r-1").await.0,
                    StatusCode::NOT_FOUND
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_same_key_at_another_endpoint_is_a_422_and_runs_nothing() {
                let (db, addr, _app) = serve(2).await;
                assert_eq!(
                    super::post(addr, "k-1", "book").await,
                    (StatusCode::CREATED, false)
                );
                assert_eq!(
                    super::post_to(addr, "/returns", "k-1", "book").await.0,
                    StatusCode::UNPROCESSABLE_ENTITY
                );
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_items(&mut db.conn()));
                assert_eq!(orders, ["book"]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_operation_is_a_500_and_leaves_nothing() {
                let (db, addr, _app) = serve(1).await;
                assert_eq!(
                    super::post(addr, "k-1", PANICS).await.0,
                    StatusCode::INTERNAL_SERVER_ERROR
                );
                let (orders, keys) = tokio::task::block_in_place(|| {
                    let mut conn = db.conn();
                    (
                        <$db as TestDb>::order_count(&mut conn),
                        <$db as TestDb>::key_count(&mut conn),
                    )
                });
                assert_eq!((orders, keys), (0, 0), "rolled back");
                // The pool's one connection came back out of the transaction.
                assert_eq!(
                    super::post(addr, "k-1", "book").await,
                    (StatusCode::CREATED, false)
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_the_policy_refuses_is_a_400_while_every_connection_is_busy() {
                let (db, addr, app) = serve(1).await;
                let held = app.pool.get().await.expect("the pool's one connection");
                let long = "k".repeat(MAX_KEY_LEN + 1);
                // Well within any pool's wait for a connection: a refusal
                // that waited for one would come too late.
                let refused = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    super::post(addr, &long, "book"),
                )
                .await
                .expect("answered without a connection");
                assert_eq!(refused.0, StatusCode::BAD_REQUEST);
                drop(held);
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_count(&mut db.conn()));
                assert_eq!(orders, 0);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_phased_request_runs_each_step_once_and_its_retry_replays() {
                let (db, addr, app) = serve(1).await;
                let first = super::post_to(addr, "/rides", "r-1", "book").await;
                let retry = super::post_to(addr, "/rides", "r-1", "book").await;
                assert_eq!(
                    (first, retry),
                    ((StatusCode::CREATED, false), (StatusCode::CREATED, true))
                );
                assert_eq!(
                    super::post_to(addr, "/rides", "r-1", "lamp").await.0,
                    StatusCode::UNPROCESSABLE_ENTITY
                );
                assert_eq!(app.provider_keys.lock().expect("the keys").len(), 1, "one call");
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_items(&mut db.conn()));
                assert_eq!(orders, ["book"]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_client_that_hangs_up_during_a_call_is_resumed_by_its_retry_once_the_lease_ran_out() {
                let (db, addr, app) = serve(1).await;
                app.provider_hangs.store(true, Ordering::SeqCst);
                tokio::time::timeout(
                    PATIENCE,
                    super::hang_up_at(addr, "/rides", "r-1", "book", &app.inside),
                )
                .await
                .expect("the call to the provider was made");
                let dropped = async {
                    while app.rides_ended.load(Ordering::SeqCst) == 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    }
                };
                tokio::time::timeout(PATIENCE, dropped)
                    .await
                    .expect("the server dropped the hung-up handler");
                // The dropped attempt holds the operation's lease: a retry
                // within it is told to come back later.
                let held = crate::common::http::client()
                    .post(format!("http://{addr}/rides"))
                    .header("Idempotency-Key", super::sent_key(addr, "r-1"))
                    .json(&NewOrder {
                        item: "book".to_owned(),
                    })
                    .send()
                    .await
                    .expect("an answer");
                assert_eq!(held.status().as_u16(), StatusCode::CONFLICT.as_u16());
                assert!(held.headers().contains_key("retry-after"), "{:?}", held.headers());
                app.clock.advance(chrono::Duration::seconds(31));
                assert_eq!(
                    super::post_to(addr, "/rides", "r-1", "book").await,
                    (StatusCode::CREATED, false),
                    "the retry resumes once the lease ran out"
                );
                let keys = app.provider_keys.lock().expect("the keys").clone();
                assert_eq!(keys.len(), 2, "the cut call was made again");
                assert_eq!(keys[0], keys[1], "with the same provider key");
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_items(&mut db.conn()));
                assert_eq!(orders, ["book"], "the committed phase did not run again");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_client_that_hangs_up_leaves_nothing_and_its_retry_executes() {
                // One connection: the retry gets the hung-up call's
                // connection back only if the pool took it back whole.
                let (db, addr, app) = serve(1).await;
                tokio::time::timeout(PATIENCE, super::hang_up(addr, "k-1", HANGS, &app.inside))
                    .await
                    .expect("the operation ran");
                // The server drops the handler; the connection it held,
                // inside its transaction, leaves the pool instead of
                // waiting in it for its next lending.
                let pool_emptied = async {
                    while $connections(&app.pool) != 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    }
                };
                tokio::time::timeout(PATIENCE, pool_emptied)
                    .await
                    .expect("the hung-up call's connection left the pool");
                // The retry waits for the key as the in-flight policy
                // allows, until the server has dropped the handler and the
                // database has ended the transaction.
                let retried = tokio::time::timeout(PATIENCE, super::post(addr, "k-1", "book-after-all"))
                    .await
                    .expect("an answer");
                assert_eq!(
                    retried,
                    (StatusCode::CREATED, false),
                    "nothing of the hung-up call stayed"
                );
                let mut lent = app.pool.get().await.expect("a connection");
                assert!(
                    !diesel_async::pooled_connection::PoolableConnection::is_broken(&mut *lent),
                    "no connection comes back inside a transaction"
                );
                drop(lent);
                let orders = tokio::task::block_in_place(|| <$db as TestDb>::order_items(&mut db.conn()));
                assert_eq!(orders, ["book-after-all"]);
            }
        }
    };
}

type SqliteConn = diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>;

/// The tests on backend `$db` over its async connection `$conn`, once on a
/// bb8 pool (module `$bb8`) and once on a deadpool pool (`$deadpool`).
macro_rules! async_http_tests_on_both_pools {
    ($bb8:ident, $deadpool:ident, $db:ty, $conn:ty) => {
        async_http_tests!(
            $bb8,
            $db,
            $conn,
            diesel_async::pooled_connection::bb8::Pool<$conn>,
            crate::common::asynchronous::bb8_pool,
            |pool: &diesel_async::pooled_connection::bb8::Pool<_>| pool.state().connections
        );
        async_http_tests!(
            $deadpool,
            $db,
            $conn,
            diesel_async::pooled_connection::deadpool::Pool<$conn>,
            crate::common::asynchronous::deadpool_pool,
            |pool: &diesel_async::pooled_connection::deadpool::Pool<_>| pool.status().size
        );
    };
}

async_http_tests_on_both_pools!(
    sqlite_bb8,
    sqlite_deadpool,
    crate::common::sqlite::Db,
    super::SqliteConn
);
#[cfg(feature = "postgres")]
async_http_tests_on_both_pools!(
    postgres_bb8,
    postgres_deadpool,
    crate::common::pg::Db,
    diesel_async::AsyncPgConnection
);
#[cfg(feature = "mysql")]
async_http_tests_on_both_pools!(
    mysql_bb8,
    mysql_deadpool,
    crate::common::mysql::Db,
    diesel_async::AsyncMysqlConnection
);
