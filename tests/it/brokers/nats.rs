//! NATS JetStream on 127.0.0.1:4222.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use idempotency::brokers::nats::{JetStreamConsumer, JetStreamPublisher};
use idempotency::brokers::{BlockingPublisher, DEAD_LETTER_REASON_HEADER, Receive};
use tokio::runtime::Runtime;

use super::{Consuming, Effects, ORDERS, PrivateBroker, Shop, Stopping};
use crate::common::unique_name;
use crate::common::wait::wait_for;

async fn context() -> jetstream::Context {
    let client = async_nats::connect("127.0.0.1:4222")
        .await
        .expect("NATS with JetStream on 127.0.0.1:4222 (.ci/run starts it)");
    jetstream::new(client)
}

/// The durable pull consumer `inbox` on `stream`, which acknowledges each
/// message explicitly.
async fn inbox_consumer(stream: &stream::Stream) -> consumer::PullConsumer {
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(String::from("inbox")),
            ack_policy: consumer::AckPolicy::Explicit,
            ..consumer::pull::Config::default()
        })
        .await
        .expect("create the consumer")
}

/// The number of messages in `stream`, as the server counts them.
async fn messages(context: &jetstream::Context, stream: &str) -> u64 {
    let mut stream = context.get_stream(stream).await.expect("the stream");
    stream.info().await.expect("the stream's info").state.messages
}

#[test]
fn every_order_has_its_effect_once_in_order_a_copy_after_the_dedup_window_included_and_the_poison_is_dead_lettered() {
    each_order_once_a_copy_after_the_dedup_window_included(|runtime, consumer| {
        let consumer = consumer.with_inbox(consumer.effects.inbox("orders-inbox"));
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

#[cfg(feature = "sqlite-async")]
#[test]
fn an_async_inbox_has_each_orders_effect_once_in_order_a_copy_after_the_dedup_window_included() {
    use idempotency::brokers::{AsyncInbox, Delivery};

    use super::{AsyncSqlite, write_effect};

    each_order_once_a_copy_after_the_dedup_window_included(|runtime, consumer| {
        let inbox = AsyncInbox::new(
            consumer.effects.async_pool(),
            "orders-inbox",
            async |conn: &mut AsyncSqlite, delivery: &Delivery| write_effect(conn, delivery).await,
        );
        let consumer = consumer.with_inbox(inbox);
        Consuming::start(runtime, |stopped| async move { consumer.run(stopped).await })
    });
}

/// What a test's consumer is made of: the stream's pull consumer and the
/// effects its inbox writes.
struct ConsumerOf<'a> {
    context: jetstream::Context,
    pull: consumer::PullConsumer,
    dead: String,
    effects: &'a Effects,
}

impl ConsumerOf<'_> {
    /// The consumer with `inbox`, which dead-letters after 3 deliveries.
    fn with_inbox<I: Receive>(&self, inbox: I) -> JetStreamConsumer<I> {
        JetStreamConsumer::new(self.context.clone(), self.pull.clone(), inbox)
            .max_deliveries(3)
            .retry_delay(Duration::from_millis(10))
            .dead_letter_subject(self.dead.clone())
    }
}

/// Publishes a shop's orders and a poison message, each twice (the second
/// a duplicate to the stream), and a copy of the first after the
/// duplicate window; consumes them with the consumer `consume` starts;
/// checks every order's effect once and in order, and the poison message
/// dead-lettered.
fn each_order_once_a_copy_after_the_dedup_window_included(
    consume: impl FnOnce(&Runtime, &ConsumerOf<'_>) -> Consuming,
) {
    let runtime = Runtime::new().expect("a tokio runtime");
    let name = unique_name("orders");
    let dead = format!("{name}_dead");
    let context = runtime.block_on(context());
    let orders_stream = runtime
        .block_on(context.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            // Short, so that the test sees a copy published after it.
            duplicate_window: Duration::from_millis(500),
            ..stream::Config::default()
        }))
        .expect("create the stream");
    runtime
        .block_on(context.create_stream(stream::Config {
            name: dead.clone(),
            subjects: vec![dead.clone()],
            ..stream::Config::default()
        }))
        .expect("create the dead-letter stream");
    let pull = runtime.block_on(inbox_consumer(&orders_stream));

    let shop = Shop::with_orders("orders");
    let poison = shop.enqueue_poison();
    let effects = Effects::new();
    let prefix = name.clone();
    let publisher =
        JetStreamPublisher::new(context.clone()).subject(move |message| format!("{prefix}.{}", message.topic));
    let publisher = BlockingPublisher::new(publisher, runtime.handle().clone());
    // The second copy of each is a duplicate to the stream, and confirmed
    // as delivered.
    let published = u64::try_from(shop.relay_each_twice(&publisher)).unwrap();
    assert_eq!(
        runtime.block_on(messages(&context, &name)),
        published,
        "the duplicates dropped"
    );

    // A copy of the first message published again once the stream's
    // duplicate window has passed, which the server says by no longer
    // calling it a duplicate: the inbox is what drops it.
    let first = runtime
        .block_on(orders_stream.get_raw_message(1))
        .expect("the first message");
    wait_for("the duplicate window to pass", || {
        let ack = runtime.block_on(async {
            let ack = context
                .publish_with_headers(first.subject.clone(), first.headers.clone(), first.payload.clone())
                .await
                .expect("publish the copy");
            ack.await.expect("the copy's PubAck")
        });
        if ack.duplicate {
            std::thread::sleep(Duration::from_millis(50));
        }
        !ack.duplicate
    });
    assert_eq!(runtime.block_on(messages(&context, &name)), published + 1);

    let consumer = ConsumerOf {
        context: context.clone(),
        pull,
        dead: dead.clone(),
        effects: &effects,
    };
    let consuming = consume(&runtime, &consumer);
    wait_for("every message handled and acknowledged", || {
        runtime.block_on(async {
            let mut inbox: consumer::PullConsumer = orders_stream.get_consumer("inbox").await.expect("the consumer");
            let info = inbox.info().await.expect("the consumer's info");
            info.num_pending == 0 && info.num_ack_pending == 0
        })
    });
    consuming.stop(&runtime);

    effects.assert_each_order_once_in_order(&shop);
    let dead_stream = runtime
        .block_on(context.get_stream(&dead))
        .expect("the dead-letter stream");
    let letter = runtime
        .block_on(dead_stream.get_raw_message(1))
        .expect("the dead letter");
    let header = |wanted: &str| {
        letter
            .headers
            .iter()
            .find(|(name, _)| name.to_string().eq_ignore_ascii_case(wanted))
            .and_then(|(_, values)| Some(values.last()?.as_str().to_owned()))
    };
    assert_eq!(header("Nats-Msg-Id"), Some(poison));
    let reason = header(DEAD_LETTER_REASON_HEADER).expect("the reason");
    assert!(reason.contains("delivery 3 of 3"), "{reason}");
    assert_eq!(runtime.block_on(messages(&context, &dead)), 1);
    runtime.block_on(async {
        context.delete_stream(&name).await.expect("delete the stream");
        context
            .delete_stream(&dead)
            .await
            .expect("delete the dead-letter stream");
    });
}

/// Whether the NATS server on `port` greets a connection with JetStream on.
fn answers(port: u16) -> bool {
    use std::io::{BufRead, BufReader};
    let Ok(stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let mut info = String::new();
    BufReader::new(stream).read_line(&mut info).is_ok() && info.contains("\"jetstream\":true")
}

#[test]
fn a_nats_server_restarted_mid_stream_loses_no_order_and_repeats_none() {
    // Stopped with SIGTERM, a restart the server shuts down for: its file
    // store writes behind its acknowledgements, so a server killed
    // outright may lose the last messages it acknowledged, which no client
    // can make up for.
    let mut broker = PrivateBroker::start("nats-server", Stopping::Signal("TERM"), |port, dir| {
        let dir = dir.to_str().expect("a utf-8 path");
        let port = port.to_string();
        ["-a", "127.0.0.1", "-p", &port, "-js", "-sd", dir]
            .map(String::from)
            .to_vec()
    });
    let port = broker.port;
    wait_for("the test's own NATS server", || answers(port));

    let runtime = Runtime::new().expect("a tokio runtime");
    let context = runtime.block_on(async {
        let client = async_nats::connect(format!("127.0.0.1:{port}"))
            .await
            .expect("the test's own NATS server");
        jetstream::new(client)
    });
    let orders_stream = runtime
        .block_on(context.create_stream(stream::Config {
            name: String::from("orders"),
            subjects: vec![String::from("orders")],
            ..stream::Config::default()
        }))
        .expect("create the stream");
    let pull = runtime.block_on(inbox_consumer(&orders_stream));

    let shop = Shop::with_orders("orders");
    let effects = Effects::new();
    let consumer = JetStreamConsumer::new(context.clone(), pull, effects.inbox("orders-inbox"))
        .retry_delay(Duration::from_millis(10));
    let consuming = Consuming::start(&runtime, |stopped| async move { consumer.run(stopped).await });

    let publisher = BlockingPublisher::new(JetStreamPublisher::new(context.clone()), runtime.handle().clone())
        .timeout(Duration::from_secs(2));
    let mut published = 0;
    let report = shop.relay_through_failures(|message| {
        published += 1;
        if published == ORDERS / 3 {
            // Mid-stream: the consumer is reading, the relay publishing.
            broker.restart();
            wait_for("the test's own NATS server again", || answers(port));
        }
        publisher.publish(message)
    });
    assert_eq!(report.delivered, usize::try_from(ORDERS).unwrap());

    wait_for("every message handled and acknowledged", || {
        runtime.block_on(async {
            let Ok(mut inbox) = orders_stream.get_consumer::<consumer::pull::Config>("inbox").await else {
                return false;
            };
            inbox
                .info()
                .await
                .is_ok_and(|info| info.num_pending == 0 && info.num_ack_pending == 0)
        })
    });
    consuming.stop(&runtime);
    effects.assert_each_order_once_in_order(&shop);
}
