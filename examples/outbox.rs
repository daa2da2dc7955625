//! An order placed with its "send receipt" message, a relay delivering it to
//! an idempotent consumer, a crash, and a redelivery the consumer absorbs.
//!
//! The shop and the mailer are separate systems with separate databases
//! (two in-memory SQLite databases here). The shop writes the order and the
//! message in one transaction; the relay carries the message over; the mailer
//! deduplicates on the message key, so the customer gets one receipt however
//! often the message arrives.
//!
//! Run with `cargo run --example outbox`.

use std::panic::{self, AssertUnwindSafe};

use chrono::Duration;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use idempotency::outbox::{self, Message, Relay};
use idempotency::testing::ManualClock;
use idempotency::{Outcome, run_idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
struct PlaceOrder<'a> {
    item: &'a str,
    email: &'a str,
}

#[derive(Serialize, Deserialize, Debug)]
struct SendReceipt {
    order_id: i64,
    email: String,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn database(schema: &str) -> anyhow::Result<SqliteConnection> {
    let mut conn = SqliteConnection::establish(":memory:")?;
    idempotency::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!("migrate: {e}"))?;
    diesel::sql_query(schema).execute(&mut conn)?;
    Ok(conn)
}

/// Why placing an order failed: the shop's own error, which wraps the
/// crate's errors with `From` so that `?` works inside the operation for both
/// the domain's database writes and the outbox.
#[derive(Debug)]
enum ShopError {
    Database(diesel::result::Error),
    Outbox(outbox::Error),
}

impl From<diesel::result::Error> for ShopError {
    fn from(error: diesel::result::Error) -> Self {
        ShopError::Database(error)
    }
}

impl From<outbox::Error> for ShopError {
    fn from(error: outbox::Error) -> Self {
        ShopError::Outbox(error)
    }
}

impl std::fmt::Display for ShopError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShopError::Database(_) => f.write_str("the order could not be saved"),
            ShopError::Outbox(_) => f.write_str("the receipt could not be queued"),
        }
    }
}

impl std::error::Error for ShopError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ShopError::Database(error) => Some(error),
            ShopError::Outbox(error) => Some(error),
        }
    }
}

/// The shop's endpoint: the order and its receipt message commit together.
fn place_order(shop: &mut SqliteConnection, key: &str, request: &PlaceOrder) -> anyhow::Result<Outcome<i64>> {
    let outcome = run_idempotent(shop, "web-shop", key, request, |tx| {
        diesel::sql_query("INSERT INTO orders (item, email) VALUES (?, ?)")
            .bind::<Text, _>(request.item)
            .bind::<Text, _>(request.email)
            .execute(tx)?;
        let order_id = diesel::select(diesel::dsl::sql::<BigInt>("last_insert_rowid()")).get_result(tx)?;
        outbox::enqueue(
            tx,
            "send-receipt",
            &SendReceipt {
                order_id,
                email: request.email.to_owned(),
            },
        )?;
        Ok::<_, ShopError>(order_id)
    })?;
    Ok(outcome)
}

/// The mailer's consumer: its name is the scope, the message key the key.
fn send_receipt(mailer: &mut SqliteConnection, message: &Message) -> anyhow::Result<Outcome<String>> {
    let receipt: SendReceipt = message.payload()?;
    let outcome = run_idempotent(mailer, "receipt-mailer", &message.key, &message.payload_json, |tx| {
        diesel::sql_query("INSERT INTO sent_receipts (order_id, email) VALUES (?, ?)")
            .bind::<BigInt, _>(receipt.order_id)
            .bind::<Text, _>(&receipt.email)
            .execute(tx)?;
        Ok::<_, diesel::result::Error>(format!("receipt for order {} sent", receipt.order_id))
    })?;
    Ok(outcome)
}

fn main() -> anyhow::Result<()> {
    let mut shop = database("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL, email TEXT NOT NULL)")?;
    let mut mailer = database("CREATE TABLE sent_receipts (order_id INTEGER NOT NULL, email TEXT NOT NULL)")?;
    let clock = ManualClock::new();
    let relay = Relay::default().clock(clock.source()).lease(Duration::seconds(30));

    let request = PlaceOrder {
        item: "The Rust Programming Language",
        email: "ada@example.com",
    };
    let placed = place_order(&mut shop, "checkout-8c1f", &request)?;
    println!(
        "order {} placed (executed: {})",
        placed.clone().into_inner(),
        !placed.is_replayed()
    );
    let retried = place_order(&mut shop, "checkout-8c1f", &request)?;
    println!(
        "client retry answered from storage (replayed: {}), no second message",
        retried.is_replayed()
    );

    // The first relay hands the message to the mailer, which sends the
    // receipt; then the relay's process dies before it records the delivery.
    // The crash is a panic here; keep its report out of the output.
    let report_panics = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let crashed = panic::catch_unwind(AssertUnwindSafe(|| {
        relay.run_once(&mut shop, |message| {
            let sent = send_receipt(&mut mailer, message)?;
            println!(
                "attempt {}: {} (key {})",
                message.attempt,
                sent.into_inner(),
                message.key
            );
            panic!("relay process crashed before recording the delivery");
            #[allow(unreachable_code)]
            Ok::<_, anyhow::Error>(())
        })
    }));
    panic::set_hook(report_panics);
    anyhow::ensure!(crashed.is_err(), "the first relay was meant to crash");
    println!("relay crashed; the message is still leased");

    // Once the lease has run out, the next relay delivers it again with the
    // same key, and the mailer answers from its own records.
    clock.advance(Duration::seconds(30));
    let report = relay.run_once(&mut shop, |message| {
        let sent = send_receipt(&mut mailer, message)?;
        println!(
            "attempt {}: replayed: {} (key {})",
            message.attempt,
            sent.is_replayed(),
            message.key
        );
        Ok::<_, anyhow::Error>(())
    })?;
    println!("redelivery recorded: {} delivered", report.delivered);
    anyhow::ensure!(report.claimed == 1, "the client's retry enqueued no second message");

    let receipts: Count = diesel::sql_query("SELECT count(*) AS n FROM sent_receipts").get_result(&mut mailer)?;
    let orders: Count = diesel::sql_query("SELECT count(*) AS n FROM orders").get_result(&mut shop)?;
    println!("{} order, {} receipt sent", orders.n, receipts.n);
    anyhow::ensure!(orders.n == 1 && receipts.n == 1, "expected one order and one receipt");
    Ok(())
}
