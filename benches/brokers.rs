//! The outbox delivered to each broker on this machine's default ports
//! (NATS JetStream 4222, RabbitMQ 5672, Redis 6379): how many messages a
//! second reach the broker, confirmed, and how long a message takes from
//! its commit to its consumer's effect.
//!
//! ```text
//! cargo bench --features nats,rabbitmq,redis,sqlite-async --bench brokers [-- --quick] [--broker redis] [--messages N]
//! ```
//!
//! Scenarios, for each broker, on one SQLite outbox (WAL) in a temporary
//! directory:
//!
//! - `bare, one at a time`: the publisher alone, no database: each message
//!   published and its confirmation awaited before the next;
//! - `bare, pipelined`: the same publisher with 64 publications awaiting
//!   their confirmations at once: the broker's confirmed rate;
//! - `closure relay`: `Relay::run_once` with a handler that does nothing:
//!   what the outbox's claims and marks cost alone;
//! - `thread relay`: `Relay::serve` with `BlockingPublisher`, one worker;
//! - `async relay`: `Relay::serve_async` on a bb8 pool, one worker, the
//!   publisher awaited as it is;
//! - `async relay, 64 in flight`: the same with `Relay::in_flight(64)`:
//!   64 publications of a batch awaiting their confirmations at once, and
//!   those confirmed marked in one statement;
//! - `async relay, batches of 1000, 500 in flight`: claims of 1000
//!   messages, handed over 500 at a time;
//! - `the same, its handler doing nothing`: what the outbox's claims and
//!   marks cost the relay above at most, its floor on this database.
//!
//! Each relay scenario delivers the same number of messages, enqueued
//! before it starts, and its rate counts from its start to its last mark.
//! The latency scenario runs the async relay and the broker's consumer
//! (an inbox writing one row per message into a database of its own)
//! while messages are enqueued one per transaction, 5 ms apart: the time
//! from each commit to the consumer's write of its effect, p50 and p99.
//! `--quick` shrinks every count so that a run takes seconds: CI uses it to
//! keep the bench working, not to judge speed.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, stream};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use futures_util::{StreamExt, TryStreamExt};
use idempotency::brokers::nats::{JetStreamConsumer, JetStreamPublisher};
use idempotency::brokers::rabbitmq::{self, RabbitConsumer, RabbitPublisher, Route};
use idempotency::brokers::redis::{RedisConsumer, RedisPublisher};
use idempotency::brokers::{self as brokers, BlockingPublisher, Delivery, Inbox, Publisher};
use idempotency::outbox::{self, Failure, Message, Relay};
use idempotency::{Shutdown, run_idempotent};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use tokio::runtime::Runtime;

type BoxError = Box<dyn Error + Send + Sync>;
type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;
type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;
type Consuming = Pin<Box<dyn Future<Output = Result<(), brokers::Error>> + Send>>;

/// How many publications await their confirmations at once in the
/// pipelined bare scenario.
const IN_FLIGHT: usize = 64;

/// The counts of a run.
struct Counts {
    /// Messages per throughput scenario.
    messages: usize,
    /// Messages of the latency scenario.
    timed: usize,
}

#[derive(Debug)]
struct WaitForLocks;

impl diesel::r2d2::CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for WaitForLocks {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 5000")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// A SQLite database at `path` in WAL mode with the crate's tables and
/// `table`.
fn database(path: &std::path::Path, table: &str) -> Result<SqlitePool, BoxError> {
    let pool = Pool::builder()
        .max_size(4)
        .connection_customizer(Box::new(WaitForLocks))
        .build(ConnectionManager::<SqliteConnection>::new(path.to_string_lossy()))?;
    let mut conn = pool.get()?;
    conn.batch_execute("PRAGMA journal_mode = WAL")?;
    idempotency::run_migrations(&mut conn)?;
    conn.batch_execute(table)?;
    Ok(pool)
}

/// What the bench does with one broker: a publisher, and a consumer of
/// what it published that runs an inbox until its stop.
trait Broker {
    type Publisher: Publisher + 'static;

    fn name(&self) -> &'static str;

    fn publisher(&self, runtime: &Runtime) -> Result<Self::Publisher, BoxError>;

    fn consumer<H>(&self, inbox: Inbox<SqliteConnection, H>, stop: Stop) -> Consuming
    where
        H: Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static;

    /// Removes what the bench made on the broker.
    fn clean(&self, runtime: &Runtime) -> Result<(), BoxError>;
}

struct Nats {
    context: jetstream::Context,
    name: String,
    pull: consumer::PullConsumer,
}

impl Nats {
    fn new(runtime: &Runtime, name: &str) -> Result<Nats, BoxError> {
        let context = jetstream::new(runtime.block_on(async_nats::connect("127.0.0.1:4222"))?);
        let created = runtime.block_on(context.create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![name.to_owned()],
            ..stream::Config::default()
        }))?;
        let pull = runtime.block_on(created.create_consumer(consumer::pull::Config {
            durable_name: Some(String::from("bench")),
            ack_policy: consumer::AckPolicy::Explicit,
            ..consumer::pull::Config::default()
        }))?;
        Ok(Nats {
            context,
            name: name.to_owned(),
            pull,
        })
    }
}

impl Broker for Nats {
    type Publisher = JetStreamPublisher;

    fn name(&self) -> &'static str {
        "NATS JetStream"
    }

    fn publisher(&self, _: &Runtime) -> Result<JetStreamPublisher, BoxError> {
        let subject = self.name.clone();
        Ok(JetStreamPublisher::new(self.context.clone()).subject(move |_| subject.clone()))
    }

    fn consumer<H>(&self, inbox: Inbox<SqliteConnection, H>, stop: Stop) -> Consuming
    where
        H: Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static,
    {
        let consumer = JetStreamConsumer::new(self.context.clone(), self.pull.clone(), inbox);
        Box::pin(async move { consumer.run(stop).await })
    }

    fn clean(&self, runtime: &Runtime) -> Result<(), BoxError> {
        runtime.block_on(self.context.delete_stream(&self.name))?;
        Ok(())
    }
}

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

struct Rabbit {
    channel: lapin::Channel,
    name: String,
}

impl Rabbit {
    fn new(runtime: &Runtime, name: &str) -> Result<Rabbit, BoxError> {
        let connection = runtime.block_on(rabbitmq::connect(AMQP))?;
        let channel = runtime.block_on(connection.create_channel())?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        runtime.block_on(channel.queue_declare(name, durable, arguments))?;
        Ok(Rabbit {
            channel,
            name: name.to_owned(),
        })
    }
}

impl Broker for Rabbit {
    type Publisher = RabbitPublisher;

    fn name(&self) -> &'static str {
        "RabbitMQ"
    }

    fn publisher(&self, runtime: &Runtime) -> Result<RabbitPublisher, BoxError> {
        let queue = self.name.clone();
        Ok(runtime
            .block_on(RabbitPublisher::connect(AMQP, ""))?
            .route(move |_| Route::new("", queue.clone())))
    }

    fn consumer<H>(&self, inbox: Inbox<SqliteConnection, H>, stop: Stop) -> Consuming
    where
        H: Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static,
    {
        let consumer = RabbitConsumer::new(AMQP, self.name.clone(), inbox);
        Box::pin(async move { consumer.run(stop).await })
    }

    fn clean(&self, runtime: &Runtime) -> Result<(), BoxError> {
        runtime.block_on(self.channel.queue_delete(&self.name, QueueDeleteOptions::default()))?;
        Ok(())
    }
}

struct Redis {
    client: redis::Client,
    name: String,
}

impl Broker for Redis {
    type Publisher = RedisPublisher;

    fn name(&self) -> &'static str {
        "Redis Streams"
    }

    fn publisher(&self, runtime: &Runtime) -> Result<RedisPublisher, BoxError> {
        let stream = self.name.clone();
        Ok(runtime
            .block_on(RedisPublisher::connect(self.client.clone()))?
            .stream(move |_| stream.clone()))
    }

    fn consumer<H>(&self, inbox: Inbox<SqliteConnection, H>, stop: Stop) -> Consuming
    where
        H: Fn(&mut SqliteConnection, &Delivery) -> Result<(), Failure> + Send + Sync + 'static,
    {
        let consumer = RedisConsumer::new(self.client.clone(), self.name.clone(), "bench", "bench-1", inbox);
        Box::pin(async move { consumer.run(stop).await })
    }

    fn clean(&self, _: &Runtime) -> Result<(), BoxError> {
        let mut conn = self.client.get_connection()?;
        redis::cmd("DEL")
            .arg(&self.name)
            .arg(format!("{}:dead", self.name))
            .query::<()>(&mut conn)?;
        Ok(())
    }
}

/// A shop's outbox in a directory of its own, with `messages` messages of
/// topic `orders` enqueued in one transaction, without ordering keys (a
/// claim takes one message of a key at a time).
fn shop_with(dir: &std::path::Path, messages: usize) -> Result<(SqlitePool, String), BoxError> {
    let path = dir.join(format!("shop-{}.db", NEXT_SHOP.fetch_add(1, Ordering::Relaxed)));
    let pool = database(&path, "CREATE TABLE orders (id BIGINT PRIMARY KEY)")?;
    pool.get()?.transaction(|tx| {
        for id in 0..messages {
            outbox::enqueue(tx, "orders", &id)?;
        }
        Ok::<_, outbox::Error>(())
    })?;
    Ok((pool, path.to_string_lossy().into_owned()))
}

static NEXT_SHOP: AtomicUsize = AtomicUsize::new(0);

/// Messages a second of `count` messages in `elapsed`.
fn rate(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

/// The scenarios on the broker `make` makes for a name: the throughput
/// scenarios on one, the latency on another, whose consumer finds no
/// backlog of the others' messages.
fn run_broker<B: Broker>(
    make: impl Fn(&str) -> Result<B, BoxError>,
    runtime: &Runtime,
    dir: &std::path::Path,
    counts: &Counts,
) -> Result<(), BoxError> {
    let name = format!("bench_{}", std::process::id());
    let broker = &make(&name)?;
    let publisher = Arc::new(broker.publisher(runtime)?);
    let messages: Vec<Message> = {
        // The relay's own messages, read back as the bare publisher's input.
        let (pool, _) = shop_with(dir, counts.messages)?;
        let mut read = Vec::new();
        Relay::default()
            .batch_size(counts.messages)
            .run_once(&mut pool.get()?, |message| {
                read.push(message.clone());
                Ok::<_, Failure>(())
            })?;
        assert_eq!(read.len(), counts.messages, "one claim takes every message");
        read
    };
    let mut rows = Vec::new();

    let started = Instant::now();
    runtime
        .block_on(async {
            for message in &messages {
                publisher.publish(message).await?;
            }
            Ok::<_, Failure>(())
        })
        .map_err(|failure| format!("{failure:?}"))?;
    rows.push(("bare, one at a time", rate(messages.len(), started.elapsed())));

    let started = Instant::now();
    runtime
        .block_on(
            futures_util::stream::iter(messages.iter().map(|message| publisher.publish(message)))
                .buffer_unordered(IN_FLIGHT)
                .try_collect::<()>(),
        )
        .map_err(|failure| format!("{failure:?}"))?;
    let pipelined = rate(messages.len(), started.elapsed());
    rows.push(("bare, pipelined", pipelined));

    let (shop, _) = shop_with(dir, counts.messages)?;
    let started = Instant::now();
    let mut conn = shop.get()?;
    let mut delivered = 0;
    while delivered < counts.messages {
        delivered += Relay::default()
            .run_once(&mut conn, |_| Ok::<_, Failure>(()))?
            .delivered;
    }
    rows.push(("closure relay", rate(delivered, started.elapsed())));

    let (shop, _) = shop_with(dir, counts.messages)?;
    let blocking = BlockingPublisher::new(broker.publisher(runtime)?, runtime.handle().clone());
    let shutdown = Shutdown::new();
    let started = Instant::now();
    let done = AtomicUsize::new(0);
    let stopped = std::thread::scope(|scope| {
        let service = scope.spawn(|| {
            Relay::default().poll_interval(chrono::Duration::milliseconds(5)).serve(
                &shop,
                |message| {
                    blocking.publish(message)?;
                    if done.fetch_add(1, Ordering::SeqCst) + 1 == counts.messages {
                        shutdown.trigger();
                    }
                    Ok::<_, Failure>(())
                },
                &shutdown,
            )
        });
        service.join().map_err(|_| "the thread relay panicked")
    })?;
    rows.push(("thread relay", rate(stopped.work.delivered, started.elapsed())));

    let scenarios = [
        ("async relay", 100, 1, true),
        ("async relay, 64 in flight", 100, 64, true),
        ("async relay, batches of 1000, 500 in flight", 1000, 500, true),
        ("the same, its handler doing nothing", 1000, 500, false),
    ];
    for (scenario, batch_size, in_flight, publishes) in scenarios {
        let (_, shop_path) = shop_with(dir, counts.messages)?;
        let relay = Relay::default()
            .poll_interval(chrono::Duration::milliseconds(5))
            .batch_size(batch_size)
            .in_flight(in_flight);
        let publisher = publishes.then(|| Arc::clone(&publisher));
        let rate = runtime.block_on(async_relay(relay, shop_path, publisher, counts.messages))?;
        rows.push((scenario, rate));
    }

    broker.clean(runtime)?;
    let timed = make(&format!("{name}_latency"))?;
    let (p50, p99) = latency(&timed, runtime, dir, counts, &Arc::new(timed.publisher(runtime)?))?;
    println!("\n{} ({} messages each)\n", broker.name(), counts.messages);
    println!("| scenario | messages/s | share of the pipelined bare rate |");
    println!("| --- | ---: | ---: |");
    for (scenario, rate) in rows {
        println!("| {scenario} | {rate:.0} | {:.2} |", rate / pipelined);
    }
    println!(
        "\ncommit to the consumer's effect, {} messages: p50 {:.1} ms, p99 {:.1} ms",
        counts.timed,
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
    timed.clean(runtime)
}

/// `relay` on tokio over the shop at `shop_path`, publishing with
/// `publisher` (or, without one, doing nothing) until `total` messages are
/// delivered: messages a second.
async fn async_relay<P: Publisher + 'static>(
    relay: Relay,
    shop_path: String,
    publisher: Option<Arc<P>>,
    total: usize,
) -> Result<f64, BoxError> {
    let pool = diesel_async::pooled_connection::bb8::Pool::builder()
        .max_size(2)
        .build(AsyncDieselConnectionManager::<SyncConnectionWrapper<SqliteConnection>>::new(shop_path))
        .await?;
    let shutdown = Shutdown::new();
    let done = Arc::new(AtomicUsize::new(0));
    let publish = {
        let shutdown = shutdown.clone();
        move |message: Message| {
            let (publisher, shutdown, done) = (publisher.clone(), shutdown.clone(), Arc::clone(&done));
            async move {
                if let Some(publisher) = publisher {
                    publisher.publish(&message).await?;
                }
                if done.fetch_add(1, Ordering::SeqCst) + 1 == total {
                    shutdown.trigger();
                }
                Ok::<_, Failure>(())
            }
        }
    };
    let started = Instant::now();
    let stopped = relay.serve_async(&pool, publish, &shutdown).await;
    Ok(rate(stopped.work.delivered, started.elapsed()))
}

/// Microseconds since the epoch, as a message carries its commit time.
fn now_micros() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros(),
    )
    .unwrap_or(u64::MAX)
}

/// The async relay and the broker's consumer running while `counts.timed`
/// messages are committed one per transaction, 5 ms apart: p50 and p99 of
/// the time from each commit to its effect.
fn latency<B: Broker>(
    broker: &B,
    runtime: &Runtime,
    dir: &std::path::Path,
    counts: &Counts,
    publisher: &Arc<B::Publisher>,
) -> Result<(Duration, Duration), BoxError> {
    let (shop, shop_path) = shop_with(dir, 0)?;
    let effects = database(
        &dir.join(format!("effects-{}.db", NEXT_SHOP.fetch_add(1, Ordering::Relaxed))),
        "CREATE TABLE effects (id BIGINT PRIMARY KEY)",
    )?;
    let waits: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let inbox = {
        let waits = Arc::clone(&waits);
        Inbox::new(
            effects,
            "bench",
            move |conn: &mut SqliteConnection, delivery: &Delivery| {
                // The throughput scenarios' messages came first on the same
                // stream or queue: consumed, and not timed.
                let Ok((id, committed)) = delivery.payload::<(i64, u64)>() else {
                    return Ok(());
                };
                diesel::sql_query("INSERT INTO effects (id) VALUES (?)")
                    .bind::<diesel::sql_types::BigInt, _>(id)
                    .execute(conn)?;
                let wait = Duration::from_micros(now_micros().saturating_sub(committed));
                waits.lock().unwrap_or_else(PoisonError::into_inner).push(wait);
                Ok(())
            },
        )
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = runtime.spawn(broker.consumer(
        inbox,
        Box::pin(async {
            let _ = stopped.await;
        }),
    ));
    let shutdown = Shutdown::new();
    let relay = runtime.spawn({
        let (publisher, shutdown) = (Arc::clone(publisher), shutdown.clone());
        async move {
            let pool = diesel_async::pooled_connection::bb8::Pool::builder()
                .max_size(2)
                .build(AsyncDieselConnectionManager::<SyncConnectionWrapper<SqliteConnection>>::new(shop_path))
                .await?;
            let publish = move |message: Message| {
                let publisher = Arc::clone(&publisher);
                async move { publisher.publish(&message).await }
            };
            let stopped = Relay::default()
                .poll_interval(chrono::Duration::milliseconds(2))
                .serve_async(&pool, publish, &shutdown)
                .await;
            Ok::<_, BoxError>(stopped)
        }
    });
    let mut conn = shop.get()?;
    for id in 0..counts.timed {
        let id = i64::try_from(id)?;
        run_idempotent(&mut conn, "bench", &id.to_string(), &id, |tx| {
            outbox::enqueue(tx, "orders", &(id, now_micros()))
        })?;
        std::thread::sleep(Duration::from_millis(5));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while waits.lock().unwrap_or_else(PoisonError::into_inner).len() < counts.timed {
        if Instant::now() > deadline {
            return Err("not every message had its effect within 60 s: is the broker running?".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    shutdown.trigger();
    let _ = stop.send(());
    runtime.block_on(relay)??;
    runtime.block_on(consumer)??;
    let mut waits = std::mem::take(&mut *waits.lock().unwrap_or_else(PoisonError::into_inner));
    waits.sort_unstable();
    let at = |share: f64| waits[((waits.len() - 1) as f64 * share).round() as usize];
    Ok((at(0.5), at(0.99)))
}

fn main() -> ExitCode {
    let mut quick = false;
    let mut only = None;
    let mut messages = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--broker" => only = args.next(),
            "--messages" => messages = args.next().and_then(|count| count.parse().ok()),
            _ => {}
        }
    }
    let mut counts = if quick {
        Counts {
            messages: 50,
            timed: 10,
        }
    } else {
        Counts {
            messages: 2_000,
            timed: 200,
        }
    };
    counts.messages = messages.unwrap_or(counts.messages);
    match run(&counts, only.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

fn run(counts: &Counts, only: Option<&str>) -> Result<(), BoxError> {
    let runtime = Runtime::new()?;
    let _entered = runtime.enter();
    let dir = tempfile::tempdir()?;
    let wanted = |broker: &str| only.is_none_or(|only| only == broker);
    if wanted("nats") {
        run_broker(|name| Nats::new(&runtime, name), &runtime, dir.path(), counts)?;
    }
    if wanted("rabbitmq") {
        run_broker(|name| Rabbit::new(&runtime, name), &runtime, dir.path(), counts)?;
    }
    if wanted("redis") {
        let redis = |name: &str| {
            Ok(Redis {
                client: redis::Client::open("redis://127.0.0.1:6379")?,
                name: name.to_owned(),
            })
        };
        run_broker(redis, &runtime, dir.path(), counts)?;
    }
    Ok(())
}
