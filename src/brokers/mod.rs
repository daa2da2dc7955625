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
//! | the key ([`Message::key`](crate::outbox::Message::key)) | `Nats-Msg-Id` header | `message_id` property | `key` field |
//! | the topic | [`TOPIC_HEADER`] header | [`TOPIC_HEADER`] header | `header:`[`TOPIC_HEADER`] field |
//! | the ordering key | [`ORDERING_KEY_HEADER`] | [`ORDERING_KEY_HEADER`] | `header:`[`ORDERING_KEY_HEADER`] |
//! | the trace context | [`TRACEPARENT_HEADER`], [`TRACESTATE_HEADER`] | the same | `header:traceparent`, `header:tracestate` |
//! | the application's headers | headers, by name | AMQP headers (long strings) | `header:<name>` fields |
//!
//! The crate's own header names are reserved: an application header of the
//! same name (compared without case) is not sent, so the consumer's
//! [`Delivery`] always reads the message's own metadata.

mod error;
mod headers;
mod inbox;
#[cfg(feature = "nats")]
pub mod nats;
mod publisher;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

pub use error::Error;
pub use headers::{
    DEAD_LETTER_REASON_HEADER, ORDERING_KEY_HEADER, TOPIC_HEADER, TRACEPARENT_HEADER, TRACESTATE_HEADER,
};
#[cfg(feature = "diesel-async")]
pub use inbox::AsyncInbox;
pub use inbox::{Delivery, Inbox, Receive};
pub use publisher::{BlockingPublisher, Publisher};
