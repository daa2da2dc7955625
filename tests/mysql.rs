//! What only a real MySQL or MariaDB server shows: requests waiting for a key
//! another call holds, by its named lock or by the row of a caller's
//! uncommitted claim; takeover races; workers whose connection or process
//! dies mid-operation; pools; callers' isolation levels; deadlocks; load;
//! and what the key table holds.
//!
//! Threads are ordered by channels, barriers and the server's own view of
//! who waits for what (the process list and `innodb_trx`), never by sleeping
//! for a guessed time.

#![cfg(feature = "mysql")]

// This file uses the MySQL helpers, not the backend macro.
mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::thread;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idempotency::outbox::{self, Relay};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, KeyError, Outcome, run_idempotent};

use common::mysql::*;
use common::{TestDb, orders};

const SCOPE: &str = "shop";
const REQUEST: &str = "place one book";

#[derive(Debug, PartialEq)]
enum DomainError {
    Refused,
    Db(String),
}

impl From<DieselError> for DomainError {
    fn from(error: DieselError) -> Self {
        DomainError::Db(error.to_string())
    }
}

type CallResult = Result<Outcome<i64>, Error<DomainError>>;

/// An operation that counts its calls and places an order.
fn counted<'a>(
    calls: &'a AtomicUsize,
    item: &'a str,
) -> impl FnOnce(&mut MysqlConnection) -> Result<i64, DomainError> + 'a {
    move |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok(Db::place_order(tx, item, 1)?)
    }
}

fn long_wait() -> Config {
    Config::default().in_flight(InFlight::Wait(Duration::seconds(30)))
}

fn is_deadlock<T: std::fmt::Debug>(result: &Result<T, Error<DomainError>>) -> bool {
    matches!(
        result,
        Err(Error::Storage(DieselError::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            _
        )))
    )
}

/// The session's `innodb_lock_wait_timeout`.
fn lock_wait_timeout(conn: &mut MysqlConnection) -> i64 {
    diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "@@SESSION.innodb_lock_wait_timeout",
    ))
    .get_result(conn)
    .expect("read innodb_lock_wait_timeout")
}

/// How a holder's operation, or a caller's transaction, ends once released.
enum Release {
    Commit,
    Fail,
}

/// A call that has claimed a key on a connection of its own, written its
/// order, and holds the uncommitted transaction (and the key's named lock)
/// until released. A holder dropped unreleased fails its operation, so a
/// failing test does not leave it blocked.
struct Holder {
    release: mpsc::Sender<Release>,
    thread: thread::JoinHandle<CallResult>,
}

impl Holder {
    /// Returns once the holder's operation runs, so the key is held.
    fn claim(db: &Db, key: &str) -> Holder {
        Holder::claim_with(db, key, Config::default())
    }

    fn claim_with(db: &Db, key: &str, config: Config) -> Holder {
        let (claimed_tx, claimed_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let mut conn = db.conn();
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            config.run(&mut conn, SCOPE, &key, REQUEST, move |tx| {
                let order_id = Db::place_order(tx, "holder", 1)?;
                claimed_tx.send(()).expect("the test waits for the claim");
                match release_rx.recv() {
                    Ok(Release::Commit) => Ok(order_id),
                    Ok(Release::Fail) | Err(_) => Err(DomainError::Refused),
                }
            })
        });
        claimed_rx
            .recv()
            .expect("the holder claims the key and runs its operation");
        Holder { release, thread }
    }

    fn finish(self, how: Release) -> CallResult {
        self.release.send(how).expect("the holder waits for its release");
        self.thread.join().expect("the holder thread does not panic")
    }
}

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
        executed_rx.recv().expect("the nested call finishes");
        Caller { release, thread }
    }

    fn finish(self, how: Release) -> CallResult {
        self.release.send(how).expect("the caller waits for its release");
        self.thread.join().expect("the caller thread does not panic")
    }
}

/// A second request for a held key, on its own thread and connection, that
/// returns its connection with its result; in a caller's transaction if
/// `nested`. The test learns its server thread to see it wait.
struct Waiter {
    id: u64,
    calls: Arc<AtomicUsize>,
    thread: thread::JoinHandle<(MysqlConnection, CallResult)>,
}

impl Waiter {
    fn start(db: &Db, key: &str, config: Config, nested: bool) -> Waiter {
        let mut conn = db.conn();
        let id = connection_id(&mut conn);
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            let op = counted(&counter, "waiter");
            let result = if nested {
                conn.transaction(|tx| config.run(tx, SCOPE, &key, REQUEST, op))
            } else {
                config.run(&mut conn, SCOPE, &key, REQUEST, op)
            };
            (conn, result)
        });
        Waiter { id, calls, thread }
    }

    fn join(self) -> (MysqlConnection, CallResult, usize) {
        let (conn, result) = self.thread.join().expect("the waiter thread does not panic");
        (conn, result, self.calls.load(Ordering::SeqCst))
    }
}

#[test]
fn waiter_replays_when_the_holder_commits_within_the_wait() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-commit");
    let waiter = Waiter::start(&db, "k-commit", long_wait(), false);
    wait_until_waiting_for_named_lock(&mut admin, waiter.id);

    let held = holder.finish(Release::Commit).expect("holder commits");
    let (mut conn, waited, calls) = waiter.join();

    let Outcome::Executed(order_id) = held else {
        panic!("the holder executes, got {held:?}")
    };
    assert_eq!(waited.expect("the waiter replays"), Outcome::Replayed(order_id));
    assert_eq!(calls, 0, "the waiter's operation is never called");
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn waiter_executes_when_the_holder_rolls_back() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-rollback");
    let waiter = Waiter::start(&db, "k-rollback", long_wait(), false);
    wait_until_waiting_for_named_lock(&mut admin, waiter.id);

    let held = holder.finish(Release::Fail);
    let (mut conn, waited, calls) = waiter.join();

    assert!(matches!(held, Err(Error::Operation(DomainError::Refused))), "{held:?}");
    assert!(
        matches!(waited, Ok(Outcome::Executed(_))),
        "the waiter takes the freed key: {waited:?}"
    );
    assert_eq!(calls, 1);
    assert_eq!(Db::order_items(&mut conn), ["waiter"], "only the waiter's order exists");
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn waiter_gets_in_progress_when_the_holder_outlasts_the_wait() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-long");
    let mut conn = db.conn();
    let mut admin = db.conn();
    let id = connection_id(&mut conn);
    let timeout_before = lock_wait_timeout(&mut conn);
    let calls = AtomicUsize::new(0);

    // The holder is released only after this returns, so it outlasts any wait.
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(200)));
    let started = std::time::Instant::now();
    let waited = short_wait.run(&mut conn, SCOPE, "k-long", REQUEST, counted(&calls, "waiter"));
    let took = started.elapsed();

    let Err(error) = waited else {
        panic!("the waiter gives up, got {waited:?}")
    };
    assert!(matches!(error, Error::InProgress), "{error:?}");
    assert_eq!(error.status_code(), 409);
    assert!(took >= std::time::Duration::from_millis(190), "it waited: {took:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    assert_eq!(open_write_transactions(&mut admin, id), 0);
    assert_eq!(lock_wait_timeout(&mut conn), timeout_before, "the session is as it was");
    let lock = lock_name(db.name(), SCOPE, "k-long");
    assert_ne!(
        named_lock_holder(&mut admin, &lock),
        Some(id),
        "the waiter holds no lock"
    );
    let other = run_idempotent(&mut conn, SCOPE, "k-other", REQUEST, counted(&calls, "other"));
    assert!(
        matches!(other, Ok(Outcome::Executed(_))),
        "the connection is still usable: {other:?}"
    );

    let held = holder.finish(Release::Commit).expect("holder commits").into_inner();
    assert_eq!(named_lock_holder(&mut admin, &lock), None, "released after the commit");
    let retry = run_idempotent(&mut conn, SCOPE, "k-long", REQUEST, counted(&calls, "waiter")).expect("retry");
    assert_eq!(retry, Outcome::Replayed(held));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the other key executed");
}

#[test]
fn reject_policy_answers_in_progress_while_the_key_is_held() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-reject");
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);

    let rejecting = Config::default().in_flight(InFlight::Reject);
    let started = std::time::Instant::now();
    let rejected = rejecting.run(&mut conn, SCOPE, "k-reject", REQUEST, counted(&calls, "rejected"));

    assert!(matches!(rejected, Err(Error::InProgress)), "{rejected:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(1), "at once");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    let other = rejecting.run(&mut conn, SCOPE, "k-free", REQUEST, counted(&calls, "other"));
    assert!(
        matches!(other, Ok(Outcome::Executed(_))),
        "the connection is still usable: {other:?}"
    );

    holder.finish(Release::Commit).expect("holder commits");
    assert!(
        rejecting
            .run(&mut conn, SCOPE, "k-reject", REQUEST, counted(&calls, "rejected"))
            .expect("replay")
            .is_replayed()
    );
    assert_eq!(Db::order_count(&mut conn), 2);
}

#[test]
fn in_progress_inside_a_callers_transaction_leaves_that_transaction_usable() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-held");
    let mut conn = db.conn();
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(100)));
    let calls = AtomicUsize::new(0);
    conn.transaction(|tx| {
        Db::place_order(tx, "before", 1)?;
        let waited = short_wait.run(tx, SCOPE, "k-held", REQUEST, counted(&calls, "waiter"));
        assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
        Db::place_order(tx, "after", 1)?;
        QueryResult::Ok(())
    })
    .expect("the caller's transaction commits");
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    holder.finish(Release::Commit).expect("holder commits");
    let mut items = Db::order_items(&mut conn);
    items.sort();
    assert_eq!(items, ["after", "before", "holder"]);
}

/// Runs `THREADS` requests with one key over a pool at once and returns
/// their results with how often the operation ran.
fn race_for_one_key(db: &Db, config: &Config, threads: usize) -> (Vec<CallResult>, usize) {
    let pool = db.pool(threads as u32);
    let barrier = Barrier::new(threads);
    let calls = AtomicUsize::new(0);
    let outcomes = thread::scope(|s| {
        let racers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut conn = pool.get().expect("pooled connection");
                    barrier.wait();
                    config.run(&mut conn, SCOPE, "k-raced", REQUEST, |tx| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        // Work that keeps the key held while the others arrive.
                        thread::sleep(std::time::Duration::from_millis(20));
                        Ok::<_, DomainError>(Db::place_order(tx, "raced", 1)?)
                    })
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|racer| racer.join().expect("racer does not panic"))
            .collect()
    });
    (outcomes, calls.into_inner())
}

#[test]
fn sixteen_requests_racing_for_a_fresh_key_execute_it_once() {
    let db = Db::new();
    let (outcomes, calls) = race_for_one_key(&db, &long_wait(), 16);

    assert_eq!(calls, 1, "the operation ran once");
    let outcomes: Vec<Outcome<i64>> = outcomes
        .into_iter()
        .map(|outcome| outcome.expect("every racer succeeds"))
        .collect();
    assert_eq!(outcomes.iter().filter(|outcome| !outcome.is_replayed()).count(), 1);
    let value = outcomes[0].clone().into_inner();
    assert!(outcomes.into_iter().all(|outcome| outcome.into_inner() == value));
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn expired_key_is_taken_over_by_exactly_one_of_sixteen_racing_requests() {
    let db = Db::new();
    let clock = ManualClock::new();
    let config = long_wait().retention(Duration::hours(1)).clock(clock.source());
    let first = config
        .run(&mut db.conn(), SCOPE, "k-raced", REQUEST, |tx| {
            Db::place_order(tx, "first", 1)
        })
        .expect("first call")
        .into_inner();
    clock.advance(Duration::hours(2));

    let (outcomes, calls) = race_for_one_key(&db, &config, 16);

    assert_eq!(calls, 1, "the expired key executes exactly once");
    let outcomes: Vec<Outcome<i64>> = outcomes
        .into_iter()
        .map(|outcome| outcome.expect("every racer succeeds"))
        .collect();
    assert_eq!(outcomes.iter().filter(|outcome| !outcome.is_replayed()).count(), 1);
    let value = outcomes[0].clone().into_inner();
    assert_ne!(value, first, "the takeover is a new execution");
    assert!(outcomes.into_iter().all(|outcome| outcome.into_inner() == value));
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2);
    assert_eq!(Db::key_count(&mut conn), 1);
}

/// Asserts that a crashed call left nothing, not even its named lock, then
/// that a retry executes exactly once and later retries replay it.
fn assert_crash_left_nothing_and_retry_executes_once(db: &Db, key: &str) {
    let mut conn = db.conn();
    Db::await_order_writers(&mut conn);
    assert_eq!(Db::key_count(&mut conn), 0, "no key record is left");
    assert_eq!(Db::order_count(&mut conn), 0, "no domain row is left");
    assert_eq!(
        named_lock_holder(&mut conn, &lock_name(db.name(), SCOPE, key)),
        None,
        "no named lock is left"
    );
    let calls = AtomicUsize::new(0);
    let reject = Config::default().in_flight(InFlight::Reject);
    let retry = reject
        .run(&mut conn, SCOPE, key, REQUEST, counted(&calls, "retry"))
        .expect("retry");
    assert!(!retry.is_replayed(), "the retry executes");
    let again = reject
        .run(&mut conn, SCOPE, key, REQUEST, counted(&calls, "retry"))
        .expect("second retry");
    assert_eq!(again, Outcome::Replayed(retry.into_inner()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn killed_connection_leaves_no_key_no_domain_row_and_no_lock() {
    let db = Db::new();
    let (id_tx, id_rx) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let mut worker_conn = db.conn();
    let worker = thread::spawn(move || {
        run_idempotent(&mut worker_conn, SCOPE, "k-killed", REQUEST, |tx| {
            let order_id = Db::place_order(tx, "killed", 1)?;
            id_tx.send(connection_id(tx)).expect("the test waits for the id");
            // Whatever the release says, the operation itself succeeds; the
            // storage under it is what fails.
            let _ = release_rx.recv();
            Ok::<_, DomainError>(order_id)
        })
    });
    let id = id_rx.recv().expect("the worker runs its operation");

    let mut admin = db.conn();
    admin
        .batch_execute(&format!("KILL CONNECTION {id}"))
        .expect("kill the worker's connection");
    wait_until_connection_gone(&mut admin, id);
    release.send(()).expect("the worker waits");
    let result = worker.join().expect("the worker does not panic");

    assert!(matches!(result, Err(Error::Storage(_))), "{result:?}");
    assert_crash_left_nothing_and_retry_executes_once(&db, "k-killed");
}

#[test]
fn panic_on_a_lost_connection_still_reaches_the_caller() {
    let db = Db::new();
    let mut conn = db.conn();
    let mut admin = db.conn();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_idempotent(&mut conn, SCOPE, "k-lost", REQUEST, |tx| {
            Db::place_order(tx, "lost", 1)?;
            // The connection dies under the operation, so rolling back and
            // releasing the lock after the panic fail too; the panic must
            // not turn into an error.
            let id = connection_id(tx);
            admin.batch_execute(&format!("KILL CONNECTION {id}"))?;
            wait_until_connection_gone(&mut admin, id);
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

/// Set in the child process of the SIGKILL test: the url of the parent's
/// test database.
const CRASH_CHILD_URL: &str = "IDEMPOTENCY_TEST_MYSQL_CRASH_CHILD_URL";
/// The line the child prints once its operation runs, followed by its
/// server thread id.
const CRASH_CHILD_READY: &str = "crash-child-ready thread=";

/// The child: claims the key, writes its order, reports, and blocks until
/// it is killed.
fn crash_child(url: &str) -> ! {
    let mut conn = MysqlConnection::establish(url).expect("child connects");
    let id = connection_id(&mut conn);
    let _ = run_idempotent(
        &mut conn,
        SCOPE,
        "k-killed",
        REQUEST,
        |tx| -> Result<i64, DomainError> {
            Db::place_order(tx, "killed", 1)?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "\n{CRASH_CHILD_READY}{id}").expect("write to the parent");
            out.flush().expect("flush to the parent");
            loop {
                thread::park();
            }
        },
    );
    unreachable!("the operation never returns");
}

/// Kills the child if the test fails before it does: a child left alive
/// would keep its transaction open and block dropping the test database.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn killed_worker_process_leaves_no_key_and_no_domain_row() {
    if let Ok(url) = std::env::var(CRASH_CHILD_URL) {
        crash_child(&url);
    }
    let db = Db::new();
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "killed_worker_process_leaves_no_key_and_no_domain_row",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_CHILD_URL, db.url())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the child"),
    );
    let stdout = child.0.stdout.take().expect("the child's stdout");
    let id = BufReader::new(stdout)
        .lines()
        .map(|line| line.expect("read the child's output"))
        .find_map(|line| {
            line.split_once(CRASH_CHILD_READY)
                .map(|(_, id)| id.trim().parse::<u64>())
        })
        .expect("the child reports that its operation runs")
        .expect("the child's server thread id");

    // The child really holds the key: another request finds it in progress.
    let mut conn = db.conn();
    let held = Config::default()
        .in_flight(InFlight::Reject)
        .run(&mut conn, SCOPE, "k-killed", REQUEST, |_| Ok::<_, DomainError>(0));
    assert!(matches!(held, Err(Error::InProgress)), "{held:?}");
    assert_eq!(
        named_lock_holder(&mut conn, &lock_name(db.name(), SCOPE, "k-killed")),
        Some(id)
    );

    child.0.kill().expect("SIGKILL the child");
    let status = child.0.wait().expect("reap the child");
    assert_eq!(
        status.code(),
        None,
        "the child was killed by a signal, not exited: {status:?}"
    );
    wait_until_connection_gone(&mut conn, id);

    assert_crash_left_nothing_and_retry_executes_once(&db, "k-killed");
}

#[test]
fn panic_on_a_pooled_connection_returns_it_outside_a_transaction_and_without_the_lock() {
    let db = Db::new();
    let pool = db.pool(1);
    let mut pooled = pool.get().expect("the pool's connection");
    let id = connection_id(&mut pooled);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = run_idempotent(
            &mut pooled,
            SCOPE,
            "k-pool-panic",
            REQUEST,
            |tx| -> Result<i64, DomainError> {
                Db::place_order(tx, "panicked", 1)?;
                panic!("worker crashed mid-operation");
            },
        );
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    // Returned outside the unwinding, so the pool judges the connection by
    // its state alone and would discard one left in a transaction.
    drop(pooled);

    let mut admin = db.conn();
    assert_eq!(
        open_write_transactions(&mut admin, id),
        0,
        "the server sees no open transaction"
    );
    assert_eq!(
        named_lock_holder(&mut admin, &lock_name(db.name(), SCOPE, "k-pool-panic")),
        None,
        "nor a named lock"
    );
    let mut pooled = pool.get().expect("the pool's connection again");
    assert_eq!(connection_id(&mut pooled), id, "the pool kept the connection");
    let retry = run_idempotent(&mut pooled, SCOPE, "k-pool-panic", REQUEST, |tx| {
        Db::place_order(tx, "retry", 1)
    })
    .expect("retry");
    assert!(!retry.is_replayed());
    drop(pooled);
    assert_eq!(
        Db::order_items(&mut admin),
        ["retry"],
        "the retry committed; the panicked order did not"
    );
    assert_eq!(Db::key_count(&mut admin), 1);
}

/// splitmix64: deterministic, so a failing run can be repeated.
struct Prng(u64);

impl Prng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn duplicate_requests_under_load_execute_each_key_once() {
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

    let db = Db::new();
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
                        Db::place_order(tx, key, 1)
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
    let rows: Vec<(String, i64, Option<i64>)> = orders::table
        .group_by(orders::item)
        .select((orders::item, diesel::dsl::count_star(), diesel::dsl::min(orders::id)))
        .load(&mut conn)
        .expect("orders per key");
    assert_eq!(rows.len(), KEYS);
    let seen = seen.into_inner().expect("no panics while locked");
    for (key, count, order_id) in rows {
        assert_eq!(count, 1, "{key} has one order");
        let values = &seen[&key];
        assert!(
            values.iter().all(|value| Some(*value) == order_id),
            "every caller of {key} saw its order: {values:?}"
        );
    }
    assert_eq!(seen.values().map(Vec::len).sum::<usize>(), REQUESTS);
    assert_eq!(Db::key_count(&mut conn), KEYS as i64);
}

/// The case every call claims its key first for: a nested call finished
/// and gave its named lock back, its claim still uncommitted in the caller's
/// transaction. A top-level request gets the lock, and its claim waits for
/// the caller's row.
#[test]
fn top_level_waiter_replays_a_callers_nested_call_once_the_caller_commits() {
    let db = Db::new();
    let mut admin = db.conn();
    let caller = Caller::executed(&db, "k-nested");
    let waiter = Waiter::start(&db, "k-nested", long_wait(), false);
    wait_until_waiting_for_row_lock(&mut admin, waiter.id);

    let executed = caller.finish(Release::Commit).expect("the caller commits").into_inner();
    let (mut conn, waited, calls) = waiter.join();
    assert_eq!(waited.expect("the waiter replays"), Outcome::Replayed(executed));
    assert_eq!(calls, 0, "the waiter's operation never ran");
    assert_eq!(Db::order_count(&mut conn), 1);
}

#[test]
fn top_level_waiter_executes_once_the_caller_of_a_nested_call_rolls_back() {
    let db = Db::new();
    let mut admin = db.conn();
    let caller = Caller::executed(&db, "k-nested");
    let waiter = Waiter::start(&db, "k-nested", long_wait(), false);
    wait_until_waiting_for_row_lock(&mut admin, waiter.id);

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

    let waited = long_wait().run(&mut conn, SCOPE, "k-nested", REQUEST, counted(&calls, "waiter"));

    assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    assert_eq!(open_write_transactions(&mut admin, id), 0);
    assert_eq!(lock_wait_timeout(&mut conn), 1, "the session's own setting");
    assert_eq!(
        named_lock_holder(&mut admin, &lock_name(db.name(), SCOPE, "k-nested")),
        None
    );
    let other = run_idempotent(&mut conn, SCOPE, "k-other", REQUEST, counted(&calls, "other"));
    assert!(matches!(other, Ok(Outcome::Executed(_))), "usable: {other:?}");

    let executed = caller.finish(Release::Commit).expect("the caller commits").into_inner();
    let retry = run_idempotent(&mut conn, SCOPE, "k-nested", REQUEST, counted(&calls, "waiter"));
    assert_eq!(retry.expect("the retry replays"), Outcome::Replayed(executed));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the other key executed");
}

#[test]
fn top_level_holder_and_nested_waiter_serialize_on_one_lock() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-mixed");
    let waiter = Waiter::start(&db, "k-mixed", long_wait(), true);
    wait_until_waiting_for_named_lock(&mut admin, waiter.id);

    let held = holder.finish(Release::Commit).expect("the holder commits").into_inner();
    let (mut conn, waited, calls) = waiter.join();
    assert_eq!(waited.expect("the nested waiter replays"), Outcome::Replayed(held));
    assert_eq!(calls, 0, "the waiter's operation never ran");
    assert_eq!(Db::order_count(&mut conn), 1);
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
    let id = connection_id(&mut conn);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let waiter = thread::spawn(move || {
        // InnoDB's default level, REPEATABLE READ.
        let result = conn.transaction(|tx| {
            // The snapshot is taken here, before the holder commits.
            let before = Db::order_count(tx);
            let outcome = long_wait().run(tx, SCOPE, "k-snapshot", REQUEST, counted(&counter, "waiter"))?;
            Ok::<_, Error<DomainError>>((before, outcome, Db::order_count(tx)))
        });
        (conn, result)
    });
    wait_until_waiting_for_named_lock(&mut admin, id);

    let held = holder.finish(Release::Commit).expect("the holder commits").into_inner();
    let (mut conn, result) = waiter.join().expect("the waiter does not panic");
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
    let waiters: Vec<Waiter> = (0..2)
        .map(|_| Waiter::start(&db, "k-two", long_wait(), nested))
        .collect();
    for waiter in &waiters {
        wait_until_waiting_for_named_lock(&mut admin, waiter.id);
    }

    assert!(holder.finish(Release::Fail).is_err());
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
                    let a = long_wait().run(tx, SCOPE, first, first, counted(&calls, first))?;
                    barrier.wait();
                    let b = long_wait().run(tx, SCOPE, second, second, counted(&calls, second))?;
                    Ok::<_, Error<DomainError>>((a, b))
                });
                let in_transaction = Db::in_transaction(&mut conn);
                (result, in_transaction)
            })
        })
        .collect();
    let ids: Vec<u64> = (0..2).map(|_| ids_rx.recv().expect("a caller's id")).collect();
    let results: Vec<_> = callers
        .into_iter()
        .map(|caller| caller.join().expect("a caller does not panic"))
        .collect();

    let victims = results.iter().filter(|(result, _)| is_deadlock(result)).count();
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

#[derive(Clone, Copy, Debug)]
enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    /// How SQL names the level.
    fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }

    /// How the server reports the level.
    fn reported(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ-COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE-READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A connection whose session runs its transactions at `isolation`.
fn session_at(db: &Db, isolation: Isolation) -> MysqlConnection {
    let mut conn = db.conn();
    conn.batch_execute(&format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", isolation.sql()))
        .expect("set the session's isolation level");
    conn
}

/// The isolation level of the session: MySQL 8 calls the variable
/// `transaction_isolation`, MariaDB `tx_isolation`.
fn session_isolation(conn: &mut MysqlConnection) -> QueryResult<String> {
    let read = |conn: &mut MysqlConnection, variable: &str| {
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Text>(&format!(
            "@@SESSION.{variable}"
        )))
        .get_result::<String>(conn)
    };
    read(conn, "transaction_isolation").or_else(|_| read(conn, "tx_isolation"))
}

#[test]
fn operation_runs_at_the_sessions_own_isolation_level() {
    let db = Db::new();
    for isolation in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        let mut conn = session_at(&db, isolation);
        let key = format!("k-{isolation:?}");
        let seen = run_idempotent(&mut conn, SCOPE, &key, REQUEST, session_isolation).expect("executes");
        assert_eq!(
            seen,
            Outcome::Executed(isolation.reported().to_owned()),
            "never changed"
        );
        let again = run_idempotent(&mut conn, SCOPE, &key, REQUEST, session_isolation).expect("replays");
        assert!(again.is_replayed());
        assert_eq!(session_isolation(&mut conn).expect("the level"), isolation.reported());
    }
}

/// Two requests with one key, round after round, released together from
/// sessions at `isolation`, top level or each in a caller's transaction.
/// The operation runs once per key. A caller whose transaction is rolled
/// back by a deadlock retries it, as deadlocks ask, and replays.
fn racing_calls_execute_each_key_once(isolation: Isolation, nested: bool) {
    const ROUNDS: usize = 20;
    let db = Db::new();
    let barrier = Barrier::new(2);
    let calls: Vec<AtomicUsize> = (0..ROUNDS).map(|_| AtomicUsize::new(0)).collect();
    let deadlocks = AtomicUsize::new(0);
    let call = |conn: &mut MysqlConnection, round: usize| {
        let key = format!("k-{round}");
        let op = counted(&calls[round], "racer");
        if nested {
            conn.transaction(|tx| long_wait().run(tx, SCOPE, &key, REQUEST, op))
        } else {
            long_wait().run(conn, SCOPE, &key, REQUEST, op)
        }
    };
    let values: Vec<Vec<i64>> = thread::scope(|s| {
        let racers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut conn = session_at(&db, isolation);
                    (0..ROUNDS)
                        .map(|round| {
                            barrier.wait();
                            let result = call(&mut conn, round);
                            if is_deadlock(&result) {
                                deadlocks.fetch_add(1, Ordering::SeqCst);
                                let retry = call(&mut conn, round).expect("the retry");
                                assert!(retry.is_replayed(), "{isolation:?} round {round}: {retry:?}");
                                return retry.into_inner();
                            }
                            match result {
                                Ok(outcome) => outcome.into_inner(),
                                Err(error) => panic!("{isolation:?} round {round}: {error:?}"),
                            }
                        })
                        .collect()
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|racer| racer.join().expect("racer does not panic"))
            .collect()
    });
    println!(
        "{isolation:?}, nested {nested}: {} of {ROUNDS} races ended in a deadlock",
        deadlocks.into_inner()
    );
    for round in 0..ROUNDS {
        assert_eq!(calls[round].load(Ordering::SeqCst), 1, "{isolation:?} round {round}");
        assert_eq!(values[0][round], values[1][round], "{isolation:?} round {round}");
    }
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), ROUNDS as i64);
    assert_eq!(Db::key_count(&mut conn), ROUNDS as i64);
}

#[test]
fn racing_calls_from_sessions_at_every_level_execute_each_key_once() {
    for isolation in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        racing_calls_execute_each_key_once(isolation, false);
    }
}

#[test]
fn callers_racing_in_transactions_at_every_level_execute_each_key_once() {
    for isolation in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
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
    let outcome = reject.run(&mut other.conn(), SCOPE, "k-shared", REQUEST, counted(&calls, "other"));
    assert!(!outcome.expect("not held up").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    holder.finish(Release::Commit).expect("the holder commits");
}

#[test]
fn key_longer_than_the_key_column_is_refused_not_cut() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().max_key_len(1000);
    let calls = AtomicUsize::new(0);
    let long = "k".repeat(256);

    let refused = config.run(&mut conn, SCOPE, &long, REQUEST, counted(&calls, "long"));
    assert!(
        matches!(
            refused,
            Err(Error::InvalidKey(KeyError::TooLong { len: 256, max: 255 }))
        ),
        "{refused:?}"
    );
    let refused = config.run(&mut conn, &long, "k", REQUEST, counted(&calls, "long"));
    assert!(
        matches!(
            refused,
            Err(Error::InvalidScope(KeyError::TooLong { len: 256, max: 255 }))
        ),
        "{refused:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(Db::key_count(&mut conn), 0);

    let longest = "k".repeat(255);
    assert!(
        !config
            .run(&mut conn, &longest, &longest, REQUEST, counted(&calls, "longest"))
            .expect("fits")
            .is_replayed()
    );
    assert!(
        config
            .run(&mut conn, &longest, &longest, REQUEST, counted(&calls, "longest"))
            .expect("replays")
            .is_replayed()
    );
    let phased =
        idempotency::phased::Phased::new("long")
            .config(config.clone())
            .run(&mut conn, SCOPE, &long, &1, |steps| {
                steps.finish(|_| Ok::<_, std::convert::Infallible>(1))
            });
    assert!(
        matches!(phased, Err(Error::InvalidKey(KeyError::TooLong { max: 255, .. }))),
        "{phased:?}"
    );
}

#[test]
fn keys_differing_in_case_are_different_keys() {
    let db = Db::new();
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);
    let upper = run_idempotent(&mut conn, SCOPE, "Order-1", REQUEST, counted(&calls, "upper")).expect("executes");
    let lower = run_idempotent(&mut conn, SCOPE, "order-1", REQUEST, counted(&calls, "lower")).expect("executes");
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
    let stored = run_idempotent(&mut conn, SCOPE, "k-big", REQUEST, |tx| {
        outbox::enqueue(tx, "big", &body)?;
        Ok::<_, outbox::Error>(body.clone())
    });
    assert!(!stored.expect("executes").is_replayed());
    let replayed = run_idempotent(&mut conn, SCOPE, "k-big", REQUEST, |_| {
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
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 0);
}

/// A purge passes over an expired record that a live call is taking over at
/// that moment instead of waiting for the call, and deletes the others.
#[test]
fn purge_passes_over_an_expired_record_a_live_call_is_taking_over() {
    let db = Db::new();
    let clock = ManualClock::new();
    let config = Config::default().retention(Duration::hours(1)).clock(clock.source());
    let mut conn = db.conn();
    for key in ["k-taken-over", "k-1", "k-2", "k-3"] {
        config
            .run(&mut conn, SCOPE, key, REQUEST, |_| Ok::<_, DomainError>(0))
            .expect("an old call");
    }
    clock.advance(Duration::hours(2));
    let holder = Holder::claim_with(&db, "k-taken-over", config.clone());

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
