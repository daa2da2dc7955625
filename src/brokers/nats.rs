//! NATS JetStream (feature `nats`, client async-nats): [`JetStreamPublisher`]
//! and [`JetStreamConsumer`].
//!
//! The publisher sends the message key as `Nats-Msg-Id`, so a stream drops
//! a second copy inside its duplicate window (2 minutes unless the stream
//! says otherwise), and counts a message delivered once the stream's
//! `PubAck` came, a `PubAck` that says `duplicate` included: the stream has
//! the message. The consumer acknowledges after the inbox's commit (and
//! waits for the server to confirm the ack), asks for a redelivery after a
//! failure with a `NAK` and a delay, and gives a message up with `TERM`
//! after its last allowed delivery, first publishing a copy to a
//! dead-letter subject when one is set.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures_util::StreamExt;

use super::error::Error;
use super::headers::{DEAD_LETTER_REASON_HEADER, outgoing_headers};
use super::inbox::{DEFAULT_MAX_DELIVERIES, Delivery, Receive, Verdict};
use super::publisher::Publisher;
use crate::outbox::{Failure, Message};
use crate::telemetry::TARGET;

/// The header JetStream deduplicates on.
const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// How long a consumer asks JetStream to wait before it delivers a failed
/// message again, by default.
const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

type SubjectRule = Arc<dyn Fn(&Message) -> String + Send + Sync>;

/// Publishes outbox messages to JetStream and waits for each `PubAck`.
///
/// The subject is the message's topic unless a [rule](JetStreamPublisher::subject)
/// says otherwise; a stream must capture it (a publish no stream captures
/// is a [`Failure::Retry`]: the stream may be created later).
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::brokers::nats::JetStreamPublisher;
///
/// let client = async_nats::connect("127.0.0.1:4222").await?;
/// let publisher = JetStreamPublisher::new(async_nats::jetstream::new(client))
///     .subject(|message| format!("shop.{}", message.topic));
/// # drop(publisher);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct JetStreamPublisher {
    context: jetstream::Context,
    subject: SubjectRule,
}

impl fmt::Debug for JetStreamPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamPublisher").finish_non_exhaustive()
    }
}

impl JetStreamPublisher {
    /// A publisher on `context` that publishes each message on the subject
    /// named as its topic.
    pub fn new(context: jetstream::Context) -> Self {
        JetStreamPublisher {
            context,
            subject: Arc::new(|message: &Message| message.topic.clone()),
        }
    }

    /// Publishes each message on the subject `rule` gives it.
    #[must_use]
    pub fn subject(mut self, rule: impl Fn(&Message) -> String + Send + Sync + 'static) -> Self {
        self.subject = Arc::new(rule);
        self
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &Message) -> Result<(), Failure> {
        let mut headers = HeaderMap::new();
        for (name, value) in outgoing_headers(message) {
            headers.insert(name, value);
        }
        headers.insert(MESSAGE_ID_HEADER, message.key.as_str());
        let subject = (self.subject)(message);
        let ack = self
            .context
            .publish_with_headers(subject, headers, message.payload_json.clone().into())
            .await
            .map_err(|error| Failure::Retry(format!("jetstream publish failed: {error}")))?;
        let ack = ack
            .await
            .map_err(|error| Failure::Retry(format!("jetstream did not acknowledge: {error}")))?;
        if ack.duplicate {
            // The stream had the message already: a redelivery inside its
            // duplicate window, which is what the key is for.
            tracing::debug!(target: TARGET, key = %message.key, stream = %ack.stream, "jetstream: duplicate acknowledged");
        }
        Ok(())
    }
}

/// Runs an [`Inbox`](super::Inbox) (or an `AsyncInbox`) for the messages of a JetStream pull consumer.
///
/// The application creates the stream and the durable pull consumer with
/// the settings it needs (`ack_wait` longer than a handler takes,
/// `max_deliver` unset or above this consumer's
/// [bound](JetStreamConsumer::max_deliveries)), and hands the consumer
/// here. Each message is handled in its turn: the inbox runs the handler
/// in its own transaction, and only after the commit is the message
/// acknowledged (a double ack: the server confirms it). A failure asks for
/// a redelivery after the [retry delay](JetStreamConsumer::retry_delay); a
/// message that failed on its last allowed delivery, failed permanently,
/// or is no message of the crate's (no `Nats-Msg-Id`, a payload that is
/// not UTF-8) is terminated, after its copy went to the
/// [dead-letter subject](JetStreamConsumer::dead_letter_subject) when one
/// is set; JetStream also reports the termination as an advisory
/// (`$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>`).
pub struct JetStreamConsumer<I> {
    context: jetstream::Context,
    consumer: PullConsumer,
    inbox: I,
    max_deliveries: u32,
    retry_delay: Duration,
    dead_letter_subject: Option<String>,
}

impl<I: fmt::Debug> fmt::Debug for JetStreamConsumer<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamConsumer")
            .field("inbox", &self.inbox)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl<I: Receive> JetStreamConsumer<I> {
    /// Runs `inbox` for the messages of `consumer`, publishing dead
    /// letters through `context`; 5 deliveries at most, 1 s between a
    /// failure and the next delivery, no dead-letter subject.
    pub fn new(context: jetstream::Context, consumer: PullConsumer, inbox: I) -> Self {
        JetStreamConsumer {
            context,
            consumer,
            inbox,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            retry_delay: DEFAULT_RETRY_DELAY,
            dead_letter_subject: None,
        }
    }

    /// Gives a message up when its delivery number `max_deliveries` (at
    /// least 1) failed.
    #[must_use]
    pub fn max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.max_deliveries = max_deliveries.max(1);
        self
    }

    /// How long JetStream waits before it delivers a failed message again.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Publishes a copy of each message it gives up to `subject` (with its
    /// headers, its `Nats-Msg-Id` and the reason in
    /// [`DEAD_LETTER_REASON_HEADER`]) and waits for the `PubAck` before it
    /// terminates the message; a stream must capture `subject`. Without
    /// one, a message given up is only terminated.
    #[must_use]
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Handles the consumer's messages until `stop` completes; the message
    /// in hand is finished first. Messages pulled ahead and not handled
    /// come again after the consumer's `ack_wait`.
    ///
    /// # Errors
    ///
    /// When the consumer's message stream could not be opened, or ended.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), Error> {
        let mut messages = self
            .consumer
            .messages()
            .await
            .map_err(|error| Error::new("the jetstream consumer could not be read", error))?;
        let mut stop = std::pin::pin!(stop);
        loop {
            let next = tokio::select! {
                () = &mut stop => return Ok(()),
                next = messages.next() => next,
            };
            match next {
                Some(Ok(message)) => self.handle(message).await,
                // Heartbeats missed, a reconnect: the stream goes on.
                Some(Err(error)) => tracing::warn!(target: TARGET, %error, "jetstream consumer: no messages for now"),
                None => return Err(Error::new("the jetstream consumer's messages ended", "stream closed")),
            }
        }
    }

    async fn handle(&self, message: jetstream::Message) {
        let attempt = message
            .info()
            .map(|info| u32::try_from(info.delivered).unwrap_or(u32::MAX))
            .unwrap_or(1);
        // Names compared as text: a header parsed off the wire is not
        // always the same `HeaderName` as the one built from the same name.
        let mut pairs: Vec<(String, String)> = message
            .headers
            .iter()
            .flat_map(|headers| headers.iter())
            .filter_map(|(name, values)| Some((name.to_string(), values.last()?.as_str().to_owned())))
            .collect();
        let key = pairs
            .iter()
            .position(|(name, _)| name.eq_ignore_ascii_case(MESSAGE_ID_HEADER))
            .map(|at| pairs.swap_remove(at).1);
        let verdict = match Delivery::from_parts(key, message.payload.to_vec(), pairs, attempt) {
            Ok(delivery) => self.inbox.receive(delivery).await.bounded(attempt, self.max_deliveries),
            Err(malformed) => Verdict::Dead(malformed.to_string()),
        };
        let acked = match verdict {
            Verdict::Done => message.double_ack().await,
            Verdict::Retry(_) => message.ack_with(AckKind::Nak(Some(self.retry_delay))).await,
            Verdict::Dead(reason) => match self.dead_letter(&message, &reason).await {
                Ok(()) => message.ack_with(AckKind::Term).await,
                Err(error) => {
                    // Not terminated: the message stays to be given up on
                    // its next delivery, once the dead-letter subject takes it.
                    tracing::warn!(target: TARGET, %error, "jetstream consumer: the dead letter was not published");
                    message.ack_with(AckKind::Nak(Some(self.retry_delay))).await
                }
            },
        };
        if let Err(error) = acked {
            // Delivered again after `ack_wait`; the inbox answers it from
            // the committed key.
            tracing::warn!(target: TARGET, %error, "jetstream consumer: the acknowledgement failed");
        }
    }

    async fn dead_letter(&self, message: &jetstream::Message, reason: &str) -> Result<(), String> {
        let Some(subject) = &self.dead_letter_subject else {
            return Ok(());
        };
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_LETTER_REASON_HEADER, reason.replace(char::is_control, " "));
        let ack = self
            .context
            .publish_with_headers(subject.clone(), headers, message.payload.clone())
            .await
            .map_err(|error| error.to_string())?;
        ack.await.map(drop).map_err(|error| error.to_string())
    }
}
