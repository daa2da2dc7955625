//! RabbitMQ (feature `rabbitmq`, client lapin on tokio): [`RabbitPublisher`]
//! and [`RabbitConsumer`].
//!
//! The publisher publishes on a channel in confirm mode, `mandatory`, as a
//! persistent message (delivery mode 2) with the key as its `message_id`
//! and the headers as AMQP headers, and counts a message delivered once
//! the broker acknowledged it without returning it: a message no queue
//! took (returned as unroutable) or that the broker refused (a `nack`) is a
//! failure. RabbitMQ has no deduplication of its own: the consumer's inbox
//! drops a second copy.
//!
//! The consumer acknowledges after the inbox's commit, requeues a message
//! that failed (a `nack` with requeue) after a delay, and rejects without
//! requeue, which sends it to the queue's dead-letter exchange, a message
//! that failed on its last allowed delivery, failed permanently or is no
//! message of the crate's. The delivery count comes from the
//! `x-delivery-count` header, which quorum queues keep: use a quorum queue
//! with `x-dead-letter-exchange` (a classic queue counts no deliveries, so
//! there only permanent failures are dead-lettered).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::error::Error;
use super::headers::outgoing_headers;
use super::inbox::{DEFAULT_MAX_DELIVERIES, Delivery, Receive, Verdict};
use super::publisher::Publisher;
use crate::outbox::{Failure, Message};
use crate::telemetry::TARGET;

/// AMQP's persistent delivery mode: the broker writes the message to disk
/// (on a durable queue) before it confirms it.
const PERSISTENT: u8 = 2;

/// The header a quorum queue counts a message's failed deliveries in.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// How long a consumer waits by default before it requeues a message that
/// failed, so that a failing database is not hammered.
const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

/// AMQP's reply code for a normal close.
const REPLY_SUCCESS: u16 = 200;

/// How many unacknowledged messages the broker sends a consumer ahead.
const DEFAULT_PREFETCH: u16 = 16;

/// Where a message is published: an exchange and a routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The exchange; empty for the default exchange, which routes by queue
    /// name.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
}

impl Route {
    /// The route to `exchange` with `routing_key`.
    pub fn new(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Route {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }
    }
}

type RouteRule = Arc<dyn Fn(&Message) -> Route + Send + Sync>;

/// lapin on tokio's executor and reactor.
fn properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// Connects to `uri` (`amqp://user:password@host:port/vhost`) on the
/// current tokio runtime.
///
/// # Errors
///
/// When the broker could not be reached or refused the connection.
pub async fn connect(uri: &str) -> Result<Connection, Error> {
    Connection::connect(uri, properties())
        .await
        .map_err(|error| Error::new("could not connect to rabbitmq", error))
}

/// Publishes outbox messages to RabbitMQ with publisher confirms.
///
/// By default a message goes to the exchange given to
/// [`connect`](RabbitPublisher::connect) with its topic as the routing key;
/// a [rule](RabbitPublisher::route) chooses otherwise. The publisher keeps
/// one connection and one channel in confirm mode, shared by every
/// publish (the confirms of concurrent publishes are awaited each on its
/// own, pipelined on the channel); when the channel or the connection
/// closes, the next publish connects again.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::brokers::rabbitmq::{RabbitPublisher, Route};
///
/// let publisher = RabbitPublisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "shop")
///     .await?
///     .route(|message| Route::new("shop", format!("shop.{}", message.topic)));
/// # drop(publisher);
/// # Ok(())
/// # }
/// ```
pub struct RabbitPublisher {
    uri: String,
    /// The connection and its confirm channel; `None` once either closed.
    link: Mutex<Option<(Connection, Channel)>>,
    route: RouteRule,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher").finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// Connects to `uri` and opens a channel in confirm mode; messages go
    /// to `exchange` with their topic as the routing key.
    ///
    /// # Errors
    ///
    /// When the broker could not be reached, or refused the channel.
    pub async fn connect(uri: impl Into<String>, exchange: impl Into<String>) -> Result<Self, Error> {
        let uri = uri.into();
        let link = open(&uri).await?;
        let exchange = exchange.into();
        Ok(RabbitPublisher {
            uri,
            link: Mutex::new(Some(link)),
            route: Arc::new(move |message: &Message| Route::new(exchange.clone(), message.topic.clone())),
        })
    }

    /// Publishes each message on the route `rule` gives it.
    #[must_use]
    pub fn route(mut self, rule: impl Fn(&Message) -> Route + Send + Sync + 'static) -> Self {
        self.route = Arc::new(rule);
        self
    }

    /// The open confirm channel, connected again if it closed.
    async fn channel(&self) -> Result<Channel, Failure> {
        let mut link = self.link.lock().await;
        if let Some((connection, channel)) = &*link
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *link = None;
        let (connection, channel) = open(&self.uri)
            .await
            .map_err(|error| Failure::Retry(format!("{error}: {}", error.source)))?;
        *link = Some((connection, channel.clone()));
        Ok(channel)
    }
}

/// A connection to `uri` and a channel on it in confirm mode.
async fn open(uri: &str) -> Result<(Connection, Channel), Error> {
    let connection = connect(uri).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|error| Error::new("could not open a rabbitmq channel", error))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|error| Error::new("rabbitmq refused confirm mode", error))?;
    Ok((connection, channel))
}

impl Publisher for RabbitPublisher {
    async fn publish(&self, message: &Message) -> Result<(), Failure> {
        let mut headers = FieldTable::default();
        for (name, value) in outgoing_headers(message) {
            headers.insert(ShortString::from(name), AMQPValue::LongString(LongString::from(value)));
        }
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message.key.as_str()))
            .with_delivery_mode(PERSISTENT)
            .with_content_type(ShortString::from("application/json"))
            .with_headers(headers);
        let route = (self.route)(message);
        let channel = self.channel().await?;
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let published = channel
            .basic_publish(
                &route.exchange,
                &route.routing_key,
                options,
                message.payload_json.as_bytes(),
                properties,
            )
            .await;
        let confirmation = match published {
            Ok(confirm) => confirm.await,
            Err(error) => Err(error),
        }
        .map_err(|error| Failure::Retry(format!("rabbitmq publish failed: {error}")))?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            // `mandatory`: no queue took it. Worth a retry: a binding may be
            // added; the relay's attempts bound how long.
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => Err(Failure::Retry(format!(
                "rabbitmq returned the message as unroutable from exchange {:?} with routing key {:?}: {} {}",
                route.exchange,
                route.routing_key,
                returned.reply_code,
                returned.reply_text.as_str()
            ))),
            Confirmation::Nack(None) => Err(Failure::Retry(String::from("rabbitmq refused the message (nack)"))),
            // The channel is in confirm mode from its start: an answer
            // without a confirm confirms nothing.
            Confirmation::NotRequested => Err(Failure::Retry(String::from("rabbitmq sent no confirm"))),
        }
    }
}

/// Runs an [`Inbox`](super::Inbox) (or an `AsyncInbox`) for the messages of a RabbitMQ queue.
///
/// The application declares the queue (a quorum queue, with
/// `x-dead-letter-exchange` naming where given-up messages go) and its
/// bindings. The consumer keeps a connection of its own, takes up to 16
/// messages ahead ([prefetch](RabbitConsumer::prefetch)) and handles them
/// in their turn: the inbox runs the handler in its own transaction, and
/// only after the commit is the message acknowledged. A failure requeues
/// the message after the [retry delay](RabbitConsumer::retry_delay); a
/// message that failed on its last allowed delivery, failed permanently or
/// is no message of the crate's (no `message_id`, a payload that is not
/// UTF-8) is rejected without requeue, into the dead-letter exchange. When
/// the connection is lost (the broker restarts), the messages it held go
/// back to the queue and the consumer connects again.
pub struct RabbitConsumer<I> {
    uri: String,
    queue: String,
    inbox: I,
    max_deliveries: u32,
    retry_delay: Duration,
    prefetch: u16,
}

impl<I: fmt::Debug> fmt::Debug for RabbitConsumer<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .field("inbox", &self.inbox)
            .field("max_deliveries", &self.max_deliveries)
            .finish_non_exhaustive()
    }
}

/// How a consumer's session on one connection ended.
enum Session {
    /// Asked to stop.
    Stopped,
    /// The connection or the channel failed.
    Lost(Error),
}

impl<I: Receive> RabbitConsumer<I> {
    /// Runs `inbox` for the messages of `queue` on the broker at `uri`; 5
    /// deliveries at most, 1 s before a failed message is requeued.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>, inbox: I) -> Self {
        RabbitConsumer {
            uri: uri.into(),
            queue: queue.into(),
            inbox,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            retry_delay: DEFAULT_RETRY_DELAY,
            prefetch: DEFAULT_PREFETCH,
        }
    }

    /// Dead-letters a message when its delivery number `max_deliveries`
    /// (at least 1) failed.
    #[must_use]
    pub fn max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.max_deliveries = max_deliveries.max(1);
        self
    }

    /// How long the consumer waits before it requeues a failed message,
    /// and before it connects again after losing its connection.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How many unacknowledged messages the broker sends ahead (at least 1).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Handles the queue's messages until `stop` completes, then closes its
    /// connection: the message in hand is finished first, and those sent
    /// ahead go back to the queue. A connection lost later is made again,
    /// every retry delay, until it is back or `stop` completes.
    ///
    /// # Errors
    ///
    /// When the first connection could not be made, or the queue could not
    /// be consumed on it (it does not exist).
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), Error> {
        let mut stop = std::pin::pin!(stop);
        let mut first = true;
        loop {
            match self.session(&mut stop, first).await {
                Ok(Session::Stopped) => return Ok(()),
                Ok(Session::Lost(error)) => {
                    first = false;
                    tracing::warn!(
                        target: TARGET, queue = %self.queue, error = %error, source = %error.source,
                        "rabbitmq consumer: connection lost, connecting again"
                    );
                }
                Err(error) if first => return Err(error),
                Err(error) => {
                    tracing::warn!(
                        target: TARGET, queue = %self.queue, error = %error, source = %error.source,
                        "rabbitmq consumer: could not connect again"
                    );
                }
            }
            tokio::select! {
                () = stop.as_mut() => return Ok(()),
                () = tokio::time::sleep(self.retry_delay) => {}
            }
        }
    }

    /// Consumes on a connection of its own until `stop` completes or the
    /// connection fails; `Err` when it could not start consuming.
    async fn session<S: Future<Output = ()>>(
        &self,
        stop: &mut std::pin::Pin<&mut S>,
        first: bool,
    ) -> Result<Session, Error> {
        let connection = connect(&self.uri).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|error| Error::new("could not open a rabbitmq channel", error))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(|error| Error::new("rabbitmq refused the prefetch", error))?;
        let mut consumer = channel
            .basic_consume(&self.queue, "", BasicConsumeOptions::default(), FieldTable::default())
            .await
            .map_err(|error| Error::new("the rabbitmq queue could not be consumed", error))?;
        if !first {
            tracing::info!(target: TARGET, queue = %self.queue, "rabbitmq consumer: connected again");
        }
        loop {
            let next = tokio::select! {
                () = stop.as_mut() => break,
                next = consumer.next() => next,
            };
            match next {
                Some(Ok(delivery)) => self.handle(delivery).await,
                Some(Err(error)) => return Ok(Session::Lost(Error::new("the rabbitmq consumer failed", error))),
                None => {
                    return Ok(Session::Lost(Error::new(
                        "the rabbitmq consumer ended",
                        "channel closed",
                    )));
                }
            }
        }
        // The messages sent ahead and not handled go back to the queue, now.
        if let Err(error) = connection.close(REPLY_SUCCESS, "consumer stopped").await {
            tracing::debug!(target: TARGET, %error, "rabbitmq consumer: the connection did not close cleanly");
        }
        Ok(Session::Stopped)
    }

    async fn handle(&self, delivery: lapin::message::Delivery) {
        let headers = delivery.properties.headers().as_ref();
        // A quorum queue counts the deliveries before this one.
        let before = headers
            .and_then(|headers| headers.inner().get(DELIVERY_COUNT_HEADER))
            .and_then(|count| {
                count
                    .as_long_long_int()
                    .or_else(|| count.as_long_int().map(i64::from))
                    .or_else(|| count.as_long_uint().map(i64::from))
            })
            .unwrap_or(0);
        let attempt = u32::try_from(before.saturating_add(1)).unwrap_or(u32::MAX);
        let pairs: Vec<(String, String)> = headers
            .map(|headers| {
                headers
                    .inner()
                    .iter()
                    .filter_map(|(name, value)| {
                        let text = value.as_long_string()?;
                        Some((
                            name.as_str().to_owned(),
                            String::from_utf8(text.as_bytes().to_vec()).ok()?,
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let key = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|key| key.as_str().to_owned());
        let verdict = match Delivery::from_parts(key, delivery.data.clone(), pairs, attempt) {
            Ok(received) => self.inbox.receive(received).await.bounded(attempt, self.max_deliveries),
            Err(malformed) => Verdict::Dead(malformed.to_string()),
        };
        let settled = match verdict {
            Verdict::Done => delivery.ack(BasicAckOptions::default()).await,
            Verdict::Retry(_) => {
                // The consumer's one message in hand: waiting here slows this
                // consumer down while its handler fails, as it should.
                tokio::time::sleep(self.retry_delay).await;
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    })
                    .await
            }
            Verdict::Dead(reason) => {
                tracing::warn!(target: TARGET, queue = %self.queue, reason, "rabbitmq consumer: message dead-lettered");
                delivery.reject(BasicRejectOptions { requeue: false }).await
            }
        };
        if let Err(error) = settled {
            // The broker requeues what this channel held when it closes; the
            // inbox answers a redelivery from the committed key.
            tracing::warn!(target: TARGET, %error, "rabbitmq consumer: the acknowledgement failed");
        }
    }
}
