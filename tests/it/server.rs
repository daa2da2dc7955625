//! What only a server shows, on PostgreSQL and MySQL alike: requests waiting
//! for a key another transaction holds, takeover races, workers whose
//! session or process dies mid-operation, pools, load, and the isolation
//! level the operation runs at. What one backend does in its own way is in
//! its own module (`postgres`, `mysql`).
//!
//! Threads are ordered by channels, barriers and the server's own view of
//! who waits for a lock, never by sleeping for a guessed time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use chrono::Duration;
use diesel::prelude::*;
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent};

use crate::common::child::{Child, parent_database, report_and_wait_for_the_kill};
use crate::common::server::*;
use crate::common::wait::{self, Barrier};
use crate::common::{Isolation, ServerDb, test_name};

crate::common::server_backend_tests!(
    waiter_replays_when_the_holder_commits_within_the_wait,
    waiter_executes_when_the_holder_rolls_back,
    waiter_gets_in_progress_when_the_holder_outlasts_the_wait,
    reject_policy_answers_in_progress_while_the_key_is_held,
    in_progress_inside_a_callers_transaction_leaves_that_transaction_usable,
    top_level_holder_and_nested_waiter_serialize_on_one_lock,
    expired_key_is_taken_over_by_exactly_one_of_sixteen_racing_requests,
    killed_session_leaves_no_key_no_domain_row_and_no_lock,
    panic_on_a_lost_connection_still_reaches_the_caller,
    killed_worker_process_leaves_no_key_and_no_domain_row,
    panic_on_a_pooled_connection_returns_it_outside_a_transaction_and_without_the_lock,
    duplicate_requests_under_load_execute_each_key_once,
    operation_runs_at_the_sessions_own_isolation_level,
);

fn waiter_replays_when_the_holder_commits_within_the_wait<D: ServerDb>() {
    the_waiter_replays_the_holders_commit::<D>("k-commit", top_level::<D>, top_level::<D>);
}

fn waiter_executes_when_the_holder_rolls_back<D: ServerDb>() {
    let db = D::new();
    let (holder, waiter) = holder_and_waiter(&db, "k-rollback", top_level::<D>, top_level::<D>);

    let held = holder.finish(Release::Fail);
    let (mut conn, waited, calls) = waiter.join();

    assert!(matches!(held, Err(Error::Operation(DomainError::Refused))), "{held:?}");
    assert!(
        matches!(waited, Ok(Outcome::Executed(_))),
        "the waiter takes the freed key: {waited:?}"
    );
    assert_eq!(calls, 1);
    assert_eq!(D::order_items(&mut conn), ["waiter"], "only the waiter's order exists");
    assert_eq!(D::key_count(&mut conn), 1);
}

fn waiter_gets_in_progress_when_the_holder_outlasts_the_wait<D: ServerDb>() {
    let db = D::new();
    let holder = Holder::claim(&db, "k-outlasted");
    let mut conn = db.conn();
    let mut admin = db.conn();
    let session = D::session_id(&mut conn);
    let setting_before = D::lock_wait_setting(&mut conn);
    let calls = AtomicUsize::new(0);

    // The holder is released only after this returns, so it outlasts any wait.
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(200)));
    let started = Instant::now();
    let waited = short_wait.run(&mut conn, SCOPE, "k-outlasted", REQUEST, counted::<D>(&calls, "waiter"));
    let took = started.elapsed();

    let Err(error) = waited else {
        panic!("the waiter gives up, got {waited:?}")
    };
    assert!(matches!(error, Error::InProgress), "{error:?}");
    assert_eq!(error.status_code(), 409);
    assert!(took >= std::time::Duration::from_millis(190), "it waited: {took:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!D::in_transaction(&mut conn));
    assert!(
        D::session_is_idle(&mut admin, session),
        "the server sees no open transaction"
    );
    assert_eq!(
        D::lock_wait_setting(&mut conn),
        setting_before,
        "the session is as it was"
    );
    assert_ne!(
        db.key_lock_holder(&mut admin, SCOPE, "k-outlasted"),
        Some(session),
        "the waiter holds no lock"
    );
    let other = run_idempotent(&mut conn, SCOPE, "k-other", REQUEST, counted::<D>(&calls, "other"));
    assert!(
        matches!(other, Ok(Outcome::Executed(_))),
        "the connection is still usable: {other:?}"
    );

    let held = holder.finish(Release::Commit).expect("holder commits").into_inner();
    assert_eq!(
        db.key_lock_holder(&mut admin, SCOPE, "k-outlasted"),
        None,
        "released after the commit"
    );
    let retry =
        run_idempotent(&mut conn, SCOPE, "k-outlasted", REQUEST, counted::<D>(&calls, "waiter")).expect("retry");
    assert_eq!(retry, Outcome::Replayed(held));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the other key executed");
}

fn reject_policy_answers_in_progress_while_the_key_is_held<D: ServerDb>() {
    let db = D::new();
    let holder = Holder::claim(&db, "k-reject");
    let mut conn = db.conn();
    let setting_before = D::lock_wait_setting(&mut conn);
    let calls = AtomicUsize::new(0);

    let rejecting = Config::default().in_flight(InFlight::Reject);
    let started = Instant::now();
    let rejected = rejecting.run(&mut conn, SCOPE, "k-reject", REQUEST, counted::<D>(&calls, "rejected"));

    assert!(matches!(rejected, Err(Error::InProgress)), "{rejected:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(1), "at once");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!D::in_transaction(&mut conn));
    assert_eq!(D::lock_wait_setting(&mut conn), setting_before);
    let other = rejecting.run(&mut conn, SCOPE, "k-free", REQUEST, counted::<D>(&calls, "other"));
    assert!(
        matches!(other, Ok(Outcome::Executed(_))),
        "the connection is still usable: {other:?}"
    );

    holder.finish(Release::Commit).expect("holder commits");
    assert!(
        rejecting
            .run(&mut conn, SCOPE, "k-reject", REQUEST, counted::<D>(&calls, "rejected"))
            .expect("replay")
            .is_replayed()
    );
    assert_eq!(D::order_count(&mut conn), 2);
}

fn in_progress_inside_a_callers_transaction_leaves_that_transaction_usable<D: ServerDb>() {
    let db = D::new();
    let holder = Holder::claim(&db, "k-held");
    let mut conn = db.conn();
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(100)));
    let calls = AtomicUsize::new(0);
    conn.transaction(|tx| {
        D::place_order(tx, "before", 1)?;
        let setting = D::set_lock_wait_to_seven_seconds(tx)?;
        let waited = short_wait.run(tx, SCOPE, "k-held", REQUEST, counted::<D>(&calls, "waiter"));
        assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
        assert_eq!(D::lock_wait_setting(tx), setting, "the caller's own setting is back");
        D::place_order(tx, "after", 1)?;
        QueryResult::Ok(())
    })
    .expect("the caller's transaction commits");
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    holder.finish(Release::Commit).expect("holder commits");
    let mut items = D::order_items(&mut conn);
    items.sort();
    assert_eq!(items, ["after", "before", "holder"]);
}

fn top_level_holder_and_nested_waiter_serialize_on_one_lock<D: ServerDb>() {
    the_waiter_replays_the_holders_commit::<D>("k-mixed", top_level::<D>, nested::<D>);
}

fn expired_key_is_taken_over_by_exactly_one_of_sixteen_racing_requests<D: ServerDb>() {
    let db = D::new();
    let clock = ManualClock::new();
    let config = long_wait().retention(Duration::hours(1)).clock(clock.source());
    let first = config
        .run(&mut db.conn(), SCOPE, "k-raced", REQUEST, |tx| {
            D::place_order(tx, "first", 1)
        })
        .expect("first call")
        .into_inner();
    clock.advance(Duration::hours(2));

    let (outcomes, calls) = race_for_one_key(&db, &config, 16);

    assert_eq!(calls, 1, "the expired key executes exactly once");
    let value = assert_one_executed_and_all_saw_it(outcomes);
    assert_ne!(value, first, "the takeover is a new execution");
    let mut conn = db.conn();
    assert_eq!(D::order_count(&mut conn), 2);
    assert_eq!(D::key_count(&mut conn), 1);
}

/// Asserts that a crashed call left nothing, not even the lock of its key,
/// then that a retry executes exactly once and later retries replay it.
fn assert_crash_left_nothing_and_retry_executes_once<D: ServerDb>(db: &D, key: &str) {
    let mut conn = db.conn();
    D::await_order_writers(&mut conn);
    assert_eq!(D::key_count(&mut conn), 0, "no key record is left");
    assert_eq!(D::order_count(&mut conn), 0, "no domain row is left");
    assert_eq!(db.key_lock_holder(&mut conn, SCOPE, key), None, "no lock is left");
    let calls = AtomicUsize::new(0);
    let reject = Config::default().in_flight(InFlight::Reject);
    let retry = reject
        .run(&mut conn, SCOPE, key, REQUEST, counted::<D>(&calls, "retry"))
        .expect("retry");
    assert!(!retry.is_replayed(), "the retry executes");
    let again = reject
        .run(&mut conn, SCOPE, key, REQUEST, counted::<D>(&calls, "retry"))
        .expect("second retry");
    assert_eq!(again, Outcome::Replayed(retry.into_inner()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1);
}

fn killed_session_leaves_no_key_no_domain_row_and_no_lock<D: ServerDb>() {
    let db = D::new();
    let (id_tx, id_rx) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let mut worker_conn = db.conn();
    let worker = thread::spawn(move || {
        run_idempotent(&mut worker_conn, SCOPE, "k-killed-session", REQUEST, |tx| {
            let order_id = D::place_order(tx, "killed", 1)?;
            id_tx.send(D::session_id(tx)).expect("the test waits for the session");
            // Whatever the release says, the operation itself succeeds; the
            // storage under it is what fails.
            let _ = release_rx.recv();
            Ok::<_, DomainError>(order_id)
        })
    });
    let id = wait::recv(&id_rx, "the worker to run its operation");

    let mut admin = db.conn();
    D::kill_session(&mut admin, id);
    D::wait_until_gone(&mut admin, id);
    release.send(()).expect("the worker waits");
    let result = wait::join(worker, "the worker's thread");

    assert!(matches!(result, Err(Error::Storage(_))), "{result:?}");
    assert_crash_left_nothing_and_retry_executes_once(&db, "k-killed-session");
}

fn panic_on_a_lost_connection_still_reaches_the_caller<D: ServerDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut admin = db.conn();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_idempotent(&mut conn, SCOPE, "k-lost", REQUEST, |tx| {
            D::place_order(tx, "lost", 1)?;
            // The connection dies under the operation, so rolling back and
            // releasing the lock after the panic fail too; the panic must
            // not turn into an error.
            let id = D::session_id(tx);
            D::kill_session(&mut admin, id);
            D::wait_until_gone(&mut admin, id);
            panic!("the operation panics after its connection was lost");
            #[allow(unreachable_code)]
            Ok::<i64, DomainError>(0)
        })
    }));
    let payload = result.expect_err("the panic reaches the caller");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"the operation panics after its connection was lost")
    );
    assert_crash_left_nothing_and_retry_executes_once(&db, "k-lost");
}

/// The line the child prints once its operation runs, followed by its
/// session id.
const CRASH_CHILD_READY: &str = "crash-child-ready session=";
/// The key of the SIGKILL test.
const KILLED_KEY: &str = "k-killed-process";

/// The child: claims the key, writes its order, reports, and blocks until
/// it is killed.
fn crash_child<D: ServerDb>(url: &str) -> ! {
    let mut conn = D::Conn::establish(url).expect("child connects");
    let id = D::session_id(&mut conn);
    let _ = run_idempotent(
        &mut conn,
        SCOPE,
        KILLED_KEY,
        REQUEST,
        |tx| -> Result<i64, DomainError> {
            D::place_order(tx, "killed", 1)?;
            report_and_wait_for_the_kill(&format!("{CRASH_CHILD_READY}{id}"))
        },
    );
    unreachable!("the operation never returns");
}

fn killed_worker_process_leaves_no_key_and_no_domain_row<D: ServerDb>() {
    if let Some(url) = parent_database() {
        crash_child::<D>(&url);
    }
    let db = D::new();
    let test = test_name::<D>(module_path!(), "killed_worker_process_leaves_no_key_and_no_domain_row");
    let mut child = Child::start(&test, db.url());
    let id = child.wait_for("that its operation runs", |line| {
        line.split_once(CRASH_CHILD_READY)
            .map(|(_, id)| id.trim().parse::<i64>().expect("the child's session id"))
    });

    // The child really holds the key: another request finds it in progress.
    let mut conn = db.conn();
    let held = Config::default()
        .in_flight(InFlight::Reject)
        .run(&mut conn, SCOPE, KILLED_KEY, REQUEST, |_| Ok::<_, DomainError>(0));
    assert!(matches!(held, Err(Error::InProgress)), "{held:?}");
    assert_eq!(db.key_lock_holder(&mut conn, SCOPE, KILLED_KEY), Some(id));

    let status = child.kill();
    assert_eq!(
        status.code(),
        None,
        "the child was killed by a signal, not exited: {status:?}"
    );
    D::wait_until_gone(&mut conn, id);

    assert_crash_left_nothing_and_retry_executes_once(&db, KILLED_KEY);
}

fn panic_on_a_pooled_connection_returns_it_outside_a_transaction_and_without_the_lock<D: ServerDb>() {
    let db = D::new();
    let pool = db.pool(1);
    let mut pooled = pool.get().expect("the pool's connection");
    let id = D::session_id(&mut pooled);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = run_idempotent(
            &mut pooled,
            SCOPE,
            "k-pool-panic",
            REQUEST,
            |tx| -> Result<i64, DomainError> {
                D::place_order(tx, "panicked", 1)?;
                panic!("worker crashed mid-operation");
            },
        );
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    // Returned outside the unwinding, so the pool judges the connection by
    // its state alone and would discard one left in a transaction.
    drop(pooled);

    let mut admin = db.conn();
    assert!(
        D::session_is_idle(&mut admin, id),
        "the server sees no open transaction"
    );
    assert_eq!(
        db.key_lock_holder(&mut admin, SCOPE, "k-pool-panic"),
        None,
        "nor a lock"
    );
    let mut pooled = pool.get().expect("the pool's connection again");
    assert_eq!(D::session_id(&mut pooled), id, "the pool kept the connection");
    let retry = run_idempotent(&mut pooled, SCOPE, "k-pool-panic", REQUEST, |tx| {
        D::place_order(tx, "retry", 1)
    })
    .expect("retry");
    assert!(!retry.is_replayed());
    drop(pooled);
    assert_eq!(
        D::order_items(&mut admin),
        ["retry"],
        "the retry committed; the panicked order did not"
    );
    assert_eq!(D::key_count(&mut admin), 1);
}

fn duplicate_requests_under_load_execute_each_key_once<D: ServerDb>() {
    const THREADS: usize = 32;
    const POOL: u32 = 16;
    const REQUESTS: usize = 2_000;
    const KEYS: usize = 200;

    let mut prng = Prng(0x1de4_907e);
    // Every key at least once, the rest duplicates, in random order.
    let mut keys: Vec<usize> = (0..KEYS).chain((KEYS..REQUESTS).map(|_| prng.below(KEYS))).collect();
    for i in (1..keys.len()).rev() {
        keys.swap(i, prng.below(i + 1));
    }
    let requests: Vec<(String, u64)> = keys
        .into_iter()
        .map(|key| (format!("key-{key}"), 1 + prng.below(20) as u64))
        .collect();

    let db = D::new();
    let pool = db.pool(POOL);
    let barrier = Barrier::new(THREADS);
    let next = AtomicUsize::new(0);
    let (calls, executed, replayed, errors) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let seen: Mutex<HashMap<String, Vec<i64>>> = Mutex::new(HashMap::new());
    thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                barrier.wait();
                while let Some((key, millis)) = requests.get(next.fetch_add(1, Ordering::SeqCst)) {
                    let mut conn = pool.get().expect("pooled connection");
                    let result = run_idempotent(&mut conn, "load", key, key, |tx| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        // Simulated work, so that duplicates overlap.
                        thread::sleep(std::time::Duration::from_millis(*millis));
                        D::place_order(tx, key, 1)
                    });
                    let value = match result {
                        Ok(Outcome::Executed(value)) => {
                            executed.fetch_add(1, Ordering::SeqCst);
                            value
                        }
                        Ok(Outcome::Replayed(value)) => {
                            replayed.fetch_add(1, Ordering::SeqCst);
                            value
                        }
                        Err(error) => {
                            errors.fetch_add(1, Ordering::SeqCst);
                            eprintln!("{key}: {error:?}");
                            continue;
                        }
                    };
                    seen.lock()
                        .expect("no panics while locked")
                        .entry(key.clone())
                        .or_default()
                        .push(value);
                }
            });
        }
    });

    let (executed, replayed, errors) = (executed.into_inner(), replayed.into_inner(), errors.into_inner());
    println!("{REQUESTS} requests over {KEYS} keys: {executed} executed, {replayed} replayed, {errors} errors");
    assert_eq!(errors, 0);
    assert_eq!(executed, KEYS);
    assert_eq!(replayed, REQUESTS - KEYS);
    assert_eq!(calls.into_inner(), KEYS, "each key's operation ran once");

    let mut conn = db.conn();
    // Per key: how many orders, and the first one's id.
    let mut rows: HashMap<String, (i64, i64)> = HashMap::new();
    for (id, item) in D::orders(&mut conn) {
        let row = rows.entry(item).or_insert((0, id));
        row.0 += 1;
        row.1 = row.1.min(id);
    }
    assert_eq!(rows.len(), KEYS);
    let seen = seen.into_inner().expect("no panics while locked");
    for (key, (count, order_id)) in rows {
        assert_eq!(count, 1, "{key} has one order");
        let values = &seen[&key];
        assert!(
            values.iter().all(|value| *value == order_id),
            "every caller of {key} saw its order: {values:?}"
        );
    }
    assert_eq!(seen.values().map(Vec::len).sum::<usize>(), REQUESTS);
    assert_eq!(D::key_count(&mut conn), KEYS as i64);
}

fn operation_runs_at_the_sessions_own_isolation_level<D: ServerDb>() {
    let db = D::new();
    for isolation in Isolation::ALL {
        let mut conn = db.session_at(isolation);
        let key = format!("k-{isolation:?}");
        let seen = run_idempotent(&mut conn, SCOPE, &key, REQUEST, D::isolation).expect("executes");
        assert_eq!(
            seen,
            Outcome::Executed(D::isolation_name(isolation)),
            "never weakened, never changed"
        );
        let again = run_idempotent(&mut conn, SCOPE, &key, REQUEST, D::isolation).expect("replays");
        assert!(again.is_replayed());
        assert_eq!(
            D::isolation(&mut conn).expect("the level"),
            D::isolation_name(isolation)
        );
    }
}
