//! Publishing a message with the broker's confirmation, and a publisher as
//! the handler of the thread relay.

use std::future::Future;
use std::time::Duration;

use crate::outbox::{Failure, Message};

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
