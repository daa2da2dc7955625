//! What the crate tells operators: `tracing` spans and events (target
//! `idempotency`, always on) and, with the `metrics` feature, counters,
//! gauges and histograms through the `metrics` facade, which cost next to
//! nothing until an application installs a recorder.
//!
//! Scopes, topics and message ids appear as the technical identifiers they
//! are; a key as its digest (see [`key_digest`]), since a client may put in
//! a key what it should not (an e-mail address) in a form the key rules do
//! not catch, and the digest serves to follow one key through the logs as
//! well. Request, response and payload bodies never do, and neither do
//! texts that may quote them: JSON errors are reported by their category and
//! position, not their message, and a handler's error text stays on the
//! message in the database.

use std::time::Duration;

use sha2::{Digest, Sha256};

use tracing::field::Empty;
use tracing::{Span, debug, error, info, warn};

use crate::error::Error;
use crate::outcome::{Outcome, Recorded};

/// The target of every span and event.
pub(crate) const TARGET: &str = "idempotency";

/// How a key appears in spans and events: the first 16 hex digits of the
/// SHA-256 of its bytes (`printf %s "$KEY" | sha256sum | cut -c1-16` finds a
/// given key's).
pub(crate) fn key_digest(key: &str) -> String {
    let mut digest = crate::key::hex(&Sha256::digest(key.as_bytes()));
    digest.truncate(16);
    digest
}

/// The W3C `traceparent` of the span a call runs in, which the record of
/// an execution keeps: the call's span, or the nearest enclosing one the
/// subscriber records where it filtered the call's out. Read inside the
/// call's span.
pub(crate) fn execution_traceparent() -> Option<String> {
    #[cfg(feature = "opentelemetry")]
    return crate::trace_context::current().map(|(traceparent, _)| traceparent);
    #[cfg(not(feature = "opentelemetry"))]
    None
}

/// A call answers the result of the execution that ran in the span
/// `traceparent` names: the span the call runs in (as
/// [`execution_traceparent`] reads it) links to it. Called inside the
/// call's span.
#[cfg_attr(not(feature = "opentelemetry"), allow(unused_variables))]
pub(crate) fn link_to_execution(traceparent: Option<&str>) {
    #[cfg(feature = "opentelemetry")]
    if let Some(traceparent) = traceparent {
        crate::trace_context::link_to(&Span::current(), traceparent);
    }
}

/// The span of one idempotent call, and the decision it ended with.
///
/// The scope and the key are recorded only once they passed validation: a
/// refused value may be what the rules keep out of logs (a card number),
/// or megabytes long.
pub(crate) struct CallTrace {
    span: Span,
    #[cfg(feature = "metrics")]
    backend: &'static str,
    started: std::time::Instant,
}

impl CallTrace {
    pub(crate) fn start(backend: &'static str) -> CallTrace {
        CallTrace::with_span(
            tracing::debug_span!(target: TARGET, "idempotent_call", scope = Empty, key_digest = Empty, backend, outcome = Empty),
            backend,
        )
    }

    /// The trace of one attempt of the phased operation named `operation`.
    pub(crate) fn phased(backend: &'static str, operation: &str) -> CallTrace {
        CallTrace::with_span(
            tracing::debug_span!(
                target: TARGET, "phased_operation",
                operation, scope = Empty, key_digest = Empty, backend, outcome = Empty
            ),
            backend,
        )
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn with_span(span: Span, backend: &'static str) -> CallTrace {
        CallTrace {
            span,
            #[cfg(feature = "metrics")]
            backend,
            started: std::time::Instant::now(),
        }
    }

    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// Records a scope that passed validation.
    pub(crate) fn scope(&self, scope: &str) {
        self.span.record("scope", scope);
    }

    /// Records a key that passed validation, as its digest.
    pub(crate) fn key(&self, key: &str) {
        self.span.record("key_digest", key_digest(key).as_str());
    }

    /// The write path waited this long for the key (another call holding
    /// it, or SQLite's write lock).
    pub(crate) fn waited(&self, wait: Duration) {
        #[cfg(feature = "metrics")]
        metrics::histogram!("idempotency_in_flight_wait_seconds", "backend" => self.backend).record(wait);
        if wait >= Duration::from_millis(1) {
            debug!(target: TARGET, parent: &self.span, wait_ms = millis(wait), "waited for the key");
        }
    }

    /// An expired record is replaced by this call.
    pub(crate) fn took_over(&self) {
        debug!(target: TARGET, parent: &self.span, "expired record taken over");
    }

    /// Records how the call ended.
    pub(crate) fn finish<R, E>(&self, result: &Result<Recorded<R>, Error<E>>) {
        let span = &self.span;
        match result {
            Ok(recorded) => match recorded.outcome {
                Outcome::Executed(_) => {
                    debug!(target: TARGET, parent: span, expires_at = %recorded.expires_at, "executed");
                }
                Outcome::Replayed(_) => {
                    debug!(target: TARGET, parent: span, created_at = %recorded.created_at, "replayed");
                }
            },
            Err(error) => self.failed(error),
        }
        self.end(result.as_ref().map(|recorded| &recorded.outcome));
    }

    /// Records how an attempt of a phased operation ended.
    pub(crate) fn finish_phased<R, E>(&self, result: Result<&Outcome<R>, &Error<E>>) {
        let span = &self.span;
        match result {
            Ok(Outcome::Executed(_)) => debug!(target: TARGET, parent: span, "executed"),
            Ok(Outcome::Replayed(_)) => debug!(target: TARGET, parent: span, "replayed"),
            Err(error) => self.failed(error),
        }
        self.end(result);
    }

    /// The event of a call that failed.
    fn failed<E>(&self, error: &Error<E>) {
        let span = &self.span;
        match error {
            Error::InvalidKey(reason) => info!(target: TARGET, parent: span, %reason, "invalid key"),
            Error::InvalidScope(reason) => info!(target: TARGET, parent: span, %reason, "invalid scope"),
            Error::Mismatch => info!(target: TARGET, parent: span, "key reused with a different request"),
            Error::AlreadyCompleted => info!(target: TARGET, parent: span, "key already completed; not replayed"),
            Error::Expired => info!(target: TARGET, parent: span, "key expired; its tombstone refuses it"),
            Error::InProgress => {
                info!(target: TARGET, parent: span, elapsed_ms = millis(self.started.elapsed()), "key in progress");
            }
            Error::Operation(_) => debug!(target: TARGET, parent: span, "operation failed; rolled back"),
            Error::Storage(cause) => {
                let error = Causes(cause);
                error!(target: TARGET, parent: span, %error, "storage failed; rolled back")
            }
            Error::OutcomeUnknown(cause) => {
                let error = Causes(cause);
                warn!(target: TARGET, parent: span, %error, "commit failed; outcome unknown");
            }
            Error::ResponseTooLarge { len, max } => {
                warn!(target: TARGET, parent: span, len, max, "result too large to store; rolled back")
            }
            Error::Parked => warn!(target: TARGET, parent: span, "operation parked"),
            Error::PhaseRenamed { position, .. } => {
                error!(target: TARGET, parent: span, position, "a step was renamed")
            }
            Error::Codec(cause) => error!(
                target: TARGET, parent: span,
                category = ?cause.classify(), line = cause.line(), column = cause.column(),
                "json encoding or decoding failed"
            ),
        }
    }

    /// Records the outcome on the span and in the metrics.
    fn end<R, E>(&self, result: Result<&Outcome<R>, &Error<E>>) {
        let outcome = match result {
            Ok(Outcome::Executed(_)) => "executed",
            Ok(Outcome::Replayed(_)) => "replayed",
            Err(Error::InvalidKey(_)) => "invalid_key",
            Err(Error::InvalidScope(_)) => "invalid_scope",
            Err(Error::Mismatch) => "mismatch",
            Err(Error::InProgress) => "in_progress",
            Err(Error::AlreadyCompleted) => "already_completed",
            Err(Error::Expired) => "expired",
            Err(Error::Operation(_)) => "operation_error",
            Err(Error::Storage(_)) => "storage_error",
            Err(Error::OutcomeUnknown(_)) => "outcome_unknown",
            Err(Error::ResponseTooLarge { .. }) => "response_too_large",
            Err(Error::Parked) => "parked",
            Err(Error::PhaseRenamed { .. }) => "phase_renamed",
            Err(Error::Codec(_)) => "codec_error",
        };
        self.span.record("outcome", outcome);
        #[cfg(feature = "metrics")]
        {
            let labels = [("outcome", outcome), ("backend", self.backend)];
            metrics::counter!("idempotency_calls_total", &labels).increment(1);
            metrics::histogram!("idempotency_call_duration_seconds", &labels).record(self.started.elapsed());
        }
    }
}

/// Gives the installed `metrics` recorder the unit and description of every
/// metric the crate records, so that exporters show them (Prometheus's
/// `# HELP` and unit suffixes, for one). Call it once, after installing the
/// recorder; the metrics are recorded with or without it.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let recorder = metrics_util::debugging::DebuggingRecorder::new();
/// let snapshotter = recorder.snapshotter();
/// metrics::with_local_recorder(&recorder, || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     idempotency::describe_metrics();
///     let mut conn = idempotency::testing::sqlite_memory();
///     idempotency::run_idempotent(&mut conn, "shop", "k", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
///     Ok(())
/// })?;
/// let (_, unit, description, _) = snapshotter
///     .snapshot()
///     .into_vec()
///     .into_iter()
///     .find(|(key, ..)| key.key().name() == "idempotency_calls_total")
///     .ok_or("no calls counted")?;
/// assert_eq!(unit, Some(metrics::Unit::Count));
/// assert!(description.is_some());
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "metrics")]
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "idempotency_calls_total",
        Unit::Count,
        "idempotent calls by how they ended"
    );
    describe_histogram!(
        "idempotency_call_duration_seconds",
        Unit::Seconds,
        "a call from its start to its answer, the operation included"
    );
    describe_histogram!(
        "idempotency_in_flight_wait_seconds",
        Unit::Seconds,
        "how long a call that took the write path waited for its key"
    );
    describe_counter!(
        "idempotency_outbox_deliveries_total",
        Unit::Count,
        "outcomes of outbox delivery attempts"
    );
    describe_gauge!(
        "idempotency_outbox_pending",
        Unit::Count,
        "outbox messages not delivered yet"
    );
    describe_gauge!(
        "idempotency_outbox_due",
        Unit::Count,
        "outbox messages due now and leased to no relay"
    );
    describe_gauge!(
        "idempotency_outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "how long the oldest pending outbox message has waited since it was enqueued"
    );
    describe_gauge!(
        "idempotency_outbox_dead",
        Unit::Count,
        "outbox messages parked after their last attempt"
    );
    describe_counter!("idempotency_purged_rows_total", Unit::Count, "rows deleted by purges");
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Outbox deliveries and their results.
pub(crate) mod relay {
    use chrono::NaiveDateTime;
    use tracing::{debug, info, warn};

    use super::TARGET;

    pub(crate) fn claimed(count: usize, lease_until: NaiveDateTime) {
        if count > 0 {
            debug!(target: TARGET, count, %lease_until, "claimed messages");
        }
    }

    pub(crate) fn delivered(id: &str, topic: &str, attempt: u32) {
        debug!(target: TARGET, message_id = id, topic, attempt, "delivered");
        count("delivered");
    }

    pub(crate) fn retrying(id: &str, topic: &str, attempt: u32, due: NaiveDateTime) {
        info!(target: TARGET, message_id = id, topic, attempt, next_due = %due, "delivery failed; retrying");
        count("retried");
    }

    pub(crate) fn dead(id: &str, topic: &str, attempts: i32) {
        warn!(target: TARGET, message_id = id, topic, attempts, "delivery failed for the last time; message parked as dead");
        count("dead");
    }

    pub(crate) fn not_listening(pool_size: u32, workers: usize) {
        warn!(
            target: TARGET, pool_size, workers,
            "no pooled connection to spare for the listener (it needs workers + 1); new messages wait for the poll interval"
        );
    }

    pub(crate) fn lease_lost(id: &str) {
        warn!(target: TARGET, message_id = id, "lease lost before settling; left to the next claim");
        count("lost");
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn count(result: &'static str) {
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotency_outbox_deliveries_total", "result" => result).increment(1);
    }
}

/// A purge's deleted rows, by table.
pub(crate) fn purged(table: &'static str, rows: usize, batches: usize, elapsed: Duration) {
    if rows > 0 {
        info!(target: TARGET, table, rows, batches, elapsed_ms = millis(elapsed), "purged");
    } else {
        debug!(target: TARGET, table, "nothing to purge");
    }
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_purged_rows_total", "table" => table).increment(rows as u64);
}

/// A purge batch, with how long it held its lock.
pub(crate) fn purge_batch(table: &'static str, rows: usize, elapsed: Duration) {
    debug!(target: TARGET, table, rows, elapsed_ms = millis(elapsed), "purge batch");
}

/// A background service met a database error and waits before it tries
/// again.
pub(crate) fn service_error(service: &'static str, cause: &(dyn std::error::Error + 'static), retry_in: Duration) {
    let error = Causes(cause);
    warn!(target: TARGET, service, %error, retry_in_ms = millis(retry_in), "database error; retrying");
}

/// An error and every error in its `source()` chain, joined by `": "`: the
/// whole cause in one log field, down to the database's own message. The
/// crate's errors never carry a request, response or payload, so neither
/// does this.
pub(crate) struct Causes<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Causes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// The outbox's backlog gauges: pending messages, those due now, dead ones,
/// and how long the oldest pending one has waited.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn backlog(pending: u64, due_now: u64, dead: u64, oldest_pending_age: Option<chrono::Duration>) {
    #[cfg(feature = "metrics")]
    {
        metrics::gauge!("idempotency_outbox_pending").set(pending as f64);
        metrics::gauge!("idempotency_outbox_due").set(due_now as f64);
        metrics::gauge!("idempotency_outbox_dead").set(dead as f64);
        let age = oldest_pending_age.and_then(|age| age.to_std().ok()).unwrap_or_default();
        metrics::gauge!("idempotency_outbox_oldest_pending_age_seconds").set(age.as_secs_f64());
    }
}
