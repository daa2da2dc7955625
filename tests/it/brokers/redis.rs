//! Redis Streams on 127.0.0.1:6379.

use std::collections::HashMap;
use std::time::Duration;

use idempotency::brokers::BlockingPublisher;
use idempotency::brokers::redis::{HEADER_FIELD_PREFIX, KEY_FIELD, RedisConsumer, RedisPublisher, Trim};
use redis::Commands;
use tokio::runtime::Runtime;

use super::{Effects, ORDERS, PrivateBroker, Shop};
use crate::common::unique_name;
use crate::common::wait::{join, wait_for};

const URL: &str = "redis://127.0.0.1:6379";

fn client() -> redis::Client {
    redis::Client::open(URL).expect("a redis url")
}

fn connection() -> redis::Connection {
    client()
        .get_connection()
        .expect("Redis on 127.0.0.1:6379 (.ci/run starts it)")
}

#[test]
fn every_order_has_its_effect_once_in_order_though_published_twice_and_the_poison_is_dead_lettered() {
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
    // Every message published twice, as by a relay that died between the
    // confirmation and its mark: Redis keeps both copies.
    let report = shop.relay(|message| {
        publisher.publish(message)?;
        publisher.publish(message)
    });
    assert_eq!(report.delivered, usize::try_from(ORDERS).unwrap() + 1);
    let length: usize = connection().xlen(&stream).expect("XLEN");
    assert_eq!(length, 2 * (usize::try_from(ORDERS).unwrap() + 1));

    let consumer = RedisConsumer::new(
        client(),
        stream.clone(),
        "inbox",
        "consumer-1",
        effects.inbox("orders-inbox"),
    )
    .max_deliveries(3)
    .claim_idle(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = runtime.spawn(async move {
        consumer
            .run(async {
                let _ = stopped.await;
            })
            .await
    });

    // Done when Redis reports every entry delivered to the group and none
    // pending: each acknowledged or dead-lettered.
    wait_for("every entry acknowledged", || {
        let groups: redis::streams::StreamInfoGroupsReply = connection().xinfo_groups(&stream).expect("XINFO GROUPS");
        // No group until the consumer created it.
        groups
            .groups
            .first()
            .is_some_and(|group| (group.lag, group.pending) == (Some(0), 0))
    });
    stop.send(()).expect("the consumer runs");
    let ran = join(std::thread::spawn(move || runtime.block_on(running)), "the consumer");
    ran.expect("the consumer's task").expect("the consumer ran");

    effects.assert_each_order_once_in_order();
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
    let mut broker = PrivateBroker::start("redis-server", "KILL", |port, dir| {
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
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = runtime.spawn(async move {
        consumer
            .run(async {
                let _ = stopped.await;
            })
            .await
    });

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
    stop.send(()).expect("the consumer runs");
    let ran = join(std::thread::spawn(move || runtime.block_on(running)), "the consumer");
    ran.expect("the consumer's task").expect("the consumer ran");
    effects.assert_each_order_once_in_order();
}
