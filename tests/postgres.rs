//! What only a real PostgreSQL server shows: requests waiting for a key
//! another transaction holds, takeover races, workers whose backend or
//! process dies mid-operation, pools, callers' isolation levels, load, and
//! the `lock_timeout` the claim borrows.
//!
//! Threads are ordered by channels, barriers and the server's own view of
//! who waits for a lock (`pg_locks`), never by sleeping for a guessed time.

#![cfg(feature = "postgres")]

// This file uses the PostgreSQL helpers, not the two-backend macro.
mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::thread;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, KeyError, Outcome, run_idempotent};

use common::pg::*;
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
) -> impl FnOnce(&mut PgConnection) -> Result<i64, DomainError> + 'a {
    move |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok(Db::place_order(tx, item, 1)?)
    }
}

#[derive(Clone, Copy, Debug)]
enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    /// How PostgreSQL names the level.
    fn name(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read committed",
            Isolation::RepeatableRead => "repeatable read",
            Isolation::Serializable => "serializable",
        }
    }
}

/// Runs `f` in a transaction of the caller's at `isolation`.
fn in_caller_transaction<T, E>(
    conn: &mut PgConnection,
    isolation: Isolation,
    f: impl FnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<DieselError>,
{
    match isolation {
        Isolation::ReadCommitted => conn.build_transaction().read_committed().run(f),
        Isolation::RepeatableRead => conn.build_transaction().repeatable_read().run(f),
        Isolation::Serializable => conn.build_transaction().serializable().run(f),
    }
}

/// A connection whose session runs its transactions at `isolation`.
fn session_at(db: &Db, isolation: Isolation) -> PgConnection {
    let mut conn = db.conn();
    conn.batch_execute(&format!(
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {}",
        isolation.name()
    ))
    .expect("set the session's isolation level");
    conn
}

/// The isolation level of the transaction `conn` is in.
fn transaction_isolation(conn: &mut PgConnection) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Level {
        #[diesel(sql_type = diesel::sql_types::Text)]
        level: String,
    }
    Ok(
        diesel::sql_query("SELECT current_setting('transaction_isolation') AS level")
            .get_result::<Level>(conn)?
            .level,
    )
}

/// How a holder's operation ends once released.
enum Release {
    Commit,
    Fail,
}

/// A call that has claimed a key on a connection of its own, written its
/// order, and holds the uncommitted transaction until released.
struct Holder {
    release: mpsc::Sender<Release>,
    thread: thread::JoinHandle<CallResult>,
}

impl Holder {
    /// Returns once the holder's operation runs, so the key is claimed.
    /// A holder dropped unreleased fails its operation, so a failing test
    /// does not leave it blocked.
    fn claim(db: &Db, key: &str, isolation: Option<Isolation>) -> Holder {
        let (claimed_tx, claimed_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let mut conn = db.conn();
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            let op = move |tx: &mut PgConnection| -> Result<i64, DomainError> {
                let order_id = Db::place_order(tx, "holder", 1)?;
                claimed_tx.send(()).expect("the test waits for the claim");
                match release_rx.recv() {
                    Ok(Release::Commit) => Ok(order_id),
                    Ok(Release::Fail) | Err(_) => Err(DomainError::Refused),
                }
            };
            match isolation {
                None => run_idempotent(&mut conn, SCOPE, &key, REQUEST, op),
                Some(level) => {
                    in_caller_transaction(&mut conn, level, |tx| run_idempotent(tx, SCOPE, &key, REQUEST, op))
                }
            }
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

/// A second request for a held key, on its own thread and connection, that
/// returns its connection with its result. The test learns its backend pid
/// to see it wait on the server.
struct Waiter {
    pid: i32,
    calls: Arc<AtomicUsize>,
    thread: thread::JoinHandle<(PgConnection, CallResult)>,
}

impl Waiter {
    fn start(db: &Db, key: &str, config: Config, isolation: Option<Isolation>) -> Waiter {
        let mut conn = db.conn();
        let pid = backend_pid(&mut conn);
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            let op = counted(&counter, "waiter");
            let result = match isolation {
                None => config.run(&mut conn, SCOPE, &key, REQUEST, op),
                Some(level) => in_caller_transaction(&mut conn, level, |tx| config.run(tx, SCOPE, &key, REQUEST, op)),
            };
            (conn, result)
        });
        Waiter { pid, calls, thread }
    }

    fn join(self) -> (PgConnection, CallResult, usize) {
        let (conn, result) = self.thread.join().expect("the waiter thread does not panic");
        (conn, result, self.calls.load(Ordering::SeqCst))
    }
}

fn long_wait() -> Config {
    Config::default().in_flight(InFlight::Wait(Duration::seconds(30)))
}

/// Visible ASCII that does not compress, as a random client key would not.
fn incompressible(len: usize, seed: u64) -> String {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'!' + u8::try_from((state >> 33) % 94).expect("below 94"))
        })
        .collect()
}

/// A B-tree entry holds 2704 bytes: a longer configured limit is lowered to
/// what the primary key can index, so a long key is refused before the
/// operation runs instead of failing at its insert.
#[test]
fn key_too_long_for_the_index_is_refused_before_the_operation_runs() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().max_key_len(10_000);
    let calls = AtomicUsize::new(0);

    let refused = config.run(
        &mut conn,
        SCOPE,
        &incompressible(1301, 1),
        REQUEST,
        counted(&calls, "long"),
    );
    assert!(
        matches!(
            refused,
            Err(Error::InvalidKey(KeyError::TooLong { len: 1301, max: 1300 }))
        ),
        "{refused:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(Db::key_count(&mut conn), 0);

    // The longest scope and key together fit, even incompressible.
    let (scope, key) = (incompressible(1300, 2), incompressible(1300, 3));
    let first = config.run(&mut conn, &scope, &key, REQUEST, counted(&calls, "longest"));
    assert!(!first.expect("fits the index").is_replayed());
    let again = config.run(&mut conn, &scope, &key, REQUEST, counted(&calls, "longest"));
    assert!(again.expect("replays").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn waiter_replays_when_the_holder_commits_within_the_wait() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-commit", None);
    let waiter = Waiter::start(&db, "k-commit", long_wait(), None);
    wait_until_waiting_for_lock(&mut admin, waiter.pid);

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
    let holder = Holder::claim(&db, "k-rollback", None);
    let waiter = Waiter::start(&db, "k-rollback", long_wait(), None);
    wait_until_waiting_for_lock(&mut admin, waiter.pid);

    let held = holder.finish(Release::Fail);
    let (mut conn, waited, calls) = waiter.join();

    assert!(matches!(held, Err(Error::Operation(DomainError::Refused))), "{held:?}");
    assert!(
        matches!(waited, Ok(Outcome::Executed(_))),
        "the waiter takes the freed key: {waited:?}"
    );
    assert_eq!(calls, 1);
    let items: Vec<String> = orders::table.select(orders::item).load(&mut conn).expect("load orders");
    assert_eq!(items, ["waiter"], "only the waiter's order exists");
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn waiter_gets_in_progress_when_the_holder_outlasts_the_wait() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-long", None);
    let mut conn = db.conn();
    let lock_timeout_before = show_lock_timeout(&mut conn);
    let calls = AtomicUsize::new(0);

    // The holder is released only after this returns, so it outlasts any wait.
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(200)));
    let waited = short_wait.run(&mut conn, SCOPE, "k-long", REQUEST, counted(&calls, "waiter"));

    let Err(error) = waited else {
        panic!("the waiter gives up, got {waited:?}")
    };
    assert!(matches!(error, Error::InProgress), "{error:?}");
    assert_eq!(error.status_code(), 409);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    assert_eq!(show_lock_timeout(&mut conn), lock_timeout_before);
    let other = run_idempotent(&mut conn, SCOPE, "k-other", REQUEST, counted(&calls, "other"));
    assert!(
        matches!(other, Ok(Outcome::Executed(_))),
        "the connection is still usable: {other:?}"
    );

    let held = holder.finish(Release::Commit).expect("holder commits").into_inner();
    let retry = run_idempotent(&mut conn, SCOPE, "k-long", REQUEST, counted(&calls, "waiter")).expect("retry");
    assert_eq!(retry, Outcome::Replayed(held));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the other key executed");
}

/// A caller's `statement_timeout` shorter than the in-flight wait ends the
/// wait for the key first; the answer is the same: the key is held.
#[test]
fn statement_timeout_shorter_than_the_wait_is_in_progress_too() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-short-statements", None);
    let mut conn = db.conn();
    conn.batch_execute("SET statement_timeout = '200ms'")
        .expect("the caller's own setting");
    let calls = AtomicUsize::new(0);

    let long_wait = Config::default().in_flight(InFlight::Wait(Duration::seconds(30)));
    let waited = long_wait.run(
        &mut conn,
        SCOPE,
        "k-short-statements",
        REQUEST,
        counted(&calls, "waiter"),
    );
    let Err(error) = waited else {
        panic!("the waiter gives up, got {waited:?}")
    };
    assert!(matches!(error, Error::InProgress), "{error:?}");
    assert!(error.is_retryable());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    holder.finish(Release::Commit).expect("the holder commits");
    let replayed = long_wait.run(
        &mut conn,
        SCOPE,
        "k-short-statements",
        REQUEST,
        counted(&calls, "retry"),
    );
    assert!(replayed.expect("the retry replays").is_replayed());
}

#[test]
fn reject_policy_answers_in_progress_while_the_key_is_held() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-reject", None);
    let mut conn = db.conn();
    let lock_timeout_before = show_lock_timeout(&mut conn);
    let calls = AtomicUsize::new(0);

    let rejecting = Config::default().in_flight(InFlight::Reject);
    let rejected = rejecting.run(&mut conn, SCOPE, "k-reject", REQUEST, counted(&calls, "rejected"));

    assert!(matches!(rejected, Err(Error::InProgress)), "{rejected:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    assert_eq!(show_lock_timeout(&mut conn), lock_timeout_before);
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
    let holder = Holder::claim(&db, "k-held", None);
    let mut conn = db.conn();
    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(100)));
    let calls = AtomicUsize::new(0);
    conn.transaction(|tx| {
        Db::place_order(tx, "before", 1)?;
        tx.batch_execute("SET LOCAL lock_timeout = '7s'")?;
        let waited = short_wait.run(tx, SCOPE, "k-held", REQUEST, counted(&calls, "waiter"));
        assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
        assert_eq!(show_lock_timeout(tx), "7s", "the caller's own setting is back");
        Db::place_order(tx, "after", 1)?;
        QueryResult::Ok(())
    })
    .expect("the caller's transaction commits");
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    holder.finish(Release::Commit).expect("holder commits");
    let mut items: Vec<String> = orders::table.select(orders::item).load(&mut conn).expect("load orders");
    items.sort();
    assert_eq!(items, ["after", "before", "holder"]);
}

#[test]
fn expired_key_is_taken_over_by_exactly_one_of_many_racing_requests() {
    const THREADS: usize = 16;
    let db = Db::new();
    let clock = ManualClock::new();
    let config = Config::default().retention(Duration::hours(1)).clock(clock.source());
    let first_calls = AtomicUsize::new(0);
    let first = config
        .run(
            &mut db.conn(),
            SCOPE,
            "k-expiring",
            REQUEST,
            counted(&first_calls, "first"),
        )
        .expect("first call")
        .into_inner();
    clock.advance(Duration::hours(2));

    let pool = db.pool(THREADS as u32);
    let barrier = Barrier::new(THREADS);
    let calls = AtomicUsize::new(0);
    let outcomes: Vec<CallResult> = thread::scope(|s| {
        let racers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    let mut conn = pool.get().expect("pooled connection");
                    barrier.wait();
                    config.run(&mut conn, SCOPE, "k-expiring", REQUEST, counted(&calls, "takeover"))
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|racer| racer.join().expect("racer does not panic"))
            .collect()
    });

    assert_eq!(calls.load(Ordering::SeqCst), 1, "the expired key executes exactly once");
    let outcomes: Vec<Outcome<i64>> = outcomes
        .into_iter()
        .map(|outcome| outcome.expect("every racer succeeds"))
        .collect();
    assert_eq!(outcomes.iter().filter(|outcome| !outcome.is_replayed()).count(), 1);
    let value = outcomes[0].clone().into_inner();
    assert_ne!(value, first, "the takeover is a new execution");
    assert!(
        outcomes.into_iter().all(|outcome| outcome.into_inner() == value),
        "every racer sees the same value"
    );
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn purge_between_the_read_and_the_store_of_a_takeover_does_not_fail_the_call() {
    let db = Db::new();
    let clock = ManualClock::new();
    let config = Config::default().retention(Duration::hours(1)).clock(clock.source());
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);
    config
        .run(&mut conn, SCOPE, "k-expiring", REQUEST, counted(&calls, "first"))
        .expect("first call");
    clock.advance(Duration::hours(2));

    let (entered, operation_running) = mpsc::channel();
    let takeover = thread::scope(|s| {
        // Owned here, so that a failed assertion drops it and frees the
        // waiting thread before the scope joins it.
        let (resume, resumed) = mpsc::channel::<()>();
        let (db, config, calls) = (&db, &config, &calls);
        let taker = s.spawn(move || {
            config.run(&mut db.conn(), SCOPE, "k-expiring", REQUEST, |tx| {
                entered.send(()).expect("the test waits");
                resumed.recv().expect("the test resumes the operation");
                counted(calls, "takeover")(tx)
            })
        });
        operation_running.recv().expect("the takeover runs its operation");
        // The takeover read the expired record and holds the key's lock,
        // which the purger does not take: the record goes under it.
        assert_eq!(config.purge_expired(&mut conn, 100).expect("purge"), 1);
        resume.send(()).expect("the operation waits");
        taker.join().expect("the taker does not panic")
    });

    assert!(!takeover.expect("the takeover executes").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(Db::key_count(&mut conn), 1, "the takeover's record is stored");
    let retry = config.run(&mut conn, SCOPE, "k-expiring", REQUEST, counted(&calls, "retry"));
    assert!(retry.expect("retry").is_replayed());
}

/// Asserts that a crashed call left nothing, then that a retry executes
/// exactly once and later retries replay it.
fn assert_crash_left_nothing_and_retry_executes_once(db: &Db, key: &str) {
    let mut conn = db.conn();
    assert_eq!(Db::key_count(&mut conn), 0, "no key record is left");
    assert_eq!(Db::order_count(&mut conn), 0, "no domain row is left");
    let calls = AtomicUsize::new(0);
    let retry = run_idempotent(&mut conn, SCOPE, key, REQUEST, counted(&calls, "retry")).expect("retry");
    assert!(!retry.is_replayed(), "the retry executes");
    let again = run_idempotent(&mut conn, SCOPE, key, REQUEST, counted(&calls, "retry")).expect("second retry");
    assert_eq!(again, Outcome::Replayed(retry.into_inner()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn terminated_backend_leaves_no_key_and_no_domain_row() {
    let db = Db::new();
    let (pid_tx, pid_rx) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let mut worker_conn = db.conn();
    let worker = thread::spawn(move || {
        run_idempotent(&mut worker_conn, SCOPE, "k-terminated", REQUEST, |tx| {
            let order_id = Db::place_order(tx, "terminated", 1)?;
            pid_tx.send(backend_pid(tx)).expect("the test waits for the pid");
            // Whatever the release says, the operation itself succeeds; the
            // storage under it is what fails.
            let _ = release_rx.recv();
            Ok::<_, DomainError>(order_id)
        })
    });
    let pid = pid_rx.recv().expect("the worker runs its operation");

    #[derive(QueryableByName)]
    struct Terminated {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        terminated: bool,
    }
    let mut admin = db.conn();
    let terminated: Terminated = diesel::sql_query("SELECT pg_terminate_backend($1, 30000) AS terminated")
        .bind::<diesel::sql_types::Integer, _>(pid)
        .get_result(&mut admin)
        .expect("terminate the worker's backend");
    assert!(terminated.terminated, "the backend ended");
    release.send(()).expect("the worker waits");
    let result = worker.join().expect("the worker does not panic");

    assert!(matches!(result, Err(Error::Storage(_))), "{result:?}");
    assert_crash_left_nothing_and_retry_executes_once(&db, "k-terminated");
}

#[test]
fn panic_on_a_lost_connection_still_reaches_the_caller() {
    let db = Db::new();
    let mut conn = db.conn();
    let mut admin = db.conn();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_idempotent(&mut conn, SCOPE, "k-lost", REQUEST, |tx| {
            Db::place_order(tx, "lost", 1)?;
            // The connection dies under the operation, so rolling back after
            // the panic fails too; the panic must not turn into an error.
            diesel::sql_query("SELECT pg_terminate_backend($1, 30000)")
                .bind::<diesel::sql_types::Integer, _>(backend_pid(tx))
                .execute(&mut admin)?;
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

/// Set in the child process of the SIGKILL test: the database URL of the
/// parent's test schema.
const CRASH_CHILD_URL: &str = "IDEMPOTENCY_TEST_CRASH_CHILD_URL";
/// The line the child prints once its operation runs, followed by its
/// backend pid.
const CRASH_CHILD_READY: &str = "crash-child-ready backend=";

/// The child: claims the key, writes its order, reports, and blocks until
/// it is killed.
fn crash_child(url: &str) -> ! {
    let mut conn = PgConnection::establish(url).expect("child connects");
    let pid = backend_pid(&mut conn);
    let _ = run_idempotent(
        &mut conn,
        SCOPE,
        "k-killed",
        REQUEST,
        |tx| -> Result<i64, DomainError> {
            Db::place_order(tx, "killed", 1)?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "\n{CRASH_CHILD_READY}{pid}").expect("write to the parent");
            out.flush().expect("flush to the parent");
            loop {
                thread::park();
            }
        },
    );
    unreachable!("the operation never returns");
}

/// Kills the child if the test fails before it does: a child left alive
/// would keep its transaction open and block dropping the test schema.
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
    let pid = BufReader::new(stdout)
        .lines()
        .map(|line| line.expect("read the child's output"))
        .find_map(|line| {
            line.split_once(CRASH_CHILD_READY)
                .map(|(_, pid)| pid.trim().parse::<i32>())
        })
        .expect("the child reports that its operation runs")
        .expect("the child's backend pid");

    // The child really holds the key: another request finds it in progress.
    let mut conn = db.conn();
    let held = Config::default()
        .in_flight(InFlight::Reject)
        .run(&mut conn, SCOPE, "k-killed", REQUEST, |_| Ok::<_, DomainError>(0));
    assert!(matches!(held, Err(Error::InProgress)), "{held:?}");

    child.0.kill().expect("SIGKILL the child");
    let status = child.0.wait().expect("reap the child");
    assert_eq!(
        status.code(),
        None,
        "the child was killed by a signal, not exited: {status:?}"
    );
    wait_until_backend_gone(&mut conn, pid);

    assert_crash_left_nothing_and_retry_executes_once(&db, "k-killed");
}

#[test]
fn panic_on_a_pooled_connection_returns_it_to_the_pool_outside_a_transaction() {
    let db = Db::new();
    let pool = db.pool(1);
    let mut pooled = pool.get().expect("the pool's connection");
    let pid = backend_pid(&mut pooled);
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
        backend_state(&mut admin, pid).as_deref(),
        Some("idle"),
        "the server sees no open transaction"
    );
    let mut pooled = pool.get().expect("the pool's connection again");
    assert_eq!(backend_pid(&mut pooled), pid, "the pool kept the connection");
    let retry = run_idempotent(&mut pooled, SCOPE, "k-pool-panic", REQUEST, |tx| {
        Db::place_order(tx, "retry", 1)
    })
    .expect("retry");
    assert!(!retry.is_replayed());
    drop(pooled);
    let items: Vec<String> = orders::table
        .select(orders::item)
        .load(&mut admin)
        .expect("load orders");
    assert_eq!(items, ["retry"], "the retry committed; the panicked order did not");
    assert_eq!(Db::key_count(&mut admin), 1);
}

/// Two requests with one key, each inside a caller's transaction at
/// `isolation`: the first claims the key and holds it; the second takes its
/// snapshot, then waits for the key; the first commits.
///
/// What happens: the second request's claim finds a conflicting row that
/// its snapshot cannot see, and PostgreSQL refuses to act on it ("could not
/// serialize access due to concurrent update"). The call fails with
/// `Error::Storage` of kind `SerializationFailure` without running its
/// operation, and the caller's transaction rolls back. Retrying the whole
/// transaction, as serialization failures ask, replays the first result.
fn nested_race_executes_once(isolation: Isolation) {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-isolated", Some(isolation));
    let waiter = Waiter::start(&db, "k-isolated", long_wait(), Some(isolation));
    wait_until_waiting_for_lock(&mut admin, waiter.pid);

    let held = holder.finish(Release::Commit).expect("the first caller commits");
    let (mut conn, waited, calls) = waiter.join();

    let Outcome::Executed(order_id) = held else {
        panic!("the first request executes, got {held:?}")
    };
    assert!(
        matches!(
            waited,
            Err(Error::Storage(DieselError::DatabaseError(
                DatabaseErrorKind::SerializationFailure,
                _
            )))
        ),
        "{isolation:?}: {waited:?}"
    );
    assert_eq!(calls, 0, "the second request's operation did not run");
    assert!(!Db::in_transaction(&mut conn), "the caller's transaction rolled back");

    let retry_calls = AtomicUsize::new(0);
    let retried = in_caller_transaction(&mut conn, isolation, |tx| {
        run_idempotent(tx, SCOPE, "k-isolated", REQUEST, counted(&retry_calls, "retry"))
    });
    assert_eq!(
        retried.expect("the caller retries its transaction"),
        Outcome::Replayed(order_id)
    );
    assert_eq!(retry_calls.load(Ordering::SeqCst), 0);
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn racing_calls_nested_in_repeatable_read_execute_once() {
    nested_race_executes_once(Isolation::RepeatableRead);
}

#[test]
fn racing_calls_nested_in_serializable_execute_once() {
    nested_race_executes_once(Isolation::Serializable);
}

/// The same race left to the scheduler: two callers released together,
/// round after round. Depending on when the loser takes its snapshot it
/// replays at once (the winner had committed), fails with a serialization
/// failure (the winner committed after the snapshot), or waits and then
/// fails. A failed caller retries its whole transaction and replays.
#[test]
fn callers_racing_in_isolated_transactions_execute_each_key_once() {
    const ROUNDS: usize = 20;
    let db = Db::new();
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let barrier = Barrier::new(2);
        let calls: Vec<AtomicUsize> = (0..ROUNDS).map(|_| AtomicUsize::new(0)).collect();
        let failures = AtomicUsize::new(0);
        let call = |conn: &mut PgConnection, round: usize| {
            let key = format!("k-{isolation:?}-{round}");
            in_caller_transaction(conn, isolation, |tx| {
                run_idempotent(tx, SCOPE, &key, REQUEST, counted(&calls[round], "racer"))
            })
        };
        let values: Vec<Vec<i64>> = thread::scope(|s| {
            let racers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut conn = db.conn();
                        (0..ROUNDS)
                            .map(|round| {
                                barrier.wait();
                                match call(&mut conn, round) {
                                    Ok(outcome) => outcome.into_inner(),
                                    Err(Error::Storage(DieselError::DatabaseError(
                                        DatabaseErrorKind::SerializationFailure,
                                        _,
                                    ))) => {
                                        failures.fetch_add(1, Ordering::SeqCst);
                                        let retry = call(&mut conn, round).expect("the retried transaction");
                                        assert!(retry.is_replayed(), "{isolation:?} round {round}: {retry:?}");
                                        retry.into_inner()
                                    }
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
            "{isolation:?}: {} of {ROUNDS} races ended in a serialization failure",
            failures.into_inner()
        );
        for round in 0..ROUNDS {
            assert_eq!(calls[round].load(Ordering::SeqCst), 1, "{isolation:?} round {round}");
            assert_eq!(values[0][round], values[1][round], "{isolation:?} round {round}");
        }
    }
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2 * ROUNDS as i64);
    assert_eq!(Db::key_count(&mut conn), 2 * ROUNDS as i64);
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

/// The operation's own view of `lock_timeout`.
fn current_lock_timeout(conn: &mut PgConnection) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    Ok(diesel::sql_query("SELECT current_setting('lock_timeout') AS value")
        .get_result::<Setting>(conn)?
        .value)
}

#[test]
fn lock_timeout_of_the_claim_does_not_leak_into_the_operation_or_the_session() {
    let db = Db::new();
    let mut conn = db.conn();
    // A wait unlike any value the caller sets, so a leak cannot hide.
    let config = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(750)));
    let seen_by_op = |conn: &mut PgConnection, key: &str| {
        config
            .run(conn, SCOPE, key, REQUEST, current_lock_timeout)
            .expect("claimed call")
            .into_inner()
    };

    let server_default = show_lock_timeout(&mut conn);
    assert_eq!(seen_by_op(&mut conn, "k-default"), server_default);
    assert_eq!(show_lock_timeout(&mut conn), server_default);

    conn.batch_execute("SET lock_timeout = '3s'")
        .expect("set a session lock_timeout");
    assert_eq!(seen_by_op(&mut conn, "k-session"), "3s");
    assert_eq!(show_lock_timeout(&mut conn), "3s");

    let failed = config.run(&mut conn, SCOPE, "k-failed", REQUEST, |_| {
        Err::<String, _>(DomainError::Refused)
    });
    assert!(
        matches!(failed, Err(Error::Operation(DomainError::Refused))),
        "{failed:?}"
    );
    assert_eq!(show_lock_timeout(&mut conn), "3s", "also after a rolled-back call");

    // Nested in a caller's transaction, the call restores the caller's
    // transaction-local value, which ends with the caller's transaction.
    conn.transaction(|tx| {
        tx.batch_execute("SET LOCAL lock_timeout = '7s'")?;
        assert_eq!(seen_by_op(tx, "k-nested"), "7s");
        assert_eq!(show_lock_timeout(tx), "7s");
        QueryResult::Ok(())
    })
    .expect("caller's transaction");
    assert_eq!(show_lock_timeout(&mut conn), "3s");
}

#[test]
fn nested_call_that_claims_nothing_leaves_the_callers_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(250)));
    let after_inner = conn
        .transaction(|conn| {
            conn.batch_execute("SET LOCAL lock_timeout = '3s'")?;
            let outcome = config.run(conn, "settings", "k-1", &1, |tx| {
                // The same key, claimed by the enclosing call on this
                // connection: the inner call claims nothing.
                let inner = config.run(tx, "settings", "k-1", &1, |_| Ok::<_, Error>(String::new()));
                assert!(matches!(inner, Err(Error::InProgress)), "got {inner:?}");
                Ok::<_, Error>(show_lock_timeout(tx))
            });
            Ok::<_, DieselError>(outcome.expect("outer call").into_inner())
        })
        .expect("caller's transaction");
    assert_eq!(after_inner, "3s");
}

#[test]
fn relay_inside_a_callers_transaction_leaves_its_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    let after = conn
        .transaction(|tx| {
            tx.batch_execute("SET LOCAL lock_timeout = '3s'")?;
            idempotency::outbox::enqueue(tx, "receipts", &1).expect("enqueue");
            let batch = idempotency::outbox::Relay::default()
                .run_once(tx, |_| Ok::<_, std::convert::Infallible>(()))
                .expect("relay");
            assert_eq!(batch.delivered, 1);
            Ok::<_, DieselError>(show_lock_timeout(tx))
        })
        .expect("caller's transaction");
    assert_eq!(after, "3s");
}

#[test]
fn longest_in_flight_wait_is_accepted() {
    let db = Db::new();
    let mut conn = db.conn();
    // Longer than PostgreSQL's largest lock_timeout; shortened to it.
    let config = Config::default().in_flight(InFlight::Wait(Duration::days(30)));
    let first = config.run(&mut conn, SCOPE, "k-long-wait", REQUEST, |tx| {
        Db::place_order(tx, "long", 1)
    });
    assert!(!first.expect("the call executes").is_replayed());
    assert!(!Db::in_transaction(&mut conn));
    let again = config.run(&mut conn, SCOPE, "k-long-wait", REQUEST, |tx| {
        Db::place_order(tx, "long", 1)
    });
    assert!(again.expect("the connection is still usable").is_replayed());
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
        let seen = run_idempotent(&mut conn, SCOPE, &key, REQUEST, transaction_isolation).expect("executes");
        assert_eq!(seen, Outcome::Executed(isolation.name().to_owned()), "never weakened");
        let again = run_idempotent(&mut conn, SCOPE, &key, REQUEST, transaction_isolation).expect("replays");
        assert!(again.is_replayed());
    }
}

/// Two top-level calls with one key from sessions at `REPEATABLE READ` or
/// `SERIALIZABLE`, released together round after round. Their reads cannot
/// see a concurrent commit, so they claim the key before the operation: the
/// loser replays, or fails with a serialization failure before its
/// operation runs and replays on its retry. The operation runs once.
#[test]
fn racing_calls_from_isolated_sessions_execute_each_key_once() {
    const ROUNDS: usize = 20;
    let db = Db::new();
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let barrier = Barrier::new(2);
        let calls: Vec<AtomicUsize> = (0..ROUNDS).map(|_| AtomicUsize::new(0)).collect();
        let values: Vec<Vec<i64>> = thread::scope(|s| {
            let racers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut conn = session_at(&db, isolation);
                        (0..ROUNDS)
                            .map(|round| {
                                let key = format!("k-{isolation:?}-{round}");
                                barrier.wait();
                                let call = |conn: &mut PgConnection| {
                                    run_idempotent(conn, SCOPE, &key, REQUEST, counted(&calls[round], "racer"))
                                };
                                match call(&mut conn) {
                                    Ok(outcome) => outcome.into_inner(),
                                    Err(Error::Storage(DieselError::DatabaseError(
                                        DatabaseErrorKind::SerializationFailure,
                                        _,
                                    ))) => call(&mut conn).expect("the retry").into_inner(),
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
        for round in 0..ROUNDS {
            assert_eq!(calls[round].load(Ordering::SeqCst), 1, "{isolation:?} round {round}");
            assert_eq!(values[0][round], values[1][round], "{isolation:?} round {round}");
        }
    }
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2 * ROUNDS as i64);
}

#[test]
fn top_level_holder_and_nested_waiter_serialize_on_one_lock() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-mixed", None);
    let waiter = Waiter::start(&db, "k-mixed", long_wait(), Some(Isolation::ReadCommitted));
    wait_until_waiting_for_lock(&mut admin, waiter.pid);

    let held = holder.finish(Release::Commit).expect("the holder commits").into_inner();
    let (mut conn, waited, calls) = waiter.join();
    assert_eq!(waited.expect("the nested waiter replays"), Outcome::Replayed(held));
    assert_eq!(calls, 0, "the waiter's operation never ran");
    assert_eq!(Db::order_count(&mut conn), 1);
}

#[test]
fn nested_holder_and_top_level_waiter_serialize_on_one_lock() {
    let db = Db::new();
    let mut admin = db.conn();
    let holder = Holder::claim(&db, "k-mixed", Some(Isolation::ReadCommitted));
    let waiter = Waiter::start(&db, "k-mixed", long_wait(), None);
    wait_until_waiting_for_lock(&mut admin, waiter.pid);

    let held = holder.finish(Release::Commit).expect("the holder commits").into_inner();
    let (mut conn, waited, calls) = waiter.join();
    assert_eq!(waited.expect("the top-level waiter replays"), Outcome::Replayed(held));
    assert_eq!(calls, 0, "the waiter's operation never ran");
    assert_eq!(Db::order_count(&mut conn), 1);
}

/// The crate locks keys in PostgreSQL's two-integer advisory key space;
/// an application's `bigint` advisory locks, even on the very same 64 bits,
/// never hold a call up.
#[test]
fn applications_bigint_advisory_locks_never_meet_the_crates() {
    use sha2::{Digest, Sha256};
    let db = Db::new();
    let mut application = db.conn();
    let mut hasher = Sha256::new();
    for part in [SCOPE, "k-locked"] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    let same_bits = i64::from_be_bytes(digest[..8].try_into().expect("eight bytes"));
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<diesel::sql_types::BigInt, _>(same_bits)
        .execute(&mut application)
        .expect("the application's lock");

    let mut conn = db.conn();
    let reject = Config::default().in_flight(InFlight::Reject);
    let calls = AtomicUsize::new(0);
    let outcome = reject.run(&mut conn, SCOPE, "k-locked", REQUEST, counted(&calls, "call"));
    assert!(!outcome.expect("not held up").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A durable replay answers only after a commit of its own, which waits for
/// the synchronous standbys where there are any (the failover suite shows
/// the effect; here, the commit is there and the answers are the same).
#[test]
fn durable_replays_commit_before_they_answer() {
    use diesel::connection::{Connection as _, InstrumentationEvent};

    let db = Db::new();
    let mut conn = db.conn();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = Arc::clone(&sent);
    conn.set_instrumentation(move |event: InstrumentationEvent<'_>| {
        if let InstrumentationEvent::StartQuery { query, .. } = event {
            recorder.lock().expect("no panic while locked").push(query.to_string());
        }
    });
    let durable = Config::default().durable_replays(true);
    let calls = AtomicUsize::new(0);
    let first = durable
        .run(&mut conn, SCOPE, "k-durable", REQUEST, counted(&calls, "first"))
        .expect("executes");
    let confirmations = |sent: &Mutex<Vec<String>>| {
        sent.lock()
            .expect("no panic while locked")
            .iter()
            .filter(|sql| sql.contains("pg_logical_emit_message"))
            .count()
    };
    assert_eq!(confirmations(&sent), 0, "an execution commits its own record");

    let replay = durable
        .run(&mut conn, SCOPE, "k-durable", REQUEST, counted(&calls, "replay"))
        .expect("replays");
    assert_eq!(replay, Outcome::Replayed(first.into_inner()));
    assert_eq!(confirmations(&sent), 1, "the replay waited for a commit of its own");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(!Db::in_transaction(&mut conn));
}
