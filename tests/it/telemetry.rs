//! What the crate tells operators through `tracing`: a span per call and an
//! event per decision, events for relays and purges, each at the level an
//! operator expects and with the fields that identify it; and never a
//! request, response, payload or handler error text.
//!
//! Every request, response, payload and handler error of these tests
//! carries a sentinel, and a layer of the test's own records every field of
//! every span and event as text. The subscriber is the test thread's own
//! (`tracing::subscriber::with_default`), so tests running in parallel do
//! not see each other's events; a thread the test spawns installs it too.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration as StdDuration, Instant};

use chrono::Duration;
use diesel::connection::SimpleConnection;
use idempotency::outbox::Relay;
use idempotency::phased::{Completer, Phased};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, Purger, RawConnection, Shutdown};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

use crate::common::TestDb;
use crate::common::kept_an_hour;
use crate::common::outbox::FourWebhooks;
use crate::common::wait::{self, PATIENCE};

crate::common::backend_tests!(
    call_decisions_are_events_of_the_call_span_without_payload_text,
    relay_and_purge_decisions_are_events_without_payload_text,
    refused_key_that_looks_like_a_card_number_is_never_traced,
    relay_on_a_pool_without_a_connection_to_spare_says_it_does_not_listen,
    services_log_the_whole_cause_of_a_database_error,
);

/// In every request, response, payload and handler error.
const SENTINEL: &str = "PAYLOAD-SENTINEL-7731";

/// A span (when it closed, with every field it was given) or an event.
#[derive(Debug, Clone)]
struct Captured {
    span: bool,
    level: Level,
    target: String,
    /// The span's name, or the event's message.
    name: String,
    fields: BTreeMap<String, String>,
    /// For an event: the fields of the span it belongs to.
    parent: BTreeMap<String, String>,
}

impl Captured {
    fn field(&self, name: &str) -> &str {
        self.fields
            .get(name)
            .unwrap_or_else(|| panic!("{:?} has no field {name}: {self:?}", self.name))
    }
}

/// Field values as text: strings as they are, everything else as its
/// `Debug` (which for `%value` fields is their `Display`).
#[derive(Debug, Default, Clone)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// The test's layer: records everything it sees.
#[derive(Debug, Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

impl<S> Layer<S> for Capture
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
        {
            values.record(fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let name = fields.0.remove("message").unwrap_or_default();
        let parent = ctx
            .event_span(event)
            .and_then(|span| span.extensions().get::<Fields>().cloned())
            .unwrap_or_default();
        self.push(Captured {
            span: false,
            level: *event.metadata().level(),
            target: event.metadata().target().to_owned(),
            name,
            fields: fields.0,
            parent: parent.0,
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            let fields = span.extensions().get::<Fields>().cloned().unwrap_or_default();
            self.push(Captured {
                span: true,
                level: *span.metadata().level(),
                target: span.metadata().target().to_owned(),
                name: span.name().to_owned(),
                fields: fields.0,
                parent: BTreeMap::new(),
            });
        }
    }
}

impl Capture {
    fn push(&self, captured: Captured) {
        self.0.lock().expect("capture").push(captured);
    }

    /// Runs `f` with this layer as the current thread's subscriber.
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        crate::common::global_subscriber::install();
        tracing::subscriber::with_default(tracing_subscriber::registry().with(self.clone()), f)
    }

    fn all(&self) -> Vec<Captured> {
        self.0.lock().expect("capture").clone()
    }

    /// The events with message `name`.
    fn events(&self, name: &str) -> Vec<Captured> {
        self.all().into_iter().filter(|c| !c.span && c.name == name).collect()
    }

    /// The first event with message `name`, which must be at `level`.
    fn event(&self, name: &str, level: Level) -> Captured {
        let event = self.events(name).into_iter().next().unwrap_or_else(|| {
            let names: Vec<_> = self.all().into_iter().map(|c| c.name).collect();
            panic!("no event {name:?} among {names:?}")
        });
        assert_eq!(event.level, level, "{event:?}");
        assert_eq!(event.target, "idempotency", "{event:?}");
        event
    }

    fn assert_never_contains(&self, secret: &str) {
        let leaks: Vec<_> = self
            .all()
            .into_iter()
            .filter(|c| format!("{c:?}").contains(secret))
            .map(|c| c.name)
            .collect();
        assert!(leaks.is_empty(), "the secret reached the telemetry in {leaks:?}");
    }
}

/// A key as spans and events show it: the first 16 hex digits of its
/// SHA-256, as an operator computes it.
fn key_digest(key: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(key.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn call_decisions_are_events_of_the_call_span_without_payload_text<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let capture = Capture::default();
    let (clock, config) = kept_an_hour();
    let request = format!("{SENTINEL} request");
    let response = format!("{SENTINEL} response");
    let respond = |_: &mut D::Conn| Ok::<_, String>(response.clone());

    capture.run(|| {
        let executed = config.run(&mut conn, "shop", "k-1", &request, respond);
        assert!(!executed.expect("executes").is_replayed());
        assert!(
            config
                .run(&mut conn, "shop", "k-1", &request, respond)
                .expect("replays")
                .is_replayed()
        );
        let mismatch = config.run(&mut conn, "shop", "k-1", &format!("{SENTINEL} other"), respond);
        assert!(matches!(mismatch, Err(Error::Mismatch)), "{mismatch:?}");
        // The stored response is a string; read as a number it does not
        // decode, and serde_json's message would quote it.
        let codec = config.run(&mut conn, "shop", "k-1", &request, |_| Ok::<i64, String>(0));
        assert!(matches!(codec, Err(Error::Codec(_))), "{codec:?}");
        let refused = config.run(&mut conn, "shop", "k-2", &request, |_| {
            Err::<String, _>(format!("{SENTINEL} refused"))
        });
        assert!(matches!(refused, Err(Error::Operation(_))), "{refused:?}");
        // A database without the key table (dropped outside any call: on
        // MySQL a DROP inside the operation would commit).
        let broken = D::new();
        let mut broken_conn = broken.conn();
        broken_conn
            .batch_execute("DROP TABLE idempotency_keys")
            .expect("drop the key table");
        let storage = config.run(&mut broken_conn, "shop", "k-3", &request, respond);
        assert!(matches!(storage, Err(Error::Storage(_))), "{storage:?}");
        clock.advance(Duration::hours(2));
        let taken_over = config.run(&mut conn, "shop", "k-1", &request, respond);
        assert!(!taken_over.expect("executes anew").is_replayed());
    });

    // Another call holds the key while this one waits for it.
    let (entered, holding) = mpsc::channel();
    thread::scope(|scope| {
        // Owned here, so that a failed assertion drops it and frees the
        // waiting thread before the scope joins it.
        let (release, released) = mpsc::channel::<()>();
        let (db, capture, config, request, response) = (&db, &capture, &config, &request, &response);
        let holder = scope.spawn(move || {
            capture.run(|| {
                config.run(&mut db.conn(), "shop", "k-busy", request, |_| {
                    entered.send(()).expect("the test waits");
                    wait::recv(&released, "the test releases the key");
                    Ok::<_, String>(response.clone())
                })
            })
        });
        wait::recv(&holding, "the holder runs its operation");
        let waiting = config.clone().in_flight(InFlight::Wait(Duration::milliseconds(50)));
        let busy = capture.run(|| waiting.run(&mut conn, "shop", "k-busy", request, respond));
        assert!(matches!(busy, Err(Error::InProgress)), "{busy:?}");
        release.send(()).expect("the holder waits");
        holder
            .join()
            .expect("the holder does not panic")
            .expect("the holder executes");
    });

    let spans: Vec<_> = capture.all().into_iter().filter(|c| c.span).collect();
    for span in &spans {
        assert_eq!(
            (span.name.as_str(), span.level, span.target.as_str()),
            ("idempotent_call", Level::DEBUG, "idempotency")
        );
        assert_eq!((span.field("scope"), span.field("backend")), ("shop", D::BACKEND));
    }
    let outcomes: Vec<_> = spans
        .iter()
        .map(|s| (s.field("key_digest"), s.field("outcome")))
        .collect();
    for (key, outcome) in [
        ("k-1", "executed"),
        ("k-1", "replayed"),
        ("k-1", "mismatch"),
        ("k-1", "codec_error"),
        ("k-2", "operation_error"),
        ("k-3", "storage_error"),
        ("k-busy", "in_progress"),
        ("k-busy", "executed"),
    ] {
        let expected = (key_digest(key), outcome);
        assert!(
            outcomes
                .iter()
                .any(|(digest, outcome)| (digest.to_string(), *outcome) == expected),
            "no call span {expected:?} among {outcomes:?}"
        );
    }

    capture.assert_never_contains("k-busy");

    let executed = capture.event("executed", Level::DEBUG);
    assert_eq!(executed.parent["key_digest"], key_digest("k-1"), "{executed:?}");
    assert!(executed.field("expires_at").starts_with("2030-01-01 01:00:00"));
    let replayed = capture.event("replayed", Level::DEBUG);
    assert!(replayed.field("created_at").starts_with("2030-01-01 00:00:00"));
    capture.event("key reused with a different request", Level::INFO);
    let codec = capture.event("json encoding or decoding failed", Level::ERROR);
    for field in ["category", "line", "column"] {
        codec.field(field);
    }
    capture.event("operation failed; rolled back", Level::DEBUG);
    let storage = capture.event("storage failed; rolled back", Level::ERROR);
    assert!(
        storage.field("error").contains("idempotency_keys"),
        "the cause: {storage:?}"
    );
    let takeover = capture.event("expired record taken over", Level::DEBUG);
    assert_eq!(takeover.parent["key_digest"], key_digest("k-1"));
    let in_progress = capture.event("key in progress", Level::INFO);
    assert_eq!(in_progress.parent["key_digest"], key_digest("k-busy"));
    in_progress.field("elapsed_ms");
    // The call that gave up waited for the policy's 50 ms.
    let waited = capture
        .events("waited for the key")
        .into_iter()
        .filter(|e| e.parent["key_digest"] == key_digest("k-busy"))
        .max_by_key(|e| e.field("wait_ms").parse::<u64>().expect("milliseconds"))
        .expect("the wait of the call that gave up");
    assert_eq!(waited.level, Level::DEBUG);
    assert!(
        waited.field("wait_ms").parse::<u64>().expect("milliseconds") >= 50,
        "{waited:?}"
    );

    capture.assert_never_contains(SENTINEL);
}

fn relay_and_purge_decisions_are_events_without_payload_text<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let capture = Capture::default();
    let clock = ManualClock::new();
    let webhooks = FourWebhooks::enqueue::<D, _>(&mut conn, &clock, |i| format!("{SENTINEL} payload {i}"));
    let (relay, ids) = (&webhooks.relay, &webhooks.ids);
    let handler = webhooks.handler(&clock, format!("{SENTINEL} endpoint said no"));
    capture.run(|| {
        let first = relay.run_once(&mut conn, &handler).expect("first pass");
        assert_eq!((first.delivered, first.retried, first.lost), (2, 1, 1), "{first:?}");
        let second = relay.run_once(&mut conn, &handler).expect("second pass");
        assert_eq!((second.delivered, second.dead), (1, 1), "{second:?}");
        clock.advance(Duration::days(1));
        assert_eq!(relay.purge_delivered(&mut conn, 2).expect("purge"), 3);
        assert_eq!(
            Config::default()
                .clock(clock.source())
                .purge_expired(&mut conn, 2)
                .expect("purge"),
            0
        );
    });

    let claimed = capture.event("claimed messages", Level::DEBUG);
    assert_eq!(claimed.field("count"), "4");
    claimed.field("lease_until");
    let delivered = capture.event("delivered", Level::DEBUG);
    assert_eq!(
        (
            delivered.field("message_id"),
            delivered.field("topic"),
            delivered.field("attempt")
        ),
        (ids[0].as_str(), "webhooks", "1")
    );
    let retrying = capture.event("delivery failed; retrying", Level::INFO);
    assert_eq!(
        (retrying.field("message_id"), retrying.field("attempt")),
        (ids[1].as_str(), "1")
    );
    assert!(
        retrying.field("next_due").starts_with("2030-01-01 00:00:01"),
        "{retrying:?}"
    );
    let dead = capture.event("delivery failed for the last time; message parked as dead", Level::WARN);
    assert_eq!(
        (dead.field("message_id"), dead.field("attempts")),
        (ids[1].as_str(), "2")
    );
    let lost = capture.event("lease lost before settling; left to the next claim", Level::WARN);
    assert_eq!(lost.field("message_id"), ids[3]);
    let purged = capture.event("purged", Level::INFO);
    assert_eq!(
        (purged.field("table"), purged.field("rows"), purged.field("batches")),
        ("idempotency_outbox", "3", "2")
    );
    purged.field("elapsed_ms");
    let batches: Vec<_> = capture
        .events("purge batch")
        .into_iter()
        .filter(|b| b.field("table") == "idempotency_outbox")
        .map(|b| (b.level, b.field("rows").to_owned(), b.fields.contains_key("elapsed_ms")))
        .collect();
    assert_eq!(
        batches,
        [
            (Level::DEBUG, "2".to_owned(), true),
            (Level::DEBUG, "1".to_owned(), true)
        ]
    );
    let nothing = capture.event("nothing to purge", Level::DEBUG);
    assert_eq!(nothing.field("table"), "idempotency_keys");

    // The service reports a database error and carries on; its workers
    // report to the subscriber of the thread that runs it.
    conn.batch_execute("ALTER TABLE idempotency_outbox RENAME TO idempotency_outbox_away")
        .expect("take the outbox away");
    let pool = db.pool(2);
    let shutdown = Shutdown::new();
    thread::scope(|scope| {
        let service = scope.spawn(|| capture.run(|| Relay::default().serve(&pool, |_| Ok::<_, String>(()), &shutdown)));
        let deadline = Instant::now() + PATIENCE;
        while capture.events("database error; retrying").is_empty() {
            if Instant::now() > deadline {
                shutdown.trigger();
                panic!("the relay reported no database error");
            }
            thread::sleep(StdDuration::from_millis(5));
        }
        shutdown.trigger();
        let summary = service.join().expect("the relay does not panic");
        assert!(summary.errors > 0, "{summary:?}");
    });
    let error = capture.event("database error; retrying", Level::WARN);
    assert_eq!(error.field("service"), "relay");
    assert!(
        error.field("error").contains("idempotency_outbox"),
        "the cause: {error:?}"
    );
    error.field("retry_in_ms");

    capture.assert_never_contains(SENTINEL);
}

fn refused_key_that_looks_like_a_card_number_is_never_traced<D: TestDb>()
where
    // Spelled out for the phased operation's steps, which the solver does
    // not find through `StoreConnection<Raw = Self>`.
    D::Conn: RawConnection,
{
    let db = D::new();
    let mut conn = db.conn();
    let capture = Capture::default();
    let card = "4111111111111111";
    let huge_scope = "s".repeat(10_000);
    capture.run(|| {
        let refused = idempotency::run_idempotent(&mut conn, "payments", card, &1, |_| Ok::<_, String>(1));
        assert!(matches!(refused, Err(Error::InvalidKey(_))), "{refused:?}");
        let refused = idempotency::run_idempotent(&mut conn, &huge_scope, "k", &1, |_| Ok::<_, String>(1));
        assert!(matches!(refused, Err(Error::InvalidScope(_))), "{refused:?}");
        let refused = Phased::new("charge").run(&mut conn, "payments", card, &1, |steps| {
            steps.finish(|_| Ok::<_, String>(1))
        });
        assert!(matches!(refused, Err(Error::InvalidKey(_))), "{refused:?}");
    });
    let invalid = capture.event("invalid key", Level::INFO);
    assert_eq!(invalid.field("reason"), "looks like a payment card number");
    capture.event("invalid scope", Level::INFO);
    let invalid_calls: Vec<_> = capture.all().into_iter().filter(|c| c.span).collect();
    let names: Vec<&str> = invalid_calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["idempotent_call", "idempotent_call", "phased_operation"]);
    assert_eq!(invalid_calls[0].field("scope"), "payments", "a valid scope is recorded");
    assert_eq!(invalid_calls[2].field("outcome"), "invalid_key");
    assert!(
        invalid_calls.iter().all(|call| !call.fields.contains_key("key_digest")),
        "no refused key is recorded: {invalid_calls:?}"
    );
    capture.assert_never_contains(card);
    capture.assert_never_contains(&huge_scope);
}

fn relay_on_a_pool_without_a_connection_to_spare_says_it_does_not_listen<D: TestDb>() {
    let db = D::new();
    let capture = Capture::default();
    let shutdown = Shutdown::new();
    shutdown.trigger();
    let pool = db.pool(1);
    capture.run(|| Relay::default().serve(&pool, |_| Ok::<_, String>(()), &shutdown));
    let warned = capture.events(
        "no pooled connection to spare for the listener (it needs workers + 1); new messages wait for the poll interval",
    );
    // Only PostgreSQL announces messages; a SQLite relay always polls.
    if D::BACKEND == "postgres" {
        assert_eq!(warned.len(), 1, "{:?}", capture.all());
        assert_eq!(warned[0].level, Level::WARN);
        assert_eq!((warned[0].field("pool_size"), warned[0].field("workers")), ("1", "1"));
    } else {
        assert!(warned.is_empty(), "{warned:?}");
    }
}

/// Runs `service` on a thread of its own, with `capture` as its subscriber,
/// until it reports a database error; returns that event.
fn first_service_error(capture: &Capture, service: impl FnOnce(&Shutdown) + Send) -> Captured {
    let shutdown = Shutdown::new();
    thread::scope(|s| {
        s.spawn(|| capture.run(|| service(&shutdown)));
        let deadline = Instant::now() + PATIENCE;
        let event = loop {
            if let Some(event) = capture.events("database error; retrying").into_iter().next() {
                break event;
            }
            if Instant::now() > deadline {
                shutdown.trigger();
                panic!("the service reported no database error: {:?}", capture.all());
            }
            thread::sleep(StdDuration::from_millis(5));
        };
        shutdown.trigger();
        event
    })
}

fn services_log_the_whole_cause_of_a_database_error<D: TestDb>() {
    let db = D::new();
    db.conn()
        .batch_execute("DROP TABLE idempotency_keys; DROP TABLE idempotency_phases; DROP TABLE idempotency_outbox")
        .expect("drop the tables the services work on");
    let pool = db.pool(2);
    let services = [
        ("purger", "idempotency_keys"),
        ("completer", "idempotency_phases"),
        ("relay", "idempotency_outbox"),
    ];
    for (service, table) in services {
        let capture = Capture::default();
        let event = first_service_error(&capture, |shutdown| match service {
            "purger" => drop(Purger::default().serve(&pool, shutdown)),
            "completer" => drop(Completer::<D::Conn>::new().serve(&pool, shutdown)),
            _ => drop(Relay::default().serve(&pool, |_| Ok::<_, String>(()), shutdown)),
        });
        assert_eq!((event.level, event.field("service")), (Level::WARN, service));
        // The database's own message names the missing table; the crate's
        // errors alone do not.
        let error = event.field("error");
        assert!(error.contains(table), "{service} logged {error:?}");
    }
}
