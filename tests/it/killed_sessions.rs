//! What a caller is told matches what committed, while the server ends
//! sessions at random moments: during the operation, during the commit,
//! between calls. Workers place orders through the crate, each call with a
//! key of its own, while a killer ends one of their sessions every few
//! milliseconds; afterwards every call's answer is compared with what the
//! database holds.
//!
//! The truth: a call answered `Ok` committed; a call answered
//! `OutcomeUnknown` may have; a call answered with any other error committed
//! nothing. A retry with the same key then replays exactly the calls that
//! committed and executes the others, and no order exists twice.

use std::cell::Cell;
use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use idempotency::phased::Phased;
use idempotency::{Config, Error, InFlight, Outcome};

use crate::common::ServerDb;
use crate::common::wait::Barrier;

crate::common::server_backend_tests!(
    killed_sessions_leave_every_call_told_what_committed,
    killed_sessions_leave_every_phased_step_told_what_committed,
);

pub const SCOPE: &str = "killed-sessions";
pub const WORKERS: usize = 8;
/// The load runs at least this long, then until the faults have hit both
/// the operations and the commits often enough, and never longer than
/// [`MOST`].
pub const LEAST: Duration = Duration::from_secs(2);
pub const MOST: Duration = Duration::from_secs(12);
/// How many calls each kind of fault must have hit before the load stops
/// early.
pub const ENOUGH: usize = 25;
pub const MOST_CALLS_PER_WORKER: usize = 4_000;

/// What a call was told, as far as what committed is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Told {
    /// `Ok`: the call's effects committed.
    Committed,
    /// `OutcomeUnknown`: they may have committed.
    Unknown,
    /// Any other error, named: nothing committed.
    Nothing(&'static str),
}

pub fn told<R, E>(result: &Result<Outcome<R>, Error<E>>) -> Told {
    match result {
        Ok(_) => Told::Committed,
        Err(Error::OutcomeUnknown(_)) => Told::Unknown,
        // Every storage error here comes from a killed session, which a
        // retry with the same key answers.
        Err(error @ Error::Storage(_)) if error.is_retryable() => Told::Nothing("Storage"),
        Err(Error::Storage(_)) => Told::Nothing("Storage, said not to be retryable"),
        Err(Error::Operation(_)) => Told::Nothing("Operation"),
        Err(Error::InProgress) => Told::Nothing("InProgress"),
        Err(Error::Mismatch) => Told::Nothing("Mismatch"),
        Err(Error::Codec(_)) => Told::Nothing("Codec"),
        Err(_) => Told::Nothing("another error"),
    }
}

/// A small generator of pseudo-random numbers, seeded from the clock: the
/// moments of the kills need no more.
pub struct Jitter(u64);

impl Jitter {
    pub fn new() -> Jitter {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |since| since.subsec_nanos());
        Jitter(u64::from(nanos) | 1)
    }

    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// What the workers of a load under kills and its killer share: the
/// session each worker is on, the answers, and the counts that end the load.
pub struct UnderKills {
    /// Each worker's session; 0 while it has none to kill.
    sessions: Vec<AtomicI64>,
    answers: Mutex<Vec<(String, Told)>>,
    unknown: AtomicUsize,
    nothing: AtomicUsize,
    stop: AtomicBool,
    kills: AtomicUsize,
}

impl UnderKills {
    pub fn new() -> Self {
        UnderKills {
            sessions: (0..WORKERS).map(|_| AtomicI64::new(0)).collect(),
            answers: Mutex::new(Vec::new()),
            unknown: AtomicUsize::new(0),
            nothing: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            kills: AtomicUsize::new(0),
        }
    }

    /// Worker `worker` is now on session `id`, which the killer may end.
    pub fn on_session(&self, worker: usize, id: i64) {
        self.sessions[worker].store(id, Ordering::SeqCst);
    }

    /// Whether the workers are to stop.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Notes that call `key` of `worker` was told `answer`. Whether the
    /// worker goes on on a new connection, as after any error; until it
    /// names its new session, the killer leaves it alone.
    pub fn told(&self, worker: usize, key: String, answer: Told) -> bool {
        self.answers.lock().expect("answers").push((key, answer));
        if answer == Told::Committed {
            return false;
        }
        match answer {
            Told::Unknown => self.unknown.fetch_add(1, Ordering::SeqCst),
            _ => self.nothing.fetch_add(1, Ordering::SeqCst),
        };
        self.sessions[worker].store(0, Ordering::SeqCst);
        true
    }

    /// The killer, on `admin`: ends the session of a worker drawn at random
    /// every 2 to 10 ms once `ready`, for at least [`LEAST`], then until the
    /// faults have hit enough calls, the workers are `finished` or
    /// [`MOST`] has passed; then tells the workers to stop.
    pub fn kill<D: ServerDb>(&self, admin: &mut D::Conn, ready: impl Fn() -> bool, finished: impl Fn() -> bool) {
        let mut jitter = Jitter::new();
        let started = Instant::now();
        loop {
            let elapsed = started.elapsed();
            let enough = self.unknown.load(Ordering::SeqCst) >= ENOUGH && self.nothing.load(Ordering::SeqCst) >= ENOUGH;
            if elapsed >= MOST || (elapsed >= LEAST && enough) || finished() {
                break;
            }
            // A kill every 2 to 10 ms lands at every moment of a call: the
            // moments themselves are what the test draws at random.
            thread::sleep(Duration::from_micros(2_000 + jitter.below(8_000)));
            if !ready() {
                continue;
            }
            let victim = usize::try_from(jitter.below(WORKERS as u64)).expect("a worker index");
            let id = self.sessions[victim].load(Ordering::SeqCst);
            if id != 0 {
                D::kill_session(admin, id);
                self.kills.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Every call's key with what it was told, in no order, and how many
    /// sessions were killed.
    pub fn into_answers(self) -> (Vec<(String, Told)>, usize) {
        (self.answers.into_inner().expect("answers"), self.kills.into_inner())
    }
}

/// Runs `call` on `WORKERS` threads while a killer ends their sessions, and
/// returns every call's key with what it was told, in no order, and how
/// many sessions were killed. A worker's `call(conn, worker, n)` makes its
/// `n`th call; after any error the worker continues on a new connection.
fn under_kills<D: ServerDb>(
    db: &D,
    call: impl Fn(&mut D::Conn, usize, usize) -> (String, Told) + Sync,
) -> (Vec<(String, Told)>, usize) {
    let race = UnderKills::new();
    let start = Barrier::new(WORKERS + 1);
    thread::scope(|s| {
        let mut workers = Vec::new();
        for worker in 0..WORKERS {
            let (race, start, call) = (&race, &start, &call);
            workers.push(s.spawn(move || {
                let mut conn = db.conn();
                race.on_session(worker, D::session_id(&mut conn));
                start.wait();
                for n in 0..MOST_CALLS_PER_WORKER {
                    if race.stopped() {
                        break;
                    }
                    let (key, answer) = call(&mut conn, worker, n);
                    if race.told(worker, key, answer) {
                        conn = db.conn();
                        race.on_session(worker, D::session_id(&mut conn));
                    }
                }
            }));
        }
        let mut admin = db.conn();
        start.wait();
        race.kill::<D>(&mut admin, || true, || workers.iter().all(|w| w.is_finished()));
    });
    race.into_answers()
}

/// Checks the retry of call `key`, which was told `answer`: it replays
/// exactly when the call committed, as `committed` holds.
pub fn assert_retry_replays_what_committed(key: &str, answer: Told, replayed: bool, committed: &HashSet<String>) {
    assert_eq!(
        replayed,
        committed.contains(key),
        "the retry of {key} ({answer:?}) replays exactly when the call committed"
    );
}

/// After the retries of the `calls` calls: each order exists once.
pub fn assert_every_order_once_after_the_retries<D: ServerDb>(conn: &mut D::Conn, calls: usize) {
    let orders = orders_placed::<D>(conn);
    let placed: HashSet<&String> = orders.iter().collect();
    assert_eq!(placed.len(), orders.len(), "a retry placed an order again");
    assert_eq!(orders.len(), calls, "every call's order exists once after the retries");
}

/// Counts the answers by what they told, for a failure message.
fn tally(answers: &[(String, Told)]) -> BTreeMap<Told, usize> {
    let mut tally = BTreeMap::new();
    for (_, answer) in answers {
        *tally.entry(*answer).or_default() += 1;
    }
    tally
}

/// The faults must have hit both operations (or statements before the
/// commit) and commits, or the comparison proves nothing.
pub fn assert_faults_hit(answers: &[(String, Told)], kills: usize) {
    let tally = tally(answers);
    let unknown = tally.get(&Told::Unknown).copied().unwrap_or(0);
    let nothing: usize = tally
        .iter()
        .filter(|(t, _)| matches!(t, Told::Nothing(_)))
        .map(|(_, n)| n)
        .sum();
    assert!(
        unknown > 0 && nothing > 0,
        "{kills} kills hit too few calls to compare: {tally:?}"
    );
    assert!(
        !tally.contains_key(&Told::Nothing("Storage, said not to be retryable")),
        "a lost connection was not recognised: {tally:?}"
    );
    eprintln!("{kills} kills: {tally:?}");
}

pub fn orders_placed<D: ServerDb>(conn: &mut D::Conn) -> Vec<String> {
    D::await_order_writers(conn);
    D::order_items(conn)
}

/// Compares every call's answer with what `conn`'s database holds: each
/// order placed once and with its key record, no call told the opposite of
/// what committed. Returns the keys whose calls committed.
pub fn assert_told_what_committed<D: ServerDb>(conn: &mut D::Conn, answers: &[(String, Told)]) -> HashSet<String> {
    let orders = orders_placed::<D>(conn);
    let records: HashSet<String> = D::keys_in_scope(conn, SCOPE).into_iter().collect();
    let placed: HashSet<String> = orders.iter().cloned().collect();
    assert_eq!(placed.len(), orders.len(), "an order was placed twice");
    assert_eq!(
        placed, records,
        "every order has its key record, and every record its order"
    );
    let lies: Vec<_> = answers
        .iter()
        .filter(|(key, answer)| match answer {
            Told::Committed => !records.contains(key),
            Told::Unknown => false,
            Told::Nothing(_) => records.contains(key),
        })
        .collect();
    assert!(
        lies.is_empty(),
        "{} of {} calls were told the opposite of what committed (answers: {:?}); first: {:?}",
        lies.len(),
        answers.len(),
        tally(answers),
        &lies[..lies.len().min(5)]
    );
    records
}

fn killed_sessions_leave_every_call_told_what_committed<D: ServerDb>() {
    let db = D::new();
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(5)));
    let (answers, kills) = under_kills(&db, |conn, worker, n| {
        let key = format!("w{worker}-{n}");
        let result = config.run(conn, SCOPE, &key, &key, |tx| D::place_order(tx, &key, 1));
        (key, told(&result))
    });
    assert_faults_hit(&answers, kills);

    let mut conn = db.conn();
    let records = assert_told_what_committed::<D>(&mut conn, &answers);

    // Every call that failed retries with its key: it replays if and only
    // if it committed, and executes otherwise.
    for (key, answer) in answers.iter().filter(|(_, answer)| *answer != Told::Committed) {
        let retry = config
            .run(&mut conn, SCOPE, key, key, |tx| D::place_order(tx, key, 1))
            .unwrap_or_else(|error| panic!("the retry of {key} ({answer:?}) failed: {error}"));
        assert_retry_replays_what_committed(key, *answer, retry.is_replayed(), &records);
    }
    assert_every_order_once_after_the_retries::<D>(&mut conn, answers.len());
}

/// The steps of the phased operation of key `key`: two phases and the
/// finish, each placing an order named by the key and the step's number.
const STEPS: u8 = 3;

fn step_order(key: &str, step: u8) -> String {
    format!("{key}/{step}")
}

/// Runs the phased operation of `key`, noting in `entered` the step it last
/// began.
fn place_in_steps<D: ServerDb>(
    phased: &Phased,
    conn: &mut D::Conn,
    key: &str,
    entered: &Cell<u8>,
) -> Result<Outcome<i64>, Error<diesel::result::Error>> {
    phased.run(conn, SCOPE, key, key, |s| {
        entered.set(1);
        s.phase("first", |tx| D::place_order(tx, &step_order(key, 1), 1))?;
        entered.set(2);
        s.phase("second", |tx| D::place_order(tx, &step_order(key, 2), 1))?;
        entered.set(3);
        s.finish(|tx| D::place_order(tx, &step_order(key, 3), 1))
    })
}

fn killed_sessions_leave_every_phased_step_told_what_committed<D: ServerDb>() {
    let db = D::new();
    // A lease that a killed attempt leaves behind runs out soon, so that
    // the retries below resume its operation.
    let phased = Phased::new("killed-sessions").lease(chrono::Duration::seconds(1));
    let entered_at = Mutex::new(BTreeMap::new());
    let (answers, kills) = under_kills(&db, |conn, worker, n| {
        let key = format!("w{worker}-{n}");
        let entered = Cell::new(0);
        let answer = told(&place_in_steps::<D>(&phased, conn, &key, &entered));
        entered_at.lock().expect("steps").insert(key.clone(), entered.get());
        (key, answer)
    });
    assert_faults_hit(&answers, kills);
    let entered_at = entered_at.into_inner().expect("steps");

    let mut conn = db.conn();
    let orders = orders_placed::<D>(&mut conn);
    let placed: HashSet<String> = orders.iter().cloned().collect();
    assert_eq!(placed.len(), orders.len(), "a step placed its order twice");
    // The steps before the one a call was told about committed (the next
    // step begins only after its predecessor's commit returned); the step
    // it was told about committed as the answer says.
    let lies: Vec<_> = answers
        .iter()
        .filter(|(key, answer)| {
            let entered = entered_at[key];
            let committed = |step| placed.contains(&step_order(key, step));
            let before = (1..entered).all(committed);
            match answer {
                Told::Committed => !(1..=STEPS).all(committed),
                Told::Unknown => !before,
                Told::Nothing(_) => !before || (entered > 0 && committed(entered)),
            }
        })
        .map(|(key, answer)| (key, answer, entered_at[key]))
        .collect();
    assert!(
        lies.is_empty(),
        "{} of {} phased calls were told the opposite of what committed (answers: {:?}); first: {:?}",
        lies.len(),
        answers.len(),
        tally(&answers),
        &lies[..lies.len().min(5)]
    );

    // Every operation that failed is resumed by retries with its key until
    // it finishes, each step committed once.
    let deadline = Instant::now() + Duration::from_secs(60);
    for (key, answer) in answers.iter().filter(|(_, answer)| *answer != Told::Committed) {
        loop {
            match place_in_steps::<D>(&phased, &mut conn, key, &Cell::new(0)) {
                Ok(_) => break,
                // The lease of the killed attempt has not run out yet.
                Err(Error::InProgress) if Instant::now() < deadline => thread::sleep(Duration::from_millis(50)),
                Err(error) => panic!("the retry of {key} ({answer:?}) failed: {error}"),
            }
        }
    }
    let orders = orders_placed::<D>(&mut conn);
    let placed: HashSet<&String> = orders.iter().collect();
    assert_eq!(
        placed.len(),
        orders.len(),
        "a resumed operation ran a committed step again"
    );
    assert_eq!(
        orders.len(),
        answers.len() * usize::from(STEPS),
        "every operation finished with each step once"
    );
}
