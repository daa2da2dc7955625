//! Redis Streams (feature `redis`, client redis-rs on tokio):
//! [`RedisPublisher`] and [`RedisConsumer`].
//!
//! The publisher appends each message to a stream with `XADD`: the key in
//! the field `key`, the payload in `payload`, each header in a field
//! `header:<name>`, and trims the stream as its [`Trim`] policy says. The
//! `XADD` reply (the entry's id) is the confirmation. Redis (7) has no
//! deduplication on append: the consumer's inbox drops a second copy.
//!
//! The consumer reads with a consumer group, acknowledges (`XACK`) after
//! the inbox's commit, and leaves a failed entry pending; pending entries
//! idle for the [claim interval](RedisConsumer::claim_idle) are claimed
//! again (`XPENDING`, `XCLAIM`), by this consumer or another of the group,
//! which counts their deliveries. An entry that failed on its last allowed
//! delivery, failed permanently or is no message of the crate's is
//! appended to a dead-letter stream with the reason and acknowledged, in
//! one `MULTI`.
//!
//! It needs Redis 6.2 or later (`XPENDING … IDLE`, exclusive ranges); it is
//! tested on Redis 7.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{Client, Value};

use super::error::Error;
use super::headers::{DEAD_LETTER_REASON_HEADER, outgoing_headers};
use super::inbox::{DEFAULT_MAX_DELIVERIES, Delivery, Receive, Verdict};
use super::publisher::Publisher;
use crate::outbox::{Failure, Message};
use crate::telemetry::TARGET;

/// The field that carries the message key.
pub const KEY_FIELD: &str = "key";
/// The field that carries the payload.
pub const PAYLOAD_FIELD: &str = "payload";
/// What comes before a header's name in the name of its field.
pub const HEADER_FIELD_PREFIX: &str = "header:";

/// How long the publisher waits for a reply from Redis.
const PUBLISH_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The default trimming: about a million entries per stream.
const DEFAULT_MAX_LEN: usize = 1_000_000;

/// How a [`RedisPublisher`] trims a stream as it appends to it.
///
/// A Redis stream lives in memory and keeps its entries after every group
/// read them: without trimming it grows for ever. Trimming removes the
/// oldest entries whether a group has read them or not, so a consumer
/// group that falls further behind than the bound loses the entries
/// trimmed before it read them; choose the bound far above any backlog a
/// consumer may build (the default, about a million entries, holds a day
/// at ten messages a second), or trim the stream yourself from the
/// groups' progress (`XINFO GROUPS`) with [`Trim::Never`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Trim {
    /// `XADD … MAXLEN ~ n`: about `n` entries at most (Redis trims whole
    /// nodes, so a few more may stay); cheap. The default, with a million.
    AboutMaxLen(usize),
    /// `XADD … MAXLEN = n`: exactly `n` entries at most; costs more per
    /// append.
    MaxLen(usize),
    /// No trimming: the application trims the streams.
    Never,
}

impl Default for Trim {
    fn default() -> Self {
        Trim::AboutMaxLen(DEFAULT_MAX_LEN)
    }
}

type StreamRule = Arc<dyn Fn(&Message) -> String + Send + Sync>;

/// Publishes outbox messages to Redis Streams with `XADD`.
///
/// A message goes to the stream named as its topic unless a
/// [rule](RedisPublisher::stream) says otherwise, trimmed by the
/// [`Trim`] policy (by default about a million entries). The publisher
/// holds a multiplexed connection that connects again after a failure.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::brokers::redis::{RedisPublisher, Trim};
///
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let publisher = RedisPublisher::connect(client)
///     .await?
///     .stream(|message| format!("shop:{}", message.topic))
///     .trim(Trim::AboutMaxLen(100_000));
/// # drop(publisher);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisPublisher {
    conn: ConnectionManager,
    stream: StreamRule,
    trim: Trim,
}

impl fmt::Debug for RedisPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPublisher")
            .field("trim", &self.trim)
            .finish_non_exhaustive()
    }
}

impl RedisPublisher {
    /// Connects through `client`; messages go to the stream named as their
    /// topic, trimmed to about a million entries.
    ///
    /// # Errors
    ///
    /// When Redis could not be reached.
    pub async fn connect(client: Client) -> Result<Self, Error> {
        let config = ConnectionManagerConfig::new().set_response_timeout(Some(PUBLISH_RESPONSE_TIMEOUT));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|error| Error::new("could not connect to redis", error))?;
        Ok(RedisPublisher {
            conn,
            stream: Arc::new(|message: &Message| message.topic.clone()),
            trim: Trim::default(),
        })
    }

    /// Appends each message to the stream `rule` names.
    #[must_use]
    pub fn stream(mut self, rule: impl Fn(&Message) -> String + Send + Sync + 'static) -> Self {
        self.stream = Arc::new(rule);
        self
    }

    /// Trims the streams by `trim` as it appends.
    #[must_use]
    pub fn trim(mut self, trim: Trim) -> Self {
        self.trim = trim;
        self
    }
}

impl Publisher for RedisPublisher {
    async fn publish(&self, message: &Message) -> Result<(), Failure> {
        let mut xadd = redis::cmd("XADD");
        xadd.arg((self.stream)(message));
        match self.trim {
            Trim::AboutMaxLen(len) => xadd.arg("MAXLEN").arg("~").arg(len),
            Trim::MaxLen(len) => xadd.arg("MAXLEN").arg("=").arg(len),
            Trim::Never => &mut xadd,
        };
        xadd.arg("*")
            .arg(KEY_FIELD)
            .arg(&message.key)
            .arg(PAYLOAD_FIELD)
            .arg(&message.payload_json);
        for (name, value) in outgoing_headers(message) {
            xadd.arg(format!("{HEADER_FIELD_PREFIX}{name}")).arg(value);
        }
        let mut conn = self.conn.clone();
        xadd.query_async::<String>(&mut conn)
            .await
            .map(drop)
            .map_err(|error| Failure::Retry(format!("redis XADD failed: {error}")))
    }
}

/// How long a consumer blocks in one `XREADGROUP` by default.
const DEFAULT_BLOCK: Duration = Duration::from_secs(1);
/// How long an entry stays pending before a consumer claims it again.
const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(30);
/// How many entries a consumer reads or claims at a time.
const BATCH: usize = 16;

/// Runs an [`Inbox`](super::Inbox) (or an `AsyncInbox`) for the entries of a Redis stream, as one consumer of
/// a consumer group.
///
/// [`run`](RedisConsumer::run) creates the group (reading the stream from
/// its start) when it does not exist, and first handles, in their order,
/// the entries its consumer name left pending when it last stopped or died:
/// restart a consumer under the same name to keep the order of what it
/// held. Then each round claims the group's
/// entries left pending for the [claim interval](RedisConsumer::claim_idle)
/// (failed, or read by a consumer that died) and then reads new entries,
/// and handles each in its turn: the inbox runs the handler in its own
/// transaction, and only after the commit is the entry acknowledged. A
/// failed entry stays pending until it is claimed again; one that failed on
/// its last allowed delivery, failed permanently or is no message of the
/// crate's is appended to the [dead-letter stream](RedisConsumer::dead_letter_stream)
/// (by default the stream's name followed by `:dead`) with the reason in
/// the field `header:`[`DEAD_LETTER_REASON_HEADER`], and acknowledged.
pub struct RedisConsumer<I> {
    client: Client,
    stream: String,
    group: String,
    consumer: String,
    inbox: I,
    max_deliveries: u32,
    claim_idle: Duration,
    block: Duration,
    dead_letter_stream: String,
}

impl<I: fmt::Debug> fmt::Debug for RedisConsumer<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConsumer")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("inbox", &self.inbox)
            .finish_non_exhaustive()
    }
}

impl<I: Receive> RedisConsumer<I> {
    /// Runs `inbox` for the entries of `stream` as `consumer` of `group`,
    /// connected through `client`; 5 deliveries at most, entries claimed
    /// again after 30 s pending.
    pub fn new(
        client: Client,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
        inbox: I,
    ) -> Self {
        let stream = stream.into();
        RedisConsumer {
            client,
            dead_letter_stream: format!("{stream}:dead"),
            stream,
            group: group.into(),
            consumer: consumer.into(),
            inbox,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            claim_idle: DEFAULT_CLAIM_IDLE,
            block: DEFAULT_BLOCK,
        }
    }

    /// Dead-letters an entry when its delivery number `max_deliveries` (at
    /// least 1) failed.
    #[must_use]
    pub fn max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.max_deliveries = max_deliveries.max(1);
        self
    }

    /// How long an entry stays pending (failed, or held by a consumer that
    /// died) before it is claimed again. Longer than a handler takes: an
    /// entry claimed while its handler still runs is handled twice (once
    /// in effect, through the inbox).
    #[must_use]
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// Appends the entries it gives up to `stream`.
    #[must_use]
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter_stream = stream.into();
        self
    }

    /// Handles the stream's entries until `stop` completes; the entries
    /// of the round in hand are finished first (a round waits at most a
    /// second for new entries).
    ///
    /// # Errors
    ///
    /// When Redis could not be reached at the start, or the group could
    /// not be created. Later failures of Redis are waited out: the
    /// connection reconnects.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), Error> {
        // A blocking read holds the connection for its block time.
        let config = ConnectionManagerConfig::new().set_response_timeout(Some(self.block + PUBLISH_RESPONSE_TIMEOUT));
        let mut conn = ConnectionManager::new_with_config(self.client.clone(), config)
            .await
            .map_err(|error| Error::new("could not connect to redis", error))?;
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Err(error) if error.code() != Some("BUSYGROUP") => {
                return Err(Error::new("could not create the redis consumer group", error));
            }
            _ => {}
        }
        let mut stop = std::pin::pin!(stop);
        // What this consumer held when it stopped or died comes first, in
        // its order, before anything newer.
        let mut recovered = false;
        // Looked at between rounds, so that a round (a read blocks for at
        // most the block time) finishes the entries it took.
        while stop.as_mut().now_or_never().is_none() {
            if !recovered {
                match self.recover(&mut conn).await {
                    Ok(()) => recovered = true,
                    Err(error) => {
                        tracing::warn!(target: TARGET, stream = %self.stream, %error, "redis consumer: recovery failed");
                        tokio::select! {
                            () = &mut stop => break,
                            () = tokio::time::sleep(self.block) => {}
                        }
                    }
                }
                continue;
            }
            if let Err(error) = self.round(&mut conn).await {
                tracing::warn!(target: TARGET, stream = %self.stream, %error, "redis consumer: round failed");
                // Redis is down or restarting: wait before the next round,
                // or for the stop.
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(self.block) => {}
                }
            }
        }
        Ok(())
    }

    /// Handles once, in stream order, the entries this consumer's name
    /// holds pending: those it read and did not settle before it stopped or
    /// died.
    async fn recover(&self, conn: &mut ConnectionManager) -> redis::RedisResult<()> {
        let mut after = String::from("-");
        loop {
            let pending: StreamPendingCountReply = redis::cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(&after)
                .arg("+")
                .arg(BATCH)
                .arg(&self.consumer)
                .query_async(conn)
                .await?;
            let Some(last) = pending.ids.last() else {
                return Ok(());
            };
            // Exclusive: an entry that fails again stays pending behind.
            after = format!("({}", last.id);
            for entry in pending.ids {
                // Claimed from itself with no idle time: counts the delivery.
                let claimed: StreamClaimReply = redis::cmd("XCLAIM")
                    .arg(&self.stream)
                    .arg(&self.group)
                    .arg(&self.consumer)
                    .arg(0)
                    .arg(&entry.id)
                    .query_async(conn)
                    .await?;
                let attempt = u32::try_from(entry.times_delivered.saturating_add(1)).unwrap_or(u32::MAX);
                for claimed in claimed.ids {
                    self.handle(conn, claimed, attempt).await?;
                }
            }
        }
    }

    /// Claims the entries pending too long, then reads new ones, and
    /// handles them.
    async fn round(&self, conn: &mut ConnectionManager) -> redis::RedisResult<()> {
        let idle = u64::try_from(self.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("IDLE")
            .arg(idle)
            .arg("-")
            .arg("+")
            .arg(BATCH)
            .query_async(conn)
            .await?;
        for entry in pending.ids {
            // XCLAIM answers only an entry still idle that long: one another
            // consumer claimed meanwhile is not taken from it.
            let claimed: StreamClaimReply = redis::cmd("XCLAIM")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(&self.consumer)
                .arg(idle)
                .arg(&entry.id)
                .query_async(conn)
                .await?;
            let attempt = u32::try_from(entry.times_delivered.saturating_add(1)).unwrap_or(u32::MAX);
            for claimed in claimed.ids {
                self.handle(conn, claimed, attempt).await?;
            }
        }
        let block = u64::try_from(self.block.as_millis()).unwrap_or(u64::MAX);
        let read: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(BATCH)
            .arg("BLOCK")
            .arg(block)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(conn)
            .await?;
        for key in read.map(|read| read.keys).unwrap_or_default() {
            for entry in key.ids {
                self.handle(conn, entry, 1).await?;
            }
        }
        Ok(())
    }

    async fn handle(&self, conn: &mut ConnectionManager, entry: StreamId, attempt: u32) -> redis::RedisResult<()> {
        let mut fields: Vec<(String, String)> = entry
            .map
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), redis::from_redis_value_ref::<String>(value).ok()?)))
            .collect();
        let key = take(&mut fields, KEY_FIELD);
        let payload = entry.map.get(PAYLOAD_FIELD).map(bytes).unwrap_or_default();
        let headers = fields.into_iter().filter_map(|(name, value)| {
            let header = name.strip_prefix(HEADER_FIELD_PREFIX)?;
            Some((header.to_owned(), value))
        });
        let verdict = match Delivery::from_parts(key, payload, headers, attempt) {
            Ok(delivery) => self.inbox.receive(delivery).await.bounded(attempt, self.max_deliveries),
            Err(malformed) => Verdict::Dead(malformed.to_string()),
        };
        match verdict {
            Verdict::Done => {
                redis::cmd("XACK")
                    .arg(&self.stream)
                    .arg(&self.group)
                    .arg(&entry.id)
                    .query_async::<()>(conn)
                    .await
            }
            // Stays pending; claimed again after the claim interval.
            Verdict::Retry(_) => Ok(()),
            Verdict::Dead(reason) => {
                tracing::warn!(target: TARGET, stream = %self.stream, id = %entry.id, reason, "redis consumer: entry dead-lettered");
                let mut xadd = redis::cmd("XADD");
                xadd.arg(&self.dead_letter_stream).arg("*");
                for (name, value) in &entry.map {
                    xadd.arg(name).arg(bytes(value));
                }
                xadd.arg(format!("{HEADER_FIELD_PREFIX}{DEAD_LETTER_REASON_HEADER}"))
                    .arg(reason)
                    .arg("source-id")
                    .arg(&entry.id);
                let mut xack = redis::cmd("XACK");
                xack.arg(&self.stream).arg(&self.group).arg(&entry.id);
                redis::pipe()
                    .atomic()
                    .add_command(xadd)
                    .ignore()
                    .add_command(xack)
                    .ignore()
                    .query_async::<()>(conn)
                    .await
            }
        }
    }
}

/// The value of the field `name`, taken out of `fields`.
fn take(fields: &mut Vec<(String, String)>, name: &str) -> Option<String> {
    let at = fields.iter().position(|(field, _)| field == name)?;
    Some(fields.swap_remove(at).1)
}

/// A field's value as bytes, as Redis stores them.
fn bytes(value: &Value) -> Vec<u8> {
    redis::from_redis_value_ref::<Vec<u8>>(value).unwrap_or_default()
}
