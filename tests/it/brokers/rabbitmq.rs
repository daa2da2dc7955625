//! RabbitMQ on 127.0.0.1:5672 (guest/guest).

use std::time::{Duration, Instant};

use idempotency::brokers::rabbitmq::{self, RabbitConsumer, RabbitPublisher, Route};
use idempotency::brokers::{
    BlockingPublisher, ORDERING_KEY_HEADER, Receive, TOPIC_HEADER, TRACEPARENT_HEADER, TRACESTATE_HEADER,
};
use idempotency::outbox::{self, Envelope, Relay};
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};
use tokio::runtime::Runtime;

use super::{Consuming, Effects, ORDERS, PrivateBroker, Shop, Stopping, TRACEPARENT, TRACESTATE, free_port, listening};
use crate::common::unique_name;
use crate::common::wait::wait_for;

const URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

async fn channel() -> Channel {
    let connection = rabbitmq::connect(URI)
        .await
        .expect("RabbitMQ on 127.0.0.1:5672 (.ci/run starts it)");
    connection.create_channel().await.expect("a channel")
}

/// The number of ready messages in `queue`, as the broker counts them.
async fn ready(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue, passive, FieldTable::default())
        .await
        .expect("the queue")
        .message_count()
}

#[test]
fn every_order_has_its_effect_once_in_order_though_published_twice_and_the_poison_goes_to_the_dead_letter_exchange() {
    each_order_once_though_published_twice(|runtime, queue, effects| {
        let consumer = consumer_of(queue, effects.inbox("orders-inbox"));
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

#[cfg(feature = "sqlite-async")]
#[test]
fn an_async_inbox_has_each_orders_effect_once_in_order_though_published_twice() {
    use idempotency::brokers::{AsyncInbox, Delivery};

    use super::{AsyncSqlite, write_effect};

    each_order_once_though_published_twice(|runtime, queue, effects| {
        let inbox = AsyncInbox::new(
            effects.async_pool(),
            "orders-inbox",
            async |conn: &mut AsyncSqlite, delivery: &Delivery| write_effect(conn, delivery).await,
        );
        let consumer = consumer_of(queue, inbox);
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

/// The consumer of `queue` with `inbox`, which dead-letters after 3
/// deliveries.
fn consumer_of<I: Receive>(queue: &str, inbox: I) -> RabbitConsumer<I> {
    RabbitConsumer::new(URI, queue, inbox)
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(10))
        // One message in hand at a time: once the queue is empty, the one
        // in hand is the last, and the stop lets it finish.
        .prefetch(1)
}

/// Publishes a shop's orders and a poison message, each twice, to a queue
/// of their own with a dead-letter exchange; consumes them with the
/// consumer `consume` starts on the queue; checks every order's effect
/// once and in order and both copies of the poison message dead-lettered.
fn each_order_once_though_published_twice(consume: impl FnOnce(&Runtime, &str, &Effects) -> Consuming) {
    let runtime = Runtime::new().expect("a tokio runtime");
    let name = unique_name("orders");
    let (dlx, dead) = (format!("{name}_dlx"), format!("{name}_dead"));
    let admin = runtime.block_on(channel());
    runtime.block_on(async {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        admin
            .exchange_declare(&name, ExchangeKind::Direct, durable, FieldTable::default())
            .await
            .expect("declare the exchange");
        admin
            .exchange_declare(&dlx, ExchangeKind::Fanout, durable, FieldTable::default())
            .await
            .expect("declare the dead-letter exchange");
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut quorum = FieldTable::default();
        quorum.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
        quorum.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(dlx.as_str())),
        );
        admin
            .queue_declare(&name, durable, quorum)
            .await
            .expect("declare the queue");
        admin
            .queue_declare(&dead, durable, FieldTable::default())
            .await
            .expect("declare the dead-letter queue");
        admin
            .queue_bind(
                &name,
                &name,
                "orders",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the queue");
        admin
            .queue_bind(&dead, &dlx, "", QueueBindOptions::default(), FieldTable::default())
            .await
            .expect("bind the dead-letter queue");
    });

    let shop = Shop::with_orders("orders");
    shop.enqueue_poison();
    let effects = Effects::new();
    let publisher = runtime
        .block_on(RabbitPublisher::connect(URI, name.as_str()))
        .expect("RabbitMQ on 127.0.0.1:5672 (.ci/run starts it)");
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    // RabbitMQ keeps both copies of each.
    let published = u32::try_from(shop.relay_each_twice(&publisher)).unwrap();
    assert_eq!(runtime.block_on(ready(&admin, &name)), 2 * published);

    let consuming = consume(&runtime, &name, &effects);
    wait_for("the queue emptied, the poison message's copies dead-lettered", || {
        runtime.block_on(async { (ready(&admin, &name).await, ready(&admin, &dead).await) }) == (0, 2)
    });
    consuming.stop(&runtime);

    effects.assert_each_order_once_in_order(&shop);
    assert_eq!(runtime.block_on(ready(&admin, &name)), 0);
    runtime.block_on(async {
        for queue in [&name, &dead] {
            admin
                .queue_delete(queue, QueueDeleteOptions::default())
                .await
                .expect("delete a queue");
        }
        for exchange in [&name, &dlx] {
            admin
                .exchange_delete(exchange, ExchangeDeleteOptions::default())
                .await
                .expect("delete an exchange");
        }
    });
}

#[test]
fn a_message_no_queue_takes_or_for_a_missing_exchange_is_a_failure_never_delivered() {
    let runtime = Runtime::new().expect("a tokio runtime");
    let name = unique_name("unroutable");
    let admin = runtime.block_on(channel());
    runtime
        .block_on(admin.exchange_declare(
            &name,
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ))
        .expect("declare an exchange without bindings");

    let db = idempotency::testing::SqliteFile::new();
    let mut conn = db.conn();
    let id = outbox::enqueue(&mut conn, "orders", &1).expect("enqueue");
    let missing = unique_name("missing");
    let target = std::sync::Arc::new(std::sync::Mutex::new(name.clone()));
    let routed = std::sync::Arc::clone(&target);
    let publisher = runtime
        .block_on(RabbitPublisher::connect(URI, name.as_str()))
        .expect("RabbitMQ on 127.0.0.1:5672 (.ci/run starts it)")
        .route(move |message| Route::new(routed.lock().unwrap().clone(), message.topic.clone()));
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    // A failed message is due again after its backoff: the test's clock
    // moves past it.
    let clock = idempotency::testing::ManualClock::new();
    let relay = Relay::default().clock(clock.source());
    let again = || clock.advance(chrono::Duration::hours(1));

    // Returned as unroutable (`mandatory`), after the broker's ack.
    let report = relay
        .run_once(&mut conn, |message| publisher.publish(message))
        .expect("relay");
    assert_eq!((report.delivered, report.retried), (0, 1));

    // Refused for an exchange that does not exist: the broker closes the
    // channel, and the next publish opens another.
    *target.lock().unwrap() = missing;
    again();
    let report = relay
        .run_once(&mut conn, |message| publisher.publish(message))
        .expect("relay");
    assert_eq!((report.delivered, report.retried), (0, 1));

    // The broker reached on the new channel: returned again.
    *target.lock().unwrap() = name.clone();
    again();
    let report = relay
        .run_once(&mut conn, |message| publisher.publish(message))
        .expect("relay");
    assert_eq!((report.delivered, report.retried), (0, 1));

    let stats = relay.stats(&mut conn).expect("the outbox's stats");
    assert_eq!((stats.pending, stats.dead), (1, 0), "{id} is still to deliver");
    runtime
        .block_on(admin.exchange_delete(&name, ExchangeDeleteOptions::default()))
        .expect("delete the exchange");
}

/// Waits until the node of `broker` listens: a node boots in seconds, and
/// in many more on a loaded machine, so this waits up to two minutes.
fn node_up(broker: &PrivateBroker) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !listening(broker.port) {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(broker.dir.path().join("broker.log")).unwrap_or_default();
            panic!("the test's own RabbitMQ node did not listen within 2 minutes; its output:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_rabbitmq_stopped_and_started_again_mid_stream_loses_no_order_and_repeats_none() {
    // A node of the test's own: its own name, ports, configuration and
    // database, in a directory the broker's user owns.
    let node = format!("{}@localhost", unique_name("rabbit_it"));
    let stop = ["rabbitmqctl", "-n", &node, "stop"].map(String::from).to_vec();
    let mut broker = PrivateBroker::start("env", Stopping::Command(stop), |port, dir| {
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\n"),
        )
        .expect("the node's configuration");
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("the node's plugins");
        std::fs::write(dir.join("env.conf"), "").expect("the node's environment");
        let owned = std::process::Command::new("chown")
            .args(["-R", "rabbitmq"])
            .arg(dir)
            .status()
            .expect("run chown");
        assert!(owned.success(), "give the node's directory to the broker's user");
        let path = |name: &str| dir.join(name).to_str().expect("a utf-8 path").to_owned();
        vec![
            format!("RABBITMQ_NODENAME={node}"),
            format!("RABBITMQ_CONF_ENV_FILE={}", path("env.conf")),
            format!("RABBITMQ_CONFIG_FILE={}", path("rabbitmq.conf")),
            format!("RABBITMQ_MNESIA_BASE={}", path("mnesia")),
            format!("RABBITMQ_LOG_BASE={}", path("log")),
            format!("RABBITMQ_ENABLED_PLUGINS_FILE={}", path("enabled_plugins")),
            format!("RABBITMQ_FEATURE_FLAGS_FILE={}", path("feature_flags")),
            format!("RABBITMQ_PLUGINS_EXPAND_DIR={}", path("plugins-expand")),
            format!("RABBITMQ_DIST_PORT={}", free_port()),
            String::from("ERL_EPMD_ADDRESS=127.0.0.1"),
            String::from("rabbitmq-server"),
        ]
    });
    let port = broker.port;
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    node_up(&broker);

    let runtime = Runtime::new().expect("a tokio runtime");
    let admin = runtime.block_on(async {
        let connection = rabbitmq::connect(&uri).await.expect("the test's own RabbitMQ node");
        connection.create_channel().await.expect("a channel")
    });
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    runtime
        .block_on(admin.queue_declare("orders", durable, quorum))
        .expect("declare the queue");

    let shop = Shop::with_orders("orders");
    let effects = Effects::new();
    let consumer = RabbitConsumer::new(uri.as_str(), "orders", effects.inbox("orders-inbox"))
        .retry_delay(Duration::from_millis(100))
        // One message in hand at a time: once the queue is empty and every
        // order has its effect, the stop lets the one in hand finish.
        .prefetch(1);
    let consuming = Consuming::start(&runtime, |stopped| async move { consumer.run(stopped).await });

    // Through the default exchange, which routes by queue name.
    let publisher = runtime
        .block_on(RabbitPublisher::connect(uri.as_str(), ""))
        .expect("the test's own RabbitMQ node");
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone()).timeout(Duration::from_secs(2));
    let mut published = 0;
    let report = shop.relay_through_failures(|message| {
        published += 1;
        if published == ORDERS / 3 {
            // Mid-stream: the consumer is reading, the relay publishing.
            broker.restart();
            node_up(&broker);
        }
        publisher.publish(message)
    });
    assert_eq!(report.delivered, usize::try_from(ORDERS).unwrap());

    let orders = usize::try_from(ORDERS).unwrap();
    let ready = |admin: &lapin::Channel| {
        runtime.block_on(async {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            admin
                .queue_declare("orders", passive, FieldTable::default())
                .await
                .map(|queue| queue.message_count())
        })
    };
    // The admin channel died with the first node.
    let admin = runtime.block_on(async {
        let connection = rabbitmq::connect(&uri).await.expect("the test's own RabbitMQ node");
        connection.create_channel().await.expect("a channel")
    });
    wait_for("every order's effect and the queue empty", || {
        effects.count() >= orders && ready(&admin).is_ok_and(|ready| ready == 0)
    });
    consuming.stop(&runtime);
    // The consumer closed its connection: what it held unacknowledged
    // would be back in the queue.
    let left = runtime.block_on(async {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        admin.queue_declare("orders", passive, FieldTable::default()).await
    });
    assert_eq!(left.expect("the queue").message_count(), 0, "nothing left behind");
    effects.assert_each_order_once_in_order(&shop);
}

#[test]
fn a_message_goes_out_persistent_with_its_key_as_message_id_and_its_metadata_as_headers() {
    let runtime = Runtime::new().expect("a tokio runtime");
    let queue = unique_name("wire");
    let admin = runtime.block_on(channel());
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    runtime
        .block_on(admin.queue_declare(&queue, durable, FieldTable::default()))
        .expect("declare the queue");

    let db = idempotency::testing::SqliteFile::new();
    let key = Envelope::new("orders", &serde_json::json!({ "order": 7 }))
        .header("x-tenant", "acme")
        .ordering_key("customer-7")
        .traceparent(TRACEPARENT)
        .tracestate(TRACESTATE)
        .enqueue(&mut db.conn())
        .expect("enqueue");
    let routed = queue.clone();
    let publisher = runtime
        .block_on(RabbitPublisher::connect(URI, ""))
        .expect("RabbitMQ on 127.0.0.1:5672 (.ci/run starts it)")
        .route(move |_| Route::new("", routed.clone()));
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    let report = Relay::default()
        .run_once(&mut db.conn(), |message| publisher.publish(message))
        .expect("relay");
    assert_eq!(report.delivered, 1);

    let got = runtime
        .block_on(admin.basic_get(&queue, BasicGetOptions { no_ack: true }))
        .expect("basic.get")
        .expect("the message");
    let properties = &got.delivery.properties;
    assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some(key.as_str())
    );
    let headers = properties.headers().as_ref().expect("headers").inner();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(AMQPValue::as_long_string)
            .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
    };
    assert_eq!(header("x-tenant").as_deref(), Some("acme"));
    assert_eq!(header(TOPIC_HEADER).as_deref(), Some("orders"));
    assert_eq!(header(ORDERING_KEY_HEADER).as_deref(), Some("customer-7"));
    assert_eq!(header(TRACEPARENT_HEADER).as_deref(), Some(TRACEPARENT));
    assert_eq!(header(TRACESTATE_HEADER).as_deref(), Some(TRACESTATE));
    assert_eq!(got.delivery.data, br#"{"order":7}"#);
    runtime
        .block_on(admin.queue_delete(&queue, QueueDeleteOptions::default()))
        .expect("delete the queue");
}
