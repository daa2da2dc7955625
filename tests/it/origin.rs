//! Where a stored result came from (feature `opentelemetry`): the record of
//! an execution keeps the trace context of the span it ran in, a replay's
//! span links to that span, and `Recorded::origin` and `Config::status`
//! tell it, on every backend, sync and async. A call no OpenTelemetry layer
//! records keeps none.

use std::convert::Infallible;

use idempotency::phased::Phased;
use idempotency::{Config, KeyStatus, Origin, Outcome, Recorded};
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_sdk::trace::SpanData;
use tracing_subscriber::filter::LevelFilter;

use crate::common::TestDb;
use crate::common::own::unique_name;
use crate::common::traces::Traces;

crate::common::backend_tests!(
    an_execution_keeps_its_trace_and_a_replay_links_to_it,
    a_call_no_opentelemetry_layer_records_keeps_no_trace,
    where_the_calls_span_is_filtered_out_the_enclosing_spans_keep_and_link_the_trace,
    a_phased_operation_keeps_the_trace_of_its_first_attempt_and_a_replay_links_to_it,
    a_phased_operation_resumed_by_a_retry_keeps_the_trace_of_the_attempt_that_began_it,
);

/// The trace and span ids of a span.
fn ids(span: &SpanData) -> (TraceId, SpanId) {
    (span.span_context.trace_id(), span.span_context.span_id())
}

/// The trace and span ids of the spans `span` links to.
fn links(span: &SpanData) -> Vec<(TraceId, SpanId)> {
    span.links
        .iter()
        .map(|link| (link.span_context.trace_id(), link.span_context.span_id()))
        .collect()
}

/// Asserts what `first` and its replay `retry` recorded in `traces`: the
/// first call's record keeps its span's trace context, the replay tells
/// the same origin, in a trace of its own whose call span links to the
/// span that executed.
fn assert_replay_links_to_its_execution(traces: &Traces, first: &Recorded<i64>, retry: &Recorded<i64>) {
    assert!(!first.outcome.is_replayed() && retry.outcome.is_replayed());
    let calls = traces.spans("idempotent_call");
    let [executed, replayed] = calls.as_slice() else {
        panic!("two calls, got {}", calls.len());
    };
    let (trace_id, span_id) = ids(executed);
    assert_eq!(
        first.origin.traceparent,
        Some(format!("00-{trace_id}-{span_id}-01")),
        "the record keeps the context of the span that executed"
    );
    assert_eq!(first.origin.trace_id(), Some(trace_id.to_string().as_str()));
    assert_eq!(retry.origin, first.origin, "a replay names the execution it replays");
    assert_ne!(
        replayed.span_context.trace_id(),
        trace_id,
        "the retry has a trace of its own"
    );
    assert_eq!(
        links(replayed),
        [(trace_id, span_id)],
        "the replay's span links to the execution"
    );
    assert!(executed.links.is_empty(), "an execution links to nothing");
}

/// The origin a lookup's `status` of a completed key tells.
fn origin_of(status: Result<KeyStatus<i64>, idempotency::Error>) -> Origin {
    match status.expect("status") {
        KeyStatus::Completed { origin, .. } => origin,
        other => panic!("not completed: {other:?}"),
    }
}

/// The origin `config`'s lookup of `key` tells.
fn looked_up_origin<C: idempotency::StoreConnection>(config: &Config, conn: &mut C, key: &str) -> Origin {
    origin_of(config.status(conn, "shop", key, &"book"))
}

/// A first call of a key of its own on `conn` in a span `request` of
/// `traces`, and its retry in a span `retry`, with the default policy:
/// the key, the first call and the retry.
fn first_and_retry<D: TestDb>(traces: &Traces, conn: &mut D::Conn) -> (String, Recorded<i64>, Recorded<i64>) {
    // Unique: PostgreSQL's key locks span every schema of the database.
    let key = unique_name("order");
    let mut call = |value: i64| {
        Config::default()
            .run_recorded(&mut *conn, "shop", &key, &"book", |_| Ok::<_, Infallible>(value))
            .expect("call")
    };
    let first = traces.in_span("request", || call(1));
    let retry = traces.in_span("retry", || call(2));
    assert_eq!(
        retry.outcome.clone().into_inner(),
        1,
        "the retry replays the first call"
    );
    (key, first, retry)
}

fn an_execution_keeps_its_trace_and_a_replay_links_to_it<D: TestDb>() {
    let traces = Traces::new();
    let db = D::new();
    let mut conn = db.conn();
    let (key, first, retry) = first_and_retry::<D>(&traces, &mut conn);
    assert_replay_links_to_its_execution(&traces, &first, &retry);
    assert_eq!(looked_up_origin(&Config::default(), &mut conn, &key), first.origin);
}

fn where_the_calls_span_is_filtered_out_the_enclosing_spans_keep_and_link_the_trace<D: TestDb>() {
    let traces = Traces::at(LevelFilter::INFO);
    let db = D::new();
    let (_, first, retry) = first_and_retry::<D>(&traces, &mut db.conn());
    assert!(retry.outcome.is_replayed());
    assert!(
        traces.spans("idempotent_call").is_empty(),
        "the calls' debug spans are left out"
    );
    let (trace_id, span_id) = ids(&traces.span("request"));
    assert_eq!(first.origin.traceparent, Some(format!("00-{trace_id}-{span_id}-01")));
    assert_eq!(retry.origin, first.origin);
    assert_eq!(links(&traces.span("retry")), [(trace_id, span_id)]);
}

/// A ride, an operation in phases, under a key of its own on a database of
/// its own, its attempts traced.
struct Ride<D: TestDb> {
    traces: Traces,
    _db: D,
    conn: D::Conn,
    ride: Phased,
    key: String,
}

impl<D: TestDb> Ride<D> {
    fn new() -> Self {
        let db = D::new();
        Ride {
            traces: Traces::new(),
            conn: db.conn(),
            _db: db,
            ride: Phased::new("ride"),
            key: unique_name("ride"),
        }
    }

    /// An attempt in a span `span`: it commits its first phase, then fails
    /// where `fail` says so, or finishes.
    fn attempt(&mut self, span: &'static str, fail: bool) -> Result<Outcome<i64>, idempotency::Error<std::io::Error>> {
        let Ride {
            traces,
            conn,
            ride,
            key,
            ..
        } = self;
        traces.in_span(span, || {
            ride.run(conn, "rider-ada", key, &"ada", |s| {
                s.phase("ride_created", |_| Ok::<_, std::io::Error>(()))?;
                if fail {
                    return Err(idempotency::Error::Operation(std::io::Error::other(
                        "the provider is down",
                    )));
                }
                s.finish(|_| Ok::<_, std::io::Error>(7_i64))
            })
        })
    }

    /// The `traceparent` the ride's lookup tells.
    fn looked_up_traceparent(&mut self) -> Option<String> {
        origin_of(self.ride.status(&mut self.conn, "rider-ada", &self.key, &"ada")).traceparent
    }
}

fn a_phased_operation_keeps_the_trace_of_its_first_attempt_and_a_replay_links_to_it<D: TestDb>() {
    let mut ride = Ride::<D>::new();
    assert!(!ride.attempt("request", false).expect("the operation").is_replayed());
    assert!(ride.attempt("retry", false).expect("the operation").is_replayed());
    let attempts = ride.traces.spans("phased_operation");
    let [executed, replayed] = attempts.as_slice() else {
        panic!("two attempts, got {}", attempts.len());
    };
    let (trace_id, span_id) = ids(executed);
    assert_eq!(links(replayed), [(trace_id, span_id)]);
    assert_eq!(
        ride.looked_up_traceparent(),
        Some(format!("00-{trace_id}-{span_id}-01"))
    );
}

fn a_phased_operation_resumed_by_a_retry_keeps_the_trace_of_the_attempt_that_began_it<D: TestDb>() {
    let mut ride = Ride::<D>::new();
    // The first attempt commits its first phase, then fails; the retry
    // resumes after that phase and finishes.
    assert!(ride.attempt("request", true).is_err());
    assert!(!ride.attempt("retry", false).expect("the retry finishes").is_replayed());
    let began = ride.traces.spans("phased_operation");
    let (trace_id, span_id) = ids(began.first().expect("the first attempt's span"));
    assert_eq!(
        ride.looked_up_traceparent(),
        Some(format!("00-{trace_id}-{span_id}-01"))
    );
}

fn a_call_no_opentelemetry_layer_records_keeps_no_trace<D: TestDb>() {
    let traces = Traces::new();
    let db = D::new();
    let mut conn = db.conn();
    let config = Config::default();
    let key = unique_name("order");
    let first = config
        .run_recorded(&mut conn, "shop", &key, &"book", |_| Ok::<_, Infallible>(1))
        .expect("call with no subscriber");
    assert_eq!(first.origin, Origin::default());
    // The retry is traced; the execution it replays was not, so it links
    // to nothing.
    let retry = traces.in_span("retry", || {
        config
            .run_recorded(&mut conn, "shop", &key, &"book", |_| Ok::<_, Infallible>(2))
            .expect("retry")
    });
    assert!(retry.outcome.is_replayed());
    assert_eq!(retry.origin, Origin::default());
    assert!(traces.span("idempotent_call").links.is_empty());
    assert_eq!(looked_up_origin(&config, &mut conn, &key), Origin::default());
}

#[cfg(feature = "diesel-async")]
mod asynchronous {
    use super::*;
    use crate::common::asynchronous::AsyncDb;

    crate::common::asynchronous::async_backend_tests!(an_async_execution_keeps_its_trace_and_a_replay_links_to_it);

    async fn an_async_execution_keeps_its_trace_and_a_replay_links_to_it<D: AsyncDb>() {
        let traces = Traces::new();
        let db = D::new();
        let mut conn = db.connect().await;
        let config = Config::default();
        let key = unique_name("order");
        let mut recorded = Vec::new();
        for (span, value) in [("request", 1), ("retry", 2)] {
            let call = config.run_recorded_async(&mut conn, "shop", &key, &"book", async |_: &mut D::Async| {
                Ok::<_, Infallible>(value)
            });
            recorded.push(traces.in_span_async(span, call).await.expect("call"));
        }
        assert_replay_links_to_its_execution(&traces, &recorded[0], &recorded[1]);
        assert_eq!(looked_up_origin(&config, &mut db.conn(), &key), recorded[0].origin);
    }
}
