//! Orders and their receipt messages delivered through a real broker: NATS
//! JetStream, RabbitMQ and Redis Streams in turn.
//!
//! The shop places orders with `run_idempotent`, each with its message in
//! the same transaction (ordered per customer, with the request's trace
//! context); the relay service publishes them and marks each delivered
//! once the broker confirmed it; the mailer, a separate system with its own
//! database, consumes them through an inbox that writes one receipt per
//! message and acknowledges after its commit.
//!
//! Run with `cargo run --example brokers --features nats,rabbitmq,redis`,
//! with the brokers on their local default ports (NATS with JetStream on
//! 4222, RabbitMQ on 5672 as guest, Redis on 6379); add `-- nats`,
//! `-- rabbitmq` or `-- redis` for one of them.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::thread;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use idempotency::brokers::nats::{JetStreamConsumer, JetStreamPublisher};
use idempotency::brokers::rabbitmq::{self, RabbitConsumer, RabbitPublisher, Route};
use idempotency::brokers::redis::{RedisConsumer, RedisPublisher};
use idempotency::brokers::{self as brokers, BlockingPublisher, Delivery, Inbox, Publisher};
use idempotency::outbox::{self, Envelope, Failure, Relay};
use idempotency::{Shutdown, run_idempotent};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;

type BoxError = Box<dyn Error + Send + Sync>;
type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;
type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The orders the shop places, for three customers.
const ORDERS: i64 = 9;
/// The trace context of the requests that placed them.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[derive(Serialize, Deserialize)]
struct SendReceipt {
    order_id: i64,
    customer: String,
}

/// The shop's own error: its writes and its messages.
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
            ShopError::Database(error) => write!(f, "the order could not be saved: {error}"),
            ShopError::Outbox(error) => write!(f, "the receipt could not be queued: {error}"),
        }
    }
}

impl Error for ShopError {}

fn main() -> Result<(), BoxError> {
    let only = std::env::args().nth(1);
    let runtime = Runtime::new()?;
    // The clients spawn their connections' tasks on the current runtime.
    let _entered = runtime.enter();
    for broker in ["nats", "rabbitmq", "redis"] {
        if only.as_deref().is_some_and(|only| only != broker) {
            continue;
        }
        println!("== {broker}");
        let dir = tempfile::tempdir()?;
        let shop = database(
            &dir.path().join("shop.db"),
            "CREATE TABLE orders (id BIGINT PRIMARY KEY, customer TEXT NOT NULL)",
        )?;
        let mailer = database(
            &dir.path().join("mailer.db"),
            "CREATE TABLE receipts (seq INTEGER PRIMARY KEY AUTOINCREMENT, order_id BIGINT NOT NULL, customer TEXT NOT NULL)",
        )?;
        place_orders(&shop)?;
        // Names of this run's own: a stream, a queue.
        let name = format!("receipts_{}", std::process::id());
        match broker {
            "nats" => via_nats(&runtime, &shop, &mailer, &name)?,
            "rabbitmq" => via_rabbitmq(&runtime, &shop, &mailer, &name)?,
            _ => via_redis(&runtime, &shop, &mailer, &name)?,
        }
        print_receipts(&mailer)?;
    }
    Ok(())
}

/// Each connection waits for another's write lock instead of failing at
/// once: the relay, the consumer and this program share the files.
#[derive(Debug)]
struct WaitForLocks;

impl diesel::r2d2::CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for WaitForLocks {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 5000")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// A pool on the SQLite file `path`, with the crate's tables and `table`.
fn database(path: &std::path::Path, table: &str) -> Result<SqlitePool, BoxError> {
    let pool = Pool::builder()
        .max_size(4)
        .connection_customizer(Box::new(WaitForLocks))
        .build(ConnectionManager::<SqliteConnection>::new(path.to_string_lossy()))?;
    let mut conn = pool.get()?;
    // Readers beside the writer.
    conn.batch_execute("PRAGMA journal_mode = WAL")?;
    idempotency::run_migrations(&mut conn)?;
    diesel::sql_query(table).execute(&mut conn)?;
    Ok(pool)
}

/// Each order and its receipt message in one transaction, under the
/// request's idempotency key; one request retried, which enqueues nothing.
fn place_orders(shop: &SqlitePool) -> Result<(), BoxError> {
    let mut conn = shop.get()?;
    for id in 1..=ORDERS {
        let customer = format!("customer-{}", id % 3);
        let key = format!("order-{id}");
        let place = |conn: &mut SqliteConnection| {
            run_idempotent(conn, &customer, &key, &id, |tx| {
                diesel::sql_query("INSERT INTO orders (id, customer) VALUES (?, ?)")
                    .bind::<BigInt, _>(id)
                    .bind::<Text, _>(&customer)
                    .execute(tx)?;
                Envelope::new(
                    "receipts",
                    &SendReceipt {
                        order_id: id,
                        customer: customer.clone(),
                    },
                )
                .ordering_key(customer.as_str())
                .traceparent(TRACEPARENT)
                .enqueue(tx)?;
                Ok::<_, ShopError>(id)
            })
        };
        place(&mut conn)?;
        if id == 1 {
            // The response was lost; the client retries with the same key.
            assert!(place(&mut conn)?.is_replayed());
        }
    }
    Ok(())
}

/// The mailer's inbox: one receipt per message, however often it comes.
fn inbox(
    mailer: &SqlitePool,
) -> Inbox<SqliteConnection, impl Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static> {
    Inbox::new(
        mailer.clone(),
        "receipt-mailer",
        |conn: &mut SqliteConnection, delivery: &Delivery| {
            let receipt: SendReceipt = delivery.payload()?;
            diesel::sql_query("INSERT INTO receipts (order_id, customer) VALUES (?, ?)")
                .bind::<BigInt, _>(receipt.order_id)
                .bind::<Text, _>(&receipt.customer)
                .execute(conn)?;
            Ok(())
        },
    )
}

/// Runs the relay service with `publisher` and the consumer `consume`
/// makes until every order has its receipt, then stops both.
fn deliver<P, F>(
    runtime: &Runtime,
    shop: &SqlitePool,
    mailer: &SqlitePool,
    publisher: P,
    consume: impl FnOnce(Stop) -> F,
) -> Result<(), BoxError>
where
    P: Publisher + 'static,
    F: Future<Output = Result<(), brokers::Error>> + Send + 'static,
{
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    let shutdown = Shutdown::new();
    let relay = thread::spawn({
        let (shop, shutdown) = (shop.clone(), shutdown.clone());
        move || Relay::default().serve(&shop, |message| publisher.publish(message), &shutdown)
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = runtime.spawn(consume(Box::pin(async {
        let _ = stopped.await;
    })));

    let deadline = Instant::now() + Duration::from_secs(30);
    while receipts(mailer)? < ORDERS {
        if Instant::now() > deadline {
            return Err("no receipt for every order within 30 s: is the broker running?".into());
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = stop.send(());
    runtime.block_on(consumer)??;
    shutdown.trigger();
    let relayed = relay.join().map_err(|_| "the relay panicked")?;
    println!(
        "relay: {} delivered, {} retried, {} dead",
        relayed.work.delivered, relayed.work.retried, relayed.work.dead
    );
    Ok(())
}

fn via_nats(runtime: &Runtime, shop: &SqlitePool, mailer: &SqlitePool, name: &str) -> Result<(), BoxError> {
    let context = jetstream::new(runtime.block_on(async_nats::connect("127.0.0.1:4222"))?);
    let config = stream::Config {
        name: name.to_owned(),
        subjects: vec![name.to_owned()],
        ..stream::Config::default()
    };
    let created = runtime.block_on(context.create_stream(config))?;
    let pull = runtime.block_on(created.create_consumer(consumer::pull::Config {
        durable_name: Some(String::from("mailer")),
        ack_policy: consumer::AckPolicy::Explicit,
        ..consumer::pull::Config::default()
    }))?;
    let subject = name.to_owned();
    let publisher = JetStreamPublisher::new(context.clone()).subject(move |_| subject.clone());
    let consumer = JetStreamConsumer::new(context.clone(), pull, inbox(mailer));
    let delivered = deliver(runtime, shop, mailer, publisher, |stop| async move {
        consumer.run(stop).await
    });
    runtime.block_on(context.delete_stream(name))?;
    delivered
}

fn via_rabbitmq(runtime: &Runtime, shop: &SqlitePool, mailer: &SqlitePool, name: &str) -> Result<(), BoxError> {
    const URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let connection = runtime.block_on(rabbitmq::connect(URI))?;
    let channel = runtime.block_on(connection.create_channel())?;
    // A quorum queue: it counts deliveries, which bounds a poison message's.
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    runtime.block_on(channel.queue_declare(name, durable, arguments))?;
    // Through the default exchange, which routes by queue name.
    let queue = name.to_owned();
    let publisher = runtime
        .block_on(RabbitPublisher::connect(URI, ""))?
        .route(move |_| Route::new("", queue.clone()));
    let consumer = RabbitConsumer::new(URI, name, inbox(mailer));
    let delivered = deliver(runtime, shop, mailer, publisher, |stop| async move {
        consumer.run(stop).await
    });
    runtime.block_on(channel.queue_delete(name, QueueDeleteOptions::default()))?;
    delivered
}

fn via_redis(runtime: &Runtime, shop: &SqlitePool, mailer: &SqlitePool, name: &str) -> Result<(), BoxError> {
    let client = redis::Client::open("redis://127.0.0.1:6379")?;
    let stream = name.to_owned();
    let publisher = runtime
        .block_on(RedisPublisher::connect(client.clone()))?
        .stream(move |_| stream.clone());
    let consumer = RedisConsumer::new(client.clone(), name, "mailer", "mailer-1", inbox(mailer));
    let delivered = deliver(runtime, shop, mailer, publisher, |stop| async move {
        consumer.run(stop).await
    });
    let mut conn = client.get_connection()?;
    redis::cmd("DEL")
        .arg(name)
        .arg(format!("{name}:dead"))
        .query::<()>(&mut conn)?;
    delivered
}

#[derive(QueryableByName)]
struct Receipt {
    #[diesel(sql_type = BigInt)]
    order_id: i64,
    #[diesel(sql_type = Text)]
    customer: String,
}

fn receipts(mailer: &SqlitePool) -> Result<i64, BoxError> {
    let count =
        diesel::select(diesel::dsl::sql::<BigInt>("(SELECT COUNT(*) FROM receipts)")).get_result(&mut mailer.get()?)?;
    Ok(count)
}

/// The receipts per customer, in the order the mailer wrote them.
fn print_receipts(mailer: &SqlitePool) -> Result<(), BoxError> {
    let rows: Vec<Receipt> =
        diesel::sql_query("SELECT order_id, customer FROM receipts ORDER BY seq").load(&mut mailer.get()?)?;
    for customer in ["customer-0", "customer-1", "customer-2"] {
        let orders: Vec<i64> = rows
            .iter()
            .filter(|row| row.customer == customer)
            .map(|row| row.order_id)
            .collect();
        println!("{customer}: receipts for orders {orders:?}");
    }
    Ok(())
}
