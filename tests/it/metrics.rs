//! The metrics of the `metrics` feature: each moves as the decisions behind
//! it happen, with the labels and units the README documents.
//!
//! The recorder is the test thread's own (`metrics::with_local_recorder`),
//! so tests running in parallel do not count each other's calls, and work
//! is done on the test thread: `Relay::run_once` rather than the service,
//! whose threads have no local recorder. Every snapshot takes the counts
//! since the one before.

use std::sync::mpsc;
use std::thread;

use chrono::Duration;
use idempotency::outbox::{self, Message, Relay};
use idempotency::{Config, Error, InFlight};
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use crate::common::outbox::FourWebhooks;
use crate::common::wait;
use crate::common::{TestDb, kept_an_hour};

crate::common::backend_tests!(
    calls_count_by_outcome_and_time_their_duration_and_wait,
    relay_deliveries_backlog_and_purges_have_their_metrics,
    described_metrics_carry_their_units_and_descriptions,
    phased_operations_count_by_outcome,
);

/// One metric as a snapshot holds it: kind, name, labels (`name=value`,
/// sorted) and value.
type Metric = (MetricKind, String, Vec<String>, DebugValue);

/// What the recorder saw since the snapshot before.
struct Taken(Vec<Metric>);

impl Taken {
    fn of(snapshotter: &Snapshotter) -> Taken {
        Taken(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| {
                    let (kind, key) = key.into_parts();
                    let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
                    labels.sort();
                    (kind, key.name().to_owned(), labels, value)
                })
                .collect(),
        )
    }

    fn find(&self, kind: MetricKind, name: &str, labels: &[&str]) -> Option<&DebugValue> {
        let mut labels: Vec<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        labels.sort();
        self.0
            .iter()
            .find(|(k, n, l, _)| *k == kind && n == name && *l == labels)
            .map(|(_, _, _, value)| value)
    }

    /// A counter's increase; 0 when it did not move.
    fn counter(&self, name: &str, labels: &[&str]) -> u64 {
        match self.find(MetricKind::Counter, name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            _ => 0,
        }
    }

    /// A histogram's new samples.
    fn histogram(&self, name: &str, labels: &[&str]) -> Vec<f64> {
        match self.find(MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.into_inner()).collect(),
            _ => Vec::new(),
        }
    }

    fn gauge(&self, name: &str) -> f64 {
        match self.find(MetricKind::Gauge, name, &[]) {
            Some(DebugValue::Gauge(value)) => value.into_inner(),
            other => panic!("no gauge {name}: {other:?}"),
        }
    }

    /// Every counter that moved, by name and labels.
    fn counters(&self) -> Vec<(String, Vec<String>, u64)> {
        self.0
            .iter()
            .filter_map(|(_, name, labels, value)| match value {
                DebugValue::Counter(n) if *n > 0 => Some((name.clone(), labels.clone(), *n)),
                _ => None,
            })
            .collect()
    }
}

/// A database of the test's own, a connection to it, and a recorder with
/// the snapshotter that reads it.
fn recorded<D: TestDb>() -> (D, D::Conn, DebuggingRecorder, Snapshotter) {
    let db = D::new();
    let conn = db.conn();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    (db, conn, recorder, snapshotter)
}

fn calls_count_by_outcome_and_time_their_duration_and_wait<D: TestDb>() {
    let (db, mut conn, recorder, snapshotter) = recorded::<D>();
    let backend = format!("backend={}", D::BACKEND);
    let backend = backend.as_str();
    let config = Config::default();
    let respond = |_: &mut D::Conn| Ok::<_, String>(7);
    let calls = |outcome: &str| format!("outcome={outcome}");

    metrics::with_local_recorder(&recorder, || {
        config.run(&mut conn, "shop", "k-1", &1, respond).expect("executes");
        let taken = Taken::of(&snapshotter);
        let executed = calls("executed");
        assert_eq!(taken.counter("idempotency_calls_total", &[&executed, backend]), 1);
        assert_eq!(
            taken
                .histogram("idempotency_call_duration_seconds", &[&executed, backend])
                .len(),
            1
        );
        assert_eq!(
            taken.histogram("idempotency_in_flight_wait_seconds", &[backend]).len(),
            1,
            "the write path records its wait for the key, however short"
        );

        config.run(&mut conn, "shop", "k-1", &1, respond).expect("replays");
        let taken = Taken::of(&snapshotter);
        let replayed = calls("replayed");
        assert_eq!(
            taken.counters(),
            [(
                "idempotency_calls_total".to_owned(),
                vec![backend.to_owned(), replayed.clone()],
                1
            )]
        );
        assert_eq!(
            taken
                .histogram("idempotency_call_duration_seconds", &[&replayed, backend])
                .len(),
            1
        );
        assert!(
            taken
                .histogram("idempotency_in_flight_wait_seconds", &[backend])
                .is_empty(),
            "a replay read it without waiting"
        );

        let mismatch = config.run(&mut conn, "shop", "k-1", &2, respond);
        assert!(matches!(mismatch, Err(Error::Mismatch)));
        let invalid = config.run(&mut conn, "shop", "has space", &1, respond);
        assert!(matches!(invalid, Err(Error::InvalidKey(_))));
        let failed = config.run(&mut conn, "shop", "k-2", &1, |_| Err::<i64, _>("refused".to_owned()));
        assert!(matches!(failed, Err(Error::Operation(_))));
        let taken = Taken::of(&snapshotter);
        for outcome in ["mismatch", "invalid_key", "operation_error"] {
            assert_eq!(
                taken.counter("idempotency_calls_total", &[&calls(outcome), backend]),
                1,
                "{outcome}"
            );
        }
    });

    // Another call holds the key; this one waits 50 ms for it, then gives up.
    let (entered, holding) = mpsc::channel();
    thread::scope(|scope| {
        // Owned here, so that a failed assertion drops it and frees the
        // waiting thread before the scope joins it.
        let (release, released) = mpsc::channel::<()>();
        let (db, config) = (&db, &config);
        let holder = scope.spawn(move || {
            config.run(&mut db.conn(), "shop", "k-busy", &1, |_| {
                entered.send(()).expect("the test waits");
                wait::recv(&released, "the test releases the key");
                Ok::<_, String>(1)
            })
        });
        wait::recv(&holding, "the holder runs its operation");
        let waiting = config.clone().in_flight(InFlight::Wait(Duration::milliseconds(50)));
        let taken = metrics::with_local_recorder(&recorder, || {
            let busy = waiting.run(&mut conn, "shop", "k-busy", &1, respond);
            assert!(matches!(busy, Err(Error::InProgress)), "{busy:?}");
            Taken::of(&snapshotter)
        });
        release.send(()).expect("the holder waits");
        holder
            .join()
            .expect("the holder does not panic")
            .expect("the holder executes");

        assert_eq!(
            taken.counter("idempotency_calls_total", &[&calls("in_progress"), backend]),
            1
        );
        let waits = taken.histogram("idempotency_in_flight_wait_seconds", &[backend]);
        // In seconds: the policy's 50 ms, not 50.
        assert!(waits.iter().any(|w| (0.05..5.0).contains(w)), "{waits:?}");
        let durations = taken.histogram("idempotency_call_duration_seconds", &[&calls("in_progress"), backend]);
        assert!(durations.iter().all(|d| (0.05..5.0).contains(d)), "{durations:?}");
    });
}

fn relay_deliveries_backlog_and_purges_have_their_metrics<D: TestDb>() {
    let (_db, mut conn, recorder, snapshotter) = recorded::<D>();
    let (clock, config) = kept_an_hour();
    let webhooks = FourWebhooks::enqueue::<D, _>(&mut conn, &clock, |i| i);
    let (relay, handler) = (&webhooks.relay, webhooks.handler(&clock, "503"));
    // Delivered, retried, dead, lost.
    let deliveries = |taken: &Taken| -> Vec<u64> {
        ["delivered", "retried", "dead", "lost"]
            .iter()
            .map(|result| taken.counter("idempotency_outbox_deliveries_total", &[&format!("result={result}")]))
            .collect()
    };

    metrics::with_local_recorder(&recorder, || {
        config
            .run(&mut conn, "shop", "k-1", &1, |_| Ok::<_, String>(1))
            .expect("a key record to purge later");
        Taken::of(&snapshotter);

        relay.run_once(&mut conn, &handler).expect("first pass");
        assert_eq!(deliveries(&Taken::of(&snapshotter)), [2, 1, 0, 1]);

        let stats = relay.stats(&mut conn).expect("stats");
        let taken = Taken::of(&snapshotter);
        assert_eq!(
            (stats.pending, stats.due_now, stats.dead),
            (2, 2, 0),
            "the retry's backoff and the lost message's lease are over"
        );
        assert_eq!(taken.gauge("idempotency_outbox_pending"), 2.0);
        assert_eq!(taken.gauge("idempotency_outbox_due"), 2.0);
        assert_eq!(taken.gauge("idempotency_outbox_dead"), 0.0);
        let age = stats
            .oldest_pending_age
            .expect("pending messages")
            .to_std()
            .expect("a positive age");
        assert_eq!(
            taken.gauge("idempotency_outbox_oldest_pending_age_seconds"),
            age.as_secs_f64()
        );

        relay.run_once(&mut conn, &handler).expect("second pass");
        assert_eq!(deliveries(&Taken::of(&snapshotter)), [1, 0, 1, 0]);

        relay.stats(&mut conn).expect("stats");
        let taken = Taken::of(&snapshotter);
        assert_eq!(taken.gauge("idempotency_outbox_pending"), 0.0);
        assert_eq!(taken.gauge("idempotency_outbox_dead"), 1.0);
        assert_eq!(
            taken.gauge("idempotency_outbox_oldest_pending_age_seconds"),
            0.0,
            "none pending"
        );

        clock.advance(Duration::days(1));
        assert_eq!(config.purge_expired(&mut conn, 100).expect("purge keys"), 1);
        assert_eq!(relay.purge_delivered(&mut conn, 2).expect("purge messages"), 3);
        let taken = Taken::of(&snapshotter);
        assert_eq!(
            taken.counter("idempotency_purged_rows_total", &["table=idempotency_keys"]),
            1
        );
        assert_eq!(
            taken.counter("idempotency_purged_rows_total", &["table=idempotency_outbox"]),
            3
        );
    });
}

/// After `describe_metrics`, every metric a call, a relay pass, the backlog
/// gauges and a purge record carries its unit (seconds for the `_seconds`
/// metrics, a count for the others) and a description.
fn described_metrics_carry_their_units_and_descriptions<D: TestDb>() {
    let (_db, mut conn, recorder, snapshotter) = recorded::<D>();
    let (clock, config) = kept_an_hour();
    let relay = Relay::default().clock(clock.source());
    metrics::with_local_recorder(&recorder, || {
        idempotency::describe_metrics();
        config
            .run(&mut conn, "shop", "k-1", &1, |_| Ok::<_, String>(1))
            .expect("executes");
        outbox::enqueue(&mut conn, "webhooks", &1).expect("enqueue");
        relay
            .run_once(&mut conn, |_: &Message| Ok::<_, String>(()))
            .expect("relay");
        relay.stats(&mut conn).expect("stats");
        clock.advance(Duration::hours(2));
        config.purge_expired(&mut conn, 10).expect("purge");
    });
    let described: Vec<(String, Option<metrics::Unit>, bool)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, unit, description, _)| (key.key().name().to_owned(), unit, description.is_some()))
        .collect();
    assert!(described.len() >= 9, "{described:?}");
    for (name, unit, has_description) in described {
        let expected = if name.ends_with("_seconds") {
            metrics::Unit::Seconds
        } else {
            metrics::Unit::Count
        };
        assert_eq!(unit, Some(expected), "{name}");
        assert!(has_description, "{name} has a description");
    }
}

/// Attempts of phased operations are calls too: counted by how they ended,
/// the outcomes only they have (`phase_renamed`) included.
fn phased_operations_count_by_outcome<D: TestDb>() {
    let (_db, mut conn, recorder, snapshotter) = recorded::<D>();
    let phased = idempotency::phased::Phased::new("greet");
    let backend = format!("backend={}", D::BACKEND);
    let taken = metrics::with_local_recorder(&recorder, || {
        let failed: Result<idempotency::Outcome<i32>, Error<String>> = phased.run(&mut conn, "shop", "p-1", &1, |s| {
            s.phase("greeting", |_| Ok::<_, String>(1))?;
            Err(Error::Operation(String::from("the client went away")))
        });
        assert!(
            matches!(&failed, Err(Error::Operation(message)) if message == "the client went away"),
            "{failed:?}"
        );
        let renamed: Result<idempotency::Outcome<i32>, Error<String>> = phased.run(&mut conn, "shop", "p-1", &1, |s| {
            s.phase("salutation", |_| Ok::<_, String>(1))?;
            s.finish(|_| Ok::<_, String>(1))
        });
        assert!(matches!(renamed, Err(Error::PhaseRenamed { .. })), "{renamed:?}");
        for _ in 0..2 {
            phased
                .run(&mut conn, "shop", "p-1", &1, |s| {
                    s.phase("greeting", |_| Ok::<_, String>(1))?;
                    s.finish(|_| Ok::<_, String>(2))
                })
                .expect("resumes, then replays");
        }
        Taken::of(&snapshotter)
    });
    for (outcome, count) in [
        ("operation_error", 1),
        ("phase_renamed", 1),
        ("executed", 1),
        ("replayed", 1),
    ] {
        let labels = [format!("outcome={outcome}"), backend.clone()];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        assert_eq!(taken.counter("idempotency_calls_total", &labels), count, "{outcome}");
    }
}

/// The async relay's first worker sets the backlog gauges, as the thread
/// relay's does: run on a current-thread runtime on the test thread, so
/// that the thread's recorder sees it (PostgreSQL's async connection runs
/// there; SQLite's refuses such a runtime).
#[cfg(feature = "postgres-async")]
#[test]
fn the_async_relay_keeps_the_backlog_gauges_current() {
    use crate::common::asynchronous::AsyncDb;
    use crate::common::pg::Db;

    let (db, mut conn, recorder, snapshotter) = recorded::<Db>();
    for i in 0..3 {
        outbox::enqueue(&mut conn, "webhooks", &i).expect("enqueue");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let pool = runtime.block_on(db.bb8(2));
    let shutdown = idempotency::Shutdown::new();
    let handler = {
        let shutdown = shutdown.clone();
        move |_: Message| {
            // Stops after the first pass: its gauges are the backlog before
            // it delivered anything.
            shutdown.trigger();
            std::future::ready(Ok::<_, String>(()))
        }
    };
    let stopped = metrics::with_local_recorder(&recorder, || {
        Taken::of(&snapshotter);
        runtime.block_on(Relay::default().serve_async(&pool, handler, &shutdown))
    });
    let taken = Taken::of(&snapshotter);
    assert!(stopped.work.delivered >= 1, "{stopped:?}");
    assert_eq!(taken.gauge("idempotency_outbox_pending"), 3.0);
    assert_eq!(taken.gauge("idempotency_outbox_due"), 3.0);
    assert_eq!(taken.gauge("idempotency_outbox_dead"), 0.0);
}
