//! A tiny order service on a SQLite file, walking through the stories that
//! idempotency keys exist for:
//!
//! 1. an order is placed, the response is lost, the client retries: the
//!    retry gets the same order back and no second order exists;
//! 2. the key is reused for a different order: refused;
//! 3. a request is rejected, corrected and retried with the same key;
//! 4. eight clients race with one key: one order.
//!
//! No HTTP is involved: each call is what a `POST /orders` handler would
//! run, and prints the status that handler would answer and whether the
//! operation executed or was replayed. `cargo run --example http_orders
//! --features axum` is the same service over HTTP.
//!
//! Run it with `cargo run --example orders`.

use std::sync::{Arc, Barrier};
use std::thread;

use anyhow::Context;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::{Config, Error, Outcome};
use serde::{Deserialize, Serialize};

diesel::table! {
    orders (id) {
        id -> BigInt,
        customer -> Text,
        item -> Text,
        quantity -> Integer,
    }
}

/// The request to place an order.
#[derive(Serialize, Clone)]
struct PlaceOrder {
    item: String,
    quantity: i32,
}

/// The response body.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct OrderPlaced {
    order_id: i64,
    item: String,
    quantity: i32,
}

/// Why the domain refused an order; returned as `Err`, so nothing is stored
/// and the key stays free for a corrected request.
#[derive(Debug)]
enum OrderError {
    InvalidQuantity(i32),
    Database(diesel::result::Error),
}

impl std::fmt::Display for OrderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OrderError::InvalidQuantity(quantity) => write!(f, "quantity must be positive, got {quantity}"),
            OrderError::Database(error) => write!(f, "database error: {error}"),
        }
    }
}

impl From<diesel::result::Error> for OrderError {
    fn from(error: diesel::result::Error) -> Self {
        OrderError::Database(error)
    }
}

/// The repository function, as the application already has it.
fn insert_order(conn: &mut SqliteConnection, customer: &str, request: &PlaceOrder) -> Result<OrderPlaced, OrderError> {
    if request.quantity <= 0 {
        return Err(OrderError::InvalidQuantity(request.quantity));
    }
    let order_id = diesel::insert_into(orders::table)
        .values((
            orders::customer.eq(customer),
            orders::item.eq(&request.item),
            orders::quantity.eq(request.quantity),
        ))
        .returning(orders::id)
        .get_result(conn)?;
    Ok(OrderPlaced {
        order_id,
        item: request.item.clone(),
        quantity: request.quantity,
    })
}

struct OrderService {
    pool: Pool<ConnectionManager<SqliteConnection>>,
    config: Config,
}

impl OrderService {
    /// What a `POST /orders` handler runs for a request with an
    /// `Idempotency-Key`, from `customer`, the id that authentication found
    /// for the request's credential (never the credential, nor a field of
    /// the body): returns the HTTP status it would answer and what
    /// happened.
    fn place(&self, customer: &str, key: &str, request: &PlaceOrder) -> (u16, String) {
        let mut conn = match self.pool.get() {
            Ok(conn) => conn,
            Err(error) => return (503, error.to_string()),
        };
        // The customer is the scope: one customer's keys never see another's.
        let result = self.config.run(&mut conn, customer, key, request, |tx| {
            insert_order(tx, customer, request)
        });
        match result {
            Ok(Outcome::Executed(placed)) => (201, format!("executed: {placed:?}")),
            Ok(Outcome::Replayed(placed)) => (201, format!("replayed: {placed:?}")),
            // The application maps its own errors; the crate's have a status.
            Err(Error::Operation(error @ OrderError::InvalidQuantity(_))) => (400, format!("refused: {error}")),
            Err(error) => (error.status_code(), format!("refused: {error}")),
        }
    }

    fn order_count(&self) -> anyhow::Result<i64> {
        let mut conn = self.pool.get()?;
        Ok(orders::table.count().get_result(&mut conn)?)
    }
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("orders.db");
    let url = path.to_str().context("temporary path is not utf-8")?;
    let pool = Pool::builder()
        .max_size(8)
        .build(ConnectionManager::<SqliteConnection>::new(url))?;
    {
        let mut conn = pool.get()?;
        conn.batch_execute(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, item TEXT NOT NULL, quantity INTEGER NOT NULL);",
        )?;
        idempotency::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!(e))?;
    }
    let service = Arc::new(OrderService {
        pool,
        config: Config::default(),
    });
    println!(
        "order service on {} (the status each call prints is what HTTP would answer)",
        path.display()
    );

    println!("\n1. the response is lost and the client retries");
    let book = PlaceOrder {
        item: "book".into(),
        quantity: 1,
    };
    let (status, body) = service.place("alice", "a1b2c3", &book);
    println!("   key=a1b2c3        -> {status} {body}   (the client never sees this)");
    let (status, body) = service.place("alice", "a1b2c3", &book);
    println!("   retry, key=a1b2c3 -> {status} {body}");
    println!("   orders in the database: {}", service.order_count()?);

    println!("\n2. the same key for a different order");
    let lamp = PlaceOrder {
        item: "lamp".into(),
        quantity: 1,
    };
    let (status, body) = service.place("alice", "a1b2c3", &lamp);
    println!("   key=a1b2c3 (lamp) -> {status} {body}");

    println!("\n3. a rejected request, corrected and retried with the same key");
    let wrong = PlaceOrder {
        item: "chair".into(),
        quantity: 0,
    };
    let (status, body) = service.place("bob", "d4e5f6", &wrong);
    println!("   key=d4e5f6 quantity=0 -> {status} {body}   (nothing stored, key still free)");
    let fixed = PlaceOrder { quantity: 2, ..wrong };
    let (status, body) = service.place("bob", "d4e5f6", &fixed);
    println!("   key=d4e5f6 quantity=2 -> {status} {body}");
    let (status, body) = service.place("bob", "not a key", &fixed);
    println!("   key=\"not a key\"       -> {status} {body}");

    println!("\n4. eight clients race with one key: one executes, the others replay its order");
    let racers = 8;
    let barrier = Arc::new(Barrier::new(racers));
    let desk = PlaceOrder {
        item: "desk".into(),
        quantity: 1,
    };
    let handles: Vec<_> = (0..racers)
        .map(|i| {
            let (service, barrier, desk) = (service.clone(), barrier.clone(), desk.clone());
            thread::spawn(move || {
                barrier.wait();
                let (status, body) = service.place("carol", "g7h8i9", &desk);
                format!("   client {i}: {status} {body}")
            })
        })
        .collect();
    for handle in handles {
        println!(
            "{}",
            handle.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?
        );
    }

    let count = service.order_count()?;
    println!("\norders in the database: {count} (book, chair, desk)");
    anyhow::ensure!(count == 3, "expected 3 orders, found {count}");
    Ok(())
}
