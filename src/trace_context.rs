//! The W3C trace context of `tracing` spans through OpenTelemetry (feature
//! `opentelemetry`): read from the current span when a message is
//! enqueued and when a call executes, set as the parent of a consumer's
//! span when the message arrives, and linked from a replay's span.
//!
//! W3C's form is written and read here rather than through an OpenTelemetry
//! propagator: the message carries `traceparent` and `tracestate` by those
//! names on every broker, whatever propagator the application installed for
//! its HTTP traffic, and the API crate has no W3C propagator of its own
//! (that one is in the SDK, which stays the application's choice).

use std::str::FromStr;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "redis"))]
pub(crate) use consumer::continue_in;

/// The `traceparent` and `tracestate` (if any) of the current span, or
/// `None` when it has no valid OpenTelemetry context: no span, no
/// OpenTelemetry layer in the subscriber, or a span the subscriber's filter
/// disabled.
pub(crate) fn current() -> Option<(String, Option<String>)> {
    let context = Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_valid() {
        return None;
    }
    let traceparent = format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        span_context.trace_flags().to_u8()
    );
    let tracestate = Some(span_context.trace_state().header()).filter(|state| !state.is_empty());
    Some((traceparent, tracestate))
}

/// Links `span` to the span that `traceparent` names (a replay's span to
/// the execution it replays). An invalid `traceparent` links nothing, and
/// so does a span nothing records in OpenTelemetry.
pub(crate) fn link_to(span: &Span, traceparent: &str) {
    if let Some(context) = parse(traceparent, None) {
        span.add_link(context);
    }
}

/// The remote span context a W3C `traceparent` and `tracestate` describe,
/// or `None` when the `traceparent` is not version 00's form, names the
/// all-zero trace or span, or has a version this reads as 00's prefix of
/// (W3C: a later version's first four fields read as version 00's).
fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    let mut parts = traceparent.split('-');
    let (version, trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let rest = parts.next();
    let hex =
        |text: &str, len: usize| text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !hex(version, 2) || version == "ff" || !hex(trace_id, 32) || !hex(span_id, 16) || !hex(flags, 2) {
        return None;
    }
    // Version 00 has exactly four fields; a later one may add more.
    if version == "00" && rest.is_some() {
        return None;
    }
    let trace_id = TraceId::from_hex(trace_id).ok()?;
    let span_id = SpanId::from_hex(span_id).ok()?;
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?) & TraceFlags::SAMPLED;
    let state = tracestate
        .and_then(|state| TraceState::from_str(state).ok())
        .unwrap_or_default();
    let context = SpanContext::new(trace_id, span_id, flags, true, state);
    context.is_valid().then_some(context)
}

/// The consumer's side: a delivery's span continues the trace its message
/// carries.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "redis"))]
mod consumer {
    use opentelemetry::Context;
    use opentelemetry::trace::TraceContextExt;
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::parse;

    /// Makes the remote span that `traceparent` names the OpenTelemetry parent
    /// of `span`, which must not have been entered yet. An absent or invalid
    /// `traceparent` leaves `span` as it is (a fresh trace, or its ambient
    /// parent's), and so does a `tracestate` that does not parse: it is dropped,
    /// the trace kept.
    pub(crate) fn continue_in(span: &Span, traceparent: Option<&str>, tracestate: Option<&str>) {
        let Some(remote) = traceparent.and_then(|traceparent| parse(traceparent, tracestate)) else {
            return;
        };
        // Refused only when nothing records the span in OpenTelemetry (no
        // layer, or the span filtered out): nothing to continue then.
        let _ = span.set_parent(Context::new().with_remote_span_context(remote));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_w3c_traceparent_reads_as_a_remote_sampled_span() {
        let context = parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("shop=1,vendor=x"),
        )
        .expect("a valid traceparent");
        assert_eq!(
            context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(context.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(context.trace_state().get("shop"), Some("1"));
    }

    #[test]
    fn a_malformed_or_all_zero_traceparent_reads_as_no_context() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad, None).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields_and_a_bad_tracestate_is_dropped() {
        let context = parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more",
            Some("not a tracestate"),
        )
        .expect("a later version's prefix");
        assert!(!context.is_sampled());
        assert_eq!(context.trace_state().header(), "");
    }
}
