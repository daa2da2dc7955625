//! Redis Streams on 127.0.0.1:6379.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use diesel::SqliteConnection;
use idempotency::brokers::redis::{HEADER_FIELD_PREFIX, KEY_FIELD, PAYLOAD_FIELD, RedisConsumer, RedisPublisher, Trim};
use idempotency::brokers::{BlockingPublisher, Receive};
use idempotency::outbox::{Deliveries, Failure, Message, Relay};
use redis::Commands;
use tokio::runtime::Runtime;

use super::{Consuming, Effects, ORDERS, Order, PrivateBroker, Shop, Stopping};
use crate::common::unique_name;
use crate::common::wait::{recv, wait_for};

const URL: &str = "redis://127.0.0.1:6379";

fn client() -> redis::Client {
    redis::Client::open(URL).expect("a redis url")
}

fn connection() -> redis::Connection {
    client()
        .get_connection()
        .expect("Redis on 127.0.0.1:6379 (.ci/run starts it)")
}

/// A publisher to `stream` on the shared Redis, for a relay on threads.
fn publisher_to(runtime: &Runtime, stream: &str) -> BlockingPublisher<RedisPublisher> {
    let target = stream.to_owned();
    let publisher = runtime
        .block_on(RedisPublisher::connect(client()))
        .expect("Redis on 127.0.0.1:6379 (.ci/run starts it)")
        .stream(move |_| target.clone());
    BlockingPublisher::new(publisher, runtime.handle().clone())
}

/// The consumer `consumer-1` of the group `inbox` on `stream`, running
/// `inbox`.
fn consumer_of<I: Receive>(stream: &str, inbox: I) -> RedisConsumer<I> {
    RedisConsumer::new(client(), stream.to_owned(), "inbox", "consumer-1", inbox)
}

/// Waits until Redis reports every entry of `stream` delivered to the
/// group `inbox` and none pending: each acknowledged or dead-lettered.
fn wait_until_all_acknowledged(redis: &mut redis::Connection, stream: &str) {
    wait_for("every entry acknowledged", || {
        let groups: redis::streams::StreamInfoGroupsReply = redis.xinfo_groups(stream).expect("XINFO GROUPS");
        // No group until the consumer created it.
        groups
            .groups
            .first()
            .is_some_and(|group| (group.lag, group.pending) == (Some(0), 0))
    });
}

#[test]
fn every_order_has_its_effect_once_in_order_though_published_twice_and_the_poison_is_dead_lettered() {
    each_order_once_though_published_twice(|runtime, stream, effects| {
        let consumer = consumer_of(stream, effects.inbox("orders-inbox"))
            .max_deliveries(3)
            .claim_idle(Duration::from_millis(50));
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

#[cfg(feature = "sqlite-async")]
#[test]
fn an_async_inbox_has_each_orders_effect_once_in_order_though_published_twice_and_dead_letters_the_poison() {
    use idempotency::brokers::{AsyncInbox, Delivery};

    use super::{AsyncSqlite, write_effect};

    each_order_once_though_published_twice(|runtime, stream, effects| {
        let inbox = AsyncInbox::new(
            effects.async_pool(),
            "orders-inbox",
            async |conn: &mut AsyncSqlite, delivery: &Delivery| write_effect(conn, delivery).await,
        );
        let consumer = consumer_of(stream, inbox)
            .max_deliveries(3)
            .claim_idle(Duration::from_millis(50));
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

/// Publishes a shop's orders and a poison message, each twice, to a stream
/// of its own, as a relay that died between the confirmation and its mark
/// would (Redis keeps both copies); consumes them with the consumer
/// `consume` starts on the stream, which writes `Effects` and
/// dead-letters after 3 deliveries; checks every order's effect once and in
/// order and both copies of the poison message dead-lettered.
fn each_order_once_though_published_twice(consume: impl FnOnce(&Runtime, &str, &Effects) -> Consuming) {
    let runtime = Runtime::new().expect("a tokio runtime");
    let stream = unique_name("orders");
    let dead = format!("{stream}:dead");
    let shop = Shop::with_orders("orders");
    let poison = shop.enqueue_poison();
    let effects = Effects::new();

    let target = stream.clone();
    let publisher = runtime
        .block_on(RedisPublisher::connect(client()))
        .expect("Redis on 127.0.0.1:6379 (.ci/run starts it)")
        .stream(move |_| target.clone())
        .trim(Trim::AboutMaxLen(10_000));
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    // Redis keeps both copies of each.
    let published = shop.relay_each_twice(&publisher);
    let length: usize = connection().xlen(&stream).expect("XLEN");
    assert_eq!(length, 2 * published);

    let consuming = consume(&runtime, &stream, &effects);
    wait_until_all_acknowledged(&mut connection(), &stream);
    consuming.stop(&runtime);

    effects.assert_each_order_once_in_order(&shop);
    let mut redis = connection();
    // Both copies of the poison message, each after its own bound.
    let letters: redis::streams::StreamRangeReply = redis.xrange_all(&dead).expect("XRANGE");
    assert_eq!(letters.ids.len(), 2);
    for letter in &letters.ids {
        let fields: HashMap<String, String> = letter
            .map
            .keys()
            .map(|name| (name.clone(), letter.get(name).expect("a text field")))
            .collect();
        assert_eq!(fields.get(KEY_FIELD), Some(&poison));
        let reason = format!("{HEADER_FIELD_PREFIX}idempotency-dead-letter-reason");
        assert!(fields[&reason].contains("delivery 3 of 3"), "{fields:?}");
    }
    let pending: redis::streams::StreamPendingReply = redis.xpending(&stream, "inbox").expect("XPENDING");
    assert_eq!(pending.count(), 0, "every entry acknowledged");
    let _: () = redis.del(&[&stream, &dead]).expect("DEL");
}

/// Whether the entry of order `id` in `stream` is pending in the group
/// `inbox`: read by a consumer and never acknowledged.
pub fn pending_entry_of(redis: &mut redis::Connection, stream: &str, id: i64) -> bool {
    let entries: redis::streams::StreamRangeReply = redis.xrange_all(stream).expect("XRANGE");
    let entry = entries
        .ids
        .iter()
        .find(|entry| {
            let payload: Option<String> = entry.get(PAYLOAD_FIELD);
            payload.is_some_and(|payload| serde_json::from_str::<Order>(&payload).is_ok_and(|order| order.id == id))
        })
        .unwrap_or_else(|| panic!("order {id}'s entry"));
    let pending: redis::streams::StreamPendingCountReply =
        redis.xpending_count(stream, "inbox", "-", "+", 1000).expect("XPENDING");
    pending.ids.iter().any(|pending| pending.id == entry.id)
}

/// Whether the Redis at `url` answers.
fn answers(url: &str) -> bool {
    redis::Client::open(url)
        .and_then(|client| client.get_connection())
        .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn))
        .is_ok()
}

#[test]
fn a_redis_killed_and_started_again_mid_stream_loses_no_order_and_repeats_none() {
    // Killed (no shutdown of its own), but with every write appended and
    // synced before its reply: what Redis confirmed survives the kill.
    let mut broker = PrivateBroker::start("redis-server", Stopping::Signal("KILL"), |port, dir| {
        let dir = dir.to_str().expect("a utf-8 path");
        let port = port.to_string();
        let args = [
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
        ];
        args.into_iter()
            .chain(["--appendfsync", "always", "--dir", dir])
            .map(String::from)
            .collect()
    });
    let url = format!("redis://127.0.0.1:{}", broker.port);
    wait_for("the test's own Redis", || answers(&url));
    let client = redis::Client::open(url.as_str()).expect("a redis url");

    let runtime = Runtime::new().expect("a tokio runtime");
    let shop = Shop::with_orders("orders");
    let effects = Effects::new();
    let consumer = RedisConsumer::new(
        client.clone(),
        "orders",
        "inbox",
        "consumer-1",
        effects.inbox("orders-inbox"),
    )
    .claim_idle(Duration::from_millis(200));
    let consuming = Consuming::start(&runtime, |stopped| async move { consumer.run(stopped).await });

    let publisher = runtime
        .block_on(RedisPublisher::connect(client.clone()))
        .expect("the test's own Redis");
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone()).timeout(Duration::from_secs(2));
    let mut published = 0;
    let report = shop.relay_through_failures(|message| {
        published += 1;
        if published == ORDERS / 3 {
            // Mid-stream: the consumer is reading, the relay publishing.
            broker.restart();
            wait_for("the test's own Redis again", || answers(&url));
        }
        publisher.publish(message)
    });
    assert_eq!(report.delivered, usize::try_from(ORDERS).unwrap());
    assert!(report.retried >= 1, "a publish met the restart: {report:?}");

    let mut redis = client.get_connection().expect("the test's own Redis");
    wait_for("every entry acknowledged", || {
        let groups: redis::streams::StreamInfoGroupsReply = redis.xinfo_groups("orders").expect("XINFO GROUPS");
        let last: redis::streams::StreamRangeReply = redis.xrevrange_count("orders", "+", "-", 1).expect("XREVRANGE");
        groups.groups.first().is_some_and(|group| {
            group.pending == 0 && Some(&group.last_delivered_id) == last.ids.first().map(|entry| &entry.id)
        })
    });
    consuming.stop(&runtime);
    effects.assert_each_order_once_in_order(&shop);
}

#[test]
fn three_relays_with_failures_at_random_hand_each_customers_orders_over_in_order() {
    let runtime = Runtime::new().expect("a tokio runtime");
    let stream = unique_name("orders");
    let shop = Shop::with_orders_of("orders", 1000, 50);
    let effects = Effects::new();
    let publisher = publisher_to(&runtime, &stream);

    // A fifth of the first two attempts fail, chosen by the message key:
    // half of them before the publish (the broker never saw it), half after
    // (the broker has it, and gets it again).
    let handler = |message: &Message| {
        let mut hasher = DefaultHasher::new();
        (&message.key, message.attempt).hash(&mut hasher);
        let draw = hasher.finish() % 10;
        if message.attempt <= 2 && draw == 0 {
            return Err(Failure::Retry(String::from("failed before the publish")));
        }
        publisher.publish(message)?;
        if message.attempt <= 2 && draw == 1 {
            return Err(Failure::Retry(String::from("failed after the publish")));
        }
        Ok(())
    };
    let relay = Relay::default()
        .backoff(chrono::Duration::milliseconds(1), chrono::Duration::milliseconds(5))
        .batch_size(20);
    let totals: Vec<Deliveries> = std::thread::scope(|scope| {
        let relays: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    let mut conn = shop.db.conn();
                    let mut total = Deliveries::default();
                    loop {
                        let report = relay.run_once(&mut conn, handler).expect("relay the outbox");
                        total += report;
                        if report.claimed == 0 {
                            if relay.stats(&mut conn).expect("the outbox's stats").pending == 0 {
                                return total;
                            }
                            // Backed-off messages are due within milliseconds.
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        relays
            .into_iter()
            .map(|relay| relay.join().expect("a relay panicked"))
            .collect()
    });
    let delivered: usize = totals.iter().map(|total| total.delivered).sum();
    let retried: usize = totals.iter().map(|total| total.retried).sum();
    assert_eq!(delivered, 1000);
    assert!(retried > 0, "failures at random: {totals:?}");
    assert!(
        totals.iter().all(|total| total.delivered > 0),
        "each relay delivered: {totals:?}"
    );

    let consumer = consumer_of(&stream, effects.inbox("orders-inbox"));
    let consuming = Consuming::start(&runtime, |stopped| async move { consumer.run(stopped).await });
    let mut redis = connection();
    wait_until_all_acknowledged(&mut redis, &stream);
    consuming.stop(&runtime);
    effects.assert_each_order_once_in_order(&shop);
    let _: () = redis.del(&stream).expect("DEL");
}

#[test]
fn a_consumer_gone_between_its_commit_and_its_ack_has_the_message_replayed_not_repeated() {
    let stream = unique_name("orders");
    let shop = Shop::with_orders("orders");
    let effects = Effects::new();
    let publishing = Runtime::new().expect("a tokio runtime");
    let publisher = publisher_to(&publishing, &stream);
    shop.relay(|message| publisher.publish(message));

    // The first consumer holds the transaction of order 20 open until its
    // runtime is gone: the commit then happens, the ack never.
    const HELD: i64 = 20;
    let (reached, held) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let inbox = effects.inbox_with("orders-inbox", move |order| {
        if order.id == HELD {
            reached.send(()).expect("the test waits");
            recv(&released.lock().expect("the gate"), "the release of the held order");
        }
    });
    let first = Runtime::new().expect("a tokio runtime");
    let consumer = consumer_of(&stream, inbox);
    first.spawn(async move { consumer.run(std::future::pending()).await });
    recv(&held, "the first consumer at order 20");
    first.shutdown_background();
    release.send(()).expect("the held handler waits");
    wait_for("order 20's effect committed", || effects.has(HELD));
    let mut redis = connection();
    assert!(
        pending_entry_of(&mut redis, &stream, HELD),
        "order 20 committed, never acknowledged"
    );

    // The consumer started again under its name handles what it held
    // first, in order: the inbox replays order 20.
    let second = Runtime::new().expect("a tokio runtime");
    let consumer = consumer_of(&stream, effects.inbox("orders-inbox"));
    let consuming = Consuming::start(&second, |stopped| async move { consumer.run(stopped).await });
    wait_until_all_acknowledged(&mut redis, &stream);
    consuming.stop(&second);
    effects.assert_each_order_once_in_order(&shop);
    let _: () = redis.del(&stream).expect("DEL");
}

/// The trace of the request that enqueued an order, continued by the
/// consumer's span on the other side of Redis (feature `opentelemetry`).
#[cfg(feature = "opentelemetry")]
#[test]
fn the_consumers_span_is_a_child_of_the_span_that_enqueued_the_message() {
    use idempotency::outbox::Envelope;
    use tracing::instrument::WithSubscriber;

    use crate::common::traces::Traces;

    let traces = Traces::new();
    let runtime = Runtime::new().expect("a tokio runtime");
    let stream = unique_name("traced");
    let shop = idempotency::testing::SqliteFile::new();
    let effects = Effects::new();
    let order = Order {
        id: 1,
        customer: String::from("customer-1"),
        poison: false,
    };
    traces.in_span("request", || {
        Envelope::new("orders", &order)
            .ordering_key("customer-1")
            .enqueue(&mut shop.conn())
            .expect("enqueue the order's message")
    });

    let publisher = publisher_to(&runtime, &stream);
    // The relay runs in a span of its own, of another trace: what is
    // current at delivery is not what the message carries.
    let report = traces.in_span("relay", || {
        Relay::default()
            .run_once(&mut shop.conn(), |message| publisher.publish(message))
            .expect("relay the outbox")
    });
    assert_eq!(report.delivered, 1);

    let consumer = consumer_of(&stream, effects.inbox("traced-inbox"));
    let dispatch = traces.dispatch.clone();
    let consuming = Consuming::start(&runtime, |stopped| {
        async move { consumer.run(stopped).await }.with_subscriber(dispatch)
    });
    wait_until_all_acknowledged(&mut connection(), &stream);
    consuming.stop(&runtime);
    assert!(effects.has(1));

    let request = traces.span("request").span_context;
    let relay = traces.span("relay").span_context;
    let inbox = traces.span("inbox_delivery");
    assert_ne!(relay.trace_id(), request.trace_id());
    assert_eq!(inbox.span_context.trace_id(), request.trace_id());
    assert_eq!(inbox.parent_span_id, request.span_id());
    assert!(inbox.parent_span_is_remote);
    let _: () = connection().del(&stream).expect("DEL");
}

/// After which of its publications the relay process reports the
/// broker's confirmation and waits for its kill, its mark not yet written.
#[cfg(feature = "sqlite-async")]
const KILLED_AFTER: usize = 20;

/// The variable by which the relay process learns its stream.
#[cfg(feature = "sqlite-async")]
const STREAM_VARIABLE: &str = "IDEMPOTENCY_TEST_STREAM";

#[cfg(feature = "sqlite-async")]
#[test]
fn a_relay_killed_between_the_brokers_confirmation_and_its_mark_publishes_again_and_the_effect_happens_once() {
    use idempotency::outbox::Relay;

    use crate::common::child::{Child, parent_database};

    if let Some(shop) = parent_database() {
        let stream = std::env::var(STREAM_VARIABLE).expect("the stream");
        relay_until_killed(&shop, &stream);
    }
    let runtime = Runtime::new().expect("a tokio runtime");
    let stream = unique_name("orders");
    let shop = Shop::with_orders("orders");
    let shop_path = shop.db.path().to_str().expect("a utf-8 path").to_owned();

    let test = crate::common::test_path(
        module_path!(),
        "a_relay_killed_between_the_brokers_confirmation_and_its_mark_publishes_again_and_the_effect_happens_once",
    );
    let mut relay = Child::start_with(&test, &shop_path, |command| {
        command.env(STREAM_VARIABLE, &stream);
    });
    let confirmed = relay.wait_for("the broker's confirmation", |line| {
        line.strip_prefix("confirmed ").map(str::to_owned)
    });
    let status = relay.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "killed, not ended: {status}"
    );
    let length: usize = connection().xlen(&stream).expect("XLEN");
    assert_eq!(
        length, KILLED_AFTER,
        "the killed relay's publications, the last one confirmed"
    );
    let mut shop_conn = shop.db.conn();
    let unmarked = Relay::default()
        .stats(&mut shop_conn)
        .expect("the outbox's stats")
        .pending;
    assert_eq!(
        unmarked,
        u64::try_from(ORDERS).unwrap() - u64::try_from(KILLED_AFTER).unwrap() + 1,
        "the confirmed message is not marked"
    );

    // Another relay, once the killed relay's lease has run out (its clock
    // moved past it), publishes what is not marked: the confirmed message
    // again, and the rest.
    let publisher = publisher_to(&runtime, &stream);
    let mut republished = Vec::new();
    shop.relay_through_failures(|message| {
        republished.push(message.key.clone());
        publisher.publish(message)
    });
    assert_eq!(
        republished.first(),
        Some(&confirmed),
        "the confirmed message is published again"
    );
    let length: usize = connection().xlen(&stream).expect("XLEN");
    assert_eq!(
        length,
        usize::try_from(ORDERS).unwrap() + 1,
        "one message twice in the stream"
    );

    let effects = Effects::new();
    let consumer = consumer_of(&stream, effects.inbox("orders-inbox"));
    let consuming = Consuming::start(&runtime, |stopped| async move { consumer.run(stopped).await });
    wait_until_all_acknowledged(&mut connection(), &stream);
    consuming.stop(&runtime);
    effects.assert_each_order_once_in_order(&shop);
    let _: () = connection().del(&stream).expect("DEL");
}

/// In the relay process: the async relay on the shop at `shop`, publishing
/// to `stream`, which reports the confirmation of its `KILLED_AFTER`th
/// publication and waits there to be killed, before the relay marks it.
#[cfg(feature = "sqlite-async")]
fn relay_until_killed(shop: &str, stream: &str) -> ! {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
    use idempotency::Shutdown;
    use idempotency::brokers::Publisher;

    use crate::common::asynchronous::bb8_pool;
    use crate::common::child::report_and_wait_for_the_kill;

    let runtime = Runtime::new().expect("a tokio runtime");
    let stopped = runtime.block_on(async {
        let pool = bb8_pool(
            AsyncDieselConnectionManager::<SyncConnectionWrapper<SqliteConnection>>::new(shop),
            2,
        )
        .await;
        let target = stream.to_owned();
        let publisher = Arc::new(
            RedisPublisher::connect(client())
                .await
                .expect("Redis on 127.0.0.1:6379")
                .stream(move |_| target.clone()),
        );
        let published = Arc::new(AtomicUsize::new(0));
        let publish = move |message: Message| {
            let (publisher, published) = (Arc::clone(&publisher), Arc::clone(&published));
            async move {
                publisher.publish(&message).await?;
                if published.fetch_add(1, Ordering::SeqCst) + 1 == KILLED_AFTER {
                    report_and_wait_for_the_kill(&format!("confirmed {}", message.key));
                }
                Ok::<_, Failure>(())
            }
        };
        Relay::default().serve_async(&pool, publish, &Shutdown::new()).await
    });
    panic!("the relay serves until it is killed, yet it stopped: {stopped:?}")
}
