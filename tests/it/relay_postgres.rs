//! What only PostgreSQL shows of the relay service: the enqueue's
//! notification, which comes with the commit and wakes a sleeping relay at
//! once, and a server restart that the relay rides out without losing a
//! message.
//!
//! The notification channel belongs to the database, not to a schema, so
//! the other tests' enqueues wake these tests' relays too. That can only
//! make a delivery come sooner: a wake-up that a test depends on is one it
//! caused itself.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::pg::{PgConnection, PgNotification};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::Text;
use idempotency::outbox::{self, Message, Relay};
use idempotency::{Purger, Shutdown};

use crate::common::TestDb;
use crate::common::outbox::enqueue_and_roll_back;
use crate::common::pg::{Db, backend_pid};
use crate::common::pg_cluster::Cluster;
use crate::common::wait::{self, PATIENCE, StopOnDrop, wait_for};

/// The relays' poll interval in the wake-up tests: far longer than a test
/// waits, so a message that arrives came through a notification.
const POLL_INTERVAL: chrono::Duration = chrono::Duration::seconds(120);

/// How long a woken relay may take to deliver. Wide on purpose: it holds on
/// a loaded machine running the whole suite at once, and is still a
/// sixtieth of the poll interval, which is all the test needs to tell a
/// notification from a poll. The latency itself is measured by the
/// benchmark.
const WAKE_BOUND: Duration = Duration::from_secs(2);

/// Stops the producer however the test ends, so that a failed assertion
/// inside `thread::scope` does not wait forever for it.
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Passes a delivered message's id on to the test.
fn report(sender: &mpsc::Sender<String>, message: &Message) -> Result<(), String> {
    sender
        .send(message.id.clone())
        .map_err(|_| "the test stopped listening".to_owned())
}

#[test]
fn relay_is_woken_by_each_commit_long_before_its_poll_interval() {
    let db = Db::new();
    // One connection for the worker, one for the listener.
    let pool = db.pool(2);
    let mut conn = db.conn();
    let relay = Relay::default().poll_interval(POLL_INTERVAL).max_attempts(1);
    let shutdown = Shutdown::new();
    let (tx, delivered) = mpsc::channel();
    let poison_fixed = AtomicBool::new(false);
    let handler = |message: &Message| {
        if message.payload::<String>().is_ok_and(|p| p == "poison") && !poison_fixed.load(Ordering::SeqCst) {
            return Err("the endpoint refuses it".to_owned());
        }
        report(&tx, message)
    };
    let next = || delivered.recv_timeout(WAKE_BOUND).expect("delivered within the bound");

    thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        // The relay's first look may find the first message without a
        // notification; every later one only a notification brings in time.
        for round in 0..4 {
            let id = outbox::enqueue(&mut conn, "receipts", &round).expect("enqueue");
            assert_eq!(next(), id, "round {round}");
        }

        // Enqueued in a transaction that stays open while another message
        // commits and is delivered: it arrives once its own transaction
        // commits, so that commit, and not the insert, woke the relay.
        let mut open = db.conn();
        let held = open
            .transaction(|tx| {
                let held = outbox::enqueue(tx, "receipts", &"held")?;
                let other = outbox::enqueue(&mut conn, "receipts", &"other")?;
                assert_eq!(next(), other, "the held message is not visible yet");
                Ok::<_, outbox::Error>(held)
            })
            .expect("commit the held message");
        assert_eq!(next(), held, "woken by the commit");

        // A dead message requeued is announced as well.
        let poison = outbox::enqueue(&mut conn, "receipts", &"poison").expect("enqueue");
        let deadline = Instant::now() + PATIENCE;
        while relay.dead_letters(&mut conn, 10).expect("dead letters").is_empty() {
            assert!(Instant::now() < deadline, "the poison message was not parked");
            thread::sleep(Duration::from_millis(5));
        }
        poison_fixed.store(true, Ordering::SeqCst);
        assert!(relay.requeue(&mut conn, &poison).expect("requeue"));
        assert_eq!(next(), poison, "woken by the requeue");

        shutdown.trigger();
        let summary = service.join().expect("the relay does not panic");
        assert_eq!((summary.work.delivered, summary.work.dead), (7, 1), "{summary:?}");
    });
}

/// Reads the notifications `listener` receives until one satisfies `last`;
/// returns all of them, that one included.
fn notifications_until(
    listener: &mut PgConnection,
    mut last: impl FnMut(&PgNotification) -> bool,
) -> Vec<PgNotification> {
    let deadline = Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    loop {
        for notification in listener.notifications_iter() {
            let notification = notification.expect("read the notifications");
            let done = last(&notification);
            seen.push(notification);
            if done {
                return seen;
            }
        }
        assert!(Instant::now() < deadline, "the expected notification never came");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Sends a notification of the test's own on the outbox channel: the
/// server delivers notifications in commit order, so every one committed
/// before it has arrived once it has.
fn mark(conn: &mut PgConnection, marker: &str) {
    diesel::sql_query("SELECT pg_notify('idempotency_outbox', $1)")
        .bind::<Text, _>(marker)
        .execute(conn)
        .expect("notify");
}

#[test]
fn enqueue_notifies_at_commit_and_never_for_a_rollback() {
    let db = Db::new();
    let mut listener = db.conn();
    listener.batch_execute("LISTEN idempotency_outbox").expect("listen");
    let mut marker = db.conn();
    let mut writer = db.conn();
    // Other tests notify on the same channel; the writer's are told apart
    // by its server process.
    let writer_pid = backend_pid(&mut writer);
    let from_writer = |seen: &[PgNotification]| seen.iter().filter(|n| n.process_id == writer_pid).count();

    enqueue_and_roll_back(&mut writer, |tx| outbox::enqueue(tx, "receipts", &"rolled back"));
    writer
        .transaction(|tx| {
            outbox::enqueue(tx, "receipts", &"committed")?;
            mark(&mut marker, "before-commit");
            let seen = notifications_until(&mut listener, |n| n.payload == "before-commit");
            assert_eq!(from_writer(&seen), 0, "nothing announced before the commit: {seen:?}");
            Ok::<_, outbox::Error>(())
        })
        .expect("commit");
    let seen = notifications_until(&mut listener, |n| n.process_id == writer_pid);
    assert_eq!(
        seen.last().map(|n| (n.channel.as_str(), n.payload.as_str())),
        Some(("idempotency_outbox", ""))
    );
    mark(&mut marker, "after-commit");
    let seen = notifications_until(&mut listener, |n| n.payload == "after-commit");
    assert_eq!(from_writer(&seen), 0, "one notification per commit: {seen:?}");
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

fn count(conn: &mut PgConnection, query: &str) -> i64 {
    diesel::sql_query(query).get_result::<Count>(conn).expect("count").n
}

#[test]
fn relay_rides_out_a_server_restart_and_loses_no_committed_message() {
    const WORKERS: usize = 2;
    /// Messages delivered before the restart, and committed after it.
    const EACH_SIDE: usize = 60;
    let cluster = Cluster::new();
    let url = cluster.url();
    idempotency::run_migrations(&mut PgConnection::establish(&url).expect("connect")).expect("migrate");
    let pool = Pool::builder()
        .max_size(WORKERS as u32 + 1)
        .build(ConnectionManager::<PgConnection>::new(&url))
        .expect("build a pool");
    // A short lease: a message whose outcome the outage swallowed comes
    // again soon.
    let relay = Relay::default()
        .workers(WORKERS)
        .lease(chrono::Duration::seconds(2))
        .poll_interval(chrono::Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let delivered = Mutex::new(HashSet::new());
    let (tx, deliveries) = mpsc::channel::<String>();
    let handler = |message: &Message| {
        // A handler that takes a moment, as one that calls out does, so
        // that the restart is likely to catch a batch in progress.
        thread::sleep(Duration::from_millis(3));
        delivered.lock().expect("delivered").insert(message.id.clone());
        report(&tx, message)
    };
    let committed = Mutex::new(Vec::new());
    let producing = AtomicBool::new(true);

    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let _stop_producing = ClearOnDrop(&producing);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        // Enqueues at a steady pace on a connection of its own, and
        // reconnects and carries on after its own errors. Only an enqueue
        // that returned its id is known to have committed.
        let producer = scope.spawn(|| {
            let mut conn: Option<PgConnection> = None;
            let mut n = 0u64;
            while producing.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(5));
                let Some(c) = conn.as_mut() else {
                    conn = PgConnection::establish(&url).ok();
                    continue;
                };
                n += 1;
                match outbox::enqueue(c, "receipts", &n) {
                    Ok(id) => committed.lock().expect("committed").push(id),
                    Err(_) => conn = None,
                }
            }
        });

        for _ in 0..EACH_SIDE {
            deliveries
                .recv_timeout(PATIENCE)
                .expect("deliveries before the restart");
        }
        cluster.stop();
        // Down for longer than a worker waits for a pooled connection (1 s),
        // so that the relay meets the outage whatever it was doing.
        thread::sleep(Duration::from_secs(2));
        cluster.start();
        let before = committed.lock().expect("committed").len();
        wait_for("messages committed after the restart", || {
            committed.lock().expect("committed").len() >= before + EACH_SIDE
        });
        producing.store(false, Ordering::SeqCst);
        producer.join().expect("the producer does not panic");

        let mut check = PgConnection::establish(&url).expect("connect after the restart");
        wait_for("every message delivered", || {
            count(
                &mut check,
                "SELECT count(*) AS n FROM idempotency_outbox WHERE status <> 'delivered'",
            ) == 0
        });
        wait_for("the relay listening again", || {
            count(
                &mut check,
                "SELECT count(*) AS n FROM pg_stat_activity WHERE query = 'LISTEN idempotency_outbox'",
            ) == 1
        });
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });

    let committed = committed.into_inner().expect("committed");
    let delivered = delivered.into_inner().expect("delivered");
    let lost: Vec<_> = committed.iter().filter(|id| !delivered.contains(*id)).collect();
    assert!(lost.is_empty(), "committed but never delivered: {lost:?}");
    assert!(summary.errors > 0, "the relay met the outage: {summary:?}");
    let mut conn = PgConnection::establish(&url).expect("connect");
    let rows = count(&mut conn, "SELECT count(*) AS n FROM idempotency_outbox");
    assert!(rows >= committed.len() as i64);
    assert!(summary.work.delivered <= rows as usize, "{summary:?}");
}

/// The listener serves the workers: when a panic ends the last of them (a
/// handler's panic is its message's failed attempt, but an injected clock
/// runs outside it), the service returns with that panic, although no
/// shutdown was triggered (the listener kept it running before).
#[test]
fn relay_returns_with_the_panic_of_its_only_worker() {
    let db = Db::new();
    let pool = db.pool(2);
    let shutdown = Shutdown::new();
    let (ended, ending) = mpsc::channel();
    let service = {
        let (pool, shutdown) = (pool.clone(), shutdown.clone());
        thread::spawn(move || {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Relay::default()
                    .workers(1)
                    .clock(|| panic!("a bug in the clock"))
                    .serve(&pool, |_: &Message| Ok::<_, String>(()), &shutdown)
            }));
            ended.send(run.is_err()).expect("the test waits");
        })
    };
    let ended = ending.recv_timeout(PATIENCE);
    shutdown.trigger();
    wait::join(service, "the service thread");
    assert_eq!(ended, Ok(true), "run returned with the clock's panic");
}

/// The relay's wake-ups are the relay's: a purger sharing its `Shutdown`
/// sleeps its whole interval while every enqueue wakes the relay.
#[test]
fn purger_sharing_the_relays_shutdown_is_not_woken_by_enqueues() {
    const MESSAGES: usize = 50;
    let db = Db::new();
    let pool = db.pool(3);
    let mut conn = db.conn();
    let relay = Relay::default().poll_interval(POLL_INTERVAL);
    let purger = Purger::default().interval(POLL_INTERVAL);
    let shutdown = Shutdown::new();
    let (tx, delivered) = mpsc::channel();
    let handler = |message: &Message| report(&tx, message);
    let next = || delivered.recv_timeout(WAKE_BOUND).expect("delivered within the bound");

    let started = Instant::now();
    let (relayed, purged) = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let relayed = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        let purged = scope.spawn(|| purger.serve(&pool, &shutdown));
        // The first may be found by the relay's first look; the second
        // only a notification brings in time, so the listener listens.
        for n in 0..2 + MESSAGES {
            let id = outbox::enqueue(&mut conn, "receipts", &n).expect("enqueue");
            assert_eq!(next(), id, "message {n}");
        }
        shutdown.trigger();
        (
            relayed.join().expect("the relay does not panic"),
            purged.join().expect("the purger does not panic"),
        )
    });
    let elapsed = started.elapsed();

    assert_eq!(relayed.work.delivered, 2 + MESSAGES, "{relayed:?}");
    let bound = (elapsed.as_secs_f64() / POLL_INTERVAL.as_seconds_f64()) as usize + 1;
    assert!(
        purged.work.rounds <= bound,
        "{} purger rounds in {elapsed:?} at one every {POLL_INTERVAL:?}",
        purged.work.rounds
    );
}
