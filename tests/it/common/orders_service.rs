//! The order service the HTTP tests serve in this process: `POST /orders`
//! on `idempotency::http::run`, `GET /orders` and `GET /orders/{id}`, on a
//! pool of the test's database. It answers as `examples/http_orders` does
//! where the tests look (bearer-token accounts as scopes, RFC 9457
//! problems, orders refused by rule before any database work, 503 with
//! `Retry-After` when no connection is free, read timeouts), and has what
//! the example has not: a hook inside the order's transaction.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::http::{
    self, Answer, Caller, Failure, IdempotencyKey, Problem, ProblemKind, Problems, StoredResponse,
};
use idempotency::{Config, InFlight};
use serde::{Deserialize, Serialize};

use super::TestDb;

/// Where the service's problems are documented.
const PROBLEMS: &str = "https://orders.example/problems/";

/// The longest `item` of an order, in characters: one that every backend
/// stores, so that every backend gives the same answer.
pub const MAX_ITEM_CHARS: usize = 1_000;

/// How long a request waits for a pooled connection by default.
const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(2);

/// What the service can be told besides its database.
#[derive(Clone)]
pub struct Settings {
    /// What a request does while another holds its key.
    pub in_flight: InFlight,
    /// How long a request waits for a pooled connection.
    pub checkout_timeout: Duration,
    /// Called inside an order's transaction after the order is written,
    /// before the commit.
    pub before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            in_flight: InFlight::default(),
            checkout_timeout: CHECKOUT_TIMEOUT,
            before_commit: None,
        }
    }
}

/// The read timeouts the server cuts stalled clients off with.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a client has to send a request's head.
    pub header_read_timeout: Duration,
    /// How long a request body may stall between two reads.
    pub body_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
        }
    }
}

/// A problem of this API.
fn problem(status: StatusCode, name: &str, title: &str) -> Problem {
    Problem::new(status, title).with_type(format!("{PROBLEMS}{name}"))
}

fn internal_error() -> Problem {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal-error",
        "Internal server error",
    )
}

/// The account a bearer token names: what precedes its first `.`, so that
/// a rotated token (`acct-1.v2`) is the same account. Its id is the scope of
/// its keys and the owner of its orders.
#[derive(Debug, Clone)]
pub struct Account(String);

impl<S: Sync> FromRequestParts<S> for Account {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
        let token = match (values.next(), values.next()) {
            (Some(value), None) => value.to_str().ok().and_then(|value| {
                let (scheme, token) = value.split_once(' ')?;
                let token = token.trim_start_matches(' ');
                (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
            }),
            _ => None,
        };
        let account = token
            .filter(|token| token.bytes().all(|b| b.is_ascii_graphic()))
            .map(|token| token.split_once('.').map_or(token, |(account, _)| account))
            .filter(|account| !account.is_empty() && account.len() <= 255);
        match account {
            Some(account) => Ok(Account(account.to_owned())),
            None => {
                let problem = problem(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized");
                Err(([(header::WWW_AUTHENTICATE, "Bearer")], problem).into_response())
            }
        }
    }
}

impl Caller for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// The JSON body of a request, with problems that never quote it.
struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(body)) => Ok(Body(body)),
            Err(rejection) if stalled(&rejection) => Err(problem(
                StatusCode::REQUEST_TIMEOUT,
                "body-timeout",
                "Request body timed out",
            )),
            Err(rejection) => {
                let detail = match &rejection {
                    JsonRejection::JsonDataError(_) => "the body does not have the expected fields and types",
                    JsonRejection::JsonSyntaxError(_) => "the body is not valid JSON",
                    _ => "the body could not be read",
                };
                Err(problem(rejection.status(), "invalid-body", "Invalid request body").with_detail(detail))
            }
        }
    }
}

/// Whether `error` comes from a body that stalled past its read timeout.
fn stalled(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source())
        .any(|error| error.is::<tower_http::timeout::TimeoutError>())
}

/// The body of `POST /orders`; unknown fields are refused, as they would
/// not be part of the fingerprint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    item: String,
    quantity: i32,
}

impl NewOrder {
    /// Why no backend may store the order, found before any database work.
    fn refusal(&self) -> Option<&'static str> {
        if self.quantity < 1 {
            Some("quantity must be at least 1")
        } else if self.item.contains('\0') {
            Some("item must not contain U+0000 (NUL)")
        } else if self.item.chars().count() > MAX_ITEM_CHARS {
            Some("item must be at most 1000 characters long")
        } else {
            None
        }
    }
}

/// An order as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: i64,
    item: String,
    quantity: i32,
}

/// Why an order was not placed.
#[derive(Debug)]
enum OrderError {
    Invalid(&'static str),
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for OrderError {
    fn from(error: diesel::result::Error) -> Self {
        OrderError::Database(error)
    }
}

impl IntoResponse for OrderError {
    fn into_response(self) -> Response {
        match self {
            OrderError::Invalid(detail) => problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-order", "Invalid order")
                .with_detail(detail)
                .into_response(),
            OrderError::Database(_) => internal_error().into_response(),
        }
    }
}

/// What every handler shares.
struct App<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    config: Config,
    before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl<D: TestDb> Clone for App<D> {
    fn clone(&self) -> Self {
        App {
            pool: self.pool.clone(),
            config: self.config.clone(),
            before_commit: self.before_commit.clone(),
        }
    }
}

async fn place_order<D: TestDb>(
    State(app): State<App<D>>,
    key: IdempotencyKey<Account>,
    Body(order): Body<NewOrder>,
) -> Result<Answer<StoredResponse<Order>>, Failure<OrderError>> {
    if let Some(detail) = order.refusal() {
        return Err(Failure::Operation(OrderError::Invalid(detail)));
    }
    let account = key.caller().0.clone();
    let before_commit = app.before_commit.clone();
    http::run(&app.pool, &app.config, &key, order, move |conn, order| {
        let id = D::place_account_order(conn, &account, &order.item, order.quantity)?;
        if let Some(hook) = &before_commit {
            hook();
        }
        let placed = Order {
            id,
            item: order.item.clone(),
            quantity: order.quantity,
        };
        let location = HeaderValue::try_from(format!("/orders/{id}")).expect("a path of digits");
        Ok(StoredResponse::new(StatusCode::CREATED, placed).with_header(header::LOCATION, location))
    })
    .await
}

/// The orders of `account`, on a pooled connection off the runtime; 503
/// with `Retry-After` when no connection is free in time.
async fn orders_of<D: TestDb>(app: &App<D>, account: Account) -> Result<Vec<Order>, Problem> {
    let pool = app.pool.clone();
    let read = tokio::task::spawn_blocking(move || {
        let Ok(mut conn) = pool.get() else {
            return Err(Problems::documented_at(PROBLEMS).problem(ProblemKind::Unavailable));
        };
        D::account_orders(&mut conn, &account.0).map_err(|_| internal_error())
    });
    let orders = read.await.map_err(|_| internal_error())??;
    Ok(orders
        .into_iter()
        .map(|(id, item, quantity)| Order { id, item, quantity })
        .collect())
}

async fn get_order<D: TestDb>(
    State(app): State<App<D>>,
    account: Account,
    Path(id): Path<String>,
) -> Result<Json<Order>, Problem> {
    let not_found = || problem(StatusCode::NOT_FOUND, "order-not-found", "Order not found");
    let id: i64 = id.parse().map_err(|_| not_found())?;
    let orders = orders_of(&app, account).await?;
    orders
        .into_iter()
        .find(|order| order.id == id)
        .map(Json)
        .ok_or_else(not_found)
}

async fn list_orders<D: TestDb>(State(app): State<App<D>>, account: Account) -> Result<Json<Vec<Order>>, Problem> {
    orders_of(&app, account).await.map(Json)
}

/// The pool the service opens on `db`. SQLite connections wait for the
/// write lock outside idempotent calls and make every commit durable.
pub(super) fn pool<D: TestDb>(db: &D, settings: &Settings) -> Pool<ConnectionManager<D::Conn>> {
    let builder = Pool::builder().connection_timeout(settings.checkout_timeout);
    let builder = if D::BACKEND == "sqlite" {
        builder.max_size(8).connection_customizer(Box::new(Setup(
            "PRAGMA busy_timeout = 5000; PRAGMA synchronous = FULL;",
        )))
    } else {
        builder.max_size(16)
    };
    builder
        .build(ConnectionManager::new(db.url()))
        .expect("open the service's database")
}

/// What every connection of the pool runs first.
#[derive(Debug)]
struct Setup(&'static str);

impl<C: SimpleConnection> diesel::r2d2::CustomizeConnection<C, diesel::r2d2::Error> for Setup {
    fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(self.0).map_err(diesel::r2d2::Error::QueryError)
    }
}

/// The service's routes on `pool`, whose database it sets up: its orders
/// table and the crate's migrations.
pub(super) fn router<D: TestDb>(pool: Pool<ConnectionManager<D::Conn>>, settings: Settings) -> Router {
    let mut conn = pool.get().expect("connect to the service's database");
    conn.batch_execute(D::SERVICE_SETUP).expect("create the orders table");
    idempotency::run_migrations(&mut *conn).expect("apply the idempotency migrations");
    drop(conn);
    let app = App::<D> {
        pool,
        config: Config::default().in_flight(settings.in_flight),
        before_commit: settings.before_commit,
    };
    Router::new()
        .route("/orders", get(list_orders::<D>).post(place_order::<D>))
        .route("/orders/{id}", get(get_order::<D>))
        .layer(Extension(Problems::documented_at(PROBLEMS)))
        .with_state(app)
}

/// Serves `router` on `listener` within `limits` until `stop` resolves:
/// HTTP/1.1 with a header read timeout, and bodies with a read timeout.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.body_read_timeout,
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut stop = std::pin::pin!(stop);
    loop {
        let stream = tokio::select! {
            () = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let router = router.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            tower::ServiceExt::oneshot(router.clone(), request)
        });
        let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
}
