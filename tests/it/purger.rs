//! The background purger: it runs beside live traffic without failing a
//! call, deletes what has expired by the clock of its `Config` and the
//! retention of its `Relay`, keeps everything else, and stops when told.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration as StdDuration;

use chrono::Duration;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::outbox;
use idempotency::testing::ManualClock;
use idempotency::{Config, Purged, Purger, Shutdown, Stopped};

use crate::common::TestDb;
use crate::common::kept_an_hour;
use crate::common::outbox::{deliver_receipts_and_a_poison, relay_keeping_delivered_for};
use crate::common::wait::{Barrier, StopOnDrop, wait_for};

crate::common::backend_tests!(
    purger_beside_live_traffic_fails_no_call_and_purges_only_expired_records,
    purger_deletes_delivered_messages_after_retention_and_stops_at_once,
    purger_stops_between_batches_once_shutdown_is_triggered,
);

fn purger_beside_live_traffic_fails_no_call_and_purges_only_expired_records<D: TestDb>() {
    const THREADS: usize = 4;
    const OLD: usize = 40;
    const NEW: usize = 40;
    let db = D::new();
    let pool = db.pool(THREADS as u32 + 1);
    let (clock, config) = kept_an_hour();
    let purger = Purger::default()
        .interval(Duration::milliseconds(5))
        .batch_size(10)
        .config(config.clone());
    let shutdown = Shutdown::new();
    let failures = Mutex::new(Vec::new());
    let retried_old = AtomicUsize::new(0);
    let phase = Barrier::new(THREADS + 1);

    let call = |key: &str, item: &str| {
        let mut conn = pool.get().expect("a pooled connection");
        let result = config.run(&mut conn, "shop", key, &item, |tx| {
            let order = D::place_order(tx, item, 1)?;
            if item == "again" {
                // Holds the retried key a moment, so that purging its
                // expired record and taking it over overlap.
                thread::sleep(StdDuration::from_millis(2));
            }
            Ok::<_, diesel::result::Error>(order)
        });
        if let Err(error) = &result {
            failures.lock().expect("failures").push(format!("{key}: {error:?}"));
        }
        result
    };

    let purged: Stopped<Purged> = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| purger.serve(&pool, &shutdown));
        for t in 0..THREADS {
            let (call, phase, retried_old, failures) = (&call, &phase, &retried_old, &failures);
            scope.spawn(move || {
                phase.wait();
                for i in 0..OLD {
                    let _ = call(&format!("old-{t}-{i}"), "old");
                }
                phase.wait();
                // The clock moved: every old record has expired.
                phase.wait();
                for i in 0..NEW {
                    let _ = call(&format!("new-{t}-{i}"), "new");
                    if i % 4 == 0 {
                        let again = call(&format!("old-{t}-{i}"), "again");
                        if again.is_ok_and(|outcome| !outcome.is_replayed()) {
                            retried_old.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    // A fresh record is kept: its retry replays. (No
                    // assertion here: a panicking thread would leave the
                    // others waiting at the barrier.)
                    let key = format!("new-{t}-{i}");
                    if call(&key, "new").is_ok_and(|outcome| !outcome.is_replayed()) {
                        failures
                            .lock()
                            .expect("failures")
                            .push(format!("{key}: executed again"));
                    }
                }
                phase.wait();
            });
        }
        phase.wait();
        phase.wait();
        clock.advance(Duration::hours(1) + Duration::seconds(1));
        phase.wait();
        phase.wait();
        let expected = (THREADS * NEW + retried_old.load(Ordering::SeqCst)) as i64;
        let mut conn = db.conn();
        wait_for("the expired records purged", || D::key_count(&mut conn) == expected);
        shutdown.trigger();
        service.join().expect("the purger does not panic")
    });

    assert_eq!(
        *failures.lock().expect("failures"),
        Vec::<String>::new(),
        "no call failed"
    );
    let retried_old = retried_old.load(Ordering::SeqCst);
    assert_eq!(
        retried_old,
        THREADS * NEW / 4,
        "every retry of an expired key executed anew"
    );
    // A retried key's old record was either purged first or taken over.
    assert!(
        (THREADS * OLD - retried_old..=THREADS * OLD).contains(&purged.work.keys),
        "{purged:?}"
    );
    assert_eq!(purged.errors, 0, "{purged:?}");
    assert!(purged.work.rounds > 0);
    let mut conn = db.conn();
    assert_eq!(D::key_count(&mut conn), (THREADS * NEW + retried_old) as i64);
    assert_eq!(
        D::order_count(&mut conn),
        (THREADS * (OLD + NEW) + retried_old) as i64,
        "each executed call placed one order, no call placed two"
    );
}

/// A database of the test's own, the pool of one connection a purger
/// serves from, the test's own connection, and a manual clock.
fn one_purger_connection<D: TestDb>() -> (D, Pool<ConnectionManager<D::Conn>>, D::Conn, ManualClock) {
    let db = D::new();
    let pool = db.pool(1);
    let conn = db.conn();
    (db, pool, conn, ManualClock::new())
}

fn purger_deletes_delivered_messages_after_retention_and_stops_at_once<D: TestDb>() {
    let (_db, pool, mut conn, clock) = one_purger_connection::<D>();
    let relay = relay_keeping_delivered_for(&clock, Duration::days(7));
    let report = deliver_receipts_and_a_poison::<D>(&mut conn, &relay, 25);
    assert_eq!((report.delivered, report.dead), (25, 1));
    outbox::enqueue(&mut conn, "receipts", &"pending").expect("enqueue");
    clock.advance(Duration::days(7));

    // An hour between rounds: the first round runs at once, and the
    // trigger ends the wait for the second.
    let purger = Purger::default()
        .interval(Duration::seconds(3600))
        .batch_size(10)
        .config(Config::default().clock(clock.source()))
        .message_retention(Duration::days(7));
    let shutdown = Shutdown::new();
    let purged = thread::scope(|scope| {
        let _stop = StopOnDrop(&shutdown);
        let service = scope.spawn(|| purger.serve(&pool, &shutdown));
        wait_for("the delivered messages purged", || {
            D::outbox_messages(&mut conn).len() == 2
        });
        shutdown.trigger();
        service.join().expect("the purger does not panic")
    });
    assert_eq!(
        (
            purged.work.rounds,
            purged.work.messages,
            purged.work.keys,
            purged.errors
        ),
        (1, 25, 0, 0)
    );
    let statuses: Vec<_> = D::outbox_messages(&mut conn).into_iter().map(|m| m.2).collect();
    assert_eq!(
        statuses,
        ["dead", "pending"],
        "dead and pending messages are never purged"
    );
}

fn purger_stops_between_batches_once_shutdown_is_triggered<D: TestDb>() {
    let (_db, pool, mut conn, clock) = one_purger_connection::<D>();
    let config = Config::default().clock(clock.source());
    for key in ["k1", "k2", "k3", "k4", "k5"] {
        config
            .run(&mut conn, "shop", key, &1, |_| Ok::<_, std::convert::Infallible>(1))
            .expect("executes");
    }
    clock.advance(Duration::hours(25));

    // The purge reads its clock once, for its cut-off, before the first
    // batch: the shutdown arrives there, in the middle of the round.
    let shutdown = Shutdown::new();
    let (trigger, now) = (shutdown.clone(), clock.source());
    let triggering = Config::default().clock(move || {
        trigger.trigger();
        now()
    });
    let purger = Purger::default().batch_size(1).config(triggering);
    let purged = purger.serve(&pool, &shutdown);
    assert_eq!(
        (purged.work.rounds, purged.work.keys),
        (1, 1),
        "one batch of one, then it stopped"
    );
    assert_eq!(D::key_count(&mut conn), 4);
}
