//! What the failover tests share: the formation and its faults, a schema of
//! each test's own on it, clients that retry every error with the same key,
//! and the figures a run is judged and reported by.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Debug, Write as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool, PoolError, PooledConnection};
use diesel::result::Error as DieselError;
use idempotency::{Error, Outcome, outbox};

pub type PgPool = Pool<ConnectionManager<PgConnection>>;
pub type Pooled = PooledConnection<ConnectionManager<PgConnection>>;

/// How long one request is retried before the test gives up on it; far
/// beyond the longest unavailability a fault causes here.
const RETRY_PATIENCE: Duration = Duration::from_secs(90);

/// Faults change the one formation all tests share, so they take turns.
static SERIAL: Mutex<()> = Mutex::new(());

const HOW_TO_START: &str = "the failover tests need a pg_auto_failover formation: \
    `.ci/ha-formation start DIR`, then run them with \
    HA_DATABASE_URL=\"$(.ci/ha-formation url DIR)\" HA_FORMATION_DIR=DIR \
    cargo test --features postgres --test failover -- --include-ignored (`.ci/run` does all of it)";

fn required_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; {HOW_TO_START}"))
}

/// A fault the formation script injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `pg_autoctl perform failover`: the primary is demoted, its standby promoted.
    PlannedFailover,
    /// SIGKILL to every process of the primary node: its keeper and its postgres.
    KillNode,
    /// SIGKILL to the primary's postmaster alone; its keeper restarts it.
    KillPostmaster,
}

impl Fault {
    fn command(self) -> &'static str {
        match self {
            Fault::PlannedFailover => "failover",
            Fault::KillNode => "kill-node",
            Fault::KillPostmaster => "kill-postmaster",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::PlannedFailover => "planned failover (pg_autoctl perform failover)",
            Fault::KillNode => "SIGKILL of the primary node (keeper and postgres)",
            Fault::KillPostmaster => "SIGKILL of the primary's postmaster",
        })
    }
}

/// One fault as the script performed it, with the test's clock around it.
#[derive(Debug)]
pub struct FaultRun {
    pub fault: Fault,
    pub started: Instant,
    pub finished: Instant,
    pub primary_before: u16,
    pub primary_after: u16,
    /// What the script printed about it.
    pub output: String,
}

/// The formation named by `HA_DATABASE_URL` and `HA_FORMATION_DIR`, held
/// by one test at a time and healthy when handed out.
pub struct Formation {
    url: String,
    dir: PathBuf,
    _serial: MutexGuard<'static, ()>,
}

impl Formation {
    /// Waits for the other tests' faults to be over and the formation to be
    /// healthy: a primary and a streaming synchronous secondary.
    pub fn acquire() -> Formation {
        let url = required_env("HA_DATABASE_URL");
        let dir = PathBuf::from(required_env("HA_FORMATION_DIR"));
        // A test that failed while holding the formation leaves nothing to
        // protect but the formation's health, which is checked next.
        let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        let formation = Formation {
            url,
            dir,
            _serial: serial,
        };
        formation.script("wait");
        formation
    }

    fn script(&self, command: &str) -> String {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/ha-formation");
        let output = Command::new(&script)
            .arg(command)
            .arg(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            ".ci/ha-formation {command} failed ({}):\n{stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    /// The port of the node the monitor holds for primary.
    pub fn primary(&self) -> u16 {
        let out = self.script("primary");
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("not a port from `.ci/ha-formation primary`: {out}"))
    }

    /// Injects `fault` and returns once the formation is healthy again.
    pub fn inject(&self, fault: Fault) -> FaultRun {
        let primary_before = self.primary();
        let started = Instant::now();
        let output = self.script(fault.command());
        let finished = Instant::now();
        FaultRun {
            fault,
            started,
            finished,
            primary_before,
            primary_after: self.primary(),
            output,
        }
    }

    /// A schema of the test's own in `appdb`, with the crate's migrations
    /// and `setup` applied; dropped when it goes out of scope.
    pub fn schema(&self, name: &str, setup: &str) -> Schema {
        let schema = format!("ha_{name}_{}", std::process::id());
        let mut admin = PgConnection::establish(&self.url).expect("connect to HA_DATABASE_URL");
        admin
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            ))
            .expect("create the test schema");
        let separator = if self.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{separator}options=-csearch_path%3D{schema}", self.url);
        let mut conn = PgConnection::establish(&url).expect("connect to the test schema");
        idempotency::run_migrations(&mut conn).expect("migrate the test schema");
        conn.batch_execute(setup).expect("create the test tables");
        conn.batch_execute(PROBE_TABLE).expect("create the probe table");
        Schema {
            admin_url: self.url.clone(),
            name: schema,
            url,
        }
    }
}

/// Where the write probe of `drive` writes.
const PROBE_TABLE: &str = "CREATE TABLE ha_probe (id BIGSERIAL PRIMARY KEY)";

pub struct Schema {
    admin_url: String,
    name: String,
    url: String,
}

impl Schema {
    /// A pool on the multi-host url, as a service would configure it: a
    /// connection is pinged on every check-out, so one that died with its
    /// node is replaced by one the url leads to the new primary; waiting for
    /// a connection is bounded, so a client sees an error to retry on rather
    /// than hanging through an outage.
    pub fn pool(&self, size: u32) -> PgPool {
        Pool::builder()
            .max_size(size)
            .test_on_check_out(true)
            .connection_timeout(Duration::from_secs(2))
            .build(ConnectionManager::new(&self.url))
            .expect("build a pool on the formation")
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).expect("connect to the test schema")
    }

    /// How many of the probe's writes the formation acknowledged and no
    /// longer holds: commits the database itself lost, which no client of
    /// it could keep.
    pub fn lost_probe_writes(&self, probe: &ProbeWrites) -> usize {
        let held: Vec<ProbeRow> = diesel::sql_query("SELECT id FROM ha_probe")
            .load(&mut self.conn())
            .expect("read the probe's rows");
        let held: std::collections::HashSet<i64> = held.into_iter().map(|row| row.id).collect();
        probe.ids.iter().filter(|id| !held.contains(id)).count()
    }
}

/// How a run under a fault ended.
pub enum Run {
    /// The formation kept every commit it acknowledged, and the run's
    /// assertions held.
    Judged,
    /// The formation lost this many of the probe's acknowledged writes: the
    /// database broke its own promise, so the run proves nothing about the
    /// crate's calls.
    FormationLost(usize),
}

/// How many runs a test makes at most while the formation loses commits it
/// acknowledged.
const RUNS: u32 = 3;

/// Runs `run` until the formation keeps its commits through the fault,
/// [`RUNS`] times at most. pg_auto_failover's planned failover has been
/// seen to promote the standby while the old primary still acknowledged
/// writes, and to lose them when it rewound that primary: the probe, a
/// plain insert beside the clients, loses its writes then as well. A run
/// where the probe lost nothing is judged in full; the test fails if none
/// such came.
pub fn until_the_formation_keeps_its_commits(mut run: impl FnMut() -> Run) {
    for attempt in 1..=RUNS {
        match run() {
            Run::Judged => return,
            Run::FormationLost(lost) => println!(
                "run {attempt} of at most {RUNS}: the formation lost {lost} acknowledged writes of the probe, \
                 a plain insert; the run proves nothing about the crate's calls and is made again"
            ),
        }
    }
    panic!("the formation lost acknowledged writes of its own in each of {RUNS} runs");
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.admin_url) {
            let _ = admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
        }
    }
}

/// How an error is counted in the report: its variant, and for database
/// errors diesel's kind and the first line of the server's or libpq's message.
pub trait Label {
    fn label(&self) -> String;
}

/// The first line of a message, which names what happened; the lines after
/// it are libpq's hints.
fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default().trim();
    line.chars().take(160).collect()
}

impl Label for DieselError {
    fn label(&self) -> String {
        match self {
            DieselError::DatabaseError(kind, info) => format!("{kind:?}: {}", first_line(info.message())),
            DieselError::RollbackErrorOnCommit {
                commit_error,
                rollback_error,
            } => format!(
                "RollbackErrorOnCommit {{ commit: {}, rollback: {} }}",
                commit_error.label(),
                rollback_error.label()
            ),
            other => first_line(&format!("{other:?}")),
        }
    }
}

impl Label for PoolError {
    fn label(&self) -> String {
        format!("pool: {}", first_line(&self.to_string()))
    }
}

impl Label for outbox::Error {
    fn label(&self) -> String {
        match self {
            outbox::Error::Storage(error) => format!("outbox Storage({})", error.label()),
            other => format!("outbox {}", first_line(&other.to_string())),
        }
    }
}

impl<E: Label> Label for Error<E> {
    fn label(&self) -> String {
        match self {
            Error::Storage(error) => format!("Storage({})", error.label()),
            Error::Operation(error) => format!("Operation({})", error.label()),
            Error::InProgress => String::from("InProgress"),
            Error::Mismatch => String::from("Mismatch"),
            Error::Codec(_) => String::from("Codec"),
            Error::InvalidKey(_) => String::from("InvalidKey"),
            Error::InvalidScope(_) => String::from("InvalidScope"),
            Error::OutcomeUnknown(error) => format!("OutcomeUnknown({})", error.label()),
            Error::Parked => String::from("Parked"),
            _ => String::from("an unknown variant"),
        }
    }
}

/// Errors counted by label.
#[derive(Default)]
pub struct ErrorCounts(Mutex<BTreeMap<String, usize>>);

impl ErrorCounts {
    pub fn add(&self, label: String) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(label)
            .or_default() += 1;
    }

    pub fn into_inner(self) -> BTreeMap<String, usize> {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One attempt of a request: the operation tells it when it starts and
/// what it returns, so that an error after the operation ran is known to
/// have left the outcome open.
pub struct Attempt<'a, A> {
    pub key: usize,
    /// Unique across the whole run.
    pub id: i64,
    runs: &'a AtomicU32,
    returned: RefCell<Option<A>>,
}

impl<A: Clone> Attempt<'_, A> {
    /// The operation started: counted per key.
    pub fn started(&self) {
        self.runs.fetch_add(1, Ordering::SeqCst);
    }

    /// The operation is about to return `answer` for the commit.
    pub fn finished(&self, answer: &A) {
        *self.returned.borrow_mut() = Some(answer.clone());
    }
}

/// A call whose operation had returned, but that failed afterwards: the
/// commit may or may not have happened.
#[derive(Debug)]
pub struct Unknown<A> {
    pub request: usize,
    pub key: usize,
    /// What the operation returned in that attempt.
    pub answer: A,
    pub error: String,
}

/// What one request finally got.
#[derive(Debug, Clone)]
pub struct Answer<A> {
    pub key: usize,
    pub value: A,
    pub replayed: bool,
    pub attempts: u32,
}

/// Everything the clients saw.
pub struct Traffic<A> {
    pub began: Instant,
    pub answers: Vec<Answer<A>>,
    /// When each call that executed returned, in no particular order.
    pub commits: Vec<Instant>,
    /// What the probe wrote beside the clients.
    pub probe: ProbeWrites,
    pub errors: BTreeMap<String, usize>,
    pub unknown: Vec<Unknown<A>>,
    /// How often the operation started, per key.
    pub op_runs: Vec<u32>,
    pub last_answer: Instant,
}

/// The longest time between two of `instants`, and when it began.
fn longest_gap(instants: &[Instant], began: Instant) -> (Duration, Instant) {
    let mut instants = instants.to_vec();
    instants.sort();
    instants
        .windows(2)
        .map(|pair| (pair[1] - pair[0], pair[0]))
        .max_by_key(|(gap, _)| *gap)
        .unwrap_or((Duration::ZERO, began))
}

/// What the probe wrote: when each write committed, in order, and the id
/// of the row it wrote.
pub struct ProbeWrites {
    pub commits: Vec<Instant>,
    pub ids: Vec<i64>,
}

#[derive(QueryableByName)]
struct ProbeRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// Writes one row every 50 ms through a connection of its own, made anew
/// through the url whenever a write fails, until `done`: how long the
/// database itself took no writes, without a pool's reconnection delays,
/// and which writes it acknowledged.
pub fn probe_writes(url: &str, done: &AtomicBool) -> ProbeWrites {
    let mut written = ProbeWrites {
        commits: Vec::new(),
        ids: Vec::new(),
    };
    let mut conn: Option<PgConnection> = None;
    while !done.load(Ordering::SeqCst) {
        if conn.is_none() {
            conn = PgConnection::establish(url).ok();
        }
        if let Some(open) = conn.as_mut() {
            match diesel::sql_query("INSERT INTO ha_probe DEFAULT VALUES RETURNING id").get_result::<ProbeRow>(open) {
                Ok(row) => {
                    written.commits.push(Instant::now());
                    written.ids.push(row.id);
                }
                Err(_) => conn = None,
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
    written
}

/// The requests of a run: every key once, every fourth key a second time at
/// once (two clients race for it) and every tenth key again about fifty
/// requests later (a retry after the first call finished).
pub fn requests_with_duplicates(keys: usize) -> Vec<usize> {
    let mut requests = Vec::with_capacity(keys * 4 / 3);
    for key in 0..keys {
        requests.push(key);
        if key % 4 == 0 {
            requests.push(key);
        }
        if key >= 40 && key % 10 == 0 {
            requests.push(key - 40);
        }
    }
    requests
}

/// How the clients behave.
pub struct Clients {
    pub threads: usize,
    /// A pause after each answer, so the run lasts long enough for a fault
    /// to land in the middle of it.
    pub think: Duration,
    /// After how many answers the fault is injected.
    pub fault_after: usize,
}

/// Sets its flag when dropped, also by a panic, so that threads that run
/// until the flag is set end and the thread scope can close.
pub struct SetOnDrop<'a>(pub &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// What the clients have seen so far.
struct Seen<A> {
    answers: Mutex<Vec<(usize, Instant, Answer<A>)>>,
    commits: Mutex<Vec<Instant>>,
    unknown: Mutex<Vec<Unknown<A>>>,
    errors: ErrorCounts,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `requests` (key numbers from zero) through `clients.threads`
/// threads over `pool`, each retrying every error with the same key and
/// request until it gets an answer, while `fault` is injected once
/// `clients.fault_after` requests are answered, and a probe writes to
/// `schema` beside them.
pub fn drive<A, E>(
    formation: &Formation,
    schema: &Schema,
    pool: &PgPool,
    clients: &Clients,
    fault: Fault,
    requests: &[usize],
    call: impl Fn(&mut Pooled, &Attempt<'_, A>) -> Result<Outcome<A>, Error<E>> + Sync,
) -> (Traffic<A>, FaultRun)
where
    A: Clone + Send + Debug,
    E: Label,
{
    let began = Instant::now();
    let keys = requests.iter().max().map_or(0, |last| last + 1);
    let clients_done = AtomicBool::new(false);
    let next_request = AtomicUsize::new(0);
    let next_attempt = AtomicI64::new(1);
    let answered = AtomicUsize::new(0);
    let op_runs: Vec<AtomicU32> = (0..keys).map(|_| AtomicU32::new(0)).collect();
    let seen = Seen {
        answers: Mutex::new(Vec::new()),
        commits: Mutex::new(Vec::new()),
        unknown: Mutex::new(Vec::new()),
        errors: ErrorCounts::default(),
    };
    let (trigger, triggered) = mpsc::channel::<()>();
    let trigger = Mutex::new(Some(trigger));

    let (fault_run, probe) = thread::scope(|scope| {
        let clients_running = SetOnDrop(&clients_done);
        let probe = scope.spawn(|| probe_writes(schema.url(), &clients_done));
        let fault_thread = scope.spawn(move || {
            // Clients that all end before the trigger drop the sender; the
            // fault is skipped then, and the run fails below.
            triggered.recv().ok().map(|()| formation.inject(fault))
        });
        let workers: Vec<_> = (0..clients.threads)
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let index = next_request.fetch_add(1, Ordering::SeqCst);
                        let Some(&key) = requests.get(index) else { break };
                        let answer = request(pool, index, key, &next_attempt, &op_runs[key], &seen, &call);
                        let at = Instant::now();
                        if !answer.replayed {
                            locked(&seen.commits).push(at);
                        }
                        locked(&seen.answers).push((index, at, answer));
                        if answered.fetch_add(1, Ordering::SeqCst) + 1 == clients.fault_after
                            && let Some(trigger) = locked(&trigger).take()
                        {
                            trigger.send(()).expect("the fault thread waits for its trigger");
                        }
                        thread::sleep(clients.think);
                    }
                })
            })
            .collect();
        let ends: Vec<_> = workers.into_iter().map(|worker| worker.join()).collect();
        drop(clients_running);
        locked(&trigger).take();
        let fault_run = fault_thread.join().expect("the fault thread does not panic");
        let probe = probe.join().expect("the probe does not panic");
        for end in ends {
            if let Err(panic) = end {
                std::panic::resume_unwind(panic);
            }
        }
        (fault_run, probe)
    });
    let fault_run = fault_run.expect("the fault was injected: the clients answered enough requests to trigger it");

    let mut answers = seen.answers.into_inner().unwrap_or_else(PoisonError::into_inner);
    answers.sort_by_key(|(index, _, _)| *index);
    let last_answer = answers.iter().map(|(_, at, _)| *at).max().unwrap_or(began);
    (
        Traffic {
            began,
            answers: answers.into_iter().map(|(_, _, answer)| answer).collect(),
            commits: seen.commits.into_inner().unwrap_or_else(PoisonError::into_inner),
            probe,
            errors: seen.errors.into_inner(),
            unknown: seen.unknown.into_inner().unwrap_or_else(PoisonError::into_inner),
            op_runs: op_runs.iter().map(|runs| runs.load(Ordering::SeqCst)).collect(),
            last_answer,
        },
        fault_run,
    )
}

/// One request: the same key and request until it gets an answer.
fn request<A, E>(
    pool: &PgPool,
    index: usize,
    key: usize,
    next_attempt: &AtomicI64,
    runs: &AtomicU32,
    seen: &Seen<A>,
    call: &impl Fn(&mut Pooled, &Attempt<'_, A>) -> Result<Outcome<A>, Error<E>>,
) -> Answer<A>
where
    A: Clone,
    E: Label,
{
    let deadline = Instant::now() + RETRY_PATIENCE;
    let mut backoff = Duration::from_millis(10);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let attempt = Attempt {
            key,
            id: next_attempt.fetch_add(1, Ordering::SeqCst),
            runs,
            returned: RefCell::new(None),
        };
        let error = match pool.get() {
            Err(error) => error.label(),
            Ok(mut conn) => match call(&mut conn, &attempt) {
                Ok(outcome) => {
                    let replayed = outcome.is_replayed();
                    return Answer {
                        key,
                        value: outcome.into_inner(),
                        replayed,
                        attempts,
                    };
                }
                Err(error) => {
                    let label = error.label();
                    if let Some(answer) = attempt.returned.into_inner() {
                        locked(&seen.unknown).push(Unknown {
                            request: index,
                            key,
                            answer,
                            error: label.clone(),
                        });
                    }
                    label
                }
            },
        };
        assert!(
            Instant::now() < deadline,
            "key {key} unanswered after {attempts} attempts in {RETRY_PATIENCE:?}; last error: {error}"
        );
        seen.errors.add(error);
        thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

/// What the database holds after a run, per key: the stored result of the
/// key record, and the answers its domain effects stand for (one per
/// execution that committed).
pub struct Stored<A> {
    pub results: HashMap<usize, A>,
    pub effects: HashMap<usize, Vec<A>>,
}

/// The verdict on a run, printed by `report` and asserted by the tests.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Answers a client got that the database does not hold (or holds
    /// otherwise), and keys answered without a stored result or effect.
    pub lost: usize,
    /// Executions beyond the first that committed, over all keys.
    pub double: usize,
    /// Unknown outcomes that had committed; the retry replayed them.
    pub unknown_committed: usize,
    /// Unknown outcomes that had not committed; the retry executed the key.
    pub unknown_reexecuted: usize,
    /// Unknown outcomes that had not committed; the retry replayed another
    /// request's execution of the key.
    pub unknown_replayed_other: usize,
    /// Unknown outcomes resolved any other way (never expected).
    pub unknown_unresolved: usize,
    /// How each unknown outcome was resolved, in the order of `Traffic::unknown`.
    pub resolutions: Vec<&'static str>,
    /// Each lost answer: what the client got, and what the database holds.
    pub lost_answers: Vec<String>,
}

pub fn judge<A: PartialEq + Debug>(traffic: &Traffic<A>, requests: &[usize], stored: &Stored<A>) -> Verdict {
    let mut verdict = Verdict::default();
    for (answer, &key) in traffic.answers.iter().zip(requests) {
        assert_eq!(answer.key, key, "answers are kept in request order");
        let effect = stored.effects.get(&key).and_then(|effects| effects.first());
        let result = stored.results.get(&key);
        if result != Some(&answer.value) || effect != Some(&answer.value) {
            verdict.lost += 1;
            verdict.lost_answers.push(format!(
                "key {key}: the client got {:?} ({}, attempt {}); stored result {result:?}, effect {effect:?}",
                answer.value,
                if answer.replayed { "replayed" } else { "executed" },
                answer.attempts
            ));
        }
    }
    for effects in stored.effects.values() {
        verdict.double += effects.len().saturating_sub(1);
    }
    for unknown in &traffic.unknown {
        let final_answer = &traffic.answers[unknown.request];
        let committed = stored.results.get(&unknown.key) == Some(&unknown.answer);
        let resolution = match (committed, final_answer.replayed, final_answer.value == unknown.answer) {
            (true, true, true) => {
                verdict.unknown_committed += 1;
                "had committed; the retry replayed it"
            }
            (false, false, false) => {
                verdict.unknown_reexecuted += 1;
                "had not committed; the retry executed"
            }
            (false, true, false) => {
                verdict.unknown_replayed_other += 1;
                "had not committed; the retry replayed another request's execution"
            }
            _ => {
                verdict.unknown_unresolved += 1;
                "UNRESOLVED"
            }
        };
        verdict.resolutions.push(resolution);
    }
    verdict
}

fn seconds(duration: Duration) -> String {
    format!("{:.2} s", duration.as_secs_f64())
}

fn at(began: Instant, instant: Instant) -> String {
    format!("+{:.1} s", instant.saturating_duration_since(began).as_secs_f64())
}

/// Prints the figures of one run, per fault, for the README and the CI log.
pub fn report<A: Debug>(
    title: &str,
    traffic: &Traffic<A>,
    fault: &FaultRun,
    verdict: &Verdict,
    extra: &[(String, BTreeMap<String, usize>)],
) {
    let began = traffic.began;
    let (gap, gap_start) = longest_gap(&traffic.commits, began);
    let (probe_gap, probe_gap_start) = longest_gap(&traffic.probe.commits, began);
    let keys = traffic.op_runs.len();
    let runs: u32 = traffic.op_runs.iter().sum();
    let mut out = String::new();
    let _ = writeln!(out, "\n== {title}: {} ==", fault.fault);
    for line in fault.output.lines() {
        let _ = writeln!(out, "   {line}");
    }
    let _ = writeln!(
        out,
        "fault: from {} to {}, primary {} -> {}",
        at(began, fault.started),
        at(began, fault.finished),
        fault.primary_before,
        fault.primary_after
    );
    let _ = writeln!(
        out,
        "requests: {} over {keys} keys, last answered at {}",
        traffic.answers.len(),
        at(began, traffic.last_answer)
    );
    let _ = writeln!(
        out,
        "writes unavailable: {} (longest gap between two successful commits, from {})",
        seconds(gap),
        at(began, gap_start)
    );
    let _ = writeln!(
        out,
        "  the database itself: {} (longest gap between the writes of a probe every 50 ms, from {})",
        seconds(probe_gap),
        at(began, probe_gap_start)
    );
    let errors: usize = traffic.errors.values().sum();
    let most_attempts = traffic.answers.iter().map(|answer| answer.attempts).max().unwrap_or(0);
    let _ = writeln!(
        out,
        "client errors: {errors} (at most {most_attempts} attempts for one request)"
    );
    for (label, count) in &traffic.errors {
        let _ = writeln!(out, "  {count:>5}  {label}");
    }
    for (what, counts) in extra {
        let _ = writeln!(out, "{what}: {}", counts.values().sum::<usize>());
        for (label, count) in counts {
            let _ = writeln!(out, "  {count:>5}  {label}");
        }
    }
    let _ = writeln!(
        out,
        "operation runs: {runs} for {keys} keys ({} rolled back with their transaction)",
        runs as usize - keys.min(runs as usize)
    );
    let _ = writeln!(
        out,
        "unknown-outcome commits: {} (had committed, the retry replayed it: {}; had not, the retry executed: {}; \
         had not, the retry replayed another request's execution: {}; otherwise: {})",
        traffic.unknown.len(),
        verdict.unknown_committed,
        verdict.unknown_reexecuted,
        verdict.unknown_replayed_other,
        verdict.unknown_unresolved
    );
    for (unknown, resolution) in traffic.unknown.iter().zip(&verdict.resolutions) {
        let _ = writeln!(out, "  key {}: {} -> {resolution}", unknown.key, unknown.error);
    }
    let _ = writeln!(out, "lost results: {}", verdict.lost);
    for lost in &verdict.lost_answers {
        let _ = writeln!(out, "  {lost}");
    }
    let _ = writeln!(out, "double executions: {}", verdict.double);
    print!("{out}");
}

/// Asserts what every run must show, whatever the fault.
pub fn assert_no_loss_no_double<A>(verdict: &Verdict, traffic: &Traffic<A>, fault: &FaultRun) {
    assert_eq!(verdict.lost, 0, "acknowledged results lost");
    assert_eq!(verdict.double, 0, "keys executed more than once");
    assert_eq!(
        verdict.unknown_unresolved, 0,
        "unknown outcomes resolved neither by replay nor execution"
    );
    assert!(
        fault.started < traffic.last_answer,
        "the fault began after the last answer, so it did not land in the traffic"
    );
}
