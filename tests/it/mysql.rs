//! What MySQL and MariaDB do in their own way (what every server does alike
//! is in `server`): requests waiting for the row of a caller's uncommitted
//! claim; named locks; callers' isolation levels; deadlocks; and what the
//! key table holds.
//!
//! Threads are ordered by channels, barriers and the server's own view of
//! who waits for what (the process list and `innodb_trx`), never by sleeping
//! for a guessed time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;
use idempotency::outbox::{self, Relay};
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent};

use crate::common::kept_an_hour;
use crate::common::mysql::*;
use crate::common::server::{self, *};
use crate::common::wait::{self, Barrier};
use crate::common::{Isolation, ServerDb, TestDb};

/// A caller's transaction in which a nested call executed the key and
/// finished: its savepoint is released and so is the key's named lock, but
/// its claim is committed only with the caller's transaction, which stays
/// open until released.
struct Caller {
    release: mpsc::Sender<Release>,
    thread: thread::JoinHandle<CallResult>,
}

impl Caller {
    fn executed(db: &Db, key: &str) -> Caller {
        let (executed_tx, executed_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let mut conn = db.conn();
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            conn.transaction(|tx| {
                let nested = run_idempotent(tx, SCOPE, &key, REQUEST, |tx| {
                    Ok::<_, DomainError>(Db::place_order(tx, "caller", 1)?)
                });
                executed_tx.send(()).expect("the test waits for the nested call");
                match release_rx.recv() {
                    Ok(Release::Commit) => nested,
                    Ok(Release::Fail) | Err(_) => Err(Error::Operation(DomainError::Refused)),
                }
            })
        });
        wait::recv(&executed_rx, "the nested call to finish");
        Caller { release, thread }
    }

    fn finish(self, how: Release) -> CallResult {
        self.release.send(how).expect("the caller waits for its release");
        wait::join(self.thread, "the caller's thread")
    }
}

/// A caller whose nested call executed `key`, and a top-level request for
/// the key, returned once the server shows its claim waiting for the
/// caller's row.
fn caller_and_top_level_waiter(db: &Db, key: &str) -> (Caller, Waiter<MysqlConnection>) {
    let mut admin = db.conn();
    let caller = Caller::executed(db, key);
    let waiter = Waiter::start(db, key, long_wait(), top_level::<Db>);
    wait_until_waiting_for_row_lock(&mut admin, waiter.session);
    (caller, waiter)
}

#[test]
fn sixteen_requests_racing_for_a_fresh_key_execute_it_once() {
    let db = Db::new();
    let (outcomes, calls) = race_for_one_key(&db, &long_wait(), 16);

    assert_eq!(calls, 1, "the operation ran once");
    assert_one_executed_and_all_saw_it(outcomes);
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

/// The case every call claims its key first for: a nested call finished
/// and gave its named lock back, its claim still uncommitted in the caller's
/// transaction. A top-level request gets the lock, and its claim waits for
/// the caller's row.
#[test]
fn top_level_waiter_replays_a_callers_nested_call_once_the_caller_commits() {
    let db = Db::new();
    let (caller, waiter) = caller_and_top_level_waiter(&db, "k-nested");

    let executed = caller.finish(Release::Commit).expect("the caller commits").into_inner();
    let (mut conn, waited, calls) = waiter.join();
    assert_eq!(waited.expect("the waiter replays"), Outcome::Replayed(executed));
    assert_eq!(calls, 0, "the waiter's operation never ran");
    assert_eq!(Db::order_count(&mut conn), 1);
}

#[test]
fn top_level_waiter_executes_once_the_caller_of_a_nested_call_rolls_back() {
    let db = Db::new();
    let (caller, waiter) = caller_and_top_level_waiter(&db, "k-nested");

    let rolled_back = caller.finish(Release::Fail);
    assert!(matches!(rolled_back, Err(Error::Operation(DomainError::Refused))));
    let (mut conn, waited, calls) = waiter.join();
    assert!(matches!(waited, Ok(Outcome::Executed(_))), "{waited:?}");
    assert_eq!(calls, 1);
    assert_eq!(Db::order_items(&mut conn), ["waiter"]);
    assert_eq!(Db::key_count(&mut conn), 1);
}

/// The wait for a caller's uncommitted claim is InnoDB's row lock wait,
/// bounded by the session's `innodb_lock_wait_timeout` (whole seconds),
/// which the crate leaves as it is.
#[test]
fn row_lock_wait_that_runs_out_is_in_progress_and_leaves_the_connection_usable() {
    let db = Db::new();
    let caller = Caller::executed(&db, "k-nested");
    let mut conn = db.conn();
    let mut admin = db.conn();
    let id = connection_id(&mut conn);
    conn.batch_execute("SET SESSION innodb_lock_wait_timeout = 1")
        .expect("a short row lock wait");
    let calls = AtomicUsize::new(0);

    let waited = long_wait().run(&mut conn, SCOPE, "k-nested", REQUEST, counted::<Db>(&calls, "waiter"));

    assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    assert_eq!(open_write_transactions(&mut admin, id), 0);
    assert_eq!(lock_wait_timeout(&mut conn), 1, "the session's own setting");
    assert_eq!(db.key_lock_holder(&mut admin, SCOPE, "k-nested"), None);
    let other = run_idempotent(&mut conn, SCOPE, "k-other", REQUEST, counted::<Db>(&calls, "other"));
    assert!(matches!(other, Ok(Outcome::Executed(_))), "usable: {other:?}");

    let executed = caller.finish(Release::Commit).expect("the caller commits").into_inner();
    let retry = run_idempotent(&mut conn, SCOPE, "k-nested", REQUEST, counted::<Db>(&calls, "waiter"));
    assert_eq!(retry.expect("the retry replays"), Outcome::Replayed(executed));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the other key executed");
}

/// Under `REPEATABLE READ` a caller's transaction that has read keeps its
/// snapshot and would not see the holder's commit with a plain read: the
/// lost claim reads the record with a lock, and replays. (PostgreSQL fails
/// such a caller with a serialization failure instead.)
#[test]
fn nested_waiter_whose_caller_has_read_replays_the_holders_commit() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-snapshot");
    let mut conn = db.conn();
    let id = Db::session_id(&mut conn);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let waiter = thread::spawn(move || {
        // InnoDB's default level, REPEATABLE READ.
        let result = conn.transaction(|tx| {
            // The snapshot is taken here, before the holder commits.
            let before = Db::order_count(tx);
            let outcome = long_wait().run(tx, SCOPE, "k-snapshot", REQUEST, counted::<Db>(&counter, "waiter"))?;
            Ok::<_, Error<DomainError>>((before, outcome, Db::order_count(tx)))
        });
        (conn, result)
    });
    Db::wait_until_waiting_for_a_key(&mut admin, id);

    let held = holder.finish(Release::Commit).expect("the holder commits").into_inner();
    let (mut conn, result) = wait::join(waiter, "the waiter's thread");
    let (before, outcome, after) = result.expect("the caller's transaction commits");
    assert_eq!(outcome, Outcome::Replayed(held));
    assert_eq!((before, after), (0, 0), "the caller's own reads keep their snapshot");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(Db::order_count(&mut conn), 1);
}

/// A holder fails while two requests wait for its key: one executes, the
/// other replays it or fails with a storage error (a deadlock, rolled
/// back); the operation never runs twice.
fn holder_rolling_back_with_two_waiters_executes_once(nested: bool) {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-two");
    let waiters: Vec<Waiter<MysqlConnection>> = (0..2)
        .map(|_| {
            Waiter::start(
                &db,
                "k-two",
                long_wait(),
                if nested { server::nested::<Db> } else { top_level::<Db> },
            )
        })
        .collect();
    for waiter in &waiters {
        Db::wait_until_waiting_for_a_key(&mut admin, waiter.session);
    }

    let failed = holder.finish(Release::Fail);
    assert!(
        matches!(failed, Err(Error::Operation(DomainError::Refused))),
        "{failed:?}"
    );
    let results: Vec<(CallResult, usize)> = waiters
        .into_iter()
        .map(|waiter| {
            let (_, result, calls) = waiter.join();
            (result, calls)
        })
        .collect();

    let calls: usize = results.iter().map(|(_, calls)| calls).sum();
    assert_eq!(calls, 1, "one waiter ran its operation: {results:?}");
    let executed: Vec<i64> = results
        .iter()
        .filter_map(|(result, _)| match result {
            Ok(Outcome::Executed(value)) => Some(*value),
            _ => None,
        })
        .collect();
    assert_eq!(executed.len(), 1, "{results:?}");
    for (result, _) in &results {
        match result {
            Ok(Outcome::Replayed(value)) => assert_eq!(*value, executed[0]),
            Ok(Outcome::Executed(_)) | Err(Error::Storage(_)) => {}
            other => panic!("a waiter fails otherwise than storage: {other:?}"),
        }
    }
    let mut conn = db.conn();
    assert_eq!(Db::order_items(&mut conn), ["waiter"]);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn holder_rolling_back_with_two_top_level_waiters_executes_once() {
    holder_rolling_back_with_two_waiters_executes_once(false);
}

#[test]
fn holder_rolling_back_with_two_nested_waiters_executes_once() {
    holder_rolling_back_with_two_waiters_executes_once(true);
}

/// Two callers' transactions each hold a nested call's uncommitted claim and
/// then call with the other's key: each claim waits for the other's row, and
/// InnoDB breaks the cycle by rolling back one caller's whole transaction.
/// That call fails with a storage error of kind `SerializationFailure` and
/// leaves nothing; the other goes on and executes both keys once.
#[test]
fn deadlock_between_callers_rolls_one_back_and_executes_each_key_once() {
    let db = Db::new();
    let mut admin = db.conn();
    let barrier = Arc::new(Barrier::new(2));
    let (ids_tx, ids_rx) = mpsc::channel();
    let calls = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = [("k-a", "k-b"), ("k-b", "k-a")]
        .into_iter()
        .map(|(first, second)| {
            let (barrier, ids_tx, calls) = (Arc::clone(&barrier), ids_tx.clone(), Arc::clone(&calls));
            let mut conn = db.conn();
            thread::spawn(move || {
                ids_tx.send(connection_id(&mut conn)).expect("the test waits");
                let result = conn.transaction(|tx| {
                    let a = long_wait().run(tx, SCOPE, first, first, counted::<Db>(&calls, first))?;
                    barrier.wait();
                    let b = long_wait().run(tx, SCOPE, second, second, counted::<Db>(&calls, second))?;
                    Ok::<_, Error<DomainError>>((a, b))
                });
                let in_transaction = Db::in_transaction(&mut conn);
                (result, in_transaction)
            })
        })
        .collect();
    let ids: Vec<u64> = (0..2).map(|_| wait::recv(&ids_rx, "a caller's id")).collect();
    let results: Vec<_> = callers
        .into_iter()
        .map(|caller| wait::join(caller, "a caller's thread"))
        .collect();

    let victims = results
        .iter()
        .filter(|(result, _)| is_serialization_failure(result))
        .count();
    assert_eq!(victims, 1, "{results:?}");
    assert!(results.iter().all(|(_, in_transaction)| !in_transaction));
    let (survivor, _) = results
        .iter()
        .find(|(result, _)| result.is_ok())
        .expect("the other caller commits");
    let (a, b) = survivor.as_ref().expect("the survivor's calls");
    assert!(!a.is_replayed() && !b.is_replayed(), "{survivor:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "two by the survivor, one rolled back");
    for id in ids {
        assert_eq!(open_write_transactions(&mut admin, id), 0);
    }
    assert_eq!(Db::order_count(&mut admin), 2);
    assert_eq!(Db::key_count(&mut admin), 2);
}

/// Two requests with one key, round after round, released together from
/// sessions at `isolation`, top level or each in a caller's transaction.
/// The operation runs once per key. A caller whose transaction is rolled
/// back by a deadlock retries it, as deadlocks ask, and replays.
fn racing_calls_execute_each_key_once(isolation: Isolation, nested: bool) {
    let db = Db::new();
    let call = |conn: &mut MysqlConnection, round: usize, calls: &AtomicUsize| {
        let call = if nested { server::nested::<Db> } else { top_level::<Db> };
        call(conn, &long_wait(), &format!("k-{round}"), counted::<Db>(calls, "racer"))
    };
    let deadlocks = race_in_rounds(&format!("{isolation:?}"), || db.session_at(isolation), call, true);
    println!("{isolation:?}, nested {nested}: {deadlocks} of {ROUNDS} races ended in a deadlock");
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), ROUNDS as i64);
    assert_eq!(Db::key_count(&mut conn), ROUNDS as i64);
}

#[test]
fn racing_calls_from_sessions_at_every_level_execute_each_key_once() {
    for isolation in Isolation::ALL {
        racing_calls_execute_each_key_once(isolation, false);
    }
}

#[test]
fn callers_racing_in_transactions_at_every_level_execute_each_key_once() {
    for isolation in Isolation::ALL {
        racing_calls_execute_each_key_once(isolation, true);
    }
}

/// Named locks are one name space per server; the crate's names include
/// the database, so a key held in one database holds nothing up in
/// another, and an application's own named locks never meet the crate's.
#[test]
fn named_locks_of_other_databases_and_of_the_application_never_meet_the_crates() {
    let db = Db::new();
    let other = Db::new();
    let holder = Holder::claim(&db, "k-shared");
    let mut application = other.conn();
    application
        .batch_execute(&format!("DO GET_LOCK('{SCOPE}:k-shared', 0)"))
        .expect("the application's own lock");

    let reject = Config::default().in_flight(InFlight::Reject);
    let calls = AtomicUsize::new(0);
    let outcome = reject.run(
        &mut other.conn(),
        SCOPE,
        "k-shared",
        REQUEST,
        counted::<Db>(&calls, "other"),
    );
    assert!(!outcome.expect("not held up").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    holder.finish(Release::Commit).expect("the holder commits");
}

#[test]
fn key_longer_than_the_key_column_is_refused_not_cut() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().max_key_len(1000);
    assert_the_longest_fits_and_longer_is_refused::<Db>(&mut conn, &config, 255, |len, _| "k".repeat(len));
    let long = "k".repeat(256);
    let phased =
        idempotency::phased::Phased::new("long")
            .config(config.clone())
            .run(&mut conn, SCOPE, &long, &1, |steps| {
                steps.finish(|_| Ok::<_, std::convert::Infallible>(1))
            });
    assert_eq!(
        too_long(&phased).map(|(what, _, max)| (what, max)),
        Some(("key", 255)),
        "{phased:?}"
    );
}

#[test]
fn keys_differing_in_case_are_different_keys() {
    let db = Db::new();
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);
    let upper = run_idempotent(&mut conn, SCOPE, "Order-1", REQUEST, counted::<Db>(&calls, "upper")).expect("executes");
    let lower = run_idempotent(&mut conn, SCOPE, "order-1", REQUEST, counted::<Db>(&calls, "lower")).expect("executes");
    assert!(!upper.is_replayed() && !lower.is_replayed());
    assert_ne!(upper.into_inner(), lower.into_inner());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// 10 MB of text in every character width utf8mb4 holds, emoji included.
fn ten_megabytes() -> String {
    let unit = "a-é-€-😀 ";
    unit.repeat(10 * 1024 * 1024 / unit.len() + 1)
}

#[test]
fn ten_megabyte_bodies_are_stored_and_come_back_whole() {
    let db = Db::new();
    let mut conn = db.conn();
    let body = ten_megabytes();
    // Beyond the default bound on what a key stores, as an application
    // that raises it may: the column still holds it whole.
    let config = Config::default().max_response_len(16 * 1024 * 1024);
    let stored = config.run(&mut conn, SCOPE, "k-big", REQUEST, |tx| {
        outbox::enqueue(tx, "big", &body)?;
        Ok::<_, outbox::Error>(body.clone())
    });
    assert!(!stored.expect("executes").is_replayed());
    let replayed = config
        .run(&mut conn, SCOPE, "k-big", REQUEST, |_| {
            Ok::<_, outbox::Error>(String::new())
        })
        .expect("replays");
    assert!(replayed.is_replayed());
    assert!(replayed.into_inner() == body, "the response comes back whole");
    let delivered = Relay::default()
        .run_once(&mut conn, |message| {
            assert!(message.payload::<String>().expect("the payload") == body);
            Ok::<_, std::convert::Infallible>(())
        })
        .expect("the relay");
    assert_eq!(delivered.delivered, 1);
}

#[test]
fn retention_of_a_hundred_years_is_kept_past_2038() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().retention(Duration::days(100 * 365));
    let first = config
        .run_recorded(&mut conn, SCOPE, "k-century", REQUEST, |tx| {
            Db::place_order(tx, "century", 1)
        })
        .expect("executes");
    assert!(first.expires_at.timestamp() > 2_200_000_000, "beyond 2038");
    let again = config
        .run_recorded(&mut conn, SCOPE, "k-century", REQUEST, |tx| {
            Db::place_order(tx, "again", 1)
        })
        .expect("replays");
    assert!(again.outcome.is_replayed());
    assert_eq!(again.expires_at, first.expires_at, "stored to the microsecond");
    // The record read by the statements other backends share: the lookup,
    // and the read FOR UPDATE of a call nested in a caller's transaction,
    // which reads nothing before its lock.
    let status = config
        .status::<_, i64>(&mut conn, SCOPE, "k-century", REQUEST)
        .expect("the status");
    assert!(
        matches!(status, idempotency::KeyStatus::Completed { expires_at, .. } if expires_at == first.expires_at),
        "{status:?}"
    );
    let nested = conn
        .transaction(|tx| config.run_recorded(tx, SCOPE, "k-century", REQUEST, |tx| Db::place_order(tx, "nested", 1)))
        .expect("replays nested");
    assert!(nested.outcome.is_replayed());
    assert_eq!(nested.expires_at, first.expires_at);
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 0);
}

/// An operation in phases kept for a hundred years and a message due in a
/// hundred, written by the statements every backend shares: their times
/// past 2038 are stored as MySQL's `DATETIME`, not as its `TIMESTAMP`,
/// which would hold `NULL` there (a record kept for ever, a message due at
/// once).
#[test]
fn a_phased_operation_and_a_message_past_2038_keep_their_times() {
    let db = Db::new();
    let mut conn = db.conn();
    let phased =
        idempotency::phased::Phased::new("century").config(Config::default().retention(Duration::days(100 * 365)));
    let run = |conn: &mut MysqlConnection, item: &str| {
        phased.run(conn, SCOPE, "k-phased-century", REQUEST, |steps| {
            let order = steps.phase("ordered", |tx| Db::place_order(tx, item, 1))?;
            steps.finish(|_| Ok::<_, diesel::result::Error>(order))
        })
    };
    let first = run(&mut conn, "century").expect("executes");
    assert!(!first.is_replayed());
    let status = phased
        .status::<_, i64>(&mut conn, SCOPE, "k-phased-century", REQUEST)
        .expect("the status");
    let idempotency::KeyStatus::Completed { expires_at, .. } = status else {
        panic!("completed: {status:?}");
    };
    assert!(expires_at.timestamp() > 2_200_000_000, "beyond 2038: {expires_at}");
    assert!(run(&mut conn, "again").expect("replays").is_replayed());
    assert_eq!(Db::order_count(&mut conn), 1);

    let due = chrono::Utc::now() + Duration::days(100 * 365);
    outbox::enqueue_at(&mut conn, "reminders", &"in a century", due).expect("enqueue");
    let stats = Relay::default().stats(&mut conn).expect("stats");
    assert_eq!((stats.pending, stats.due_now), (1, 0), "{stats:?}");
}

/// A purge passes over an expired record that a live call is taking over at
/// that moment instead of waiting for the call, and deletes the others.
#[test]
fn purge_passes_over_an_expired_record_a_live_call_is_taking_over() {
    let db = Db::new();
    let (clock, config) = kept_an_hour();
    let mut conn = db.conn();
    for key in ["k-taken-over", "k-1", "k-2", "k-3"] {
        config
            .run(&mut conn, SCOPE, key, REQUEST, |_| Ok::<_, DomainError>(0))
            .expect("an old call");
    }
    clock.advance(Duration::hours(2));
    let holder = Holder::claim_with(&db, "k-taken-over", config.clone(), top_level::<Db>);

    let started = std::time::Instant::now();
    let purged = config.purge_expired(&mut conn, 2).expect("purge");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "it did not wait");
    assert_eq!(purged, 3, "every expired record but the one being taken over");

    let taken_over = holder.finish(Release::Commit).expect("the takeover commits");
    assert!(!taken_over.is_replayed());
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn relays_claiming_at_once_take_disjoint_messages() {
    const RELAYS: usize = 4;
    const MESSAGES: usize = 200;
    let db = Db::new();
    let mut conn = db.conn();
    conn.transaction(|tx| {
        for n in 0..MESSAGES {
            outbox::enqueue(tx, "receipts", &n)?;
        }
        Ok::<_, outbox::Error>(())
    })
    .expect("enqueue");
    let barrier = Barrier::new(RELAYS);
    let deliveries: Mutex<HashMap<String, usize>> = Mutex::new(HashMap::new());
    let relay = Relay::default().batch_size(10);
    thread::scope(|s| {
        for _ in 0..RELAYS {
            s.spawn(|| {
                let mut conn = db.conn();
                barrier.wait();
                loop {
                    let report = relay
                        .run_once(&mut conn, |message| {
                            *deliveries
                                .lock()
                                .expect("no panic while locked")
                                .entry(message.id.clone())
                                .or_default() += 1;
                            Ok::<_, std::convert::Infallible>(())
                        })
                        .expect("no claim fails");
                    if report.claimed == 0 {
                        break;
                    }
                }
            });
        }
    });
    let deliveries = deliveries.into_inner().expect("no panic while locked");
    assert_eq!(deliveries.len(), MESSAGES);
    assert!(deliveries.values().all(|count| *count == 1), "each message once");
}
