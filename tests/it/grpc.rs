//! Keys on gRPC: a shop served by tonic on a free port of 127.0.0.1 and
//! called by tonic's client over real TCP, on every backend's r2d2 pool.
//! The messages and the service are written by hand (what tonic-build
//! would generate, less of it), so no `protoc` is needed.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll};
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool};
use http::uri::PathAndQuery;
use idempotency::grpc::{self, ERROR_DOMAIN, GrpcKey};
use idempotency::{Config, InFlight};
use tokio::sync::Notify;
use tonic::body::Body;
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::Channel;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;
use tonic_types::StatusExt;

use crate::common::TestDb;

crate::common::backend_tests!(
    async:
    a_first_call_executes_and_its_retry_replays_it_marked,
    a_replay_names_the_request_that_executed_by_its_id,
    racing_requests_with_ids_of_their_own_are_all_told_the_one_that_executed,
    a_request_id_field_is_the_key_as_aip_155_has_it,
    another_request_method_or_principal_with_the_key_is_failed_precondition,
    a_call_in_progress_runs_once_and_its_duplicate_is_aborted_with_a_retry_delay,
    a_missing_or_invalid_key_is_invalid_argument_and_runs_nothing,
    an_invalid_key_is_refused_at_once_while_the_pool_is_exhausted,
    a_client_that_drops_its_connection_mid_call_gets_the_first_result_on_retry,
);

/// The key from the `idempotency-key` metadata entry.
const PLACE: &str = "/shop.Orders/Place";
/// The key from the message's `request_id`.
const PLACE_BY_ID: &str = "/shop.Orders/PlaceById";

#[derive(Clone, PartialEq, prost::Message)]
struct PlaceOrder {
    #[prost(string, tag = "1")]
    item: String,
    #[prost(int32, tag = "2")]
    quantity: i32,
    #[prost(string, tag = "3")]
    request_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(int64, tag = "1")]
    id: i64,
    #[prost(string, tag = "2")]
    item: String,
}

/// The shop's state, shared by every call.
struct State<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    config: Config,
    calls: AtomicUsize,
    /// Met twice by the first operation: once entered, once let go.
    hold_first: Option<Arc<Barrier>>,
    /// Told when a call's handler ends, done or dropped.
    handler_ended: Notify,
}

/// The `shop.Orders` service, as tonic-build would route it.
struct Shop<D: TestDb>(Arc<State<D>>);

impl<D: TestDb> Clone for Shop<D> {
    fn clone(&self) -> Self {
        Shop(self.0.clone())
    }
}

impl<D: TestDb> NamedService for Shop<D> {
    const NAME: &'static str = "shop.Orders";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<D: TestDb> tower::Service<http::Request<Body>> for Shop<D> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let method = match req.uri().path() {
            PLACE => PLACE,
            PLACE_BY_ID => PLACE_BY_ID,
            _ => return Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        };
        let place = Place {
            state: self.0.clone(),
            method,
        };
        Box::pin(async move { Ok(Grpc::new(ProstCodec::default()).unary(place, req).await) })
    }
}

/// One call of a method that places an order.
struct Place<D: TestDb> {
    state: Arc<State<D>>,
    method: &'static str,
}

/// Tells the state when the handler ends, whether it finished or was dropped.
struct Ending<D: TestDb>(Arc<State<D>>);

impl<D: TestDb> Drop for Ending<D> {
    fn drop(&mut self) {
        self.0.handler_ended.notify_one();
    }
}

impl<D: TestDb> UnaryService<PlaceOrder> for Place<D> {
    type Response = Order;
    type Future = BoxFuture<Result<Response<Order>, Status>>;

    fn call(&mut self, request: Request<PlaceOrder>) -> Self::Future {
        let (state, method) = (self.state.clone(), self.method);
        Box::pin(async move {
            let _ending = Ending(state.clone());
            // Authentication first: the scope is the shop's, the principal
            // the member's.
            let member = request
                .metadata()
                .get("authorization")
                .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
                .ok_or_else(|| Status::unauthenticated("no credentials"))?
                .to_owned();
            let key = match method {
                PLACE => GrpcKey::from_metadata(request.metadata(), method, "shop-1")?,
                _ => GrpcKey::from_field(&request.get_ref().request_id, method, "shop-1")?,
            }
            .with_principal(member);
            let held = state.clone();
            grpc::run(
                &state.pool,
                &state.config,
                &key,
                request.into_inner(),
                move |conn, order| {
                    let first = held.calls.fetch_add(1, Ordering::SeqCst) == 0;
                    if let Some(barrier) = held.hold_first.as_ref().filter(|_| first) {
                        barrier.wait();
                        barrier.wait();
                    }
                    let id = D::place_order(conn, &order.item, order.quantity)
                        .map_err(|_| Status::internal("the order was not placed"))?;
                    Ok::<_, Status>(Order {
                        id,
                        item: order.item.clone(),
                    })
                },
            )
            .await
        })
    }
}

/// The shop served on a free port until dropped.
struct Server<D: TestDb> {
    addr: SocketAddr,
    state: Arc<State<D>>,
    task: tokio::task::JoinHandle<()>,
}

impl<D: TestDb> Server<D> {
    fn start(db: &D, config: Config, hold_first: Option<Arc<Barrier>>) -> Self {
        Self::start_on(db.pool(4), config, hold_first)
    }

    fn start_on(pool: Pool<ConnectionManager<D::Conn>>, config: Config, hold_first: Option<Arc<Barrier>>) -> Self {
        let state = Arc::new(State::<D> {
            pool,
            config,
            calls: AtomicUsize::new(0),
            hold_first,
            handler_ended: Notify::new(),
        });
        let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind a free port");
        let addr = incoming.local_addr().expect("the bound address");
        let router = tonic::transport::Server::builder().add_service(Shop(state.clone()));
        let task = tokio::spawn(async move {
            router.serve_with_incoming(incoming).await.expect("serve");
        });
        Server { addr, state, task }
    }

    async fn client(&self) -> tonic::client::Grpc<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .expect("a valid address")
            .connect()
            .await
            .expect("connect");
        tonic::client::Grpc::new(channel)
    }

    fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }
}

impl<D: TestDb> Drop for Server<D> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A call of `method` by `member`, with `key` as metadata where given.
async fn call(
    client: &mut tonic::client::Grpc<Channel>,
    method: &'static str,
    member: &str,
    key: Option<&str>,
    order: PlaceOrder,
) -> Result<Response<Order>, Status> {
    call_with(client, (method, member, key), &[], order).await
}

/// [`call`], with the metadata entries `entries` besides the credentials
/// and the key.
async fn call_with(
    client: &mut tonic::client::Grpc<Channel>,
    (method, member, key): (&'static str, &str, Option<&str>),
    entries: &[(&'static str, &str)],
    order: PlaceOrder,
) -> Result<Response<Order>, Status> {
    let mut request = Request::new(order);
    let bearer = format!("Bearer {member}").parse().expect("an ASCII value");
    request.metadata_mut().insert("authorization", bearer);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("an ASCII value"));
    }
    for (name, value) in entries {
        request
            .metadata_mut()
            .append(*name, value.parse().expect("an ASCII value"));
    }
    client
        .ready()
        .await
        .map_err(|error| Status::unknown(error.to_string()))?;
    client
        .unary(request, PathAndQuery::from_static(method), ProstCodec::default())
        .await
}

fn book() -> PlaceOrder {
    PlaceOrder {
        item: "book".into(),
        quantity: 1,
        request_id: String::new(),
    }
}

fn replayed(response: &Response<Order>) -> Option<&str> {
    response
        .metadata()
        .get("idempotent-replayed")
        .map(|value| value.to_str().expect("ASCII"))
}

/// The reason of the `ErrorInfo` in `status`'s details, after checking its domain.
fn reason(status: &Status) -> String {
    let info = status.get_details_error_info().expect("an ErrorInfo in the details");
    assert_eq!(info.domain, ERROR_DOMAIN);
    info.reason
}

async fn new_db<D: TestDb>() -> D {
    tokio::task::spawn_blocking(D::new).await.expect("create the database")
}

async fn order_count<D: TestDb>(db: &D) -> i64 {
    let mut conn = db.conn();
    tokio::task::block_in_place(|| D::order_count(&mut conn))
}

async fn a_first_call_executes_and_its_retry_replays_it_marked<D: TestDb>() {
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    let mut client = server.client().await;

    let first = call(&mut client, PLACE, "alice", Some("o-1"), book())
        .await
        .expect("placed");
    assert_eq!(replayed(&first), None);
    let retry = call(&mut client, PLACE, "alice", Some("o-1"), book())
        .await
        .expect("replayed");
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_replay_names_the_request_that_executed_by_its_id<D: TestDb>() {
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    let mut client = server.client().await;
    let original = |response: &Response<Order>| {
        response
            .metadata()
            .get("original-request")
            .map(|value| value.to_str().expect("ASCII").to_owned())
    };
    let sent = |id: &'static str| [("x-request-id", id)];

    let first = call_with(&mut client, (PLACE, "alice", Some("o-1")), &sent("req-1"), book())
        .await
        .expect("placed");
    assert_eq!(original(&first), None);
    let retry = call_with(&mut client, (PLACE, "alice", Some("o-1")), &sent("req-2"), book())
        .await
        .expect("replayed");
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(original(&retry).as_deref(), Some("req-1"));
    // An id the record cannot keep (two entries, a space) is left out,
    // and the call goes on.
    for (key, entries) in [
        ("o-2", vec![("x-request-id", "a"), ("x-request-id", "b")]),
        ("o-3", vec![("x-request-id", "req 3")]),
    ] {
        call_with(&mut client, (PLACE, "alice", Some(key)), &entries, book())
            .await
            .expect("placed");
        let retry = call(&mut client, PLACE, "alice", Some(key), book())
            .await
            .expect("replayed");
        assert_eq!(original(&retry), None, "{key}");
    }
    assert_eq!(server.calls(), 3);
}

/// Eight requests with one key and an id each, released at once: one
/// executes, and every other waits for it and is told its id, whichever
/// of them reached the database first.
async fn racing_requests_with_ids_of_their_own_are_all_told_the_one_that_executed<D: TestDb>() {
    const RACERS: usize = 8;
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    // Unique: PostgreSQL's key locks span every schema of the database.
    let key = crate::common::unique_name("race");
    let start = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut racers = Vec::new();
    for racer in 0..RACERS {
        let (mut client, start, key) = (server.client().await, start.clone(), key.clone());
        racers.push(tokio::spawn(async move {
            let id = format!("req-{racer}");
            start.wait().await;
            let answered = call_with(
                &mut client,
                (PLACE, "alice", Some(&key)),
                &[("x-request-id", &id)],
                book(),
            )
            .await;
            (id, answered.expect("answered"))
        }));
    }
    let mut executed = Vec::new();
    let mut told = Vec::new();
    for racer in racers {
        let (id, response) = racer.await.expect("the racer's task");
        match replayed(&response) {
            None => executed.push(id),
            Some(_) => told.push(
                response
                    .metadata()
                    .get("original-request")
                    .map(|value| value.to_str().expect("ASCII").to_owned()),
            ),
        }
    }
    assert_eq!(executed.len(), 1, "one request executed: {executed:?}");
    assert_eq!(told, vec![Some(executed[0].clone()); RACERS - 1]);
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_request_id_field_is_the_key_as_aip_155_has_it<D: TestDb>() {
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    let mut client = server.client().await;
    let order = PlaceOrder {
        request_id: "9f0c3a52-6c1e-4f1b-9d1a-2a4b1c9e7d31".into(),
        ..book()
    };

    let first = call(&mut client, PLACE_BY_ID, "alice", None, order.clone())
        .await
        .expect("placed");
    assert_eq!(replayed(&first), None);
    let retry = call(&mut client, PLACE_BY_ID, "alice", None, order)
        .await
        .expect("replayed");
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.get_ref(), first.get_ref());

    let another = PlaceOrder {
        request_id: "0b6e2d8c-0a7f-4c52-8f3e-5a1d9c7b4e20".into(),
        ..book()
    };
    let second = call(&mut client, PLACE_BY_ID, "alice", None, another)
        .await
        .expect("placed");
    assert_eq!(replayed(&second), None);
    assert_ne!(second.get_ref().id, first.get_ref().id);
    assert_eq!(server.calls(), 2);
}

async fn another_request_method_or_principal_with_the_key_is_failed_precondition<D: TestDb>() {
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    let mut client = server.client().await;
    call(&mut client, PLACE, "alice", Some("o-1"), book())
        .await
        .expect("placed");

    let mut refusals = Vec::new();
    let pen = PlaceOrder {
        item: "pen".into(),
        ..book()
    };
    refusals.push(call(&mut client, PLACE, "alice", Some("o-1"), pen).await);
    // The same key and message at another method.
    let by_id = PlaceOrder {
        request_id: "o-1".into(),
        ..book()
    };
    refusals.push(call(&mut client, PLACE_BY_ID, "alice", None, by_id).await);
    // Another member of the shop.
    refusals.push(call(&mut client, PLACE, "bob", Some("o-1"), book()).await);
    for refused in refusals {
        let status = refused.expect_err("refused");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(reason(&status), "IDEMPOTENCY_KEY_REUSED");
        assert!(!status.message().contains("o-1"), "no key in the message");
    }
    assert_eq!(server.calls(), 1);
    assert_eq!(order_count(&db).await, 1);
}

async fn a_call_in_progress_runs_once_and_its_duplicate_is_aborted_with_a_retry_delay<D: TestDb>() {
    let db = new_db::<D>().await;
    let held = Arc::new(Barrier::new(2));
    // The duplicate is answered at once rather than after a wait.
    let server = Server::start(&db, Config::default().in_flight(InFlight::Reject), Some(held.clone()));
    let mut first_client = server.client().await;
    let first = tokio::spawn(async move { call(&mut first_client, PLACE, "alice", Some("o-2"), book()).await });
    let meet = || {
        let held = held.clone();
        tokio::task::spawn_blocking(move || {
            held.wait();
        })
    };
    meet().await.expect("the first call entered its operation");

    let mut client = server.client().await;
    let duplicate = call(&mut client, PLACE, "alice", Some("o-2"), book())
        .await
        .expect_err("refused while in progress");
    assert_eq!(duplicate.code(), Code::Aborted, "{duplicate:?}");
    assert_eq!(reason(&duplicate), "IDEMPOTENCY_KEY_IN_PROGRESS");
    let retry_info = duplicate.get_details_retry_info().expect("a RetryInfo");
    assert_eq!(retry_info.retry_delay, Some(Duration::from_secs(1)));

    meet().await.expect("the first call goes on");
    let first = first.await.expect("the first call's task").expect("placed");
    assert_eq!(server.calls(), 1, "the operation ran once");
    let retry = call(&mut client, PLACE, "alice", Some("o-2"), book())
        .await
        .expect("replayed");
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(order_count(&db).await, 1);
}

async fn a_missing_or_invalid_key_is_invalid_argument_and_runs_nothing<D: TestDb>() {
    let db = new_db::<D>().await;
    let server = Server::start(&db, Config::default(), None);
    let mut client = server.client().await;

    let missing = call(&mut client, PLACE, "alice", None, book())
        .await
        .expect_err("refused");
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(reason(&missing), "IDEMPOTENCY_KEY_MISSING");
    let no_request_id = call(&mut client, PLACE_BY_ID, "alice", None, book())
        .await
        .expect_err("refused");
    assert_eq!(no_request_id.code(), Code::InvalidArgument);
    assert_eq!(reason(&no_request_id), "IDEMPOTENCY_KEY_MISSING");

    // A space, a card number, and a key beyond the default 255 bytes.
    let long = "k".repeat(256);
    for invalid in ["two words", "4111111111111111", long.as_str()] {
        let refused = call(&mut client, PLACE, "alice", Some(invalid), book())
            .await
            .expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{invalid}: {refused:?}");
        assert_eq!(reason(&refused), "IDEMPOTENCY_KEY_INVALID");
    }
    // Two entries.
    let mut request = Request::new(book());
    request
        .metadata_mut()
        .insert("authorization", "Bearer alice".parse().expect("ASCII"));
    request
        .metadata_mut()
        .append("idempotency-key", "a-1".parse().expect("ASCII"));
    request
        .metadata_mut()
        .append("idempotency-key", "a-2".parse().expect("ASCII"));
    client.ready().await.expect("ready");
    let two = client
        .unary::<_, Order, _>(request, PathAndQuery::from_static(PLACE), ProstCodec::default())
        .await
        .expect_err("refused");
    assert_eq!(two.code(), Code::InvalidArgument);
    assert_eq!(reason(&two), "IDEMPOTENCY_KEY_INVALID");

    assert_eq!(server.calls(), 0);
    assert_eq!(order_count(&db).await, 0);
}

/// A key that can never succeed is answered before a connection is
/// checked out: not after the pool's timeout, and not as `UNAVAILABLE`,
/// which would tell the client to retry it.
async fn an_invalid_key_is_refused_at_once_while_the_pool_is_exhausted<D: TestDb>() {
    let db = new_db::<D>().await;
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(crate::common::wait::PATIENCE)
        .build(ConnectionManager::<D::Conn>::new(db.url()))
        .expect("a pool of one connection");
    let held = tokio::task::block_in_place(|| pool.get().expect("the pool's one connection"));
    let server = Server::<D>::start_on(pool, Config::default(), None);
    let mut client = server.client().await;

    let refused = tokio::time::timeout(
        crate::common::wait::PATIENCE / 2,
        call(&mut client, PLACE, "alice", Some("two words"), book()),
    )
    .await
    .expect("answered before the pool's timeout")
    .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(reason(&refused), "IDEMPOTENCY_KEY_INVALID");
    assert_eq!(server.calls(), 0);
    drop(held);
}

/// The client goes away while its operation runs: the server drops the
/// call's handler, the operation goes on and commits, and the retry on a
/// new connection gets its result.
async fn a_client_that_drops_its_connection_mid_call_gets_the_first_result_on_retry<D: TestDb>() {
    let db = new_db::<D>().await;
    let held = Arc::new(Barrier::new(2));
    let server = Server::start(&db, Config::default(), Some(held.clone()));
    let meet = || {
        let held = held.clone();
        tokio::task::spawn_blocking(move || {
            held.wait();
        })
    };

    // The client and its connection live in this task alone.
    let mut gone_client = server.client().await;
    let gone = tokio::spawn(async move { call(&mut gone_client, PLACE, "alice", Some("o-3"), book()).await });
    meet().await.expect("the first call entered its operation");
    gone.abort();
    assert!(gone.await.expect_err("cancelled").is_cancelled());
    // The handler ends before its operation does: it was dropped.
    tokio::time::timeout(crate::common::wait::PATIENCE, server.state.handler_ended.notified())
        .await
        .expect("the server drops the call of the client that went away");
    meet().await.expect("the operation goes on");

    let mut client = server.client().await;
    let retry = call(&mut client, PLACE, "alice", Some("o-3"), book())
        .await
        .expect("replayed");
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.get_ref().item, "book");
    assert_eq!(server.calls(), 1, "the operation ran once");
    assert_eq!(order_count(&db).await, 1);
}

/// `grpc::run_async` on each backend's diesel-async connection, in the
/// handler's own future, served and called over real TCP as above. A
/// service's future must be `Send`, which the compiler proves only for a
/// concrete connection: each backend gets its module from one macro.
#[cfg(feature = "diesel-async")]
mod asynchronous {
    macro_rules! async_grpc_tests {
        ($backend:ident, $db:ty, $conn:ty) => {
            mod $backend {
                use super::super::*;
                use crate::common::asynchronous::AsyncDb;

                type Db = $db;
                type Conn = $conn;

                struct AsyncState {
                    db: Db,
                    calls: AtomicUsize,
                    /// Awaited by the first operation, which the test never
                    /// lets go: it waits there until its client goes away.
                    hold_first: Option<Arc<tokio::sync::Barrier>>,
                    handler_ended: Notify,
                }

                #[derive(Clone)]
                struct AsyncShop(Arc<AsyncState>);

                impl NamedService for AsyncShop {
                    const NAME: &'static str = "shop.Orders";
                }

                impl tower::Service<http::Request<Body>> for AsyncShop {
                    type Response = http::Response<Body>;
                    type Error = Infallible;
                    type Future = BoxFuture<Result<Self::Response, Infallible>>;

                    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                        Poll::Ready(Ok(()))
                    }

                    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
                        if req.uri().path() != PLACE {
                            return Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) });
                        }
                        let place = AsyncPlace(self.0.clone());
                        Box::pin(async move { Ok(Grpc::new(ProstCodec::default()).unary(place, req).await) })
                    }
                }

                struct AsyncPlace(Arc<AsyncState>);

                /// Tells the state when the handler ends, done or dropped.
                struct AsyncEnding(Arc<AsyncState>);

                impl Drop for AsyncEnding {
                    fn drop(&mut self) {
                        self.0.handler_ended.notify_one();
                    }
                }

                impl UnaryService<PlaceOrder> for AsyncPlace {
                    type Response = Order;
                    type Future = BoxFuture<Result<Response<Order>, Status>>;

                    fn call(&mut self, request: Request<PlaceOrder>) -> Self::Future {
                        let state = self.0.clone();
                        Box::pin(async move {
                            let _ending = AsyncEnding(state.clone());
                            let key = GrpcKey::from_metadata(request.metadata(), PLACE, "shop-1")?;
                            // A connection of the call's own; a pool lends one the same way.
                            let mut conn = state.db.connect().await;
                            grpc::run_async(
                                &mut conn,
                                &Config::default(),
                                &key,
                                request.into_inner(),
                                async |conn: &mut Conn, order: &PlaceOrder| {
                                    let first = state.calls.fetch_add(1, Ordering::SeqCst) == 0;
                                    <Db as AsyncDb>::insert_order(conn, &order.item)
                                        .await
                                        .map_err(|_| Status::internal("the order was not placed"))?;
                                    if let Some(barrier) = state.hold_first.as_ref().filter(|_| first) {
                                        // Entered, its order written in the transaction.
                                        barrier.wait().await;
                                        std::future::pending::<()>().await;
                                    }
                                    Ok::<_, Status>(Order {
                                        id: 0,
                                        item: order.item.clone(),
                                    })
                                },
                            )
                            .await
                        })
                    }
                }

                /// The shop on `db`, served on a free port until the runtime ends.
                async fn serve(db: Db, hold_first: Option<Arc<tokio::sync::Barrier>>) -> (Arc<AsyncState>, SocketAddr) {
                    let state = Arc::new(AsyncState {
                        db,
                        calls: AtomicUsize::new(0),
                        hold_first,
                        handler_ended: Notify::new(),
                    });
                    let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind a free port");
                    let addr = incoming.local_addr().expect("the bound address");
                    let router = tonic::transport::Server::builder().add_service(AsyncShop(state.clone()));
                    tokio::spawn(async move {
                        router.serve_with_incoming(incoming).await.expect("serve");
                    });
                    (state, addr)
                }

                async fn client(addr: SocketAddr) -> tonic::client::Grpc<Channel> {
                    let channel = Channel::from_shared(format!("http://{addr}"))
                        .expect("a valid address")
                        .connect()
                        .await
                        .expect("connect");
                    tonic::client::Grpc::new(channel)
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn an_async_call_executes_once_and_its_retry_replays_it_marked() {
                    let (state, addr) = serve(new_db::<Db>().await, None).await;
                    let mut client = client(addr).await;

                    let first = call(&mut client, PLACE, "alice", Some("o-1"), book())
                        .await
                        .expect("placed");
                    assert_eq!(replayed(&first), None);
                    let retry = call(&mut client, PLACE, "alice", Some("o-1"), book())
                        .await
                        .expect("replayed");
                    assert_eq!(replayed(&retry), Some("true"));
                    assert_eq!(retry.get_ref(), first.get_ref());
                    let pen = PlaceOrder {
                        item: "pen".into(),
                        ..book()
                    };
                    let refused = call(&mut client, PLACE, "alice", Some("o-1"), pen)
                        .await
                        .expect_err("refused");
                    assert_eq!(refused.code(), Code::FailedPrecondition);
                    assert_eq!(reason(&refused), "IDEMPOTENCY_KEY_REUSED");
                    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
                    assert_eq!(order_count(&state.db).await, 1);
                }

                /// tonic drops the handler of a client that went away; the
                /// async call in it rolls back as a whole, its order with
                /// it, and the retry with the key executes, once.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn an_async_call_whose_client_drops_it_rolls_back_and_its_retry_executes() {
                    let held = Arc::new(tokio::sync::Barrier::new(2));
                    let (state, addr) = serve(new_db::<Db>().await, Some(held.clone())).await;

                    let mut gone_client = client(addr).await;
                    let gone =
                        tokio::spawn(async move { call(&mut gone_client, PLACE, "alice", Some("o-2"), book()).await });
                    held.wait().await;
                    gone.abort();
                    assert!(gone.await.expect_err("cancelled").is_cancelled());
                    tokio::time::timeout(crate::common::wait::PATIENCE, state.handler_ended.notified())
                        .await
                        .expect("the server drops the call of the client that went away");

                    let mut client = client(addr).await;
                    let retry = call(&mut client, PLACE, "alice", Some("o-2"), book())
                        .await
                        .expect("placed");
                    assert_eq!(
                        replayed(&retry),
                        None,
                        "the dropped call committed nothing to replay"
                    );
                    assert_eq!(state.calls.load(Ordering::SeqCst), 2);
                    assert_eq!(
                        order_count(&state.db).await,
                        1,
                        "the dropped call's order rolled back"
                    );
                }
            }
        };
    }

    async_grpc_tests!(
        sqlite,
        crate::common::sqlite::Db,
        diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>
    );
    #[cfg(feature = "postgres")]
    async_grpc_tests!(postgres, crate::common::pg::Db, diesel_async::AsyncPgConnection);
    #[cfg(feature = "mysql")]
    async_grpc_tests!(mysql, crate::common::mysql::Db, diesel_async::AsyncMysqlConnection);
}
