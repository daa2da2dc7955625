//! The trace context a message is enqueued with (feature `opentelemetry`):
//! captured from the span current at `enqueue`, not at delivery, unless the
//! application gave one.

use idempotency::outbox::{self, Envelope, Relay};

use crate::common::traces::Traces;

/// The `traceparent` and `tracestate` of every message the relay hands
/// over now, run inside a span `relay` of `traces` so that a context read
/// at delivery would show.
fn relayed(traces: &Traces, conn: &mut diesel::SqliteConnection) -> Vec<(Option<String>, Option<String>)> {
    let mut seen = Vec::new();
    traces.in_span("relay", || {
        Relay::default()
            .run_once(conn, |message| {
                seen.push((
                    message.traceparent().map(str::to_owned),
                    message.tracestate().map(str::to_owned),
                ));
                Ok::<_, std::convert::Infallible>(())
            })
            .expect("relay the outbox")
    });
    seen
}

#[test]
fn enqueue_inside_a_span_carries_that_spans_trace_context_to_the_relay() {
    let traces = Traces::new();
    let mut conn = idempotency::testing::sqlite_memory();
    traces.in_span("request", || {
        outbox::enqueue(&mut conn, "orders.placed", &1).expect("enqueue");
        Envelope::new("orders.placed", &2)
            .header("x-order", "2")
            .enqueue(&mut conn)
            .expect("enqueue an envelope");
    });
    let request = traces.span("request").span_context;
    let expected = format!("00-{}-{}-01", request.trace_id(), request.span_id());
    let seen = relayed(&traces, &mut conn);
    assert_eq!(seen, vec![(Some(expected.clone()), None), (Some(expected), None)]);
}

#[test]
fn enqueue_outside_any_span_or_without_opentelemetry_carries_no_trace_context() {
    let traces = Traces::new();
    let mut conn = idempotency::testing::sqlite_memory();
    outbox::enqueue(&mut conn, "orders.placed", &1).expect("enqueue with no subscriber");
    tracing::dispatcher::with_default(&traces.dispatch, || {
        outbox::enqueue(&mut conn, "orders.placed", &2).expect("enqueue outside any span")
    });
    assert_eq!(relayed(&traces, &mut conn), vec![(None, None), (None, None)]);
}

#[test]
fn a_trace_context_given_by_hand_is_kept_over_the_current_spans() {
    let traces = Traces::new();
    let mut conn = idempotency::testing::sqlite_memory();
    let given = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    traces.in_span("request", || {
        Envelope::new("orders.placed", &1)
            .traceparent(given)
            .tracestate("shop=1")
            .enqueue(&mut conn)
            .expect("enqueue");
        // A `tracestate` alone is still the application's mistake, not
        // completed with the span's `traceparent`.
        let refused = Envelope::new("orders.placed", &2)
            .tracestate("shop=1")
            .enqueue(&mut conn);
        assert!(
            matches!(refused, Err(outbox::Error::InvalidTraceContext(_))),
            "{refused:?}"
        );
    });
    assert_eq!(
        relayed(&traces, &mut conn),
        vec![(Some(given.to_owned()), Some(String::from("shop=1")))]
    );
}
