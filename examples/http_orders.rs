//! An order service over HTTP, on `idempotency::http`: a client that lost
//! the response to `POST /orders` retries it with the same
//! `Idempotency-Key` and gets the first response back, and no second order
//! is placed.
//!
//! ```text
//! cargo run --example http_orders --features axum -- --addr 127.0.0.1:8080 [--database orders.db] [--in-flight-wait MS]
//! cargo run --example http_orders --features axum,postgres -- --database postgres://localhost/orders
//! cargo run --example http_orders --features axum,mysql -- --database mysql://root@127.0.0.1:3306/orders
//! ```
//!
//! | request | answer |
//! | --- | --- |
//! | `POST /orders` with `Authorization: Bearer <token>`, `Idempotency-Key` and `{"item": string, "quantity": integer}` | `201 Created`, `Location: /orders/{id}`, `{"id", "item", "quantity"}` |
//! | `GET /orders/{id}` | the account's order, or 404 |
//! | `GET /orders` | the account's orders |
//!
//! The bearer token stands in for a signed credential that names its
//! account, as a verified token's subject does: `acct-42`, or
//! `acct-42.<anything>` after a rotation. The account id, never the token,
//! is the scope of the account's idempotency keys and the owner of its
//! orders, so a retry sent with a rotated token still replays. Errors are
//! RFC 9457 problems. An order needs a quantity of at least 1 and an item of at most
//! 1,000 characters without U+0000; what breaks a rule is refused (422)
//! before any database work, so that every backend gives the same answer.
//! Every route answers 503 with `Retry-After` when no database connection
//! is free within 2 s.
//!
//! The server guards itself against clients that hold connections: a
//! request head must arrive within 10 s (also the idle timeout between
//! requests), a body must not stall for 10 s, and at the connection limit
//! (1,024, or fewer under a lower open-file limit) a new connection takes
//! the place of the one idle the longest. Errors are logged to stderr with
//! their causes, never with a body.
//!
//! When ready the service prints one line to stdout,
//! `listening on http://HOST:PORT`; Ctrl-C or SIGTERM stop it after the
//! requests in progress. A background thread purges expired keys.

use std::borrow::Cow;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use anyhow::Context;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, R2D2Connection};
use idempotency::http::{
    self, Answer, Caller, Failure, IdempotencyKey, Problem, ProblemKind, Problems, StoredResponse,
};
use idempotency::{Config, InFlight, StoreConnection};
use serde::{Deserialize, Serialize};

diesel::table! {
    orders (id) {
        id -> BigInt,
        account -> Text,
        item -> Text,
        quantity -> Integer,
    }
}

/// Where the problems of this API are documented: each `type` is this
/// followed by the problem's name.
const PROBLEMS: &str = "https://orders.example/problems/";

/// How long a request waits for a pooled connection; then it is answered
/// 503 with `Retry-After`. A transaction here takes milliseconds, so a
/// request that finds no connection free for 2 s meets a database that is
/// overloaded or gone, and the client is better told at once when to come
/// back than held for r2d2's default of 30 s, longer than many clients and
/// proxies wait for a whole response.
pub const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the background thread purges expired keys.
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// The longest `item` of an order, in characters. The same request must
/// get the same answer on every backend, so the bound is one that all of
/// them store: MariaDB's `TEXT`, the tightest, holds 65,535 bytes, and
/// 1,000 characters take at most 4,000 bytes of UTF-8.
pub const MAX_ITEM_CHARS: usize = 1_000;

/// What an order with a longer item is told.
const ITEM_TOO_LONG: &str = "item must be at most 1000 characters long";

/// The body of `POST /orders`. Unknown fields are refused rather than
/// ignored: an ignored field would not be part of the fingerprint, and a
/// retry that changed it would replay instead of being told it differs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    pub item: String,
    pub quantity: i32,
}

impl NewOrder {
    /// Why the order cannot be placed, if it cannot. Checked before any
    /// database work, so that a request that can never succeed is refused
    /// even while every connection is busy, with the same answer on every
    /// backend: PostgreSQL's text cannot hold U+0000, which the others
    /// store, so no backend gets it.
    pub fn refusal(&self) -> Option<&'static str> {
        if self.quantity < 1 {
            Some("quantity must be at least 1")
        } else if self.item.contains('\0') {
            Some("item must not contain U+0000 (NUL)")
        } else if self.item.chars().count() > MAX_ITEM_CHARS {
            Some(ITEM_TOO_LONG)
        } else {
            None
        }
    }
}

/// An order as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Queryable)]
pub struct Order {
    pub id: i64,
    pub item: String,
    pub quantity: i32,
}

/// The order table's statements on each backend.
pub trait OrderStore: StoreConnection<Raw = Self> + R2D2Connection + Send + 'static {
    /// Creates the orders table if it is missing.
    fn create_orders_table(&mut self) -> QueryResult<()>;

    /// Inserts an order of `account`.
    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order>;

    /// The order `id` if it belongs to `account`.
    fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>>;

    /// The orders of `account`, oldest first.
    fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>>;
}

/// The values of a new order's row.
macro_rules! new_order {
    ($account:expr, $order:expr) => {
        (
            orders::account.eq($account),
            orders::item.eq(&$order.item),
            orders::quantity.eq($order.quantity),
        )
    };
}

/// diesel's query types are concrete per connection; the bodies are written
/// once here and expanded into each backend's impl. `returning` inserts with
/// `RETURNING`, which MySQL does not have.
macro_rules! order_queries {
    (returning) => {
        fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order> {
            diesel::insert_into(orders::table)
                .values(new_order!(account, order))
                .returning((orders::id, orders::item, orders::quantity))
                .get_result(self)
        }

        order_queries!();
    };
    () => {
        fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>> {
            orders::table
                .filter(orders::id.eq(id).and(orders::account.eq(account)))
                .select((orders::id, orders::item, orders::quantity))
                .first(self)
                .optional()
        }

        fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>> {
            orders::table
                .filter(orders::account.eq(account))
                .order(orders::id)
                .select((orders::id, orders::item, orders::quantity))
                .load(self)
        }
    };
}

impl OrderStore for SqliteConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 account TEXT NOT NULL,
                 item TEXT NOT NULL,
                 quantity INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS orders_account ON orders (account, id);",
        )
    }

    order_queries!(returning);
}

#[cfg(feature = "postgres")]
impl OrderStore for PgConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id BIGSERIAL PRIMARY KEY,
                 account TEXT NOT NULL,
                 item TEXT NOT NULL,
                 quantity INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS orders_account ON orders (account, id);",
        )
    }

    order_queries!(returning);
}

#[cfg(feature = "mysql")]
diesel::define_sql_function! {
    /// The id the last insert on this connection gave its row.
    fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
}

#[cfg(feature = "mysql")]
impl OrderStore for MysqlConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id BIGINT AUTO_INCREMENT PRIMARY KEY,
                 account VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                 item TEXT CHARACTER SET utf8mb4 NOT NULL,
                 quantity INTEGER NOT NULL,
                 INDEX orders_account (account, id)
             )",
        )
    }

    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order> {
        diesel::insert_into(orders::table)
            .values(new_order!(account, order))
            .execute(self)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(self)?;
        orders::table
            .find(i64::try_from(id).map_err(|error| diesel::result::Error::DeserializationError(Box::new(error)))?)
            .select((orders::id, orders::item, orders::quantity))
            .get_result(self)
    }

    order_queries!();
}

/// The authenticated account, by its id: the scope of its idempotency keys
/// and the owner of its orders.
#[derive(Debug, Clone)]
pub struct Account(String);

impl<S: Sync> FromRequestParts<S> for Account {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
        let token = match (values.next(), values.next()) {
            (Some(value), None) => value.to_str().ok().and_then(bearer_token),
            _ => None,
        };
        match token.and_then(account_of) {
            Some(account) => Ok(Account(account.to_owned())),
            None => {
                let problem = problem(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
                    .with_detail("send Authorization: Bearer <account token>");
                Err(([(header::WWW_AUTHENTICATE, "Bearer")], problem).into_response())
            }
        }
    }
}

/// The account a token names: what precedes its first `.`, where a real
/// service would verify the token and read its subject. The part after it
/// changes when the token is rotated; the account does not, and a scope
/// that held the token would make a retry sent with the new one execute
/// again (and store a credential in every key record).
fn account_of(token: &str) -> Option<&str> {
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let account = token.split_once('.').map_or(token, |(account, _)| account);
    // An id the key rules would refuse as a scope is no account of ours.
    (!account.is_empty() && account.len() <= 255).then_some(account)
}

fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

impl Caller for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// A problem of this API.
fn problem(status: StatusCode, name: &str, title: &str) -> Problem {
    Problem::new(status, title).with_type(format!("{PROBLEMS}{name}"))
}

/// The JSON body of a request, with problems for what is wrong with it.
/// They never quote the body: a parser's message would.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(body)) => Ok(Body(body)),
            Err(rejection) if stalled(&rejection) => {
                Err(
                    problem(StatusCode::REQUEST_TIMEOUT, "body-timeout", "Request body timed out")
                        .with_detail("the body stopped arriving; send it again"),
                )
            }
            Err(rejection) => {
                let detail = match &rejection {
                    JsonRejection::JsonDataError(_) => {
                        "the body does not have the expected fields and types: item (string), quantity (integer)"
                    }
                    JsonRejection::JsonSyntaxError(_) => "the body is not valid JSON",
                    JsonRejection::MissingJsonContentType(_) => "send the body as Content-Type: application/json",
                    _ if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => "the body is too large",
                    _ => "the body could not be read",
                };
                Err(problem(rejection.status(), "invalid-body", "Invalid request body").with_detail(detail))
            }
        }
    }
}

/// Whether `error` comes from a body that stopped arriving for longer than
/// the body read timeout of [`serve`].
fn stalled(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        next = error.source();
    }
    false
}

/// Why an order was not placed. Nothing is stored and the key stays free
/// for the corrected request or the retry.
#[derive(Debug)]
pub enum OrderError {
    /// The order breaks a rule ([`NewOrder::refusal`]); found before the
    /// idempotent call.
    Invalid(&'static str),
    /// The operation's statements failed.
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
            OrderError::Database(error) => {
                eprintln!("placing an order failed: {}", causes(&error));
                internal_error().into_response()
            }
        }
    }
}

/// `error` and each of its sources, joined by `: `, so that a log line
/// carries the database's own message and not only the failure it caused.
/// A JSON error is shown by its category and position: its message may
/// quote the body it was reading.
pub fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut next = Some(error);
    while let Some(error) = next {
        if !line.is_empty() {
            line.push_str(": ");
        }
        match error.downcast_ref::<serde_json::Error>() {
            Some(json) => line.push_str(&format!(
                "JSON {:?} error at line {} column {}",
                json.classify(),
                json.line(),
                json.column()
            )),
            None => line.push_str(&error.to_string()),
        }
        next = error.source();
    }
    line
}

/// How the service describes its problems.
fn problems() -> Problems {
    Problems::documented_at(PROBLEMS)
}

fn internal_error() -> Problem {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal-error",
        "Internal server error",
    )
    .with_detail("the server could not complete the request")
}

/// What the service can be told besides its database.
#[derive(Clone)]
pub struct Settings {
    /// What a request does while another holds its key.
    pub in_flight: InFlight,
    /// How long a request waits for a pooled connection
    /// ([`CHECKOUT_TIMEOUT`] unless told otherwise).
    pub checkout_timeout: Duration,
    /// Called inside an order's transaction after the order is written,
    /// before the commit. Tests hold transactions open with it; the
    /// service has none.
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

struct App<C: R2D2Connection + 'static> {
    pool: Pool<ConnectionManager<C>>,
    config: Config,
    before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl<C: R2D2Connection + 'static> Clone for App<C> {
    fn clone(&self) -> Self {
        App {
            pool: self.pool.clone(),
            config: self.config.clone(),
            before_commit: self.before_commit.clone(),
        }
    }
}

async fn place_order<C: OrderStore>(
    State(app): State<App<C>>,
    key: IdempotencyKey<Account>,
    Body(order): Body<NewOrder>,
) -> Result<Answer<StoredResponse<Order>>, Failure<OrderError>> {
    if let Some(detail) = order.refusal() {
        return Err(Failure::Operation(OrderError::Invalid(detail)));
    }
    let account = key.caller().clone();
    let before_commit = app.before_commit.clone();
    let outcome = http::run(&app.pool, &app.config, &key, order, move |conn, order| {
        let placed = conn.insert_order(&account.0, order)?;
        if let Some(hook) = &before_commit {
            hook();
        }
        let location = HeaderValue::try_from(format!("/orders/{}", placed.id)).expect("a path of digits");
        Ok(StoredResponse::new(StatusCode::CREATED, placed).with_header(header::LOCATION, location))
    })
    .await;
    if let Err(Failure::Failed { cause, .. }) = &outcome {
        // The key is a technical identifier and may be logged; the body not.
        eprintln!("POST /orders, key {:?}: {}", key.key(), causes(&**cause));
    }
    outcome
}

/// What went wrong on a read route's blocking thread.
enum ReadFailure {
    Checkout(diesel::r2d2::PoolError),
    Query(diesel::result::Error),
}

/// Runs sync diesel work on the blocking pool with a pooled connection.
/// No connection within the checkout timeout is a 503 with `Retry-After`,
/// as on the idempotent route: the client may retry.
async fn blocking<C, T>(
    pool: &Pool<ConnectionManager<C>>,
    work: impl FnOnce(&mut C) -> QueryResult<T> + Send + 'static,
) -> Result<T, Problem>
where
    C: R2D2Connection + 'static,
    T: Send + 'static,
{
    let pool = pool.clone();
    let task = tokio::task::spawn_blocking(move || {
        let mut conn = pool.get().map_err(ReadFailure::Checkout)?;
        work(&mut conn).map_err(ReadFailure::Query)
    });
    match task.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(ReadFailure::Checkout(error))) => {
            eprintln!("reading orders: no connection: {}", causes(&error));
            Err(problems()
                .problem(ProblemKind::Unavailable)
                .with_detail("the server is busy; retry later"))
        }
        Ok(Err(ReadFailure::Query(error))) => {
            eprintln!("reading orders failed: {}", causes(&error));
            Err(internal_error())
        }
        Err(error) => {
            eprintln!("reading orders failed: {}", causes(&error));
            Err(internal_error())
        }
    }
}

async fn get_order<C: OrderStore>(
    State(app): State<App<C>>,
    account: Account,
    Path(id): Path<String>,
) -> Result<Json<Order>, Problem> {
    let not_found = || problem(StatusCode::NOT_FOUND, "order-not-found", "Order not found");
    let id: i64 = id.parse().map_err(|_| not_found())?;
    let order = blocking(&app.pool, move |conn| conn.find_order(&account.0, id)).await?;
    order.map(Json).ok_or_else(not_found)
}

async fn list_orders<C: OrderStore>(State(app): State<App<C>>, account: Account) -> Result<Json<Vec<Order>>, Problem> {
    let orders = blocking(&app.pool, move |conn| conn.list_orders(&account.0)).await?;
    Ok(Json(orders))
}

/// The service on one database: its routes, and the purge of expired keys
/// for a background thread.
pub struct Service {
    pub router: Router,
    purge: Box<dyn Fn() -> anyhow::Result<usize> + Send + Sync>,
}

impl Service {
    /// Deletes the expired keys; returns how many.
    ///
    /// # Errors
    ///
    /// When no connection is free or the purge fails.
    pub fn purge_expired(&self) -> anyhow::Result<usize> {
        (self.purge)()
    }
}

/// The service on `pool`: creates the orders table and applies the
/// idempotency migrations.
///
/// # Errors
///
/// When the database cannot be prepared.
pub fn service_on<C: OrderStore>(pool: Pool<ConnectionManager<C>>, settings: Settings) -> anyhow::Result<Service> {
    let mut conn = pool.get().context("connect to the database")?;
    conn.create_orders_table().context("create the orders table")?;
    idempotency::run_migrations(&mut *conn)
        .map_err(|error| anyhow::anyhow!("{error}"))
        .context("apply the idempotency migrations")?;
    drop(conn);

    let config = Config::default().in_flight(settings.in_flight);
    let app = App {
        pool: pool.clone(),
        config: config.clone(),
        before_commit: settings.before_commit,
    };
    let router = Router::new()
        .route("/orders", get(list_orders::<C>).post(place_order::<C>))
        .route("/orders/{id}", get(get_order::<C>))
        .layer(Extension(problems()))
        .with_state(app);
    let purge = move || {
        let mut conn = pool.get()?;
        Ok(config.purge_expired(&mut *conn, 500)?)
    };
    Ok(Service {
        router,
        purge: Box::new(purge),
    })
}

/// SQLite connections: wait up to 5 s for the write lock outside
/// idempotent calls (which set their own wait), and make every commit
/// durable.
#[derive(Debug)]
struct SqliteSetup;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqliteSetup {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 5000; PRAGMA synchronous = FULL;")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// The connection pool of a database of any backend.
pub enum Database {
    Sqlite(Pool<ConnectionManager<SqliteConnection>>),
    #[cfg(feature = "postgres")]
    Postgres(Pool<ConnectionManager<PgConnection>>),
    #[cfg(feature = "mysql")]
    Mysql(Pool<ConnectionManager<MysqlConnection>>),
}

/// Opens `database`: a `postgres://` URL (with the `postgres` feature), a
/// `mysql://` URL (with the `mysql` feature) or the path of a SQLite file,
/// created if missing.
///
/// # Errors
///
/// When the database cannot be opened.
pub fn open(database: &str, checkout_timeout: Duration) -> anyhow::Result<Database> {
    if database.starts_with("postgres://") || database.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        {
            let pool = Pool::builder()
                .max_size(16)
                .min_idle(Some(2))
                .connection_timeout(checkout_timeout)
                .build(ConnectionManager::<PgConnection>::new(database))
                .context("connect to PostgreSQL")?;
            return Ok(Database::Postgres(pool));
        }
        #[cfg(not(feature = "postgres"))]
        anyhow::bail!("this build has no PostgreSQL: build with --features axum,postgres");
    }
    if database.starts_with("mysql://") {
        #[cfg(feature = "mysql")]
        {
            let pool = Pool::builder()
                .max_size(16)
                .min_idle(Some(2))
                .connection_timeout(checkout_timeout)
                .build(ConnectionManager::<MysqlConnection>::new(database))
                .context("connect to MySQL")?;
            return Ok(Database::Mysql(pool));
        }
        #[cfg(not(feature = "mysql"))]
        anyhow::bail!("this build has no MySQL: build with --features axum,mysql");
    }
    // WAL: readers, such as replays, do not wait for the writer.
    SqliteConnection::establish(database)
        .with_context(|| format!("open {database}"))?
        .batch_execute("PRAGMA journal_mode = WAL")
        .context("enable WAL")?;
    let pool = Pool::builder()
        .max_size(8)
        .connection_timeout(checkout_timeout)
        .connection_customizer(Box::new(SqliteSetup))
        .build(ConnectionManager::<SqliteConnection>::new(database))
        .with_context(|| format!("open {database}"))?;
    Ok(Database::Sqlite(pool))
}

/// The service on `database`; see [`open`].
///
/// # Errors
///
/// When the database cannot be opened or prepared.
pub fn service(database: &str, settings: Settings) -> anyhow::Result<Service> {
    match open(database, settings.checkout_timeout)? {
        Database::Sqlite(pool) => service_on(pool, settings),
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => service_on(pool, settings),
        #[cfg(feature = "mysql")]
        Database::Mysql(pool) => service_on(pool, settings),
    }
}

/// The command line.
#[derive(Debug)]
pub struct Args {
    pub addr: SocketAddr,
    pub database: String,
    pub in_flight: InFlight,
}

const USAGE: &str =
    "usage: http_orders [--addr HOST:PORT] [--database PATH|postgres://...|mysql://...] [--in-flight-wait MS]";

/// Parses the arguments after the program name.
///
/// # Errors
///
/// A message for an unknown argument or a missing or malformed value.
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
        database: String::from("http_orders.db"),
        in_flight: InFlight::Wait(chrono::Duration::milliseconds(5000)),
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--addr" => parsed.addr = value()?.parse().map_err(|error| format!("--addr: {error}"))?,
            "--database" => parsed.database = value()?,
            "--in-flight-wait" => {
                let millis: u32 = value()?.parse().map_err(|error| format!("--in-flight-wait: {error}"))?;
                parsed.in_flight = match millis {
                    0 => InFlight::Reject,
                    millis => InFlight::Wait(chrono::Duration::milliseconds(millis.into())),
                };
            }
            "--help" | "-h" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(parsed)
}

/// A client has this long to send a request's head, from the moment the
/// server waits for one: on a new connection, and on a kept-alive
/// connection between requests, so it is the idle timeout too. A head is a
/// few hundred bytes that a client sends at once; 10 s tolerates a stalled
/// mobile link and soon frees the slot of a socket that says nothing. A
/// client that finds its kept-alive connection closed retries on a new
/// one, which the Idempotency-Key makes safe for a POST.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A request body may stall this long between two reads; then the request
/// is answered 408. The bodies here are small JSON, sent at once.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The most connections served at once, unless the open-file limit leaves
/// room for fewer.
pub const MAX_CONNECTIONS: usize = 1024;

/// Open files kept free of client connections: the database pool's
/// sockets or SQLite's files (three a connection), the runtime, stdio.
#[cfg(unix)]
const RESERVED_FILES: u64 = 64;

/// How the server protects itself from clients that hold connections
/// without using them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`BODY_READ_TIMEOUT`].
    pub body_read_timeout: Duration,
    /// The most connections served at once. At the limit a new connection
    /// takes the place of the one idle the longest; when none is idle it
    /// waits in the listen queue until one is.
    pub max_connections: usize,
}

impl Limits {
    /// The constants above, with no more connections than the process's
    /// open-file limit leaves room for: a process out of descriptors cannot
    /// accept, nor open a database connection, whoever is waiting.
    pub fn of_this_process() -> Limits {
        Limits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_connections: room_for_connections(),
        }
    }
}

#[cfg(unix)]
fn room_for_connections() -> usize {
    match rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
        Some(files) => usize::try_from(files.saturating_sub(RESERVED_FILES))
            .unwrap_or(MAX_CONNECTIONS)
            .clamp(1, MAX_CONNECTIONS),
        None => MAX_CONNECTIONS,
    }
}

#[cfg(not(unix))]
fn room_for_connections() -> usize {
    MAX_CONNECTIONS
}

/// The connections being served: whether each is in a request, and since
/// when the others have been idle, so that the server can close the one
/// idle the longest when it needs room.
#[derive(Default)]
struct Connections {
    table: std::sync::Mutex<ConnectionTable>,
    /// A request ended or a connection closed.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct ConnectionTable {
    /// Counts accepts and ended requests: the order in which connections
    /// became idle.
    clock: u64,
    open: std::collections::HashMap<u64, Tracked>,
}

struct Tracked {
    requests: usize,
    idle_since: u64,
    closing: bool,
    close: Arc<tokio::sync::Notify>,
}

impl Connections {
    fn table(&self) -> std::sync::MutexGuard<'_, ConnectionTable> {
        // Every change to the table is a single step: a panic elsewhere
        // cannot leave it half done.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn len(&self) -> usize {
        self.table().open.len()
    }

    /// Registers an accepted connection, idle until its first request.
    fn open(self: &Arc<Self>) -> Tracking {
        let close = Arc::new(tokio::sync::Notify::new());
        let mut table = self.table();
        table.clock += 1;
        let id = table.clock;
        let tracked = Tracked {
            requests: 0,
            idle_since: id,
            closing: false,
            close: close.clone(),
        };
        table.open.insert(id, tracked);
        Tracking {
            connections: self.clone(),
            id,
            close,
        }
    }

    /// Asks the connection idle the longest to close, unless one is
    /// closing already. Returns whether one is closing.
    fn make_room(&self) -> bool {
        let mut table = self.table();
        if table.open.values().any(|tracked| tracked.closing) {
            return true;
        }
        let oldest = table
            .open
            .values_mut()
            .filter(|tracked| tracked.requests == 0)
            .min_by_key(|tracked| tracked.idle_since);
        match oldest {
            Some(tracked) => {
                tracked.closing = true;
                tracked.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Asks every connection to close once its request is answered.
    fn close_all(&self) {
        for tracked in self.table().open.values_mut() {
            tracked.closing = true;
            tracked.close.notify_one();
        }
    }
}

/// A connection's entry, removed when the connection's task ends.
struct Tracking {
    connections: Arc<Connections>,
    id: u64,
    close: Arc<tokio::sync::Notify>,
}

impl Tracking {
    /// Marks the connection in a request until the guard is dropped.
    fn request(self: &Arc<Self>) -> InRequest {
        if let Some(tracked) = self.connections.table().open.get_mut(&self.id) {
            tracked.requests += 1;
        }
        InRequest(self.clone())
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        self.connections.table().open.remove(&self.id);
        self.connections.changed.notify_one();
    }
}

struct InRequest(Arc<Tracking>);

impl Drop for InRequest {
    fn drop(&mut self) {
        let connections = &self.0.connections;
        let mut table = connections.table();
        table.clock += 1;
        let now = table.clock;
        if let Some(tracked) = table.open.get_mut(&self.0.id) {
            tracked.requests -= 1;
            tracked.idle_since = now;
        }
        drop(table);
        connections.changed.notify_one();
    }
}

/// How long the accept loop pauses after an error it cannot make room for.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` within `limits` until `shutdown`
/// resolves, then lets the requests in progress finish.
///
/// axum's own `serve` has no header or idle timeout, nor a limit on
/// connections: a client that opens sockets and sends nothing holds them
/// forever, and once the process is out of descriptors no one else is
/// served. Here every connection is HTTP/1.1 with hyper's header read
/// timeout, bodies have a read timeout, and at the connection limit the
/// connection idle the longest makes room for a new one.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.body_read_timeout,
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let connections = Arc::new(Connections::default());
    let mut tasks = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    'accept: loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break 'accept,
            Some(_) = tasks.join_next() => continue,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                // The new connection waits here, unserved, until there is
                // room: while it does, no other is accepted.
                while connections.len() >= limits.max_connections {
                    connections.make_room();
                    tokio::select! {
                        () = &mut shutdown => break 'accept,
                        () = connections.changed.notified() => {}
                    }
                }
                let tracking = Arc::new(connections.open());
                tasks.spawn(serve_connection(stream, router.clone(), http.clone(), tracking));
            }
            // Out of descriptors or memory: a connection closed gives some
            // back. Other errors concern one connection that never was.
            Err(error) => {
                eprintln!("accepting a connection failed: {}", causes(&error));
                if connections.make_room() {
                    let _ = tokio::time::timeout(ACCEPT_BACKOFF, connections.changed.notified()).await;
                } else {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
    drop(listener);
    connections.close_all();
    while tasks.join_next().await.is_some() {}
}

/// Serves one connection until the client closes it, a timeout does, or
/// the server asks it to close (which waits for the response in progress).
async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    http: hyper::server::conn::http1::Builder,
    tracking: Arc<Tracking>,
) {
    let close = tracking.close.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let in_request = tracking.request();
        let response = tower::ServiceExt::oneshot(router.clone(), request);
        async move {
            let response = response.await;
            drop(in_request);
            response
        }
    });
    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    // A connection's errors (a client gone, a timeout) are the client's
    // business, not the service's: they are not logged.
    tokio::select! {
        _ = connection.as_mut() => return,
        () = close.notified() => connection.as_mut().graceful_shutdown(),
    }
    let _ = connection.await;
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

fn main() -> anyhow::Result<()> {
    let args = parse_args(std::env::args().skip(1)).map_err(|message| anyhow::anyhow!(message))?;
    let service = Arc::new(service(
        &args.database,
        Settings {
            in_flight: args.in_flight,
            ..Settings::default()
        },
    )?);

    // The purger sleeps on a channel, so that dropping the sender at
    // shutdown wakes it at once.
    let (stop_purger, stopped) = mpsc::channel::<()>();
    let purger = {
        let service = service.clone();
        std::thread::spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(PURGE_EVERY) {
                match service.purge_expired() {
                    Ok(0) => {}
                    Ok(purged) => eprintln!("purged {purged} expired keys"),
                    Err(error) => eprintln!("purging expired keys failed: {}", causes(error.as_ref())),
                }
            }
        })
    };

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.addr)
            .await
            .with_context(|| format!("listen on {}", args.addr))?;
        let addr = listener.local_addr()?;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on http://{addr}")?;
        stdout.flush()?;
        drop(stdout);
        serve(
            listener,
            service.router.clone(),
            Limits::of_this_process(),
            shutdown_signal(),
        )
        .await;
        anyhow::Ok(())
    })?;
    // Dropping the runtime waits for the blocking tasks, so transactions in
    // progress finish before the process ends.
    drop(runtime);
    drop(stop_purger);
    purger.join().map_err(|_| anyhow::anyhow!("the purger panicked"))?;
    eprintln!("stopped");
    Ok(())
}
