//! What the scenarios learn from diesel's instrumentation rather than from
//! the clock around a call: how many statements a call sends and how long
//! each purge batch holds its transaction (every statement's time is
//! `server.rs`'s). A count of statements tells why one scenario costs more
//! than another where a time alone cannot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
