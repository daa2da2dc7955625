//! An idempotent order endpoint that serves its own OpenAPI document
//! (feature `openapi`): `POST /orders` with an `Idempotency-Key`,
//! `GET /orders/status` for what became of a key, `GET /openapi.json`.
//!
//! ```sh
//! cargo run --example openapi_orders --features openapi -- 127.0.0.1:8080
//! curl http://127.0.0.1:8080/openapi.json
//! ```
//!
//! The orders live in a temporary SQLite file, gone when the program stops.

use std::borrow::Cow;
use std::convert::Infallible;

use axum::extract::{FromRequestParts, State};
use axum::http::{HeaderValue, Method, StatusCode, header, request::Parts};
use axum::routing::{get, post};
use axum::{Json, Router};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::Config;
use idempotency::http::openapi::{IdempotencyKeyHeader, IdempotencyProblems, IdempotentReplays, LookupProblems};
use idempotency::http::{self, Answer, Caller, Failure, IdempotencyKey, Problem, StoredResponse};
use serde::{Deserialize, Serialize};
use utoipa::{OpenApi, ToSchema};

/// The caller, from the bearer token, which names the account.
pub struct Account(String);

impl<S: Sync> FromRequestParts<S> for Account {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
            .map(|token| Account(token.to_owned()))
            .ok_or_else(|| Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized"))
    }
}

impl Caller for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// An order to place.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct NewOrder {
    item: String,
    quantity: i32,
}

/// A placed order.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct Order {
    id: i64,
    item: String,
    quantity: i32,
}

type Db = Pool<ConnectionManager<SqliteConnection>>;

#[derive(Clone)]
struct App {
    pool: Db,
    config: Config,
}

fn internal(_: diesel::result::Error) -> Problem {
    Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error")
}

/// Places an order, at most once per key.
#[utoipa::path(
    post,
    path = "/orders",
    params(IdempotencyKeyHeader),
    request_body = NewOrder,
    responses(
        (status = 201, description = "The order was placed", body = Order,
            headers(("Location" = String, description = "The order's URL"))),
        IdempotencyProblems,
    )
)]
async fn place_order(
    State(app): State<App>,
    key: IdempotencyKey<Account>,
    Json(order): Json<NewOrder>,
) -> Result<Answer<StoredResponse<Order>>, Failure<Problem>> {
    http::run(&app.pool, &app.config, &key, order, |conn, order| {
        diesel::sql_query("INSERT INTO orders (item, quantity) VALUES (?, ?)")
            .bind::<diesel::sql_types::Text, _>(&order.item)
            .bind::<diesel::sql_types::Integer, _>(order.quantity)
            .execute(conn)
            .map_err(internal)?;
        let id = diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>("last_insert_rowid()"))
            .get_result(conn)
            .map_err(internal)?;
        let location = HeaderValue::try_from(format!("/orders/{id}")).expect("a path of digits");
        let placed = Order {
            id,
            item: order.item.clone(),
            quantity: order.quantity,
        };
        Ok(StoredResponse::new(StatusCode::CREATED, placed).with_header(header::LOCATION, location))
    })
    .await
}

/// What became of the order placed with this key.
#[utoipa::path(
    get,
    path = "/orders/status",
    params(IdempotencyKeyHeader),
    responses(
        (status = 201, description = "The order placed with this key, as first answered", body = Order),
        LookupProblems,
    )
)]
async fn order_status(
    State(app): State<App>,
    key: IdempotencyKey<Account>,
) -> Result<Answer<StoredResponse<Order>>, Failure<Infallible>> {
    http::lookup(&app.pool, &app.config, &key, &[(Method::POST, "/orders")]).await
}

#[derive(OpenApi)]
#[openapi(paths(place_order, order_status), modifiers(&IdempotentReplays))]
struct ApiDoc;

/// The API's OpenAPI document.
pub fn spec() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The service on the SQLite database at `path`, which it sets up.
pub fn app(path: &str) -> Result<Router, Box<dyn std::error::Error + Send + Sync>> {
    let pool = Pool::new(ConnectionManager::<SqliteConnection>::new(path))?;
    let mut conn = pool.get()?;
    idempotency::run_migrations(&mut *conn)?;
    diesel::sql_query(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(&mut *conn)?;
    let spec = Json(spec());
    Ok(Router::new()
        .route("/orders", post(place_order))
        .route("/orders/status", get(order_status))
        .route("/openapi.json", get(move || async move { spec }))
        .with_state(App {
            pool,
            config: Config::default(),
        }))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:8080".to_owned());
    let db = idempotency::testing::SqliteFile::new();
    let app = app(db.path().to_str().ok_or("a UTF-8 path")?)?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
