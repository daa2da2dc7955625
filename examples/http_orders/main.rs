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
//! The command line is read by [`args`]. The bearer token names the account ([`account`]), whose id is the scope
//! of its idempotency keys. Errors are RFC 9457 problems ([`problems`]). An
//! order needs a quantity of at least 1 and an item of at most 1,000
//! characters without U+0000; what breaks a rule is refused (422) before
//! any database work, so that every backend gives the same answer
//! ([`orders`]). Every route answers 503 with `Retry-After` when no
//! database connection is free within 2 s ([`database`]). The server
//! guards itself against clients that hold connections ([`server`]).
//! Errors are logged to stderr with their causes, never with a body.
//!
//! When ready the service prints one line to stdout,
//! `listening on http://HOST:PORT`; Ctrl-C or SIGTERM stop it after the
//! requests in progress. A background thread purges expired keys.

pub mod account;
pub mod args;
pub mod database;
pub mod orders;
pub mod problems;
pub mod server;

use std::io::Write;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::routing::get;
use axum::{Extension, Json, Router};
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use idempotency::http::{self, Answer, Failure, IdempotencyKey, Problem, StoredResponse};
use idempotency::{Config, InFlight};

use account::Account;
use database::{CHECKOUT_TIMEOUT, Database, blocking};
use orders::{NewOrder, Order, OrderStore};
use problems::{Body, OrderError, causes, problem};
use server::Limits;

/// How often the background thread purges expired keys.
const PURGE_EVERY: Duration = Duration::from_secs(60);

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

/// What every handler shares.
struct App<C: R2D2Connection + 'static> {
    pool: Pool<ConnectionManager<C>>,
    config: Config,
    before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

// Derived, `Clone` would require `C: Clone`, which no connection is.
impl<C: R2D2Connection + 'static> Clone for App<C> {
    fn clone(&self) -> Self {
        App {
            pool: self.pool.clone(),
            config: self.config.clone(),
            before_commit: self.before_commit.clone(),
        }
    }
}

/// `POST /orders`: the order and its key record in one transaction, so a
/// retry gets the first response back and places nothing.
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
        let placed = conn.insert_order(account.id(), order)?;
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

/// `GET /orders/{id}`: reads need no key.
async fn get_order<C: OrderStore>(
    State(app): State<App<C>>,
    account: Account,
    Path(id): Path<String>,
) -> Result<Json<Order>, Problem> {
    let not_found = || problem(StatusCode::NOT_FOUND, "order-not-found", "Order not found");
    let id: i64 = id.parse().map_err(|_| not_found())?;
    let order = blocking(&app.pool, move |conn| conn.find_order(account.id(), id)).await?;
    order.map(Json).ok_or_else(not_found)
}

/// `GET /orders`.
async fn list_orders<C: OrderStore>(State(app): State<App<C>>, account: Account) -> Result<Json<Vec<Order>>, Problem> {
    let orders = blocking(&app.pool, move |conn| conn.list_orders(account.id())).await?;
    Ok(Json(orders))
}

/// The service on one database: its routes, and the purge of expired keys
/// for a background thread.
pub struct Service {
    /// The routes, to serve.
    pub router: Router,
    purge: Box<dyn Fn() -> anyhow::Result<usize> + Send + Sync>,
}

impl Service {
    /// Deletes the expired keys; returns how many.
    ///
    /// # Errors
    ///
    /// When no connection is free or the purge fails.
    fn purge_expired(&self) -> anyhow::Result<usize> {
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
        .layer(Extension(problems::problems()))
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

/// The service on `database`; see [`database::open`].
///
/// # Errors
///
/// When the database cannot be opened or prepared.
pub fn service(database: &str, settings: Settings) -> anyhow::Result<Service> {
    match database::open(database, settings.checkout_timeout)? {
        Database::Sqlite(pool) => service_on(pool, settings),
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => service_on(pool, settings),
        #[cfg(feature = "mysql")]
        Database::Mysql(pool) => service_on(pool, settings),
    }
}

fn main() -> anyhow::Result<()> {
    let args = args::parse(std::env::args().skip(1)).map_err(|message| anyhow::anyhow!(message))?;
    let settings = Settings {
        in_flight: args.in_flight,
        ..Settings::default()
    };
    let service = Arc::new(service(&args.database, settings)?);

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
        let limits = Limits::of_this_process();
        server::serve(listener, service.router.clone(), limits, shutdown_signal()).await;
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
