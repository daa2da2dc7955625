//! What the HTTP layer adds per request: the order service's `POST /orders`
//! against the same handler without idempotency, driven over keep-alive
//! connections on 127.0.0.1 by 1 and by 16 concurrent clients.
//!
//! ```text
//! cargo bench --features axum --bench http -- --backend sqlite [--quick]
//! DATABASE_URL=postgres://... cargo bench --features axum,postgres --bench http -- --backend postgres [--quick]
//! MYSQL_URL=mysql://... cargo bench --features axum,mysql --bench http -- --backend mysql [--quick]
//! ```
//!
//! Scenarios, all on one database and one server:
//!
//! - `plain`: the handler without idempotency: authentication, the JSON
//!   body, a pooled connection on the blocking pool, the order inserted in
//!   a transaction, `201` with `Location` and the order.
//! - `core`: the same handler calling `Config::run` itself, the key read
//!   from the header by hand: what the idempotent call costs.
//! - `http`: the example's `POST /orders` on `idempotency::http`: the
//!   extractor, `http::run`, `StoredResponse`: what the whole layer costs.
//! - `replay`: `http` with a key it already answered.
//!
//! On PostgreSQL with the feature `postgres-async`, two more, on a bb8 pool of
//! `AsyncPgConnection`s beside the r2d2 pool:
//!
//! - `plain_async`: the plain handler on the async pool, the order inserted
//!   in a diesel-async transaction, nothing on the blocking pool;
//! - `http_async`: the same handler on `http::run_async`.
//!
//! Every request but the replays has a key of its own. In each round every
//! scenario sends one batch, the scenarios' order rotating, so a
//! disturbance on the machine lands on all of them alike; requests per
//! second are the median over rounds of each batch's rate, latencies the
//! percentiles of all requests of a scenario. The server runs on a tokio
//! runtime of two workers, the clients on another runtime in the same
//! process. `--quick` shrinks every count so that a run takes seconds: CI
//! uses it to keep the bench working, not to judge speed.

// The service under measurement is the example's; its `main`, command line
// and read routes are unused here.
#[allow(dead_code)]
#[path = "../examples/http_orders/main.rs"]
mod http_orders;

mod common;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use common::{Args, Scratch};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use http_orders::Settings;
use http_orders::account::Account;
use http_orders::database::{self, Database};
use http_orders::orders::{NewOrder, Order, OrderStore};
use http_orders::problems::Body;
use idempotency::http::{Caller, IDEMPOTENT_REPLAYED};
use idempotency::{Config, Outcome};

#[cfg(not(feature = "postgres-async"))]
const SCENARIOS: [&str; 4] = ["plain", "core", "http", "replay"];
/// On PostgreSQL with diesel-async the async scenarios run beside the
/// others; a run on another backend skips them.
#[cfg(feature = "postgres-async")]
const SCENARIOS: [&str; 6] = ["plain", "core", "http", "replay", "plain_async", "http_async"];
const CLIENTS: [usize; 2] = [1, 16];
const BODY: &str = r#"{"item": "book", "quantity": 1}"#;

#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Measured rounds; one more runs first as a warm-up.
    rounds: usize,
    /// Requests of one scenario in one round, per client.
    per_client: usize,
}

const FULL: Sizes = Sizes {
    rounds: 15,
    per_client: 100,
};
const QUICK: Sizes = Sizes {
    rounds: 2,
    per_client: 10,
};

/// A transaction as a careful plain handler opens it: on SQLite one that
/// takes the write lock at once, so that concurrent writers wait for each
/// other instead of failing.
trait Begin: OrderStore {
    fn write<T>(&mut self, f: impl FnOnce(&mut Self) -> QueryResult<T>) -> QueryResult<T>;
}

impl Begin for SqliteConnection {
    fn write<T>(&mut self, f: impl FnOnce(&mut Self) -> QueryResult<T>) -> QueryResult<T> {
        self.immediate_transaction(f)
    }
}

#[cfg(feature = "postgres")]
impl Begin for PgConnection {
    fn write<T>(&mut self, f: impl FnOnce(&mut Self) -> QueryResult<T>) -> QueryResult<T> {
        self.transaction(f)
    }
}

#[cfg(feature = "mysql")]
impl Begin for MysqlConnection {
    fn write<T>(&mut self, f: impl FnOnce(&mut Self) -> QueryResult<T>) -> QueryResult<T> {
        self.transaction(f)
    }
}

struct Plain<C: Begin> {
    pool: Pool<ConnectionManager<C>>,
    config: Config,
}

impl<C: Begin> Clone for Plain<C> {
    fn clone(&self) -> Self {
        Plain {
            pool: self.pool.clone(),
            config: self.config.clone(),
        }
    }
}

fn created(order: Order, replayed: bool) -> Response {
    let location = HeaderValue::try_from(format!("/orders/{}", order.id)).expect("a path of digits");
    let mut response = (StatusCode::CREATED, [(header::LOCATION, location)], Json(order)).into_response();
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

async fn plain_order<C: Begin>(State(app): State<Plain<C>>, account: Account, Body(order): Body<NewOrder>) -> Response {
    let scope = account.scope().into_owned();
    let placed = tokio::task::spawn_blocking(move || {
        let mut conn = app.pool.get().map_err(|error| error.to_string())?;
        conn.write(|tx| tx.insert_order(&scope, &order))
            .map_err(|error| error.to_string())
    });
    match placed.await {
        Ok(Ok(order)) => created(order, false),
        _ => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn core_order<C: Begin>(
    State(app): State<Plain<C>>,
    account: Account,
    headers: HeaderMap,
    Body(order): Body<NewOrder>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let (scope, key) = (account.scope().into_owned(), key.to_owned());
    let placed = tokio::task::spawn_blocking(move || {
        let mut conn = app.pool.get().map_err(|_| 503_u16)?;
        app.config
            .run(&mut *conn, &scope, &key, &order, |tx| tx.insert_order(&scope, &order))
            .map_err(|error| error.status_code())
    });
    match placed.await {
        Ok(Ok(Outcome::Executed(order))) => created(order, false),
        Ok(Ok(Outcome::Replayed(order))) => created(order, true),
        Ok(Err(status)) => StatusCode::from_u16(status)
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// The async handlers, on a bb8 pool of diesel-async connections.
#[cfg(feature = "postgres-async")]
mod asynchronous {
    use std::sync::Arc;

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use diesel::prelude::*;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::bb8::Pool;
    use diesel_async::{AsyncConnection, AsyncPgConnection};
    use idempotency::Config;
    use idempotency::http::{self, Caller, IdempotencyKey, StoredResponse};

    use crate::created;
    use crate::http_orders::account::Account;
    use crate::http_orders::orders::{Order, orders};

    /// The body the example's `POST /orders` takes.
    #[derive(serde::Serialize, serde::Deserialize)]
    struct NewOrder {
        item: String,
        quantity: i32,
    }

    struct App {
        pool: Pool<AsyncPgConnection>,
        config: Config,
    }

    async fn insert(conn: &mut AsyncPgConnection, account: &str, order: &NewOrder) -> QueryResult<Order> {
        diesel_async::RunQueryDsl::get_result(
            diesel::insert_into(orders::table)
                .values((
                    orders::account.eq(account),
                    orders::item.eq(&order.item),
                    orders::quantity.eq(order.quantity),
                ))
                .returning((orders::id, orders::item, orders::quantity)),
            conn,
        )
        .await
    }

    async fn plain_order(State(app): State<Arc<App>>, account: Account, Json(order): Json<NewOrder>) -> Response {
        let scope = account.scope().into_owned();
        let Ok(mut conn) = app.pool.get().await else {
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        };
        let placed = conn
            .transaction::<_, diesel::result::Error, _>(async |tx| insert(tx, &scope, &order).await)
            .await;
        match placed {
            Ok(order) => created(order, false),
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }

    async fn http_order(
        State(app): State<Arc<App>>,
        key: IdempotencyKey<Account>,
        Json(order): Json<NewOrder>,
    ) -> Response {
        let scope = key.scope().to_owned();
        http::run_async(
            &app.pool,
            &app.config,
            &key,
            order,
            async |tx: &mut AsyncPgConnection, order: &NewOrder| {
                let order = insert(tx, &scope, order)
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                let location = axum::http::HeaderValue::try_from(format!("/orders/{}", order.id))
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                Ok::<_, StatusCode>(
                    StoredResponse::new(StatusCode::CREATED, order).with_header(axum::http::header::LOCATION, location),
                )
            },
        )
        .await
        .into_response()
    }

    /// The async routes, on a pool of `size` connections to `url`.
    pub async fn router(url: &str, size: u32) -> anyhow::Result<Router> {
        let pool = Pool::builder()
            .max_size(size)
            .build(AsyncDieselConnectionManager::new(url))
            .await?;
        let app = Arc::new(App {
            pool,
            config: Config::default(),
        });
        Ok(Router::new()
            .route("/async/plain/orders", post(plain_order))
            .route("/async/orders", post(http_order))
            .with_state(app))
    }
}

/// The example's service at `/orders`, the plain and core handlers beside
/// it on the same pool.
fn router<C: Begin>(pool: Pool<ConnectionManager<C>>) -> anyhow::Result<Router> {
    let service = http_orders::service_on(pool.clone(), Settings::default())?;
    let plain = Router::new()
        .route("/plain/orders", post(plain_order::<C>))
        .route("/core/orders", post(core_order::<C>))
        .with_state(Plain {
            pool,
            config: Config::default(),
        });
    Ok(service.router.merge(plain))
}

/// Starts the server on its own runtime; returns its address and the
/// runtime, which serves until dropped.
fn serve(router: Router) -> anyhow::Result<(SocketAddr, tokio::runtime::Runtime)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    runtime.spawn(async move { axum::serve(listener, router).await });
    Ok((addr, runtime))
}

/// Per-request latencies and batch rates of one scenario at one client count.
#[derive(Default)]
struct Figures {
    latencies: Vec<Duration>,
    rates: Vec<f64>,
}

impl Figures {
    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let index = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[index]
    }

    fn rate(&self) -> f64 {
        let mut rates = self.rates.clone();
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    }
}

/// One batch: every client sends `per_client` requests one after another;
/// returns every latency and the batch's wall time.
async fn batch(
    clients: &[reqwest::Client],
    base: &str,
    scenario: &str,
    round: usize,
    per_client: usize,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let started = Instant::now();
    // Keys name the client count too: both counts share one database.
    let count = clients.len();
    let mut tasks = tokio::task::JoinSet::new();
    for (c, client) in clients.iter().enumerate() {
        let client = client.clone();
        let path = match scenario {
            "plain" => "/plain/orders",
            "core" => "/core/orders",
            "plain_async" => "/async/plain/orders",
            "http_async" => "/async/orders",
            _ => "/orders",
        };
        let url = format!("{base}{path}");
        let scenario = scenario.to_owned();
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(per_client);
            for i in 0..per_client {
                let key = match scenario.as_str() {
                    "replay" => format!("replay-{count}-{c}"),
                    _ => format!("{scenario}-{count}-{round}-{c}-{i}"),
                };
                let sent = Instant::now();
                let response = client
                    .post(&url)
                    .bearer_auth("bench")
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(BODY)
                    .send()
                    .await?;
                let status = response.status();
                response.bytes().await?;
                latencies.push(sent.elapsed());
                anyhow::ensure!(status == StatusCode::CREATED, "{scenario}: {status}");
            }
            Ok::<_, anyhow::Error>(latencies)
        });
    }
    let mut latencies = Vec::new();
    for result in tasks.join_all().await {
        latencies.extend(result?);
    }
    Ok((latencies, started.elapsed()))
}

fn run(args: &Args) -> anyhow::Result<()> {
    let sizes = if args.quick { QUICK } else { FULL };
    let scratch = Scratch::new(&args.backend, "idem_http_bench")?;
    let router = match database::open(scratch.url(), database::CHECKOUT_TIMEOUT)? {
        Database::Sqlite(pool) => router(pool)?,
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => {
            let router = router(pool)?;
            #[cfg(feature = "postgres-async")]
            let router = {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                router.merge(runtime.block_on(asynchronous::router(scratch.url(), 16))?)
            };
            router
        }
        #[cfg(feature = "mysql")]
        Database::Mysql(pool) => router(pool)?,
    };
    // The async scenarios have routes on PostgreSQL only.
    let scenarios: Vec<usize> = (0..SCENARIOS.len())
        .filter(|&index| args.backend == "postgres" || !SCENARIOS[index].ends_with("_async"))
        .collect();
    let (addr, _server) = serve(router)?;
    let base = format!("http://{addr}");
    let client_runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    println!(
        "backend {}, {} measured rounds, {} requests per client per batch{}",
        args.backend,
        sizes.rounds,
        sizes.per_client,
        if args.quick { " (quick)" } else { "" }
    );
    for clients in CLIENTS {
        let per_client = sizes.per_client * if clients == 1 { 4 } else { 1 };
        let pool: Vec<reqwest::Client> = (0..clients)
            .map(|_| reqwest::Client::builder().no_proxy().pool_max_idle_per_host(1).build())
            .collect::<Result<_, _>>()?;
        let mut figures: Vec<Figures> = SCENARIOS.iter().map(|_| Figures::default()).collect();
        client_runtime.block_on(async {
            // The replayed keys are answered once before the rounds.
            batch(&pool, &base, "replay", 0, 1).await?;
            for round in 0..=sizes.rounds {
                for turn in 0..scenarios.len() {
                    let index = scenarios[(round + turn) % scenarios.len()];
                    let (latencies, wall) = batch(&pool, &base, SCENARIOS[index], round, per_client).await?;
                    if round > 0 {
                        figures[index].rates.push(latencies.len() as f64 / wall.as_secs_f64());
                        figures[index].latencies.extend(latencies);
                    }
                }
            }
            Ok::<_, anyhow::Error>(())
        })?;
        report(clients, &figures, &scenarios);
    }
    Ok(())
}

fn micros(duration: Duration) -> String {
    format!("{:.0} µs", duration.as_secs_f64() * 1e6)
}

fn report(clients: usize, figures: &[Figures], scenarios: &[usize]) {
    println!("\n{clients} client(s), keep-alive");
    println!("| scenario | requests/s | p50 | p99 |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, figures) in scenarios.iter().map(|&index| (SCENARIOS[index], &figures[index])) {
        println!(
            "| {name} | {:.0} | {} | {} |",
            figures.rate(),
            micros(figures.percentile(0.5)),
            micros(figures.percentile(0.99))
        );
    }
    let [plain, core, http, replay] = [&figures[0], &figures[1], &figures[2], &figures[3]];
    let p50 = |f: &Figures| f.percentile(0.5).as_secs_f64() * 1e6;
    println!(
        "http / plain: throughput × {:.2}, p50 {:+.0} µs; http / core: throughput × {:.2}, p50 {:+.0} µs; \
         replay / plain: throughput × {:.2}",
        http.rate() / plain.rate(),
        p50(http) - p50(plain),
        http.rate() / core.rate(),
        p50(http) - p50(core),
        replay.rate() / plain.rate(),
    );
    if scenarios.len() == SCENARIOS.len() && SCENARIOS.len() == 6 {
        let (plain_async, http_async) = (&figures[SCENARIOS.len() - 2], &figures[SCENARIOS.len() - 1]);
        println!(
            "http_async / plain_async: throughput × {:.2}, p50 {:+.0} µs; http_async / http: throughput × {:.2}; \
             plain_async / plain: throughput × {:.2}",
            http_async.rate() / plain_async.rate(),
            p50(http_async) - p50(plain_async),
            http_async.rate() / http.rate(),
            plain_async.rate() / plain.rate(),
        );
    }
}

fn main() -> ExitCode {
    let args = match common::parse_args("usage: http --backend sqlite|postgres|mysql [--quick]", |other, _| {
        Err(format!("unknown argument {other}"))
    }) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("http bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}
