//! A message with what a broker carries besides its payload: headers, an
//! ordering key and the trace context, checked before anything is written.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Serialize;

use super::error::{Error, HeaderError, MAX_HEADER_NAME_LEN, MAX_HEADER_VALUE_LEN, MAX_HEADERS, TraceContextError};

/// The longest topic accepted, in bytes.
pub(super) const MAX_TOPIC_LEN: usize = 255;
use crate::backend::outbox::{NewMessage, OutboxStore};
use crate::backend::{BackendRules, RulesOf, StoreConnection, block_on};

/// The longest `tracestate`, in bytes: what W3C Trace Context asks every
/// vendor to pass on.
const MAX_TRACESTATE_LEN: usize = 512;

/// A message to enqueue with headers, an ordering key, the trace context or
/// a time before which it is not due: what [`enqueue`](super::enqueue)
/// writes, and more. Built with consuming methods, written by
/// [`enqueue`](Envelope::enqueue) (or
/// [`enqueue_async`](Envelope::enqueue_async)) through the transaction's
/// connection, exactly like [`enqueue`](super::enqueue); the relay's
/// handler reads it all back on the [`Message`](super::Message).
///
/// Nothing is checked before `enqueue`, and nothing is written when a check
/// fails there.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::outbox::{Envelope, Relay};
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// Envelope::new("orders.placed", &serde_json::json!({ "order": 7 }))
///     .header("content-type", "application/json")
///     .ordering_key("order-7")
///     .traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
///     .enqueue(&mut conn)?;
///
/// Relay::default().run_once(&mut conn, |message| {
///     assert_eq!(message.header("content-type"), Some("application/json"));
///     assert_eq!(message.ordering_key(), Some("order-7"));
///     assert_eq!(message.traceparent(), Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
///     Ok::<_, std::convert::Infallible>(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "an envelope is written only by `enqueue`"]
pub struct Envelope {
    topic: String,
    payload: Result<String, serde_json::Error>,
    headers: BTreeMap<String, String>,
    ordering_key: Option<String>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    not_before: Option<DateTime<Utc>>,
}

impl Envelope {
    /// A message for `topic` with `payload` as JSON, due at once, without
    /// headers, ordering key or trace context.
    pub fn new<P: Serialize + ?Sized>(topic: impl Into<String>, payload: &P) -> Self {
        Envelope {
            topic: topic.into(),
            payload: crate::codec::to_readable_json(payload),
            headers: BTreeMap::new(),
            ordering_key: None,
            traceparent: None,
            tracestate: None,
            not_before: None,
        }
    }

    /// Adds a header; a second value for the same name replaces the first.
    /// A name is 1 to 255 bytes of visible ASCII other than `:`; a value at
    /// most 4096 bytes of UTF-8 without control characters; a message
    /// carries at most 64 headers. Names are kept as given (brokers differ
    /// on case).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The ordering key: messages that share one are handed over in the
    /// order they were enqueued, by any number of relays, and one that is
    /// pending holds back the later ones of its key (see
    /// [ordering](crate::outbox#ordering)). The rules of a topic: 1 to 255
    /// bytes of visible ASCII.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// The W3C `traceparent` of the request that enqueues the message, as
    /// its `traceparent` header had it or the application's tracer gives
    /// it: `version-traceid-parentid-flags` in lower-case hex
    /// (`00-4bf9...4736-00f0...02b7-01`). With the feature
    /// `opentelemetry`, an envelope given neither this nor a
    /// [`tracestate`](Envelope::tracestate) takes both from the current
    /// span when it is enqueued (see [the trace](crate::guide::outbox));
    /// one given here is kept.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
    }

    /// The W3C `tracestate` that goes with the
    /// [`traceparent`](Envelope::traceparent): at most 512 bytes of
    /// printable ASCII.
    pub fn tracestate(mut self, tracestate: impl Into<String>) -> Self {
        self.tracestate = Some(tracestate.into());
        self
    }

    /// No relay delivers the message before `not_before`, as
    /// [`enqueue_at`](super::enqueue_at).
    pub fn not_before(mut self, not_before: DateTime<Utc>) -> Self {
        self.not_before = Some(not_before);
        self
    }

    /// Writes the message through `conn`, as [`enqueue`](super::enqueue)
    /// does, and returns its id.
    ///
    /// # Errors
    ///
    /// Nothing was written when a check fails:
    ///
    /// - [`Error::InvalidTopic`], [`Error::Codec`], [`Error::Storage`]: as
    ///   [`enqueue`](super::enqueue);
    /// - [`Error::InvalidOrderingKey`]: the ordering key breaks a topic's
    ///   rules;
    /// - [`Error::InvalidHeader`]: a header's name or value breaks its
    ///   rules, or there are more than 64;
    /// - [`Error::InvalidTraceContext`]: the `traceparent` is not W3C's
    ///   version-traceid-parentid-flags, or the `tracestate` is too long,
    ///   holds a control character, or comes without a `traceparent`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{Envelope, Error, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let refused = Envelope::new("receipts", &1).header("x-note", "line\nbreak").enqueue(&mut conn);
    /// assert!(matches!(refused, Err(Error::InvalidHeader(_))));
    /// assert_eq!(Relay::default().stats(&mut conn)?.pending, 0, "nothing was written");
    /// # Ok(())
    /// # }
    /// ```
    pub fn enqueue<C: StoreConnection>(self, conn: &mut C) -> Result<String, Error> {
        let not_before = self
            .not_before
            .map(|at| RulesOf::<C::Raw>::storable_time(at.naive_utc()));
        block_on(self.write(conn.raw(), not_before))
    }

    /// [`enqueue`](Envelope::enqueue) on a diesel-async connection (feature
    /// `diesel-async`), as [`enqueue_async`](super::enqueue_async).
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Envelope::enqueue).
    #[cfg(feature = "diesel-async")]
    pub async fn enqueue_async<C: crate::AsyncStoreConnection>(self, conn: &mut C) -> Result<String, Error> {
        let not_before = self.not_before.map(|at| C::Rules::storable_time(at.naive_utc()));
        self.write(conn, not_before).await
    }

    /// Checks everything, then writes the message on either kind of
    /// connection with the scope of the call executing on `conn`.
    async fn write<C: OutboxStore>(
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))] mut self,
        conn: &mut C,
        not_before: Option<NaiveDateTime>,
    ) -> Result<String, Error> {
        // Read here, in the caller's span (the request's), never at
        // delivery; a context given by hand, even a part of one, wins.
        #[cfg(feature = "opentelemetry")]
        if self.traceparent.is_none()
            && self.tracestate.is_none()
            && let Some((traceparent, tracestate)) = crate::trace_context::current()
        {
            self.traceparent = Some(traceparent);
            self.tracestate = tracestate;
        }
        crate::key::validate_topic(&self.topic, MAX_TOPIC_LEN).map_err(Error::InvalidTopic)?;
        if let Some(key) = &self.ordering_key {
            crate::key::validate_topic(key, MAX_TOPIC_LEN).map_err(Error::InvalidOrderingKey)?;
        }
        check_headers(&self.headers).map_err(Error::InvalidHeader)?;
        check_trace_context(self.traceparent.as_deref(), self.tracestate.as_deref())?;
        let payload = self.payload.map_err(Error::Codec)?;
        let headers = match self.headers.is_empty() {
            true => None,
            // A map of strings always serializes.
            false => Some(serde_json::to_string(&self.headers).map_err(Error::Codec)?),
        };
        let id = crate::id::new();
        let scope = crate::executing::scope_on(&*conn).unwrap_or_default();
        conn.insert_message(&NewMessage {
            id: &id,
            scope: &scope,
            topic: &self.topic,
            payload: &payload,
            not_before,
            headers: headers.as_deref(),
            ordering_key: self.ordering_key.as_deref(),
            traceparent: self.traceparent.as_deref(),
            tracestate: self.tracestate.as_deref(),
        })
        .await?;
        Ok(id)
    }
}

fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), HeaderError> {
    if headers.len() > MAX_HEADERS {
        return Err(HeaderError::TooMany { count: headers.len() });
    }
    for (name, value) in headers {
        let name_ok = !name.is_empty()
            && name.len() <= MAX_HEADER_NAME_LEN
            && name.bytes().all(|b| b.is_ascii_graphic() && b != b':');
        if !name_ok {
            return Err(HeaderError::InvalidName { name: shortened(name) });
        }
        if value.len() > MAX_HEADER_VALUE_LEN || value.chars().any(char::is_control) {
            return Err(HeaderError::InvalidValue { name: name.clone() });
        }
    }
    Ok(())
}

/// `name` cut to 64 bytes on a character boundary, for an error message.
fn shortened(name: &str) -> String {
    let mut end = name.len().min(64);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].to_owned()
}

fn check_trace_context(traceparent: Option<&str>, tracestate: Option<&str>) -> Result<(), Error> {
    let refused = |reason| Err(Error::InvalidTraceContext(reason));
    match traceparent {
        Some(traceparent) if !valid_traceparent(traceparent) => return refused(TraceContextError::Traceparent),
        None if tracestate.is_some() => return refused(TraceContextError::TracestateWithoutTraceparent),
        _ => {}
    }
    match tracestate {
        Some(state) if state.len() > MAX_TRACESTATE_LEN || !state.bytes().all(|b| (b' '..=b'~').contains(&b)) => {
            refused(TraceContextError::Tracestate)
        }
        _ => Ok(()),
    }
}

fn valid_traceparent(traceparent: &str) -> bool {
    let parts: Vec<&str> = traceparent.split('-').collect();
    let hex = |part: &str, len: usize| {
        part.len() == len && part.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |part: &str| part.bytes().any(|b| b != b'0');
    matches!(parts.as_slice(), [version, trace, parent, flags]
        if hex(version, 2) && *version != "ff" && hex(trace, 32) && nonzero(trace)
            && hex(parent, 16) && nonzero(parent) && hex(flags, 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_follows_the_w3c_format() {
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
        ] {
            assert!(!valid_traceparent(bad), "{bad:?}");
        }
    }

    #[test]
    fn header_rules_refuse_control_characters_colons_and_excess() {
        let one = |name: &str, value: &str| check_headers(&BTreeMap::from([(name.to_owned(), value.to_owned())]));
        assert_eq!(one("content-type", "application/json; charset=ü"), Ok(()));
        assert_eq!(one("x-empty", ""), Ok(()));
        assert!(matches!(one("", "v"), Err(HeaderError::InvalidName { .. })));
        assert!(matches!(one("a:b", "v"), Err(HeaderError::InvalidName { .. })));
        assert!(matches!(one("a b", "v"), Err(HeaderError::InvalidName { .. })));
        assert!(matches!(
            one(&"n".repeat(256), "v"),
            Err(HeaderError::InvalidName { .. })
        ));
        assert!(matches!(one("n", "a\r\nb"), Err(HeaderError::InvalidValue { .. })));
        assert!(matches!(one("n", "nul\0"), Err(HeaderError::InvalidValue { .. })));
        assert!(matches!(
            one("n", &"v".repeat(4097)),
            Err(HeaderError::InvalidValue { .. })
        ));
        let many: BTreeMap<String, String> = (0..65).map(|i| (format!("h{i}"), String::new())).collect();
        assert_eq!(check_headers(&many), Err(HeaderError::TooMany { count: 65 }));
    }
}
