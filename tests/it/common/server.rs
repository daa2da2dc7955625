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
use diesel::result::Error as DieselError;
use idempotency::{Config, Error, InFlight, Outcome};

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
    let outcomes: Vec<Outcome<i64>> = outcomes
        .into_iter()
        .map(|outcome| outcome.expect("every racer succeeds"))
        .collect();
    assert_eq!(outcomes.iter().filter(|outcome| !outcome.is_replayed()).count(), 1);
    let value = outcomes[0].clone().into_inner();
    assert!(
        outcomes.into_iter().all(|outcome| outcome.into_inner() == value),
        "every racer sees the same value"
    );
    value
}

/// splitmix64: deterministic, so a failing run can be repeated.
pub struct Prng(pub u64);

impl Prng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
