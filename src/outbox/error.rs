//! Why an outbox call failed.

use std::fmt;

use crate::error::KeyError;

/// The most headers a message carries.
pub(super) const MAX_HEADERS: usize = 64;
/// The longest header name, in bytes.
pub(super) const MAX_HEADER_NAME_LEN: usize = 255;
/// The longest header value, in bytes.
pub(super) const MAX_HEADER_VALUE_LEN: usize = 4096;

/// Why an outbox call failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The topic breaks the key rules (without the card number check):
    /// empty, longer than 255 bytes or not visible ASCII. Nothing was written.
    InvalidTopic(KeyError),
    /// The payload did not serialize to JSON. Nothing was written.
    Codec(serde_json::Error),
    /// The ordering key breaks a topic's rules: empty, longer than 255
    /// bytes or not visible ASCII. Nothing was written.
    InvalidOrderingKey(KeyError),
    /// A header's name or value breaks its rules, or there are too many.
    /// Nothing was written.
    InvalidHeader(HeaderError),
    /// The trace context is not W3C's. Nothing was written.
    InvalidTraceContext(TraceContextError),
    /// The database failed. For a relay: messages it had claimed and not yet
    /// settled are delivered again once their lease runs out.
    Storage(diesel::result::Error),
}

impl From<diesel::result::Error> for Error {
    fn from(error: diesel::result::Error) -> Self {
        Error::Storage(error)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidTopic(reason) => write!(f, "invalid outbox topic: {reason}"),
            Error::Codec(_) => f.write_str("outbox payload cannot be stored as json"),
            Error::InvalidOrderingKey(reason) => write!(f, "invalid outbox ordering key: {reason}"),
            Error::InvalidHeader(reason) => write!(f, "invalid outbox header: {reason}"),
            Error::InvalidTraceContext(reason) => write!(f, "invalid outbox trace context: {reason}"),
            Error::Storage(_) => f.write_str("outbox storage failed"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // The reason is part of the message already.
            Error::InvalidTopic(_)
            | Error::InvalidOrderingKey(_)
            | Error::InvalidHeader(_)
            | Error::InvalidTraceContext(_) => None,
            Error::Codec(error) => Some(error),
            Error::Storage(error) => Some(error),
        }
    }
}

/// Why a message's headers were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// More than 64 headers.
    TooMany {
        /// How many were given.
        count: usize,
    },
    /// A name that is empty, longer than 255 bytes, or holds a byte that is
    /// not visible ASCII or is a `:`.
    InvalidName {
        /// The name, cut to 64 bytes (on a character boundary).
        name: String,
    },
    /// A value longer than 4096 bytes or holding a control character.
    InvalidValue {
        /// The header's name.
        name: String,
    },
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::TooMany { count } => write!(f, "{count} headers, the limit is {MAX_HEADERS}"),
            HeaderError::InvalidName { name } => write!(
                f,
                "header name {name:?} is not 1 to {MAX_HEADER_NAME_LEN} bytes of visible ascii without ':'"
            ),
            HeaderError::InvalidValue { name } => write!(
                f,
                "the value of header {name:?} is longer than {MAX_HEADER_VALUE_LEN} bytes or holds a control character"
            ),
        }
    }
}

impl std::error::Error for HeaderError {}

/// Why a trace context was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceContextError {
    /// Not `version-traceid-parentid-flags` in lower-case hex (2, 32, 16
    /// and 2 digits), or version `ff`, or an all-zero trace or parent id.
    Traceparent,
    /// Longer than 512 bytes or holding a byte that is not printable ASCII.
    Tracestate,
    /// A `tracestate` without a `traceparent`.
    TracestateWithoutTraceparent,
}

impl fmt::Display for TraceContextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TraceContextError::Traceparent => "traceparent is not a w3c version-traceid-parentid-flags",
            TraceContextError::Tracestate => "tracestate is longer than 512 bytes or not printable ascii",
            TraceContextError::TracestateWithoutTraceparent => "tracestate without a traceparent",
        })
    }
}

impl std::error::Error for TraceContextError {}
