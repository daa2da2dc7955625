//! What a consumer received, and the inbox that runs the application's
//! handler for it under the message key, at most once in effect.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use serde::de::DeserializeOwned;

use super::headers::*;
use crate::outbox::HandlerError;
use crate::telemetry::TARGET;
use crate::{Config, Error as CallError, StoreConnection};

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

    /// The message key ([`Message::key`](crate::outbox::Message::key)): the idempotency key the inbox
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

/// What becomes of a delivery after the inbox ran it. Public in a module
/// no other crate can name: [`Receive`] is sealed by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
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
/// [`JetStreamConsumer`](super::nats::JetStreamConsumer),
/// [`RabbitConsumer`](super::rabbitmq::RabbitConsumer),
/// [`RedisConsumer`](super::redis::RedisConsumer).
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
}

/// What a consumer runs for each delivery: an [`Inbox`] on an r2d2 pool of
/// synchronous connections, or an [`AsyncInbox`] on a bb8 or deadpool pool
/// of diesel-async ones (feature `diesel-async`). Sealed: only the crate
/// implements it.
pub trait Receive: fmt::Debug + Send + Sync {
    /// Runs the handler for `delivery` in its own transaction and says what
    /// the consumer should do with it.
    fn receive(&self, delivery: Delivery) -> impl Future<Output = Verdict>;
}

impl<C, H, E> Receive for Inbox<C, H>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    H: Fn(&mut C, &Delivery) -> Result<(), E> + Send + Sync + 'static,
    E: HandlerError + 'static,
{
    async fn receive(&self, delivery: Delivery) -> Verdict {
        let (pool, scope, config, handler) = (
            self.pool.clone(),
            self.scope.clone(),
            self.config.clone(),
            Arc::clone(&self.handler),
        );
        let span = delivery_span(&self.scope, &delivery);
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
            Err(joined) if joined.is_panic() => Verdict::Retry(String::from(PANICKED)),
            Err(joined) => Verdict::Retry(format!("the handler did not run: {joined}")),
        };
        reported(&span, verdict)
    }
}

/// The failure of a delivery whose handler panicked.
const PANICKED: &str = "the handler panicked";

/// The span a delivery is handled in: `inbox_delivery`, with the scope,
/// the key's digest, the attempt and the `traceparent` it carries; with
/// OpenTelemetry a child of the span that enqueued the message.
fn delivery_span(scope: &str, delivery: &Delivery) -> tracing::Span {
    // The message's key as its digest, as the calls record theirs: it
    // came over the wire and is logged before the key rules checked it.
    let key = crate::telemetry::key_digest(&delivery.key);
    let span = tracing::debug_span!(
        target: TARGET, "inbox_delivery",
        scope = %scope, key_digest = %key, attempt = delivery.attempt,
        traceparent = delivery.traceparent.as_deref(),
    );
    // Before the span is entered: OpenTelemetry starts it then.
    #[cfg(feature = "opentelemetry")]
    crate::trace_context::continue_in(&span, delivery.traceparent.as_deref(), delivery.tracestate.as_deref());
    span
}

/// Reports `verdict` in `span`, and returns it.
fn reported(span: &tracing::Span, verdict: Verdict) -> Verdict {
    match &verdict {
        Verdict::Done => tracing::debug!(target: TARGET, parent: span, "inbox: message handled"),
        Verdict::Retry(reason) => {
            tracing::warn!(target: TARGET, parent: span, reason, "inbox: message failed, left for redelivery")
        }
        Verdict::Dead(reason) => {
            tracing::warn!(target: TARGET, parent: span, reason, "inbox: message can never be handled")
        }
    }
    verdict
}

/// [`Inbox`] on a bb8 or deadpool pool of diesel-async connections
/// ([`AsyncConnectionPool`](crate::AsyncConnectionPool)), with an async
/// handler: each delivery runs under
/// [`Config::run_async`](crate::Config::run_async) with the message key,
/// in the consumer's own task, nothing on the blocking pool. The handler
/// is an async closure called once per delivery, on a clone of itself
/// (capture an `Arc`, or references, to share state): it receives the
/// call's connection, inside its transaction, and the delivery. Everything
/// else is as [`Inbox`]: the span, the verdicts, a panic as a failed
/// delivery.
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::SqliteConnection;
/// use diesel_async::RunQueryDsl;
/// use diesel_async::pooled_connection::AsyncDieselConnectionManager;
/// use diesel_async::pooled_connection::bb8::Pool;
/// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
/// use idempotency::brokers::{AsyncInbox, Delivery};
/// use idempotency::outbox::Failure;
///
/// type Conn = SyncConnectionWrapper<SqliteConnection>;
/// # let database = tempfile::NamedTempFile::new()?;
/// # let url = database.path().to_string_lossy().into_owned();
/// # idempotency::run_migrations(&mut <SqliteConnection as diesel::Connection>::establish(&url)?)?;
/// let pool = Pool::builder().build(AsyncDieselConnectionManager::<Conn>::new(url)).await?;
/// let inbox = AsyncInbox::new(pool, "receipt-mailer", async |conn: &mut Conn, delivery: &Delivery| {
///     let order: i64 = delivery.payload()?;
///     diesel::sql_query("INSERT INTO receipts (order_id) VALUES (?)")
///         .bind::<diesel::sql_types::BigInt, _>(order)
///         .execute(conn)
///         .await?;
///     Ok::<_, Failure>(())
/// });
/// # drop(inbox);
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub struct AsyncInbox<P, H> {
    pool: P,
    scope: String,
    config: Config,
    handler: H,
}

#[cfg(feature = "diesel-async")]
impl<P, H> fmt::Debug for AsyncInbox<P, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncInbox")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "diesel-async")]
impl<P, H, E> AsyncInbox<P, H>
where
    P: crate::AsyncConnectionPool,
    H: AsyncFnOnce(&mut P::Connection, &Delivery) -> Result<(), E> + Clone + Send + Sync,
    E: HandlerError,
{
    /// An inbox that runs `handler` for each delivery with a connection of
    /// `pool`, under `scope` (the consumer's name: its keys are its own)
    /// and [`Config::default()`].
    pub fn new(pool: P, scope: impl Into<String>, handler: H) -> Self {
        AsyncInbox {
            pool,
            scope: scope.into(),
            config: Config::default(),
            handler,
        }
    }

    /// Runs the calls under `config`, as [`Inbox::config`].
    #[must_use]
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }
}

#[cfg(feature = "diesel-async")]
impl<P, H, E> Receive for AsyncInbox<P, H>
where
    P: crate::AsyncConnectionPool,
    H: AsyncFnOnce(&mut P::Connection, &Delivery) -> Result<(), E> + Clone + Send + Sync,
    E: HandlerError,
{
    async fn receive(&self, delivery: Delivery) -> Verdict {
        use tracing::Instrument;

        let span = delivery_span(&self.scope, &delivery);
        let handled = async {
            let mut conn = match self.pool.lend().await {
                Ok(conn) => conn,
                Err(error) => return Verdict::Retry(format!("no database connection: {error}")),
            };
            let handler = self.handler.clone();
            let run = self.config.run_async(
                &mut *conn,
                &self.scope,
                &delivery.key,
                delivery.payload.as_str(),
                async |tx: &mut P::Connection| handler(tx, &delivery).await,
            );
            match crate::backend::catch_unwind(run).await {
                Ok(run) => run.map_or_else(verdict_of, |_| Verdict::Done),
                Err(_panic) => Verdict::Retry(String::from(PANICKED)),
            }
        };
        let verdict = handled.instrument(span.clone()).await;
        reported(&span, verdict)
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

    /// The async inbox against a handler that panics after its write: the
    /// delivery fails, nothing of it stays, and its redelivery has its
    /// effect once.
    #[cfg(feature = "sqlite-async")]
    mod asynchronous {
        use std::sync::atomic::{AtomicUsize, Ordering};

        use diesel::SqliteConnection;
        use diesel::connection::SimpleConnection;
        use diesel_async::pooled_connection::AsyncDieselConnectionManager;
        use diesel_async::pooled_connection::deadpool::Pool;
        use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;

        use super::*;

        type Conn = SyncConnectionWrapper<SqliteConnection>;

        /// The rows of `effects`, and the key records, as a connection of
        /// their own reads them.
        fn rows(url: &str) -> (i64, i64) {
            use diesel::RunQueryDsl;
            let mut conn = <SqliteConnection as diesel::Connection>::establish(url).unwrap();
            let mut count = |table: &str| -> i64 {
                diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!(
                    "(SELECT COUNT(*) FROM {table})"
                )))
                .get_result(&mut conn)
                .unwrap()
            };
            (count("effects"), count("idempotency_keys"))
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_handler_that_panics_after_its_write_fails_the_delivery_and_its_redelivery_has_its_effect_once() {
            let database = tempfile::NamedTempFile::new().unwrap();
            let url = database.path().to_string_lossy().into_owned();
            let mut setup = <SqliteConnection as diesel::Connection>::establish(&url).unwrap();
            crate::run_migrations(&mut setup).unwrap();
            setup
                .batch_execute("CREATE TABLE effects (id INTEGER PRIMARY KEY)")
                .unwrap();
            let pool = Pool::builder(AsyncDieselConnectionManager::<Conn>::new(url.clone()))
                .max_size(1)
                .build()
                .unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let handler = {
                let calls = Arc::clone(&calls);
                async move |conn: &mut Conn, _: &Delivery| {
                    diesel_async::RunQueryDsl::execute(diesel::sql_query("INSERT INTO effects (id) VALUES (1)"), conn)
                        .await?;
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the handler breaks after its write");
                    }
                    Ok::<_, crate::outbox::Failure>(())
                }
            };
            let inbox = AsyncInbox::new(pool, "panics", handler);
            let delivery = || Delivery::from_parts(Some("message-1".into()), b"1".to_vec(), [], 1).unwrap();

            let failed = inbox.receive(delivery()).await;
            assert_eq!(failed, Verdict::Retry(String::from(PANICKED)));
            let left = tokio::task::block_in_place(|| rows(&url));
            assert_eq!(left, (0, 0), "neither the effect nor the key stayed");

            assert_eq!(inbox.receive(delivery()).await, Verdict::Done);
            assert_eq!(inbox.receive(delivery()).await, Verdict::Done, "a replay");
            let done = tokio::task::block_in_place(|| rows(&url));
            assert_eq!(done, (1, 1), "the effect once");
            assert_eq!(calls.load(Ordering::SeqCst), 2, "the replay ran no handler");
        }
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
