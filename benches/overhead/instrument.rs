//! What the scenarios learn from diesel's instrumentation rather than from
//! the clock around a call: how many statements a call sends, how long each
//! purge batch holds its transaction, and, with `--statements`, every
//! statement and its time. A count of statements tells why one scenario
//! costs more than another where a time alone cannot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::stats::round3;

/// Counts the statements a connection sends: on PostgreSQL each is one
/// round trip to the server.
#[derive(Clone, Default)]
pub struct StatementCounter(Arc<AtomicU64>);

impl StatementCounter {
    pub fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let count = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn take(&self) -> u64 {
        self.0.swap(0, Ordering::Relaxed)
    }
}

/// Counts the statements a connection sends and the round trips they take:
/// a statement sent while another one's answer is still awaited (a
/// pipelined one, on diesel-async's PostgreSQL connection) shares that
/// one's round trip. diesel's instrumentation does not report the prepare
/// of a statement it does not cache, a round trip of its own that is not
/// counted.
#[cfg(feature = "postgres-async")]
#[derive(Clone, Default)]
pub struct RoundTripCounter(Arc<RoundTrips>);

#[cfg(feature = "postgres-async")]
#[derive(Default)]
struct RoundTrips {
    statements: AtomicU64,
    round_trips: AtomicU64,
    in_flight: AtomicU64,
}

#[cfg(feature = "postgres-async")]
impl RoundTripCounter {
    pub fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let counts = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| match event {
            diesel::connection::InstrumentationEvent::StartQuery { .. } => {
                counts.statements.fetch_add(1, Ordering::Relaxed);
                if counts.in_flight.fetch_add(1, Ordering::Relaxed) == 0 {
                    counts.round_trips.fetch_add(1, Ordering::Relaxed);
                }
            }
            diesel::connection::InstrumentationEvent::FinishQuery { .. } => {
                counts.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// The statements and the round trips since the last `take`.
    pub fn take(&self) -> (u64, u64) {
        (
            self.0.statements.swap(0, Ordering::Relaxed),
            self.0.round_trips.swap(0, Ordering::Relaxed),
        )
    }
}

/// Records how long each purge batch (one `DELETE` statement, its own
/// transaction) takes from start to commit.
#[derive(Clone, Default)]
pub struct BatchTimer(Arc<Mutex<(Option<Instant>, Vec<f64>)>>);

impl BatchTimer {
    pub fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let state = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            use diesel::connection::InstrumentationEvent::{FinishQuery, StartQuery};
            let mut state = state.lock().expect("batch timer");
            match event {
                StartQuery { query, .. } if query.to_string().contains("DELETE") => state.0 = Some(Instant::now()),
                FinishQuery { .. } => {
                    if let Some(start) = state.0.take() {
                        state.1.push(start.elapsed().as_secs_f64() * 1000.0);
                    }
                }
                _ => {}
            }
        }
    }

    pub fn batches_ms(&self) -> Vec<f64> {
        std::mem::take(&mut self.0.lock().expect("batch timer").1)
    }
}

/// Per scenario and statement: how many were sent and their mean time from
/// send to result, which on PostgreSQL includes the round trip.
pub type Profile = Vec<(String, String, f64, f64)>;

/// Times every statement of the single-connection scenarios (`--statements`).
/// Reading a statement's text costs time of its own, so the per-call figures
/// of a run with it are not the ones to quote.
#[derive(Clone, Default)]
pub struct Profiler(Arc<Mutex<ProfilerState>>);

#[derive(Default)]
struct ProfilerState {
    scenario: &'static str,
    started: Option<(String, Instant)>,
    totals: BTreeMap<(&'static str, String), (u64, f64)>,
}

impl Profiler {
    pub fn instrumentation(&self, counter: StatementCounter) -> impl diesel::connection::Instrumentation {
        let state = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            use diesel::connection::InstrumentationEvent::{FinishQuery, StartQuery};
            let mut state = state.lock().expect("profiler");
            match event {
                StartQuery { query, .. } => {
                    counter.0.fetch_add(1, Ordering::Relaxed);
                    let text = query.to_string();
                    let sql = text.split(" -- binds").next().unwrap_or_default();
                    let label: String = sql
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ")
                        .chars()
                        .take(64)
                        .collect();
                    state.started = Some((label, Instant::now()));
                }
                FinishQuery { .. } => {
                    if let Some((label, start)) = state.started.take() {
                        let scenario = state.scenario;
                        let entry = state.totals.entry((scenario, label)).or_default();
                        entry.0 += 1;
                        entry.1 += start.elapsed().as_secs_f64() * 1e6;
                    }
                }
                _ => {}
            }
        }
    }

    pub fn enter(&self, scenario: &'static str) {
        self.0.lock().expect("profiler").scenario = scenario;
    }

    pub fn reset(&self) {
        self.0.lock().expect("profiler").totals.clear();
    }

    /// Statements per call and mean µs per statement, for `calls` calls of
    /// each scenario.
    pub fn report(&self, calls: usize) -> Profile {
        let state = self.0.lock().expect("profiler");
        state
            .totals
            .iter()
            .map(|((scenario, label), (count, total))| {
                (
                    scenario.to_string(),
                    label.clone(),
                    round3(*count as f64 / calls as f64),
                    round3(total / *count as f64),
                )
            })
            .collect()
    }
}
