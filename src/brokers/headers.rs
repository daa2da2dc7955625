//! The names of the headers every broker carries beside the application's.

use crate::outbox::Message;

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

pub(super) fn reserved(name: &str) -> bool {
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
