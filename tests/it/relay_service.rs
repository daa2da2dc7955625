//! The relay as a service: `Relay::serve` delivers what is due until it is
//! stopped, sleeps until the next due time, stops without losing what it
//! had claimed, and `Relay::stats` reports the backlog.
//!
//! Handlers report to the test over channels, and the test waits on those,
//! never on a guessed sleep. Where a test shows that a message was *not*
//! delivered yet, it enqueues a probe after it and waits for the probe: one
//! worker claims due messages oldest first, so had the earlier message been
//! due, it would have been handed over before the probe.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};
use std::thread;
use std::time::Duration as StdDuration;

use chrono::{Duration, NaiveDateTime, Utc};
use diesel::connection::SimpleConnection;
use idempotency::Shutdown;
use idempotency::Stopped;
use idempotency::outbox::{self, Deliveries, Message, Relay};
use idempotency::testing::ManualClock;

use crate::common::TestDb;
use crate::common::wait::{PATIENCE, StopOnDrop, wait_for};

crate::common::backend_tests!(
    messages_enqueued_before_and_during_the_run_are_each_delivered_once,
    failed_delivery_is_not_claimed_before_its_backoff_ends,
    delayed_message_is_not_claimed_before_its_not_before_time,
    relay_sleeps_until_the_next_due_time_rather_than_its_poll_interval,
    stopping_lets_the_running_handler_finish_and_gives_the_rest_of_the_batch_back,
    stats_follow_the_backlog_through_delivery_failure_and_requeue,
    database_error_mid_batch_keeps_the_batch_deliveries_in_the_summary,
    relay_on_a_pool_of_one_connection_delivers_without_errors,
    relay_with_a_clock_behind_the_database_delivers_at_once,
    panicking_handler_fails_its_message_while_the_others_are_delivered,
    hanging_handler_is_given_up_within_its_lease_while_the_others_are_delivered,
    worker_claims_nothing_while_four_handlers_it_gave_up_on_still_run,
    workers_keep_each_ordering_key_in_order_and_park_a_permanent_failure_at_once,
);

/// A handler's report: the message id and its attempt.
type Handed = (String, u32);

fn status_count<D: TestDb>(conn: &mut D::Conn, status: &str) -> usize {
    D::outbox_messages(conn).iter().filter(|m| m.2 == status).count()
}

/// When the claim that leased message `id` ran, by the relay's clock: the
/// claim writes the end of the lease as the time the message is next due.
fn claimed_at<D: TestDb>(conn: &mut D::Conn, id: &str, lease: Duration) -> NaiveDateTime {
    let (lease_until, _) = D::outbox_schedule(conn, id);
    lease_until.expect("a leased message has a due time") - lease
}

fn messages_enqueued_before_and_during_the_run_are_each_delivered_once<D: TestDb>() {
    const WORKERS: usize = 3;
    const BEFORE: usize = 40;
    const DURING: usize = 40;
    let db = D::new();
    // One connection per worker, and one for the listener on PostgreSQL.
    let pool = db.pool(WORKERS as u32 + 1);
    let mut conn = db.conn();
    let mut enqueued = HashSet::new();
    for i in 0..BEFORE {
        enqueued.insert(outbox::enqueue(&mut conn, "receipts", &i).expect("enqueue"));
    }

    let relay = Relay::default()
        .workers(WORKERS)
        .batch_size(5)
        .poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let delivered = Mutex::new(HashSet::new());
    let duplicates = AtomicUsize::new(0);
    let handed = AtomicUsize::new(0);
    // The first handler of each worker waits here until all of them have
    // arrived: the workers really deliver side by side.
    let all_arrived = Shutdown::new();
    let (arrived, arrivals) = mpsc::channel();
    let (done, deliveries) = mpsc::channel();
    let handler = |message: &Message| {
        if handed.fetch_add(1, Ordering::SeqCst) < WORKERS {
            arrived.send(()).expect("the test listens");
            all_arrived.wait(Duration::from_std(PATIENCE).expect("a patience chrono holds"));
        }
        if !delivered.lock().expect("delivered").insert(message.id.clone()) {
            duplicates.fetch_add(1, Ordering::SeqCst);
        }
        done.send(()).expect("the test listens");
        Ok::<_, String>(())
    };

    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        for _ in 0..WORKERS {
            arrivals
                .recv_timeout(PATIENCE)
                .expect("every worker hands a message over at the same time");
        }
        all_arrived.trigger();
        // Four to a transaction: a commit makes several due at once.
        for first in (BEFORE..BEFORE + DURING).step_by(4) {
            let ids = diesel::Connection::transaction(&mut conn, |tx| {
                (first..first + 4)
                    .map(|n| outbox::enqueue(tx, "receipts", &n))
                    .collect::<Result<Vec<_>, _>>()
            })
            .expect("enqueue four in one transaction");
            enqueued.extend(ids);
        }
        for _ in 0..BEFORE + DURING {
            deliveries.recv_timeout(PATIENCE).expect("every message is delivered");
        }
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });

    assert_eq!(duplicates.load(Ordering::SeqCst), 0, "no message was delivered twice");
    assert_eq!(*delivered.lock().expect("delivered"), enqueued);
    assert_eq!(summary.errors, 0);
    let report = summary.work;
    assert_eq!(
        (
            report.claimed,
            report.delivered,
            report.retried,
            report.dead,
            report.lost,
            report.released
        ),
        (BEFORE + DURING, BEFORE + DURING, 0, 0, 0, 0),
        "{summary:?}"
    );
    assert_eq!(status_count::<D>(&mut conn, "delivered"), BEFORE + DURING);
}

fn failed_delivery_is_not_claimed_before_its_backoff_ends<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let backoff = Duration::seconds(10);
    let relay = Relay::default()
        .clock(clock.source())
        .backoff(backoff, backoff)
        .poll_interval(Duration::milliseconds(10));
    let failing = outbox::enqueue(&mut conn, "webhooks", &"fails once").expect("enqueue");
    let shutdown = Shutdown::new();
    let (tx, handed) = mpsc::channel::<Handed>();
    let handler = |message: &Message| {
        tx.send((message.id.clone(), message.attempt))
            .expect("the test listens");
        if message.id == failing && message.attempt == 1 {
            Err("endpoint unavailable")
        } else {
            Ok(())
        }
    };
    let next = || handed.recv_timeout(PATIENCE).expect("a delivery");

    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        assert_eq!(next(), (failing.clone(), 1));
        // Delivered in a later pass than the failure, so the failure has
        // been recorded, at the clock's time, when this arrives.
        let probe = outbox::enqueue(&mut conn, "webhooks", &"probe").expect("enqueue");
        assert_eq!(next(), (probe, 1));

        clock.advance(backoff - Duration::milliseconds(1));
        let probe = outbox::enqueue(&mut conn, "webhooks", &"probe").expect("enqueue");
        assert_eq!(
            next(),
            (probe, 1),
            "1 ms before its backoff ends the message is not due"
        );

        clock.advance(Duration::milliseconds(1));
        assert_eq!(next(), (failing.clone(), 2), "due once its backoff ends");
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });
    assert_eq!((summary.work.delivered, summary.work.retried), (3, 1), "{summary:?}");
}

fn delayed_message_is_not_claimed_before_its_not_before_time<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let relay = Relay::default()
        .clock(clock.source())
        .poll_interval(Duration::milliseconds(10));
    let delay = Duration::hours(3);
    let delayed =
        outbox::enqueue_at(&mut conn, "reminders", &"invoice 7 is due", clock.now() + delay).expect("enqueue");
    let shutdown = Shutdown::new();
    let (tx, handed) = mpsc::channel::<Handed>();
    let handler = |message: &Message| {
        tx.send((message.id.clone(), message.attempt))
            .expect("the test listens");
        Ok::<_, String>(())
    };
    let next = || handed.recv_timeout(PATIENCE).expect("a delivery");

    thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        let probe = outbox::enqueue(&mut conn, "reminders", &"probe").expect("enqueue");
        assert_eq!(next(), (probe, 1), "a delayed message is not due at once");

        clock.advance(delay - Duration::milliseconds(1));
        let probe = outbox::enqueue(&mut conn, "reminders", &"probe").expect("enqueue");
        assert_eq!(next(), (probe, 1), "1 ms before its time the message is not due");

        clock.advance(Duration::milliseconds(1));
        assert_eq!(next(), (delayed.clone(), 1), "due at its not-before time");
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 3);
}

fn relay_sleeps_until_the_next_due_time_rather_than_its_poll_interval<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let lease = Duration::seconds(30);
    let wait = Duration::milliseconds(300);
    // Far longer than the test waits for any delivery: a relay that slept
    // for its poll interval would make the test fail.
    let poll_interval = Duration::seconds(120);
    let relay = Relay::default()
        .lease(lease)
        .backoff(wait, wait)
        .poll_interval(poll_interval);
    let failing = outbox::enqueue(&mut conn, "webhooks", &"fails once").expect("enqueue");
    // On PostgreSQL the relay's clock is the server's, on the same machine.
    let not_before = Utc::now() + wait;
    let delayed = outbox::enqueue_at(&mut conn, "webhooks", &"later", not_before).expect("enqueue");
    let shutdown = Shutdown::new();
    let handler_conn = Mutex::new(db.conn());
    let (tx, handed) = mpsc::channel::<(String, u32, NaiveDateTime)>();
    let handler = |message: &Message| {
        let claimed = claimed_at::<D>(&mut handler_conn.lock().expect("connection"), &message.id, lease);
        tx.send((message.id.clone(), message.attempt, claimed))
            .expect("the test listens");
        if message.id == failing && message.attempt == 1 {
            Err("endpoint unavailable")
        } else {
            Ok(())
        }
    };
    let next = || handed.recv_timeout(StdDuration::from_secs(10)).expect("a delivery");

    thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        let (id, attempt, first_claim) = next();
        assert_eq!((id.as_str(), attempt), (failing.as_str(), 1));
        let mut rest = vec![next(), next()];
        rest.sort_by_key(|(_, _, claimed)| *claimed);
        let [(id_a, attempt_a, claimed_a), (id_b, attempt_b, claimed_b)] = <[_; 2]>::try_from(rest).expect("two");
        let (retried, delayed_claim) = if id_a == failing {
            assert_eq!((id_b.as_str(), attempt_a, attempt_b), (delayed.as_str(), 2, 1));
            (claimed_a, claimed_b)
        } else {
            assert_eq!((id_a.as_str(), attempt_a, attempt_b), (delayed.as_str(), 1, 2));
            (claimed_b, claimed_a)
        };
        assert!(
            retried - first_claim >= wait,
            "the retry was claimed {} ms after the failure, before its backoff ended",
            (retried - first_claim).num_milliseconds()
        );
        assert!(
            delayed_claim >= not_before.naive_utc(),
            "the delayed message was claimed before its time"
        );
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });
}

fn stopping_lets_the_running_handler_finish_and_gives_the_rest_of_the_batch_back<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let ids: Vec<String> = (0..5)
        .map(|i| outbox::enqueue(&mut conn, "receipts", &i).expect("enqueue"))
        .collect();
    let relay = Relay::default().batch_size(10);
    let shutdown = Shutdown::new();
    let (started, handler_started) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let released = Mutex::new(released);
    let handler = |message: &Message| {
        started.send(message.id.clone()).expect("the test listens");
        released
            .lock()
            .expect("release")
            .recv_timeout(PATIENCE)
            .map_err(|_| "the test never released the handler")
    };

    let summary: Stopped<Deliveries> = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        assert_eq!(handler_started.recv_timeout(PATIENCE).expect("a delivery"), ids[0]);
        // The whole batch is claimed and the first handler is blocked.
        shutdown.trigger();
        release.send(()).expect("the handler waits");
        service.join().expect("the relay does not panic")
    });
    let report = summary.work;
    assert_eq!(
        (report.claimed, report.delivered, report.released, report.lost),
        (5, 1, 4, 0),
        "{summary:?}"
    );
    assert!(handler_started.try_recv().is_err(), "no handler ran after the trigger");
    let rows = D::outbox_messages(&mut conn);
    assert_eq!((rows[0].0.as_str(), rows[0].2.as_str()), (ids[0].as_str(), "delivered"));
    for row in &rows[1..] {
        assert_eq!(
            (row.2.as_str(), row.3),
            ("pending", 0),
            "given back unattempted: {row:?}"
        );
    }

    // Due at once for the next relay, whose lease is long: it does not wait
    // for the stopped relay's lease to run out.
    let mut attempts = Vec::new();
    let next = Relay::default()
        .lease(Duration::hours(1))
        .run_once(&mut conn, |message| {
            attempts.push((message.id.clone(), message.attempt));
            Ok::<_, String>(())
        });
    assert_eq!(next.expect("the next relay").delivered, 4);
    let expected: Vec<_> = ids[1..].iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(attempts, expected);
}

fn stats_follow_the_backlog_through_delivery_failure_and_requeue<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::at(Utc::now());
    let relay = Relay::default().clock(clock.source());
    let stats = |conn: &mut D::Conn| {
        let s = relay.stats(conn).expect("stats");
        (s.pending, s.due_now, s.dead, s.oldest_pending_age)
    };
    assert_eq!(stats(&mut conn), (0, 0, 0, None));

    let fails = outbox::enqueue(&mut conn, "webhooks", &"gone").expect("enqueue");
    outbox::enqueue(&mut conn, "webhooks", &"fine").expect("enqueue");
    outbox::enqueue_at(&mut conn, "webhooks", &"later", clock.now() + Duration::hours(1)).expect("enqueue");
    clock.advance(Duration::minutes(5));
    let (pending, due, dead, age) = stats(&mut conn);
    assert_eq!((pending, due, dead), (3, 2, 0), "the delayed one is pending, not due");
    // Enqueued a moment after the clock was read.
    let age = age.expect("an oldest pending message");
    assert!(age <= Duration::minutes(5) && age > Duration::minutes(4), "{age}");

    let report = relay
        .clone()
        .max_attempts(1)
        .run_once(
            &mut conn,
            |message| {
                if message.id == fails { Err("410 gone") } else { Ok(()) }
            },
        )
        .expect("relay");
    assert_eq!((report.delivered, report.dead), (1, 1));
    let (pending, due, dead, age) = stats(&mut conn);
    assert_eq!((pending, due, dead), (1, 0, 1), "one delivered, one dead, one delayed");
    assert!(age.is_some_and(|age| age <= Duration::minutes(5)));

    clock.advance(Duration::hours(1));
    assert_eq!(stats(&mut conn).1, 1, "the delayed message is due");
    // A failed attempt: pending, waiting for its backoff, not due.
    relay
        .clone()
        .backoff(Duration::minutes(1), Duration::minutes(1))
        .run_once(&mut conn, |_| Err("503"))
        .expect("relay");
    let (pending, due, dead, _) = stats(&mut conn);
    assert_eq!((pending, due, dead), (1, 0, 1));
    clock.advance(Duration::minutes(1));
    assert_eq!(stats(&mut conn).1, 1, "due again after the backoff");

    assert!(relay.requeue(&mut conn, &fails).expect("requeue"));
    let (pending, due, dead, age) = stats(&mut conn);
    assert_eq!((pending, due, dead), (2, 2, 0));
    // The requeued message counts from when it was first enqueued.
    assert!(age.is_some_and(|age| age > Duration::hours(1)));
    assert_eq!(
        relay
            .run_once(&mut conn, |_| Ok::<_, String>(()))
            .expect("relay")
            .delivered,
        2
    );
    assert_eq!(stats(&mut conn), (0, 0, 0, None));
}

fn database_error_mid_batch_keeps_the_batch_deliveries_in_the_summary<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let ids: Vec<String> = (0..3)
        .map(|i| outbox::enqueue(&mut conn, "receipts", &i).expect("enqueue"))
        .collect();
    let relay = Relay::default().batch_size(10);
    let shutdown = Shutdown::new();
    let saboteur = Mutex::new(db.conn());
    // The second handler takes the outbox table away, so recording its
    // outcome fails, and stops the service, which then ends after that
    // one error.
    let handler = |message: &Message| {
        if message.id == ids[1] {
            saboteur
                .lock()
                .expect("connection")
                .batch_execute("ALTER TABLE idempotency_outbox RENAME TO idempotency_outbox_away")
                .map_err(|error| error.to_string())?;
            shutdown.trigger();
        }
        Ok::<_, String>(())
    };
    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        scope
            .spawn(|| relay.serve(&pool, handler, &shutdown))
            .join()
            .expect("the relay does not panic")
    });
    conn.batch_execute("ALTER TABLE idempotency_outbox_away RENAME TO idempotency_outbox")
        .expect("put the table back");
    assert_eq!(summary.errors, 1, "{summary:?}");
    assert_eq!(
        (summary.work.claimed, summary.work.delivered),
        (3, 1),
        "the delivery before the error counts: {summary:?}"
    );
    let statuses: Vec<_> = D::outbox_messages(&mut conn).into_iter().map(|m| (m.2, m.3)).collect();
    assert_eq!(
        statuses,
        [
            ("delivered".to_owned(), 1),
            ("pending".to_owned(), 1),
            ("pending".to_owned(), 1)
        ],
        "the rest of the batch stays leased, for the next claim after the lease"
    );
}

fn relay_on_a_pool_of_one_connection_delivers_without_errors<D: TestDb>() {
    let db = D::new();
    // No connection to spare for a listener on PostgreSQL.
    let pool = db.pool(1);
    let mut conn = db.conn();
    let relay = Relay::default().poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let (tx, delivered) = mpsc::channel();
    let handler = |message: &Message| tx.send(message.id.clone()).map_err(|e| e.to_string());
    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        for i in 0..3 {
            let id = outbox::enqueue(&mut conn, "receipts", &i).expect("enqueue");
            assert_eq!(delivered.recv_timeout(PATIENCE).expect("delivered"), id);
        }
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });
    assert_eq!((summary.work.delivered, summary.errors), (3, 0), "{summary:?}");
}

/// A message never attempted is due whatever the relay's clock says, as a
/// claim takes it: a relay whose injected clock is an hour behind the
/// database (which stamps the enqueue) delivers it at once.
fn relay_with_a_clock_behind_the_database_delivers_at_once<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let behind = ManualClock::at(Utc::now() - Duration::hours(1));
    let relay = Relay::default()
        .clock(behind.source())
        .poll_interval(Duration::milliseconds(50));
    let id = outbox::enqueue(&mut db.conn(), "receipts", &1).expect("enqueue");
    let (sender, received) = mpsc::channel();
    let shutdown = Shutdown::new();
    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| {
            relay.serve(
                &pool,
                |message: &Message| sender.send(message.id.clone()).map_err(|e| e.to_string()),
                &shutdown,
            )
        });
        assert_eq!(received.recv_timeout(PATIENCE), Ok(id));
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });
    assert_eq!((summary.work.delivered, summary.errors), (1, 0));
}

/// Enqueues a `webhooks` message of `payload`, then `others` more; returns
/// the id of the first.
fn enqueue_one_among<D: TestDb>(conn: &mut D::Conn, payload: &str, others: usize) -> String {
    let id = outbox::enqueue(conn, "webhooks", &payload).expect("enqueue");
    for n in 0..others {
        outbox::enqueue(conn, "webhooks", &n).expect("enqueue");
    }
    id
}

/// A relay of two workers with a lease of 1 s, which gives a message up
/// after `max_attempts`, soon backed off and polling often.
fn two_workers_giving_up_after(max_attempts: u32) -> Relay {
    Relay::default()
        .workers(2)
        .batch_size(5)
        .lease(Duration::seconds(1))
        .max_attempts(max_attempts)
        .backoff(Duration::milliseconds(10), Duration::milliseconds(40))
        .poll_interval(Duration::milliseconds(10))
}

/// A message whose handler panics is a poison message: each panic is a
/// failed attempt of that message alone, counted and backed off until it
/// is dead, while both workers go on delivering the rest.
fn panicking_handler_fails_its_message_while_the_others_are_delivered<D: TestDb>() {
    const OTHERS: usize = 20;
    const MAX_ATTEMPTS: u32 = 3;
    let db = D::new();
    let pool = db.pool(3);
    let mut conn = db.conn();
    let poison = enqueue_one_among::<D>(&mut conn, "poison", OTHERS);
    let relay = two_workers_giving_up_after(MAX_ATTEMPTS);
    let shutdown = Shutdown::new();
    let (delivered, poisoned) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let handler = |message: &Message| {
        if message.id == poison {
            poisoned.fetch_add(1, Ordering::SeqCst);
            panic!("the payload does not parse");
        }
        delivered.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(())
    };

    let stopped = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        wait_for("the other messages delivered and the poison message dead", || {
            status_count::<D>(&mut conn, "delivered") == OTHERS && status_count::<D>(&mut conn, "dead") == 1
        });
        shutdown.trigger();
        service.join()
    });
    let summary = stopped.expect("the relay returns at shutdown, without a panic");

    assert_eq!(
        delivered.load(Ordering::SeqCst),
        OTHERS,
        "each other message delivered once"
    );
    assert_eq!(
        poisoned.load(Ordering::SeqCst),
        MAX_ATTEMPTS as usize,
        "one panic per attempt"
    );
    let rows = D::outbox_messages(&mut conn);
    let (_, _, status, attempts, last_error) = rows.iter().find(|row| row.0 == poison).expect("the poison message");
    assert_eq!((status.as_str(), *attempts), ("dead", MAX_ATTEMPTS as i32));
    assert_eq!(
        last_error.as_deref(),
        Some("the handler panicked: the payload does not parse")
    );
    assert_eq!(summary.errors, 0);
    let work = summary.work;
    assert_eq!(
        (work.delivered, work.retried, work.dead, work.lost),
        (OTHERS, MAX_ATTEMPTS as usize - 1, 1, 0),
        "{summary:?}"
    );
}

/// A handler that never returns holds its message for less than the
/// lease: the attempt is given up and recorded as failed, the rest of its
/// batch is given back, and the workers go on delivering. The threads left
/// blocked in the handler are released at the end, and what they return
/// then changes nothing.
fn hanging_handler_is_given_up_within_its_lease_while_the_others_are_delivered<D: TestDb>() {
    const OTHERS: usize = 20;
    const MAX_ATTEMPTS: u32 = 2;
    let db = D::new();
    let pool = db.pool(3);
    let mut conn = db.conn();
    let hanging = enqueue_one_among::<D>(&mut conn, "hangs", OTHERS);
    let relay = two_workers_giving_up_after(MAX_ATTEMPTS);
    let shutdown = Shutdown::new();
    let (delivered, hangs, returned) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
    // Never sent on: the handler blocks until the test drops the sender.
    let (release, blocked) = mpsc::channel::<()>();
    let blocked = Mutex::new(blocked);
    let handler = |message: &Message| {
        if message.id == hanging {
            hangs.fetch_add(1, Ordering::SeqCst);
            let _ = blocked.lock().unwrap_or_else(PoisonError::into_inner).recv();
            returned.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        delivered.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(())
    };

    let stopped = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let release = release;
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        wait_for("the other messages delivered and the hanging message dead", || {
            status_count::<D>(&mut conn, "delivered") == OTHERS && status_count::<D>(&mut conn, "dead") == 1
        });
        assert_eq!(
            returned.load(Ordering::SeqCst),
            0,
            "the hanging handlers are still blocked"
        );
        shutdown.trigger();
        drop(release);
        service.join()
    });
    let summary = stopped.expect("the relay returns once the blocked handlers are released");

    assert_eq!(
        delivered.load(Ordering::SeqCst),
        OTHERS,
        "each other message delivered once"
    );
    assert_eq!(
        hangs.load(Ordering::SeqCst),
        MAX_ATTEMPTS as usize,
        "one hang per attempt"
    );
    assert_eq!(
        returned.load(Ordering::SeqCst),
        MAX_ATTEMPTS as usize,
        "every blocked thread returned"
    );
    let rows = D::outbox_messages(&mut conn);
    let (_, _, status, attempts, last_error) = rows.iter().find(|row| row.0 == hanging).expect("the hanging message");
    assert_eq!(
        (status.as_str(), *attempts),
        ("dead", MAX_ATTEMPTS as i32),
        "the late successes recorded nothing"
    );
    assert_eq!(
        last_error.as_deref(),
        Some("the handler did not return within three quarters of the lease; the attempt was given up")
    );
    assert_eq!(summary.errors, 0);
    let work = summary.work;
    assert_eq!(
        (work.delivered, work.retried, work.dead),
        (OTHERS, MAX_ATTEMPTS as usize - 1, 1),
        "{summary:?}"
    );
}

/// The threads a worker leaves behind are bounded: with four handlers it
/// gave up on still running it claims nothing more, and it claims again
/// once one of them has returned.
fn worker_claims_nothing_while_four_handlers_it_gave_up_on_still_run<D: TestDb>() {
    const HANGING: usize = 4;
    let db = D::new();
    let pool = db.pool(2);
    let mut conn = db.conn();
    let hanging: HashSet<String> = (0..HANGING)
        .map(|n| outbox::enqueue(&mut conn, "webhooks", &n).expect("enqueue"))
        .collect();
    let after = outbox::enqueue(&mut conn, "webhooks", &"after").expect("enqueue");
    let relay = Relay::default()
        .batch_size(1)
        .lease(Duration::milliseconds(300))
        .max_attempts(1)
        .poll_interval(Duration::milliseconds(10));
    let shutdown = Shutdown::new();
    let released = AtomicUsize::new(0);
    let (release, blocked) = mpsc::channel::<()>();
    let blocked = Mutex::new(blocked);
    let (tx, delivered) = mpsc::channel();
    let handler = |message: &Message| {
        if hanging.contains(&message.id) {
            let _ = blocked.lock().unwrap_or_else(PoisonError::into_inner).recv();
            return Ok(());
        }
        tx.send((message.id.clone(), released.load(Ordering::SeqCst)))
            .map_err(|_| "the test stopped listening")
    };

    thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let release = release;
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        wait_for("the hanging messages given up on", || {
            status_count::<D>(&mut conn, "dead") == HANGING
        });
        released.store(1, Ordering::SeqCst);
        release.send(()).expect("a blocked handler takes it");
        assert_eq!(
            delivered.recv_timeout(PATIENCE).expect("a delivery"),
            (after, 1),
            "claimed only once a handler returned"
        );
        shutdown.trigger();
        drop(release);
        service.join().expect("the relay does not panic")
    });
}

/// The service's workers hand each key's messages over in enqueue order
/// while some attempts fail, and a handler's permanent failure, returned
/// from the worker's handler thread, parks its message after one attempt.
fn workers_keep_each_ordering_key_in_order_and_park_a_permanent_failure_at_once<D: TestDb>() {
    use std::collections::HashMap;
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    const KEYS: usize = 3;
    const PER_KEY: usize = 6;
    let db = D::new();
    let pool = db.pool(4);
    let mut conn = db.conn();
    let gone = outbox::enqueue(&mut conn, "webhooks", &serde_json::json!("gone")).expect("enqueue");
    for n in 0..PER_KEY {
        for key in 0..KEYS {
            outbox::Envelope::new("webhooks", &serde_json::json!([key, n]))
                .ordering_key(format!("key-{key}"))
                .enqueue(&mut conn)
                .expect("enqueue");
        }
    }
    let relay = Relay::default()
        .workers(3)
        .batch_size(5)
        .max_attempts(1000)
        .backoff(Duration::milliseconds(1), Duration::milliseconds(1))
        .poll_interval(Duration::milliseconds(10));
    let delivered = Mutex::new(HashMap::<usize, Vec<usize>>::new());
    let handler = |message: &Message| -> Result<(), outbox::Failure> {
        let Ok((key, n)) = message.payload::<(usize, usize)>() else {
            return Err(outbox::Permanent("410 gone").into());
        };
        let mut hasher = DefaultHasher::new();
        (&message.id, message.attempt).hash(&mut hasher);
        if hasher.finish().is_multiple_of(3) {
            return Err(outbox::Failure::Retry(String::from("random failure")));
        }
        delivered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_default()
            .push(n);
        Ok(())
    };
    let shutdown = Shutdown::new();
    let summary = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        wait_for("every keyed message delivered and the gone one dead", || {
            status_count::<D>(&mut conn, "delivered") == KEYS * PER_KEY && status_count::<D>(&mut conn, "dead") == 1
        });
        shutdown.trigger();
        service.join().expect("the relay does not panic")
    });

    let delivered = delivered.into_inner().unwrap_or_else(PoisonError::into_inner);
    for key in 0..KEYS {
        assert_eq!(
            delivered[&key],
            (0..PER_KEY).collect::<Vec<_>>(),
            "key {key} in enqueue order"
        );
    }
    let rows = D::outbox_messages(&mut conn);
    let (_, _, status, attempts, last_error) = rows.iter().find(|row| row.0 == gone).expect("the gone message");
    assert_eq!(
        (status.as_str(), *attempts, last_error.as_deref()),
        ("dead", 1, Some("410 gone"))
    );
    assert_eq!((summary.work.dead, summary.errors), (1, 0), "{summary:?}");
}
