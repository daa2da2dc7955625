//! Delivery through real brokers: publishers that hand the outbox's
//! messages to NATS JetStream, RabbitMQ or Redis Streams and count a
//! message delivered only once the broker confirmed it, and consumers that
//! run the receiving side's handler as an inbox, under
//! [`run_idempotent`](crate::run_idempotent) with the message key, and
//! acknowledge only after that transaction committed. Each broker is a
//! feature: `nats`, `rabbitmq`, `redis`. The [guide](crate::guide::brokers)
//! says which to choose and what each guarantees.
//!
//! What the brokers share lives here: the [`Publisher`] contract (async, so
//! that an async relay awaits it as it is), [`BlockingPublisher`], which
//! makes any publisher the handler of the thread-based
//! [`Relay`](crate::outbox::Relay), the names of the headers a message
//! travels with, the [`Delivery`] a consumer receives and the [`Inbox`]
//! that runs the handler for it.
//!
//! # On the wire
//!
//! Every publisher sends the message's payload (its JSON text) as the
//! broker message's body, and beside it:
//!
//! | what | NATS JetStream | RabbitMQ | Redis Streams |
//! | --- | --- | --- | --- |
//! | the key ([`Message::key`]) | `Nats-Msg-Id` header | `message_id` property | `key` field |
//! | the topic | [`TOPIC_HEADER`] header | [`TOPIC_HEADER`] header | `header:`[`TOPIC_HEADER`] field |
//! | the ordering key | [`ORDERING_KEY_HEADER`] | [`ORDERING_KEY_HEADER`] | `header:`[`ORDERING_KEY_HEADER`] |
//! | the trace context | [`TRACEPARENT_HEADER`], [`TRACESTATE_HEADER`] | the same | `header:traceparent`, `header:tracestate` |
//! | the application's headers | headers, by name | AMQP headers (long strings) | `header:<name>` fields |
//!
//! The crate's own header names are reserved: an application header of the
//! same name (compared without case) is not sent, so the consumer's
//! [`Delivery`] always reads the message's own metadata.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use serde::de::DeserializeOwned;

use crate::outbox::{Failure, HandlerError, Message};
use crate::telemetry::TARGET;
use crate::{Config, Error as CallError, StoreConnection};

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

/// The header that carries the message's topic.
pub const TOPIC_HEADER: &str = "idempotency-topic";
/// The header that carries the message's
/// [ordering key](crate::outbox::Envelope::ordering_key), when it has one.
pub const ORDERING_KEY_HEADER: &str = "idempotency-ordering-key";
/// The W3C `traceparent` captured at enqueue, under the name W3C's
/// propagators read.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The W3C `tracestate` captured at enqueue.
pub const TRACESTATE_HEADER: &str = "tracestate";
/// The header a consumer adds to a message it dead-letters itself (NATS,
/// Redis): why the message was given up.
pub const DEAD_LETTER_REASON_HEADER: &str = "idempotency-dead-letter-reason";

/// The crate's own header names, which an application header may not take.
const RESERVED: [&str; 5] = [
    TOPIC_HEADER,
    ORDERING_KEY_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    DEAD_LETTER_REASON_HEADER,
];

fn reserved(name: &str) -> bool {
    RESERVED.iter().any(|reserved| reserved.eq_ignore_ascii_case(name))
}

/// The headers `message` travels with, besides its key: the application's
/// (but for reserved names), then the crate's.
pub(crate) fn outgoing_headers(message: &Message) -> Vec<(&str, &str)> {
    let mut headers: Vec<(&str, &str)> = message
        .headers()
        .iter()
        .filter(|(name, _)| !reserved(name))
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect();
    headers.push((TOPIC_HEADER, &message.topic));
    let metadata = [
        (ORDERING_KEY_HEADER, message.ordering_key()),
        (TRACEPARENT_HEADER, message.traceparent()),
        (TRACESTATE_HEADER, message.tracestate()),
    ];
    headers.extend(metadata.into_iter().filter_map(|(name, value)| Some((name, value?))));
    headers
}

/// Hands a message to a broker and waits until the broker confirmed it.
///
/// `publish` returns `Ok` only when the broker took responsibility for the
/// message (a JetStream `PubAck`, a RabbitMQ publisher confirm without a
/// return, a Redis `XADD` reply), so a relay marks it delivered only then;
/// [`Failure::Retry`] when another attempt may succeed, and
/// [`Failure::Permanent`] when none can, which parks the message as dead at
/// once. The future is `Send`, so an async relay awaits it on any tokio
/// worker; [`BlockingPublisher`] runs it for the thread-based
/// [`Relay`](crate::outbox::Relay).
///
/// An application writes its own publisher for another broker (Kafka, SQS)
/// against the same contract: send the payload with the key where the
/// broker deduplicates (or where the consumer reads it), the headers of
/// [`outbox::Message`](Message) beside it, and return `Ok` from the
/// broker's acknowledgement only.
///
/// ```
/// use idempotency::brokers::Publisher;
/// use idempotency::outbox::{Failure, Message};
///
/// /// Publishes into a channel, as a broker client would over the network.
/// struct Channel(tokio::sync::mpsc::Sender<(String, String)>);
///
/// impl Publisher for Channel {
///     async fn publish(&self, message: &Message) -> Result<(), Failure> {
///         // `Ok` only once the receiving end has the message.
///         self.0.send((message.key.clone(), message.payload_json.clone())).await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync {
    /// Publishes `message` and waits for the broker's confirmation.
    ///
    /// # Errors
    ///
    /// [`Failure::Retry`] when the broker did not confirm the message (no
    /// connection, a refusal it may lift, no answer); [`Failure::Permanent`]
    /// when it never will.
    fn publish(&self, message: &Message) -> impl Future<Output = Result<(), Failure>> + Send;
}

/// How long [`BlockingPublisher`] waits for a confirmation by default: well
/// inside the relay's default lease of 30 s, of which a handler may take
/// three quarters.
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// A [`Publisher`] for the thread-based [`Relay`](crate::outbox::Relay):
/// [`publish`](BlockingPublisher::publish) runs the publisher's future on a
/// tokio runtime through its handle and blocks the relay's thread until the
/// broker confirmed, at most for a [timeout](BlockingPublisher::timeout).
///
/// The relay's threads (those of [`Relay::run_once`](crate::outbox::Relay::run_once)
/// called from a plain thread, and those [`Relay::serve`](crate::outbox::Relay::serve)
/// starts) are not tokio's, so they may block; the broker client's
/// connection keeps running on the runtime's workers meanwhile.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::sync::Mutex;
///
/// use idempotency::brokers::{BlockingPublisher, Publisher};
/// use idempotency::outbox::{self, Failure, Message, Relay};
///
/// /// Stands in for a broker client here; `JetStreamPublisher`,
/// /// `RabbitPublisher` and `RedisPublisher` plug in the same way.
/// struct Recorder(Mutex<Vec<String>>);
///
/// impl Publisher for Recorder {
///     async fn publish(&self, message: &Message) -> Result<(), Failure> {
///         tokio::task::yield_now().await;
///         self.0.lock().map_err(|_| Failure::Retry("poisoned".into()))?.push(message.key.clone());
///         Ok(())
///     }
/// }
///
/// let runtime = tokio::runtime::Runtime::new()?;
/// let publisher = BlockingPublisher::new(Recorder(Mutex::new(Vec::new())), runtime.handle().clone());
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let key = outbox::enqueue(&mut conn, "receipts", &7)?;
/// let report = Relay::default().run_once(&mut conn, |message| publisher.publish(message))?;
/// assert_eq!(report.delivered, 1);
/// assert_eq!(*publisher.publisher().0.lock().unwrap(), [key]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct BlockingPublisher<P> {
    publisher: P,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl<P: Publisher> BlockingPublisher<P> {
    /// `publisher`, run on the runtime of `runtime`, waiting at most 10 s
    /// for a confirmation.
    pub fn new(publisher: P, runtime: tokio::runtime::Handle) -> Self {
        BlockingPublisher {
            publisher,
            runtime,
            timeout: DEFAULT_CONFIRM_TIMEOUT,
        }
    }

    /// Waits at most `timeout` for the broker's confirmation; an attempt
    /// still unconfirmed then is a [`Failure::Retry`] (the broker may have
    /// the message: the key lets its dedup and the consumer's inbox drop
    /// the second copy). Keep it below three quarters of the relay's
    /// [lease](crate::outbox::Relay::lease), after which the relay gives the
    /// attempt up on its own.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The publisher it runs.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Publishes `message` and blocks until the broker confirmed it.
    ///
    /// # Errors
    ///
    /// As [`Publisher::publish`], and [`Failure::Retry`] when no
    /// confirmation came within the timeout.
    ///
    /// # Panics
    ///
    /// When called on a thread of a tokio runtime (an async task, a
    /// `block_on`): block there with
    /// `tokio::task::spawn_blocking`, or await the [`Publisher`] itself.
    pub fn publish(&self, message: &Message) -> Result<(), Failure> {
        let confirmed = self
            .runtime
            .block_on(async { tokio::time::timeout(self.timeout, self.publisher.publish(message)).await });
        confirmed.unwrap_or_else(|_| {
            Err(Failure::Retry(format!(
                "the broker did not confirm within {} ms",
                self.timeout.as_millis()
            )))
        })
    }
}

/// A message as a consumer received it from a broker: what the publisher
/// sent (the key, the payload, the headers, the ordering key and the trace
/// context), and which delivery of it this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    key: String,
    payload: String,
    topic: Option<String>,
    headers: BTreeMap<String, String>,
    ordering_key: Option<String>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    attempt: u32,
}

/// Why a broker message cannot be a [`Delivery`]: it is poison, given up at
/// once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Malformed {
    NoKey,
    PayloadNotUtf8,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Malformed::NoKey => "the message carries no key",
            Malformed::PayloadNotUtf8 => "the payload is not utf-8",
        })
    }
}

impl Delivery {
    /// A delivery of the message with `key` and `payload`, its headers read
    /// from `headers` (the crate's own taken out of the application's), on
    /// its `attempt`.
    pub(crate) fn from_parts(
        key: Option<String>,
        payload: Vec<u8>,
        headers: impl IntoIterator<Item = (String, String)>,
        attempt: u32,
    ) -> Result<Self, Malformed> {
        let key = key.filter(|key| !key.is_empty()).ok_or(Malformed::NoKey)?;
        let payload = String::from_utf8(payload).map_err(|_| Malformed::PayloadNotUtf8)?;
        let mut delivery = Delivery {
            key,
            payload,
            topic: None,
            headers: BTreeMap::new(),
            ordering_key: None,
            traceparent: None,
            tracestate: None,
            attempt: attempt.max(1),
        };
        for (name, value) in headers {
            match name.as_str() {
                TOPIC_HEADER => delivery.topic = Some(value),
                ORDERING_KEY_HEADER => delivery.ordering_key = Some(value),
                TRACEPARENT_HEADER => delivery.traceparent = Some(value),
                TRACESTATE_HEADER => delivery.tracestate = Some(value),
                _ if reserved(&name) => {}
                _ => {
                    delivery.headers.insert(name, value);
                }
            }
        }
        Ok(delivery)
    }

    /// The message key ([`Message::key`]): the idempotency key the inbox
    /// runs the handler under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The payload as the publisher sent it: the message's JSON text.
    pub fn payload_json(&self) -> &str {
        &self.payload
    }

    /// The payload decoded into `T`.
    ///
    /// # Errors
    ///
    /// The JSON error when the payload does not decode into `T`.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.payload)
    }

    /// The topic the message was enqueued for, when the publisher sent it
    /// (the crate's always do).
    pub fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    /// The application's headers, by name, without the crate's own.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The value of the application's header `name`, if it came.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The message's ordering key, if it has one.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The W3C `traceparent` captured when the message was enqueued: the
    /// span of the request that caused it, for the consumer's span to
    /// continue.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// The W3C `tracestate` captured with the `traceparent`.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// Which delivery of the message this is to the consumer, from 1, as
    /// the broker counts them (RabbitMQ counts them on quorum queues only;
    /// on a classic queue every delivery is the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// What becomes of a delivery after the inbox ran it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its effect committed (now or before): acknowledge it.
    Done,
    /// It failed and may succeed again: leave it to the broker to deliver
    /// again.
    Retry(String),
    /// It can never succeed: dead-letter it.
    Dead(String),
}

impl Verdict {
    /// The verdict for a delivery that failed with `verdict` on its
    /// `attempt` out of `max_deliveries`: dead once the bound is reached.
    pub(crate) fn bounded(self, attempt: u32, max_deliveries: u32) -> Verdict {
        match self {
            Verdict::Retry(reason) if attempt >= max_deliveries => {
                Verdict::Dead(format!("failed on delivery {attempt} of {max_deliveries}: {reason}"))
            }
            verdict => verdict,
        }
    }
}

/// How many deliveries of one message a consumer attempts by default
/// before it dead-letters it.
pub(crate) const DEFAULT_MAX_DELIVERIES: u32 = 5;

/// The receiving side of a broker: runs the application's handler for each
/// delivery under [`Config::run`] with the message key as the idempotency
/// key and the inbox's scope, in a transaction on a connection of its own
/// pool, so that a redelivered message (the relay published it twice, the
/// broker delivered it again after a lost ack) has its effect once.
///
/// The handler is synchronous diesel work: it runs on tokio's blocking
/// pool, never on an async worker, with a connection checked out of the
/// r2d2 pool there. It returns `Ok` when the message's effect is written;
/// an error that is worth another delivery (any [`Display`](fmt::Display)
/// error) has the message delivered again, and a
/// [`Permanent`](crate::outbox::Permanent) one dead-letters it at once. A
/// panic counts as a failed delivery.
///
/// Each delivery runs in a `debug` span `inbox_delivery` (target
/// `idempotency`) with the scope, the key's digest, the attempt and the
/// `traceparent` the message carries; the call's own span and the
/// handler's run inside it. With the feature `opentelemetry`, that span is
/// a child of the span the `traceparent` names, the one that enqueued the
/// message ([the trace](crate::guide::brokers#the-trace)).
///
/// Each broker's consumer takes an `Inbox`:
/// [`JetStreamConsumer`](nats::JetStreamConsumer),
/// [`RabbitConsumer`](rabbitmq::RabbitConsumer),
/// [`RedisConsumer`](redis::RedisConsumer).
pub struct Inbox<C: R2D2Connection + 'static, H> {
    pool: Pool<ConnectionManager<C>>,
    scope: String,
    config: Config,
    handler: Arc<H>,
}

impl<C: R2D2Connection + 'static, H> fmt::Debug for Inbox<C, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl<C, H, E> Inbox<C, H>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    H: Fn(&mut C, &Delivery) -> Result<(), E> + Send + Sync + 'static,
    E: HandlerError + 'static,
{
    /// An inbox that runs `handler` for each delivery with a connection of
    /// `pool`, under `scope` (the consumer's name: its keys are its own)
    /// and [`Config::default()`].
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::prelude::*;
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use idempotency::brokers::{Delivery, Inbox};
    ///
    /// let database = tempfile::NamedTempFile::new()?;
    /// let pool = Pool::new(ConnectionManager::<SqliteConnection>::new(database.path().to_string_lossy()))?;
    /// idempotency::run_migrations(&mut pool.get()?)?;
    /// let inbox = Inbox::new(pool, "receipt-mailer", |conn: &mut SqliteConnection, delivery: &Delivery| {
    ///     let order: i64 = delivery.payload()?;
    ///     diesel::sql_query("INSERT INTO receipts (order_id) VALUES (?)")
    ///         .bind::<diesel::sql_types::BigInt, _>(order)
    ///         .execute(conn)?;
    ///     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    /// });
    /// # drop(inbox);
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(pool: Pool<ConnectionManager<C>>, scope: impl Into<String>, handler: H) -> Self {
        Inbox {
            pool,
            scope: scope.into(),
            config: Config::default(),
            handler: Arc::new(handler),
        }
    }

    /// Runs the calls under `config` (its retention is how long a key
    /// stays spent: keep it longer than any redelivery, the relay's
    /// backoff included).
    #[must_use]
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Runs the handler for `delivery` in its own transaction and says what
    /// the consumer should do with it.
    pub(crate) async fn receive(&self, delivery: Delivery) -> Verdict {
        let (pool, scope, config, handler) = (
            self.pool.clone(),
            self.scope.clone(),
            self.config.clone(),
            Arc::clone(&self.handler),
        );
        // The message's key as its digest, as the calls record theirs: it
        // came over the wire and is logged before the key rules checked it.
        let key = crate::telemetry::key_digest(&delivery.key);
        let span = tracing::debug_span!(
            target: TARGET, "inbox_delivery",
            scope = %self.scope, key_digest = %key, attempt = delivery.attempt,
            traceparent = delivery.traceparent.as_deref(),
        );
        // Before the span is entered: OpenTelemetry starts it then.
        #[cfg(feature = "opentelemetry")]
        crate::trace_context::continue_in(&span, delivery.traceparent.as_deref(), delivery.tracestate.as_deref());
        let in_span = span.clone();
        // The handler reports where the consumer's task does: to its
        // subscriber (also one it was given by `with_subscriber`), which a
        // thread of the blocking pool does not have as its default.
        let dispatch = tracing::dispatcher::get_default(tracing::Dispatch::clone);
        let ran = tokio::task::spawn_blocking(move || {
            let _default = tracing::dispatcher::set_default(&dispatch);
            let _entered = in_span.enter();
            let mut conn = pool
                .get()
                .map_err(|error| Verdict::Retry(format!("no database connection: {error}")))?;
            let conn: &mut C = &mut conn;
            let run = config.run(conn, &scope, &delivery.key, delivery.payload.as_str(), |tx| {
                handler(tx, &delivery)
            });
            run.map(|_| ()).map_err(verdict_of)
        })
        .await;
        let verdict = match ran {
            Ok(Ok(())) => Verdict::Done,
            Ok(Err(verdict)) => verdict,
            Err(joined) if joined.is_panic() => Verdict::Retry(String::from("the handler panicked")),
            Err(joined) => Verdict::Retry(format!("the handler did not run: {joined}")),
        };
        match &verdict {
            Verdict::Done => tracing::debug!(target: TARGET, parent: &span, "inbox: message handled"),
            Verdict::Retry(reason) => {
                tracing::warn!(target: TARGET, parent: &span, reason, "inbox: message failed, left for redelivery")
            }
            Verdict::Dead(reason) => {
                tracing::warn!(target: TARGET, parent: &span, reason, "inbox: message can never be handled")
            }
        }
        verdict
    }
}

/// What a failed call means for the delivery.
fn verdict_of<E: HandlerError>(error: CallError<E>) -> Verdict {
    match error {
        CallError::Operation(failure) if failure.is_permanent() => Verdict::Dead(failure.text()),
        CallError::Operation(failure) => Verdict::Retry(failure.text()),
        // Another delivery of the same key is running: this one comes again.
        CallError::InProgress => Verdict::Retry(String::from("another delivery of the message is running")),
        CallError::Mismatch => Verdict::Dead(String::from(
            "the key was used before for another payload: not this message's effect to repeat",
        )),
        CallError::InvalidKey(reason) => Verdict::Dead(format!("the message key is not an idempotency key: {reason}")),
        error => Verdict::Retry(error_text(&error)),
    }
}

fn error_text<E>(error: &CallError<E>) -> String {
    match error {
        CallError::Storage(error) => format!("the database failed: {error}"),
        CallError::Codec(error) => format!("the stored result does not decode: {error}"),
        CallError::InvalidScope(reason) => format!("the inbox scope is invalid: {reason}"),
        _ => String::from("the call failed"),
    }
}

/// Why a consumer stopped, or a publisher could not be set up.
#[derive(Debug)]
pub struct Error {
    context: &'static str,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl Error {
    pub(crate) fn new(context: &'static str, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error {
            context,
            source: source.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.context)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_takes_the_crates_headers_out_of_the_applications() {
        let headers = [
            (TOPIC_HEADER, "orders"),
            (ORDERING_KEY_HEADER, "customer-7"),
            (
                TRACEPARENT_HEADER,
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
            (DEAD_LETTER_REASON_HEADER, "x"),
            ("content-type", "application/json"),
        ]
        .map(|(name, value)| (name.to_owned(), value.to_owned()));
        let delivery = Delivery::from_parts(Some("k".into()), b"1".to_vec(), headers, 0).unwrap();
        assert_eq!(delivery.topic(), Some("orders"));
        assert_eq!(delivery.ordering_key(), Some("customer-7"));
        assert!(delivery.traceparent().is_some());
        assert_eq!(delivery.tracestate(), None);
        assert_eq!(delivery.headers().len(), 1);
        assert_eq!(delivery.attempt(), 1);
    }

    #[test]
    fn a_message_without_a_key_or_with_a_binary_payload_is_malformed() {
        assert_eq!(Delivery::from_parts(None, Vec::new(), [], 1), Err(Malformed::NoKey));
        assert_eq!(
            Delivery::from_parts(Some("k".into()), vec![0xff], [], 1),
            Err(Malformed::PayloadNotUtf8)
        );
    }

    /// The inbox's trace with OpenTelemetry: deliveries built by hand, run
    /// by an inbox on SQLite under a subscriber that exports its spans to
    /// memory.
    #[cfg(feature = "opentelemetry")]
    mod trace {
        use std::sync::Mutex;

        use diesel::SqliteConnection;
        use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider};
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
        use tracing::instrument::WithSubscriber;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        use tracing_subscriber::layer::SubscriberExt;

        use super::*;

        const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
        const SPAN_ID: &str = "00f067aa0ba902b7";

        /// What one delivery left: the inbox's span as exported, and the
        /// trace the handler saw itself in.
        struct Traced {
            verdict: Verdict,
            inbox_span: SpanData,
            handler_trace: TraceId,
        }

        fn deliver(traceparent: Option<&str>) -> Traced {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let subscriber = tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
            let database = tempfile::NamedTempFile::new().unwrap();
            let pool = Pool::new(ConnectionManager::<SqliteConnection>::new(
                database.path().to_string_lossy(),
            ))
            .unwrap();
            crate::run_migrations(&mut pool.get().unwrap()).unwrap();
            let seen = Arc::new(Mutex::new(TraceId::INVALID));
            let recorded = Arc::clone(&seen);
            let inbox = Inbox::new(pool, "trace-inbox", move |_: &mut SqliteConnection, _: &Delivery| {
                *recorded.lock().unwrap() = tracing::Span::current().context().span().span_context().trace_id();
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            });
            let headers = traceparent.map(|traceparent| (TRACEPARENT_HEADER.to_owned(), traceparent.to_owned()));
            let delivery = Delivery::from_parts(Some("message-1".into()), b"1".to_vec(), headers, 1).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let verdict = runtime.block_on(inbox.receive(delivery).with_subscriber(subscriber));
            let inbox_span = exporter
                .get_finished_spans()
                .unwrap()
                .into_iter()
                .find(|span| span.name == "inbox_delivery")
                .expect("the inbox's span was exported");
            let handler_trace = *seen.lock().unwrap();
            Traced {
                verdict,
                inbox_span,
                handler_trace,
            }
        }

        #[test]
        fn a_delivery_with_a_traceparent_is_handled_in_a_child_of_its_remote_span() {
            let traced = deliver(Some(&format!("00-{TRACE_ID}-{SPAN_ID}-01")));
            assert_eq!(traced.verdict, Verdict::Done);
            let trace_id = TraceId::from_hex(TRACE_ID).unwrap();
            assert_eq!(traced.inbox_span.span_context.trace_id(), trace_id);
            assert_eq!(traced.inbox_span.parent_span_id, SpanId::from_hex(SPAN_ID).unwrap());
            assert!(traced.inbox_span.parent_span_is_remote);
            assert_eq!(traced.handler_trace, trace_id, "the handler runs in the same trace");
        }

        #[test]
        fn a_delivery_without_a_trace_context_or_with_an_invalid_one_starts_a_fresh_trace() {
            for traceparent in [None, Some("00-not-a-trace-01"), Some("garbage")] {
                let traced = deliver(traceparent);
                assert_eq!(traced.verdict, Verdict::Done, "{traceparent:?}");
                let span = traced.inbox_span.span_context;
                assert!(span.is_valid(), "{traceparent:?}");
                assert_ne!(span.trace_id(), TraceId::from_hex(TRACE_ID).unwrap());
                assert_eq!(
                    traced.inbox_span.parent_span_id,
                    SpanId::INVALID,
                    "{traceparent:?}: a root"
                );
                assert_eq!(traced.handler_trace, span.trace_id(), "{traceparent:?}");
            }
        }
    }

    #[test]
    fn a_failure_on_the_last_delivery_is_dead() {
        assert_eq!(Verdict::Retry("x".into()).bounded(4, 5), Verdict::Retry("x".into()));
        assert!(matches!(Verdict::Retry("x".into()).bounded(5, 5), Verdict::Dead(_)));
        assert_eq!(Verdict::Done.bounded(9, 5), Verdict::Done);
    }
}
