//! Delivery through the live brokers (the features `nats`, `rabbitmq`,
//! `redis`): a shop enqueues orders and their messages in one transaction,
//! a relay publishes them, and a consumer writes their effects into another
//! database through its inbox. A broker that is down fails its tests.
//!
//! Each test declares streams, queues and subjects of its own and deletes
//! them at its end. The tests run as a service does: the broker clients
//! and the consumer on a tokio runtime, the relay on a plain thread (the
//! test's) that blocks on the runtime for each confirmation.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Nullable, Text};
use idempotency::brokers::{BlockingPublisher, Delivery, Inbox, Publisher};
use idempotency::outbox::{Deliveries, Envelope, Failure, Message, Relay};
use idempotency::testing::SqliteFile;
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;

use crate::common::wait::PATIENCE;

#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "redis")]
mod redis;
#[cfg(all(feature = "redis", feature = "axum", feature = "sqlite-async"))]
mod redis_processes;

/// A consumer running on a tokio runtime until the test stops it.
pub struct Consuming {
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<Result<(), idempotency::brokers::Error>>,
}

/// The future a consumer's `run` is given to stop on.
pub type Stopped = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

impl Consuming {
    /// Spawns `consume` on `runtime`: a consumer's `run` with the future
    /// that ends when the test calls [`Consuming::stop`].
    pub fn start<F>(runtime: &Runtime, consume: impl FnOnce(Stopped) -> F) -> Consuming
    where
        F: Future<Output = Result<(), idempotency::brokers::Error>> + Send + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped: Stopped = Box::pin(async {
            let _ = stopped.await;
        });
        Consuming {
            stop,
            running: runtime.spawn(consume(stopped)),
        }
    }

    /// Stops the consumer and asserts that it ran without an error and
    /// stopped within the tests' patience.
    pub fn stop(self, runtime: &Runtime) {
        self.stop.send(()).expect("the consumer runs");
        // The timer is made inside the runtime, whose clock it needs.
        let ran = runtime
            .block_on(async { tokio::time::timeout(PATIENCE, self.running).await })
            .expect("the consumer stops in time");
        ran.expect("the consumer's task").expect("the consumer ran");
    }
}

/// The trace context the shop's request had when it enqueued its messages.
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
pub const TRACESTATE: &str = "shop=1";

/// How many orders a test places, and over how many customers (the
/// ordering keys).
pub const ORDERS: i64 = 60;
pub const CUSTOMERS: i64 = 4;

/// An order's message.
#[derive(Debug, Serialize, Deserialize)]
pub struct Order {
    pub id: i64,
    pub customer: String,
    /// A message the consumer's handler fails on every delivery.
    pub poison: bool,
}

/// The shop's database: orders, and their messages in its outbox.
pub struct Shop {
    pub db: SqliteFile,
    pub topic: String,
    /// How many orders it placed, over how many customers.
    pub orders: i64,
    pub customers: i64,
}

impl Shop {
    /// A shop whose `ORDERS` orders, spread over `CUSTOMERS` customers,
    /// were placed in one transaction with a message each for `topic`,
    /// keyed by the customer, with a header and the trace context.
    pub fn with_orders(topic: &str) -> Shop {
        Shop::with_orders_of(topic, ORDERS, CUSTOMERS)
    }

    /// A shop as [`Shop::with_orders`], with `orders` orders over
    /// `customers` customers.
    pub fn with_orders_of(topic: &str, orders: i64, customers: i64) -> Shop {
        let db = SqliteFile::new();
        let mut conn = db.conn();
        diesel::sql_query("CREATE TABLE orders (id BIGINT PRIMARY KEY, customer TEXT NOT NULL)")
            .execute(&mut conn)
            .expect("create the orders table");
        conn.transaction(|tx| {
            for id in 1..=orders {
                let customer = format!("customer-{}", id % customers);
                diesel::sql_query("INSERT INTO orders (id, customer) VALUES (?, ?)")
                    .bind::<BigInt, _>(id)
                    .bind::<Text, _>(&customer)
                    .execute(tx)?;
                Envelope::new(
                    topic,
                    &Order {
                        id,
                        customer: customer.clone(),
                        poison: false,
                    },
                )
                .ordering_key(customer)
                .header("x-order", id.to_string())
                .traceparent(TRACEPARENT)
                .tracestate(TRACESTATE)
                .enqueue(tx)
                .map_err(|error| diesel::result::Error::QueryBuilderError(Box::new(error)))?;
            }
            Ok::<_, diesel::result::Error>(())
        })
        .expect("place the orders");
        Shop {
            db,
            topic: topic.to_owned(),
            orders,
            customers,
        }
    }

    /// Enqueues a message the consumer fails on every delivery; its key.
    pub fn enqueue_poison(&self) -> String {
        let order = Order {
            id: 0,
            customer: String::from("nobody"),
            poison: true,
        };
        Envelope::new(self.topic.as_str(), &order)
            .enqueue(&mut self.db.conn())
            .expect("enqueue the poison message")
    }

    /// Relays the outbox with `publish` (a message of an ordering key
    /// waits for the one before it) until no message is due.
    pub fn relay(&self, mut publish: impl FnMut(&Message) -> Result<(), Failure>) -> Deliveries {
        let mut conn = self.db.conn();
        let mut total = Deliveries::default();
        loop {
            let report = Relay::default()
                .run_once(&mut conn, &mut publish)
                .expect("relay the outbox");
            total += report;
            if report.claimed == 0 {
                return total;
            }
        }
    }

    /// Relays the outbox publishing every message twice with `publisher`,
    /// as a relay that died between the broker's confirmation and its mark
    /// would, and checks that each order and the poison message counted
    /// delivered once and nothing failed: how many messages there were.
    pub fn relay_each_twice<P: Publisher>(&self, publisher: &BlockingPublisher<P>) -> usize {
        let report = self.relay(|message| {
            publisher.publish(message)?;
            publisher.publish(message)
        });
        let published = usize::try_from(self.orders).unwrap() + 1;
        assert_eq!(report.delivered, published);
        assert_eq!((report.retried, report.dead), (0, 0));
        published
    }

    /// Relays the outbox with `publish` until every message is delivered:
    /// a failed message is due again after its backoff, which the relay's
    /// own clock is moved past whenever nothing else is due.
    pub fn relay_through_failures(&self, mut publish: impl FnMut(&Message) -> Result<(), Failure>) -> Deliveries {
        let clock = idempotency::testing::ManualClock::new();
        // Attempts enough for a broker to come back between two of them.
        let relay = Relay::default().clock(clock.source()).max_attempts(100);
        let mut conn = self.db.conn();
        let mut total = Deliveries::default();
        loop {
            let report = relay.run_once(&mut conn, &mut publish).expect("relay the outbox");
            total += report;
            if report.claimed == 0 {
                if relay.stats(&mut conn).expect("the outbox's stats").pending == 0 {
                    return total;
                }
                clock.advance(chrono::Duration::hours(1));
            }
        }
    }
}

/// The consumer's database: one row per effect, in the order the consumer
/// wrote them.
pub struct Effects {
    pub db: SqliteFile,
}

#[derive(QueryableByName)]
struct Effect {
    #[diesel(sql_type = BigInt)]
    order_id: i64,
    #[diesel(sql_type = Text)]
    customer: String,
    #[diesel(sql_type = Nullable<Text>)]
    traceparent: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    header: Option<String>,
}

impl Effects {
    pub fn new() -> Effects {
        let db = SqliteFile::new();
        diesel::sql_query(
            "CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, order_id BIGINT NOT NULL, \
             customer TEXT NOT NULL, traceparent TEXT, header TEXT)",
        )
        .execute(&mut db.conn())
        .expect("create the effects table");
        Effects { db }
    }

    /// An inbox that writes an order's effect, and fails a poison message.
    pub fn inbox(
        &self,
        scope: &str,
    ) -> Inbox<SqliteConnection, impl Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static>
    {
        self.inbox_with(scope, |_| {})
    }

    /// An inbox as [`Effects::inbox`] that calls `before_commit` with each
    /// order whose effect it wrote, inside the transaction.
    pub fn inbox_with(
        &self,
        scope: &str,
        before_commit: impl Fn(&Order) + Send + Sync + 'static,
    ) -> Inbox<SqliteConnection, impl Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static>
    {
        effects_inbox(self.db.path().to_str().expect("a utf-8 path"), scope, before_commit)
    }

    /// A deadpool pool of diesel-async connections to the effects'
    /// database, for an [`AsyncInbox`](idempotency::brokers::AsyncInbox)
    /// whose handler is [`write_effect`].
    #[cfg(feature = "sqlite-async")]
    pub fn async_pool(&self) -> AsyncSqlitePool {
        let url = self.db.path().to_str().expect("a utf-8 path").to_owned();
        AsyncSqlitePool::builder(diesel_async::pooled_connection::AsyncDieselConnectionManager::new(url))
            .max_size(2)
            .build()
            .expect("a pool on the effects database")
    }

    /// How many effects are written.
    #[cfg(any(
        feature = "rabbitmq",
        all(feature = "redis", feature = "axum", feature = "sqlite-async")
    ))]
    pub fn count(&self) -> usize {
        self.rows().len()
    }

    /// Whether the effect of order `id` is written.
    #[cfg(feature = "redis")]
    pub fn has(&self, id: i64) -> bool {
        self.rows().iter().any(|row| row.order_id == id)
    }

    fn rows(&self) -> Vec<Effect> {
        diesel::sql_query("SELECT order_id, customer, traceparent, header FROM effects ORDER BY seq")
            .load(&mut self.db.conn())
            .expect("read the effects")
    }

    /// Every order of `shop` has its effect once, the effects of each
    /// customer came in the order the orders were placed, and each carried
    /// its header and the shop's trace context.
    pub fn assert_each_order_once_in_order(&self, shop: &Shop) {
        let rows = self.rows();
        let mut ids: Vec<i64> = rows.iter().map(|row| row.order_id).collect();
        let in_consumer_order = ids.clone();
        ids.sort_unstable();
        assert_eq!(
            ids,
            (1..=shop.orders).collect::<Vec<_>>(),
            "each order once: {in_consumer_order:?}"
        );
        let mut by_customer: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for row in &rows {
            by_customer.entry(row.customer.as_str()).or_default().push(row.order_id);
            assert_eq!(row.customer, format!("customer-{}", row.order_id % shop.customers));
            assert_eq!(row.traceparent.as_deref(), Some(TRACEPARENT));
            assert_eq!(row.header, Some(row.order_id.to_string()));
        }
        assert_eq!(by_customer.len(), usize::try_from(shop.customers).unwrap());
        for (customer, ids) in by_customer {
            assert!(ids.is_sorted(), "{customer}'s orders out of order: {ids:?}");
        }
    }
}

/// The inbox of [`Effects::inbox_with`] on the effects database at `url`,
/// also in a consumer process of a test's own.
pub fn effects_inbox(
    url: &str,
    scope: &str,
    before_commit: impl Fn(&Order) + Send + Sync + 'static,
) -> Inbox<SqliteConnection, impl Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static> {
    let pool = Pool::builder()
        .max_size(2)
        .build(ConnectionManager::<SqliteConnection>::new(url))
        .expect("a pool on the effects database");
    Inbox::new(pool, scope, move |conn: &mut SqliteConnection, delivery: &Delivery| {
        let order: Order = delivery.payload()?;
        if order.poison {
            return Err(Failure::Retry(String::from("this message always fails")));
        }
        diesel::sql_query("INSERT INTO effects (order_id, customer, traceparent, header) VALUES (?, ?, ?, ?)")
            .bind::<BigInt, _>(order.id)
            .bind::<Text, _>(delivery.ordering_key().unwrap_or_default())
            .bind::<Nullable<Text>, _>(delivery.traceparent())
            .bind::<Nullable<Text>, _>(delivery.header("x-order"))
            .execute(conn)?;
        before_commit(&order);
        Ok(())
    })
}

/// The diesel-async connection of [`Effects::async_pool`].
#[cfg(feature = "sqlite-async")]
pub type AsyncSqlite = diesel_async::sync_connection_wrapper::SyncConnectionWrapper<SqliteConnection>;

/// The pool of [`Effects::async_pool`].
#[cfg(feature = "sqlite-async")]
pub type AsyncSqlitePool = diesel_async::pooled_connection::deadpool::Pool<AsyncSqlite>;

/// What [`Effects::inbox`] does for a delivery, on a diesel-async
/// connection: writes an order's effect, and fails a poison message.
#[cfg(feature = "sqlite-async")]
pub async fn write_effect(conn: &mut AsyncSqlite, delivery: &Delivery) -> Result<(), Failure> {
    let order: Order = delivery.payload()?;
    if order.poison {
        return Err(Failure::Retry(String::from("this message always fails")));
    }
    let insert = diesel::sql_query("INSERT INTO effects (order_id, customer, traceparent, header) VALUES (?, ?, ?, ?)")
        .bind::<BigInt, _>(order.id)
        .bind::<Text, _>(delivery.ordering_key().unwrap_or_default().to_owned())
        .bind::<Nullable<Text>, _>(delivery.traceparent().map(str::to_owned))
        .bind::<Nullable<Text>, _>(delivery.header("x-order").map(str::to_owned));
    diesel_async::RunQueryDsl::execute(insert, conn).await?;
    Ok(())
}

/// How a [`PrivateBroker`] is stopped for a restart.
pub enum Stopping {
    /// By this signal to its process (`KILL`, `TERM`).
    #[cfg(any(feature = "nats", feature = "redis"))]
    Signal(&'static str),
    /// By this command (its program and arguments), which returns once the
    /// broker stopped.
    #[cfg(feature = "rabbitmq")]
    Command(Vec<String>),
}

/// A broker of the test's own, on a port of its own, that the test stops
/// and starts again: the shared brokers are never restarted.
pub struct PrivateBroker {
    program: &'static str,
    stopping: Stopping,
    args: Vec<String>,
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: std::process::Child,
}

impl PrivateBroker {
    /// Starts `program` with the arguments `args` makes of a free port and
    /// a new directory; its output goes to `broker.log` there. `restart`
    /// stops it as `stopping` says.
    pub fn start(
        program: &'static str,
        stopping: Stopping,
        args: impl Fn(u16, &std::path::Path) -> Vec<String>,
    ) -> PrivateBroker {
        let port = free_port();
        let dir = tempfile::tempdir().expect("a directory for the broker");
        let args = args(port, dir.path());
        let child = Self::spawn(program, &args, dir.path());
        PrivateBroker {
            program,
            stopping,
            args,
            port,
            dir,
            child,
        }
    }

    fn spawn(program: &str, args: &[String], dir: &std::path::Path) -> std::process::Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("broker.log"))
            .expect("the broker's log");
        std::process::Command::new(program)
            .args(args)
            .stdout(log.try_clone().expect("the broker's log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("start {program} (installed with the broker): {error}"))
    }

    fn stop(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match &self.stopping {
            #[cfg(any(feature = "nats", feature = "redis"))]
            Stopping::Signal(signal) => std::process::Command::new("kill")
                .args(["-s", signal, &self.child.id().to_string()])
                .status(),
            #[cfg(feature = "rabbitmq")]
            Stopping::Command(command) => std::process::Command::new(&command[0])
                .args(&command[1..])
                .stdout(std::process::Stdio::null())
                .status(),
        }
    }

    /// Stops the broker and starts it again on the same port and directory
    /// once it has exited.
    pub fn restart(&mut self) {
        let stopped = self.stop().expect("stop the broker");
        assert!(stopped.success(), "stop the broker");
        self.child.wait().expect("reap the broker");
        self.child = Self::spawn(self.program, &self.args, self.dir.path());
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        // A command stops a broker whose process is not the one started
        // (RabbitMQ's script starts the node as its own user).
        #[cfg(feature = "rabbitmq")]
        if matches!(self.stopping, Stopping::Command(_)) {
            let _ = self.stop();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port no one listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// Whether something accepts connections on `port`.
#[cfg(feature = "rabbitmq")]
pub fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}
