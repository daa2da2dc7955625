//! Spans exported to memory through OpenTelemetry (feature
//! `opentelemetry`): a `tracing` subscriber with the OpenTelemetry layer,
//! which a test sets for its own thread or gives a future, and the spans it
//! finished.

use opentelemetry::trace::TracerProvider;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Dispatch;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;

/// A subscriber that exports every span it ends to memory.
pub struct Traces {
    pub dispatch: Dispatch,
    exporter: InMemorySpanExporter,
}

impl Traces {
    pub fn new() -> Traces {
        Traces::at(LevelFilter::TRACE)
    }

    /// A subscriber that records the spans of `level` and above only, as
    /// `RUST_LOG=info` leaves out the crate's debug spans.
    pub fn at(level: LevelFilter) -> Traces {
        // The crate's callsites stay wanted whichever test's thread meets
        // them first (see `global_subscriber`).
        super::global_subscriber::install();
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        // The filter is the subscriber's, as `EnvFilter` usually is: a
        // span it leaves out does not exist for any layer.
        let subscriber = tracing_subscriber::registry()
            .with(level)
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idempotency-tests")));
        Traces {
            dispatch: Dispatch::new(subscriber),
            exporter,
        }
    }

    /// Runs `f` on this thread inside a new span `name`, and returns what
    /// `f` returned.
    pub fn in_span<T>(&self, name: &'static str, f: impl FnOnce() -> T) -> T {
        tracing::dispatcher::with_default(&self.dispatch, || {
            tracing::info_span!("span", otel.name = name).in_scope(f)
        })
    }

    /// Awaits `future` inside a new span `name`, every poll of it with this
    /// subscriber, and returns its output.
    #[cfg(feature = "diesel-async")]
    pub async fn in_span_async<F: Future>(&self, name: &'static str, future: F) -> F::Output {
        use tracing::instrument::{Instrument, WithSubscriber};

        let span = tracing::dispatcher::with_default(&self.dispatch, || tracing::info_span!("span", otel.name = name));
        future.instrument(span).with_subscriber(self.dispatch.clone()).await
    }

    /// The one finished span named `name`.
    pub fn span(&self, name: &str) -> SpanData {
        let mut named = self.spans(name);
        assert_eq!(named.len(), 1, "one span {name}");
        named.remove(0)
    }

    /// The finished spans named `name`, in the order they ended.
    pub fn spans(&self, name: &str) -> Vec<SpanData> {
        self.exporter
            .get_finished_spans()
            .expect("the exported spans")
            .into_iter()
            .filter(|span| span.name == name)
            .collect()
    }
}
