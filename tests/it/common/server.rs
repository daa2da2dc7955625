//! What the tests of the server backends are made of: calls that hold a key
//! on a connection of their own until the test releases them, requests that
//! wait for such a key, races of many requests, and the checks after a
//! crash. Threads are ordered by channels, barriers and the server's own
//! view of who waits for what, never by sleeping for a guessed time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;

use chrono::Duration;
use diesel::Connection;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idempotency::{Config, Error, InFlight, KeyError, Outcome};

use super::wait::{self, Barrier};
use super::{ServerDb, TestDb};

pub const SCOPE: &str = "shop";
pub const REQUEST: &str = "place one book";

#[derive(Debug, PartialEq)]
pub enum DomainError {
    Refused,
    Db(String),
}

impl From<DieselError> for DomainError {
    fn from(error: DieselError) -> Self {
        DomainError::Db(error.to_string())
    }
}

pub type CallResult = Result<Outcome<i64>, Error<DomainError>>;

/// The operation of a call: places an order.
pub type Op<'a, C> = Box<dyn FnOnce(&mut C) -> Result<i64, DomainError> + Send + 'a>;

/// How a request is made: at the top level, or in a transaction of the
/// caller's; `(conn, policy, key, operation)`.
pub type Call<C> = fn(&mut C, &Config, &str, Op<'_, C>) -> CallResult;

/// A request at the top level.
pub fn top_level<D: TestDb>(conn: &mut D::Conn, config: &Config, key: &str, op: Op<'_, D::Conn>) -> CallResult {
    config.run(conn, SCOPE, key, REQUEST, op)
}

/// A request in a transaction of the caller's, at the session's level.
pub fn nested<D: TestDb>(conn: &mut D::Conn, config: &Config, key: &str, op: Op<'_, D::Conn>) -> CallResult {
    conn.transaction(|tx| config.run(tx, SCOPE, key, REQUEST, op))
}

/// An operation that counts its calls and places an order.
pub fn counted<'a, D: TestDb>(calls: &'a AtomicUsize, item: &'a str) -> Op<'a, D::Conn> {
    Box::new(move |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok(D::place_order(tx, item, 1)?)
    })
}

pub fn long_wait() -> Config {
    Config::default().in_flight(InFlight::Wait(Duration::seconds(30)))
}

/// How a holder's operation, or a caller's transaction, ends once released.
pub enum Release {
    Commit,
    Fail,
}

/// A call that has claimed a key on a connection of its own, written its
/// order, and holds the uncommitted transaction (and the key's lock) until
/// released. A holder dropped unreleased fails its operation, so a failing
/// test does not leave it blocked.
pub struct Holder {
    release: mpsc::Sender<Release>,
    thread: thread::JoinHandle<CallResult>,
}

impl Holder {
    /// Returns once the holder's operation runs, so the key is held.
    pub fn claim<D: TestDb>(db: &D, key: &str) -> Holder {
        Holder::claim_with(db, key, Config::default(), top_level::<D>)
    }

    /// As [`Holder::claim`], under `config`, made as `call` makes it.
    pub fn claim_with<D: TestDb>(db: &D, key: &str, config: Config, call: Call<D::Conn>) -> Holder {
        let (claimed_tx, claimed_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let mut conn = db.conn();
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            let op: Op<'_, D::Conn> = Box::new(move |tx| {
                let order_id = D::place_order(tx, "holder", 1)?;
                claimed_tx.send(()).expect("the test waits for the claim");
                match release_rx.recv() {
                    Ok(Release::Commit) => Ok(order_id),
                    Ok(Release::Fail) | Err(_) => Err(DomainError::Refused),
                }
            });
            call(&mut conn, &config, &key, op)
        });
        wait::recv(&claimed_rx, "the holder to claim the key and run its operation");
        Holder { release, thread }
    }

    pub fn finish(self, how: Release) -> CallResult {
        self.release.send(how).expect("the holder waits for its release");
        wait::join(self.thread, "the holder's thread")
    }
}

/// A second request for a held key, on its own thread and connection, that
/// returns its connection with its result. The test learns its session to
/// see it wait on the server.
pub struct Waiter<C> {
    pub session: i64,
    calls: Arc<AtomicUsize>,
    thread: thread::JoinHandle<(C, CallResult)>,
}

impl<C: Send + 'static> Waiter<C> {
    pub fn start<D: ServerDb<Conn = C>>(db: &D, key: &str, config: Config, call: Call<C>) -> Waiter<C> {
        let mut conn = db.conn();
        let session = D::session_id(&mut conn);
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        let key = key.to_owned();
        let thread = thread::spawn(move || {
            let result = call(&mut conn, &config, &key, counted::<D>(&counter, "waiter"));
            (conn, result)
        });
        Waiter { session, calls, thread }
    }

    /// The waiter's connection, its result and how often its operation ran.
    pub fn join(self) -> (C, CallResult, usize) {
        let (conn, result) = wait::join(self.thread, "the waiter's thread");
        (conn, result, self.calls.load(Ordering::SeqCst))
    }
}

/// Runs `threads` requests with one key over a pool at once and returns
/// their results with how often the operation ran.
pub fn race_for_one_key<D: TestDb>(db: &D, config: &Config, threads: usize) -> (Vec<CallResult>, usize) {
    let pool = db.pool(u32::try_from(threads).expect("a pool size"));
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
                        Ok::<_, DomainError>(D::place_order(tx, "raced", 1)?)
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

/// Asserts that the racers of [`race_for_one_key`] all succeeded, one of
/// them executing, and all saw its value; returns the value.
pub fn assert_one_executed_and_all_saw_it(outcomes: Vec<CallResult>) -> i64 {
    super::race::assert_one_executed_and_all_saw_it(
        outcomes
            .into_iter()
            .map(|outcome| outcome.expect("every racer succeeds"))
            .collect(),
    )
}

pub use super::property::Prng;

/// Whether a call failed with a serialization failure: PostgreSQL's, or a
/// deadlock that MySQL rolled back the caller's transaction for.
pub fn is_serialization_failure<T>(result: &Result<T, Error<DomainError>>) -> bool {
    matches!(
        result,
        Err(Error::Storage(DieselError::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            _
        )))
    )
}

/// How many rounds [`race_in_rounds`] runs.
pub const ROUNDS: usize = 20;

/// Two racers, each on a connection that `connect` makes, released together
/// round after round; in round `n` each makes the call `call(conn, n,
/// calls)` with a key of that round, whose operation counts itself in
/// `calls`. A racer whose call fails with a serialization failure retries
/// it once, as those failures ask; the retry must succeed, and replay where
/// `retry_replays`. Any other failure fails the test. Asserts that each
/// round's operation ran once and both racers got its value, and returns
/// how many calls were retried. `what` names the race in the messages.
pub fn race_in_rounds<C>(
    what: &str,
    connect: impl Fn() -> C + Sync,
    call: impl Fn(&mut C, usize, &AtomicUsize) -> CallResult + Sync,
    retry_replays: bool,
) -> usize {
    let barrier = Barrier::new(2);
    let calls: Vec<AtomicUsize> = (0..ROUNDS).map(|_| AtomicUsize::new(0)).collect();
    let retries = AtomicUsize::new(0);
    let values: Vec<Vec<i64>> = thread::scope(|s| {
        let racers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut conn = connect();
                    (0..ROUNDS)
                        .map(|round| {
                            barrier.wait();
                            let result = call(&mut conn, round, &calls[round]);
                            if is_serialization_failure(&result) {
                                retries.fetch_add(1, Ordering::SeqCst);
                                let retry = call(&mut conn, round, &calls[round]).expect("the retry");
                                assert!(!retry_replays || retry.is_replayed(), "{what} round {round}: {retry:?}");
                                return retry.into_inner();
                            }
                            match result {
                                Ok(outcome) => outcome.into_inner(),
                                Err(error) => panic!("{what} round {round}: {error:?}"),
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
        assert_eq!(calls[round].load(Ordering::SeqCst), 1, "{what} round {round}");
        assert_eq!(values[0][round], values[1][round], "{what} round {round}");
    }
    retries.into_inner()
}

/// A holder of `key`, claimed as `holder` makes a call, and a waiter for
/// it, started as `waiter` makes a call; returned once the server shows
/// the waiter waiting for the key.
pub fn holder_and_waiter<D: ServerDb>(
    db: &D,
    key: &str,
    holder: Call<D::Conn>,
    waiter: Call<D::Conn>,
) -> (Holder, Waiter<D::Conn>) {
    let mut admin = db.conn();
    let holder = Holder::claim_with(db, key, Config::default(), holder);
    let waiter = Waiter::start(db, key, long_wait(), waiter);
    D::wait_until_waiting_for_a_key(&mut admin, waiter.session);
    (holder, waiter)
}

/// On a database of its own: a holder of `key`, claimed as `holder` makes
/// a call, commits while a waiter, started as `waiter` makes a call, waits
/// for the key; asserts that the waiter replays what the holder executed,
/// without running its own operation.
pub fn the_waiter_replays_the_holders_commit<D: ServerDb>(key: &str, holder: Call<D::Conn>, waiter: Call<D::Conn>) {
    let db = D::new();
    let (holder, waiter) = holder_and_waiter(&db, key, holder, waiter);
    let held = holder.finish(Release::Commit).expect("the holder commits");
    let (mut conn, waited, calls) = waiter.join();

    let Outcome::Executed(order_id) = held else {
        panic!("the holder executes, got {held:?}")
    };
    assert_eq!(waited.expect("the waiter replays"), Outcome::Replayed(order_id));
    assert_eq!(calls, 0, "the waiter's operation is never called");
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1);
}

/// What a call refused for a key or a scope over the length limit says:
/// which of the two, its length and the limit; `None` for any other result.
pub fn too_long<T, E>(result: &Result<T, Error<E>>) -> Option<(&'static str, usize, usize)> {
    match result {
        Err(Error::InvalidKey(KeyError::TooLong { len, max })) => Some(("key", *len, *max)),
        Err(Error::InvalidScope(KeyError::TooLong { len, max })) => Some(("scope", *len, *max)),
        _ => None,
    }
}

/// A call as `config` makes it, of `key` in `scope`, refused for a length
/// over the limit; asserts that it was refused before its operation ran and
/// wrote nothing, and says what [`too_long`] says of it.
pub fn refused_as_too_long<D: TestDb>(
    config: &Config,
    conn: &mut D::Conn,
    scope: &str,
    key: &str,
) -> Option<(&'static str, usize, usize)> {
    let calls = AtomicUsize::new(0);
    let refused = config.run(conn, scope, key, REQUEST, counted::<D>(&calls, "long"));
    assert_eq!(calls.load(Ordering::SeqCst), 0, "{refused:?}");
    assert_eq!(D::key_count(conn), 0, "{refused:?}");
    too_long(&refused)
}

/// Under `config`, which allows longer keys than the backend holds (`max`
/// bytes): a key, and a scope, one byte longer are refused before the
/// operation runs, and the longest scope and key together fit, execute and
/// replay. `text(len, seed)` makes the text of a key or scope.
pub fn assert_the_longest_fits_and_longer_is_refused<D: TestDb>(
    conn: &mut D::Conn,
    config: &Config,
    max: usize,
    text: impl Fn(usize, u64) -> String,
) {
    let too_long = Some(("key", max + 1, max));
    assert_eq!(
        refused_as_too_long::<D>(config, conn, SCOPE, &text(max + 1, 1)),
        too_long
    );
    let too_long = Some(("scope", max + 1, max));
    assert_eq!(refused_as_too_long::<D>(config, conn, &text(max + 1, 1), "k"), too_long);

    // The longest scope and key together fit, even incompressible.
    let calls = AtomicUsize::new(0);
    let (scope, key) = (text(max, 2), text(max, 3));
    let first = config.run(conn, &scope, &key, REQUEST, counted::<D>(&calls, "longest"));
    assert!(!first.expect("fits").is_replayed());
    let again = config.run(conn, &scope, &key, REQUEST, counted::<D>(&calls, "longest"));
    assert!(again.expect("replays").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
