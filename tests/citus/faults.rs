//! The core contract on distributed tables under faults: what a caller is
//! told matches what committed, and a retry with the same key replays
//! exactly the calls that committed and executes the others.
//!
//! Threads place orders through the coordinator, each call with a key of
//! its own and a scope among several tenants whose shards lie on both
//! workers, while the test ends sessions at random moments (a caller's own
//! on the coordinator, or the coordinator's connections to the workers on
//! its behalf) or restarts a worker. Afterwards every answer is compared
//! with what the database holds:
//!
//! - `Ok`: the order and its key record committed, with the value told;
//! - `OutcomeUnknown`: they may have committed;
//! - any other error: nothing committed.
//!
//! Then every failed call is retried with its key: it replays exactly when
//! it had committed, with the value that committed, and executes otherwise;
//! in the end every key has exactly one order.
//!
//! One fault is placed rather than drawn: a worker that committed and lost
//! its answer to the coordinator's COMMIT, which Citus reports to the
//! client as an error over a connection still up. The caller must be told
//! `OutcomeUnknown`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool, PooledConnection};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Integer, Text};
use idempotency::{Config, Error, Outcome};

use crate::wait::{Barrier, PATIENCE, wait_for};
use crate::{Db, PlaceOrder, Worker, idempotency_keys, orders, place_order, placement_of, workers};

const THREADS: usize = 6;
/// Tenants, each a scope and the account of its orders, half of them with
/// their shard on each worker.
const TENANTS: usize = 6;
/// The killer runs at least this long, then until the kills have hit
/// operations and commits often enough, and never longer than [`MOST`].
const LEAST: Duration = Duration::from_secs(3);
const MOST: Duration = Duration::from_secs(12);
const ENOUGH: usize = 15;
const MOST_CALLS_PER_THREAD: usize = 3_000;
/// How many calls must commit on the restarted worker's tenants before its
/// restart, and again after it.
const COMMITS_AROUND_RESTART: usize = 20;

/// What a call was told, as far as what committed is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Told {
    /// `Ok`, with the order's id: the order and its key record committed.
    Committed(i64),
    /// `OutcomeUnknown`: they may have committed.
    Unknown,
    /// Any other error, by kind: nothing committed.
    Nothing(String),
}

/// One call: its tenant (scope and account), its key (also its order's
/// item), what it was told, and the error as it was returned.
#[derive(Debug, Clone)]
struct Answer {
    tenant: String,
    key: String,
    told: Told,
    error: Option<String>,
}

/// How diesel classified a failed statement: whether libpq saw the
/// connection go down, or the server answered with an error.
fn diesel_kind(error: &DieselError) -> &'static str {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, _) => "closed connection",
        DieselError::DatabaseError(DatabaseErrorKind::UnableToSendCommand, _) => "unable to send",
        DieselError::DatabaseError(_, _) => "server error",
        DieselError::RollbackErrorOnCommit { .. } => "rollback error on commit",
        _ => "other",
    }
}

fn told(result: &Result<Outcome<i64>, Error<DieselError>>) -> (Told, Option<String>) {
    let error = match result {
        Ok(Outcome::Executed(id) | Outcome::Replayed(id)) => return (Told::Committed(*id), None),
        Err(error) => error,
    };
    let told = match error {
        Error::OutcomeUnknown(_) => Told::Unknown,
        Error::Storage(e) if error.is_retryable() => Told::Nothing(format!("Storage, retryable ({})", diesel_kind(e))),
        Error::Storage(e) => Told::Nothing(format!("Storage, not retryable ({})", diesel_kind(e))),
        Error::Operation(e) => Told::Nothing(format!("Operation ({})", diesel_kind(e))),
        Error::InProgress => Told::Nothing("InProgress".into()),
        Error::Mismatch => Told::Nothing("Mismatch".into()),
        Error::Codec(_) => Told::Nothing("Codec".into()),
        _ => Told::Nothing("another error".into()),
    };
    (told, Some(format!("{error:?}")))
}

/// A small generator of pseudo-random numbers: the moments of the faults
/// need no more.
struct Jitter(u64);

impl Jitter {
    fn new(stream: u64) -> Jitter {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |since| since.subsec_nanos());
        Jitter((u64::from(nanos) ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// The coordinator session a caller is on: its backend pid, and its
/// global pid, which names the coordinator's connections to the workers
/// on its behalf (`application_name` `citus_internal gpid=...` there).
/// Zero while the caller changes sessions.
#[derive(Default)]
struct Session {
    pid: AtomicI64,
    gpid: AtomicI64,
}

#[derive(QueryableByName)]
struct SessionIds {
    #[diesel(sql_type = Integer)]
    pid: i32,
    #[diesel(sql_type = BigInt)]
    gpid: i64,
}

/// Sets the flag however the scope that holds it ends, so that a failed
/// fault does not leave the callers running to their last call.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The callers' shared state while they run.
struct Traffic {
    tenants: Vec<String>,
    sessions: Vec<Session>,
    /// Every coordinator backend a caller used, for the two-phase commit
    /// check.
    pids: Mutex<BTreeSet<i64>>,
    answers: Mutex<Vec<Answer>>,
    /// How many times an operation was invoked.
    op_calls: AtomicUsize,
    /// Calls answered `Ok`, per tenant.
    committed: Vec<AtomicUsize>,
    unknown: AtomicUsize,
    nothing: AtomicUsize,
    finished: AtomicUsize,
    stop: AtomicBool,
}

impl Traffic {
    fn new(tenants: Vec<String>) -> Traffic {
        Traffic {
            committed: tenants.iter().map(|_| AtomicUsize::new(0)).collect(),
            tenants,
            sessions: (0..THREADS).map(|_| Session::default()).collect(),
            pids: Mutex::new(BTreeSet::new()),
            answers: Mutex::new(Vec::new()),
            op_calls: AtomicUsize::new(0),
            unknown: AtomicUsize::new(0),
            nothing: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    fn committed_on(&self, tenants: &[usize]) -> usize {
        tenants.iter().map(|&t| self.committed[t].load(Ordering::SeqCst)).sum()
    }

    fn all_finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst) == THREADS
    }

    /// A connection from the pool for caller `thread`, its session noted.
    fn checkout(
        &self,
        pool: &Pool<ConnectionManager<PgConnection>>,
        thread: usize,
    ) -> PooledConnection<ConnectionManager<PgConnection>> {
        // A session the killer still knows as another caller's may be ended
        // under this one before it is noted: check out another then.
        let (conn, ids) = (0..100)
            .find_map(|_| {
                let mut conn = pool.get().expect("a pooled connection to the coordinator");
                let ids: SessionIds = diesel::sql_query("SELECT pg_backend_pid() AS pid, citus_backend_gpid() AS gpid")
                    .get_result(&mut conn)
                    .ok()?;
                Some((conn, ids))
            })
            .expect("a session that lives long enough to say who it is");
        self.pids.lock().expect("pids").insert(i64::from(ids.pid));
        self.sessions[thread].gpid.store(ids.gpid, Ordering::SeqCst);
        self.sessions[thread].pid.store(i64::from(ids.pid), Ordering::SeqCst);
        conn
    }

    /// Caller `thread` places orders, each call with a key of its own, in
    /// turn for each tenant, until stopped; after any error it goes on on a
    /// connection checked out anew.
    fn call(&self, pool: &Pool<ConnectionManager<PgConnection>>, thread: usize, start: &Barrier) {
        let config = Config::default();
        let mut jitter = Jitter::new(thread as u64);
        let mut conn = self.checkout(pool, thread);
        start.wait();
        for n in 0..MOST_CALLS_PER_THREAD {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            let tenant = (thread + n) % self.tenants.len();
            let account = &self.tenants[tenant];
            let key = format!("c{thread}-{n}");
            let pause = Duration::from_micros(jitter.below(3_000));
            let result = config.run(&mut conn, account, &key, &PlaceOrder { item: &key }, |tx| {
                self.op_calls.fetch_add(1, Ordering::SeqCst);
                let id = place_order(tx, account, &key)?;
                // Work after the write: the faults land in the operation,
                // not only in the statements and the commit.
                thread::sleep(pause);
                Ok(id)
            });
            let (told, error) = told(&result);
            match told {
                Told::Committed(_) => self.committed[tenant].fetch_add(1, Ordering::SeqCst),
                Told::Unknown => self.unknown.fetch_add(1, Ordering::SeqCst),
                Told::Nothing(_) => self.nothing.fetch_add(1, Ordering::SeqCst),
            };
            let failed = !matches!(told, Told::Committed(_));
            self.answers.lock().expect("answers").push(Answer {
                tenant: account.clone(),
                key,
                told,
                error,
            });
            if failed {
                self.sessions[thread].pid.store(0, Ordering::SeqCst);
                self.sessions[thread].gpid.store(0, Ordering::SeqCst);
                drop(conn);
                conn = self.checkout(pool, thread);
            }
        }
        self.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// Runs the callers on `THREADS` threads, all starting together with
/// `fault`, which runs on this thread and stops the callers when it
/// returns.
fn under(db: &Db, tenants: Vec<String>, fault: impl FnOnce(&Traffic)) -> Traffic {
    let traffic = Traffic::new(tenants);
    let pool = db.pool(u32::try_from(THREADS).expect("a few threads"));
    let start = Barrier::new(THREADS + 1);
    thread::scope(|s| {
        let _stop = StopOnDrop(&traffic.stop);
        for caller in 0..THREADS {
            let (traffic, pool, start) = (&traffic, &pool, &start);
            s.spawn(move || traffic.call(pool, caller, start));
        }
        start.wait();
        fault(&traffic);
    });
    traffic
}

/// A database of the test's own on the cluster, a connection to its
/// coordinator, and the workers the coordinator lists.
fn cluster() -> (Db, PgConnection, Vec<Worker>) {
    let db = Db::new();
    let mut coordinator = db.coordinator();
    let workers = workers(&mut coordinator);
    (db, coordinator, workers)
}

/// `TENANTS` tenants, half of them with their shard on each worker.
fn tenants_on_both_workers(coordinator: &mut PgConnection, workers: &[Worker]) -> Vec<String> {
    let mut per_worker: BTreeMap<String, usize> = workers.iter().map(|w| (w.name.clone(), 0)).collect();
    let mut tenants = Vec::new();
    for i in 0..1_000 {
        if tenants.len() == TENANTS {
            break;
        }
        let tenant = format!("tenant-{i}");
        let placed = per_worker
            .get_mut(&placement_of(coordinator, &tenant))
            .expect("a shard on a listed worker");
        if *placed < TENANTS / workers.len() {
            *placed += 1;
            tenants.push(tenant);
        }
    }
    assert_eq!(tenants.len(), TENANTS, "tenants on both workers: {per_worker:?}");
    tenants
}

/// Ends a session of a caller every few milliseconds, at random: its own
/// backend on the coordinator, or the coordinator's connections to the
/// workers on its behalf. Returns how many of each it ended.
fn kill_at_random(traffic: &Traffic, coordinator: &mut PgConnection, workers: &mut [Worker]) -> (usize, usize) {
    #[derive(QueryableByName)]
    struct Ended {
        #[diesel(sql_type = BigInt)]
        ended: i64,
    }
    let mut jitter = Jitter::new(THREADS as u64);
    let (mut coordinator_kills, mut worker_kills) = (0, 0);
    let started = Instant::now();
    loop {
        let elapsed = started.elapsed();
        let enough = traffic.unknown.load(Ordering::SeqCst) >= ENOUGH
            && traffic.nothing.load(Ordering::SeqCst) >= ENOUGH
            && coordinator_kills >= ENOUGH
            && worker_kills >= ENOUGH;
        if elapsed >= MOST || (elapsed >= LEAST && enough) || traffic.all_finished() {
            break;
        }
        // A kill every 2 to 10 ms lands at every moment of a call: the
        // moments themselves are what the test draws at random.
        thread::sleep(Duration::from_micros(2_000 + jitter.below(8_000)));
        let victim = &traffic.sessions[usize::try_from(jitter.below(THREADS as u64)).expect("an index")];
        let (pid, gpid) = (victim.pid.load(Ordering::SeqCst), victim.gpid.load(Ordering::SeqCst));
        if pid == 0 {
            continue;
        }
        if jitter.below(2) == 0 {
            let ended: Ended = diesel::sql_query("SELECT pg_terminate_backend($1::int)::int::bigint AS ended")
                .bind::<BigInt, _>(pid)
                .get_result(coordinator)
                .expect("end a caller's session on the coordinator");
            coordinator_kills += usize::from(ended.ended > 0);
        } else {
            let name = format!("citus_internal gpid={gpid}");
            let mut ended = 0;
            for worker in workers.iter_mut() {
                ended += diesel::sql_query(
                    "SELECT coalesce(sum(pg_terminate_backend(pid)::int), 0)::bigint AS ended
                     FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind::<Text, _>(&name)
                .get_result::<Ended>(&mut worker.conn)
                .unwrap_or_else(|e| panic!("end the coordinator's connections on {}: {e}", worker.name))
                .ended;
            }
            worker_kills += usize::from(ended > 0);
        }
    }
    (coordinator_kills, worker_kills)
}

/// Every order in the test's schema, by tenant and key (its item), with
/// its ids.
fn orders_by_key(conn: &mut PgConnection) -> HashMap<(String, String), Vec<i64>> {
    let mut placed: HashMap<(String, String), Vec<i64>> = HashMap::new();
    for (account, item, id) in orders::table
        .select((orders::account, orders::item, orders::id))
        .load::<(String, String, i64)>(conn)
        .expect("read the orders")
    {
        placed.entry((account, item)).or_default().push(id);
    }
    placed
}

fn key_records(conn: &mut PgConnection) -> BTreeSet<(String, String)> {
    idempotency_keys::table
        .select((idempotency_keys::scope, idempotency_keys::idempotency_key))
        .load::<(String, String)>(conn)
        .expect("read the key records")
        .into_iter()
        .collect()
}

/// The counts of the answers, by what they told.
fn tally(answers: &[Answer]) -> BTreeMap<String, usize> {
    let mut tally = BTreeMap::new();
    for answer in answers {
        let told = match &answer.told {
            Told::Committed(_) => "committed".to_owned(),
            Told::Unknown => "OutcomeUnknown".to_owned(),
            Told::Nothing(kind) => kind.clone(),
        };
        *tally.entry(told).or_default() += 1;
    }
    tally
}

/// The errors returned, with their numbers blurred, and how often each.
fn errors_seen(answers: &[Answer]) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for error in answers.iter().filter_map(|a| a.error.as_deref()) {
        let mut blurred = String::new();
        for c in error.chars() {
            if !c.is_ascii_digit() {
                blurred.push(c);
            } else if !blurred.ends_with('#') {
                blurred.push('#');
            }
        }
        *seen.entry(blurred).or_default() += 1;
    }
    seen
}

/// The two-phase commits of the callers' coordinator sessions, recorded on
/// the coordinator or left prepared on a worker. Citus names each
/// `citus_<group>_<pid>_<transaction>_<connection>`, with the pid of the
/// coordinator backend that ran the transaction.
fn two_phase_commits_of(pids: &BTreeSet<i64>, coordinator: &mut PgConnection, workers: &mut [Worker]) -> Vec<String> {
    let ours = |gid: &String| {
        gid.split('_')
            .nth(2)
            .and_then(|pid| pid.parse::<i64>().ok())
            .is_some_and(|pid| pids.contains(&pid))
    };
    let mut found: Vec<String> = crate::lines(
        coordinator,
        "SELECT 'recorded ' || gid::text AS line FROM pg_dist_transaction",
    )
    .into_iter()
    .filter(|line| ours(&line["recorded ".len()..].to_owned()))
    .collect();
    for worker in workers {
        let prepared = crate::lines(&mut worker.conn, "SELECT gid::text AS line FROM pg_prepared_xacts");
        found.extend(
            prepared
                .into_iter()
                .filter(ours)
                .map(|gid| format!("prepared on {}: {gid}", worker.name)),
        );
    }
    found
}

/// The orders by key, each key's placed once (`when`, for the message).
fn orders_placed_once(conn: &mut PgConnection, when: &str) -> HashMap<(String, String), Vec<i64>> {
    let placed = orders_by_key(conn);
    let twice: Vec<_> = placed.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "orders placed twice {when}: {twice:?}");
    placed
}

/// The truth check: every answer against what committed, then every failed
/// call retried with its key, and every key with exactly one order in the
/// end. Returns a summary of the retries.
fn assert_every_call_told_what_committed(db: &Db, traffic: &Traffic) -> String {
    let answers = traffic.answers.lock().expect("answers").clone();
    let mut conn = db.conn();
    let placed = orders_placed_once(&mut conn, "under faults");
    let records = key_records(&mut conn);
    let order_keys: BTreeSet<(String, String)> = placed.keys().cloned().collect();
    assert_eq!(
        order_keys, records,
        "every order has its key record, and every record its order"
    );
    let calls: BTreeSet<(String, String)> = answers.iter().map(|a| (a.tenant.clone(), a.key.clone())).collect();
    assert_eq!(calls.len(), answers.len(), "every call had a key of its own");
    let strays: Vec<_> = records.difference(&calls).collect();
    assert!(strays.is_empty(), "records of no call: {strays:?}");
    let op_calls = traffic.op_calls.load(Ordering::SeqCst);
    assert!(
        op_calls <= answers.len(),
        "the operation ran at most once per call: {op_calls} runs for {} calls",
        answers.len()
    );

    let lies: Vec<&Answer> = answers
        .iter()
        .filter(|a| {
            let committed = placed.get(&(a.tenant.clone(), a.key.clone()));
            match a.told {
                Told::Committed(id) => committed != Some(&vec![id]),
                Told::Unknown => false,
                Told::Nothing(_) => committed.is_some(),
            }
        })
        .collect();
    assert!(
        lies.is_empty(),
        "{} of {} calls were told the opposite of what committed (answers: {:?}); the first: {:#?}",
        lies.len(),
        answers.len(),
        tally(&answers),
        &lies[..lies.len().min(5)]
    );

    // Every call that failed retries with its key: it replays the value
    // that committed if it committed, and executes otherwise.
    let config = Config::default();
    let retry_calls = AtomicUsize::new(0);
    let (mut replayed, mut executed) = (0, 0);
    for a in answers.iter().filter(|a| !matches!(a.told, Told::Committed(_))) {
        let committed = placed.get(&(a.tenant.clone(), a.key.clone())).map(|ids| ids[0]);
        let retry = config
            .run(&mut conn, &a.tenant, &a.key, &PlaceOrder { item: &a.key }, |tx| {
                retry_calls.fetch_add(1, Ordering::SeqCst);
                place_order(tx, &a.tenant, &a.key)
            })
            .unwrap_or_else(|error| panic!("the retry of {a:?} failed: {error:?}"));
        match (retry, committed) {
            (Outcome::Replayed(id), Some(stored)) => {
                assert_eq!(id, stored, "the retry of {a:?} replays the order that committed");
                replayed += 1;
            }
            (Outcome::Executed(_), None) => executed += 1,
            (retry, committed) => panic!(
                "the retry of {a:?} replays exactly when the call committed: {retry:?}, committed: {committed:?}"
            ),
        }
    }
    assert_eq!(
        retry_calls.into_inner(),
        executed,
        "a retry runs the operation only when it executes"
    );

    let order_keys: BTreeSet<(String, String)> =
        orders_placed_once(&mut conn, "after the retries").into_keys().collect();
    assert_eq!(
        order_keys, calls,
        "every call's key has exactly one order after the retries"
    );
    assert_eq!(key_records(&mut conn), calls, "and its key record");
    format!("retries: {replayed} replayed, {executed} executed; operation runs: {op_calls} under faults")
}

/// A storage error the faults caused is one a retry answers, and says so.
fn assert_lost_connections_recognised(traffic: &Traffic) {
    let answers = traffic.answers.lock().expect("answers");
    let unrecognised: Vec<&Answer> = answers
        .iter()
        .filter(|a| matches!(&a.told, Told::Nothing(kind) if kind.starts_with("Storage, not retryable")))
        .collect();
    assert!(
        unrecognised.is_empty(),
        "{} storage errors were said not to be retryable; the first: {:#?}",
        unrecognised.len(),
        &unrecognised[..unrecognised.len().min(5)]
    );
}

fn report(what: &str, traffic: &Traffic, retries: &str, two_phase: &[String]) {
    let answers = traffic.answers.lock().expect("answers");
    println!(
        "{what}: {} calls: {:?}; {retries}; two-phase commits of the callers' sessions: {}",
        answers.len(),
        tally(&answers),
        two_phase.len()
    );
    for (error, count) in errors_seen(&answers) {
        println!("  {count:5} x {error}");
    }
}

/// The checks after the faults: every answer against what committed, every
/// failed call retried, lost connections recognised, and no two-phase
/// commit of the callers' sessions, with the figures printed.
fn assert_told_what_committed_without_two_phase_commit(
    db: &Db,
    traffic: &Traffic,
    summary: &str,
    coordinator: &mut PgConnection,
    workers: &mut [Worker],
) {
    let retries = assert_every_call_told_what_committed(db, traffic);
    let pids = traffic.pids.lock().expect("pids").clone();
    let two_phase = two_phase_commits_of(&pids, coordinator, workers);
    report(summary, traffic, &retries, &two_phase);
    assert_lost_connections_recognised(traffic);
    assert!(
        two_phase.is_empty(),
        "single-shard calls commit without two-phase commit, and leave nothing prepared: {two_phase:?}"
    );
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn killed_coordinator_and_worker_sessions_leave_every_call_told_what_committed() {
    let (db, mut coordinator, mut workers) = cluster();
    assert_eq!(workers.len(), 2, "a cluster of two workers");
    let tenants = tenants_on_both_workers(&mut db.conn(), &workers);

    let mut kills = (0, 0);
    let traffic = under(&db, tenants, |traffic| {
        kills = kill_at_random(traffic, &mut coordinator, &mut workers);
    });
    let (coordinator_kills, worker_kills) = kills;
    let summary = format!(
        "{} kills: {coordinator_kills} of callers' coordinator sessions, {worker_kills} of the coordinator's connections to workers",
        coordinator_kills + worker_kills
    );
    let (unknown, nothing) = (
        traffic.unknown.load(Ordering::SeqCst),
        traffic.nothing.load(Ordering::SeqCst),
    );
    // The kills must have hit commits (an unknown outcome) and operations
    // or statements before the commit (an error), or the comparison
    // proves little.
    assert!(
        coordinator_kills > 0 && worker_kills > 0 && unknown > 0 && nothing > 0,
        "{summary} hit too few calls to compare: {:?}",
        tally(&traffic.answers.lock().expect("answers"))
    );

    assert_told_what_committed_without_two_phase_commit(&db, &traffic, &summary, &mut coordinator, &mut workers);
}

/// The directory of the cluster, whose workers the test restarts.
fn citus_dir() -> String {
    std::env::var("CITUS_DIR").expect(
        "the Citus fault tests need CITUS_DIR, the directory of the running cluster named by \
         CITUS_DATABASE_URL, to restart a worker: .ci/citus start DIR && \
         CITUS_DATABASE_URL=$(.ci/citus url DIR) CITUS_DIR=DIR cargo test --features postgres --test citus -- --include-ignored",
    )
}

/// `.ci/citus restart DIR NODE`, waited for at most [`PATIENCE`].
fn restart(dir: &str, node: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/citus");
    let mut child = Command::new(script)
        .args(["restart", dir, node])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("the restart's status") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{script} restart {dir} {node} did not end within {PATIENCE:?}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    // Ended: its pipes hold what it wrote (the node's own output goes to its log).
    let output = child.wait_with_output().expect("the restart's output");
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(status.success(), "{script} restart {dir} {node}: {status}: {output}");
}

fn postmaster_started(worker: &mut Worker) -> String {
    crate::lines(&mut worker.conn, "SELECT pg_postmaster_start_time()::text AS line")
        .pop()
        .expect("one line")
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn a_worker_restarted_mid_traffic_leaves_every_call_told_what_committed() {
    let dir = citus_dir();
    let (db, mut coordinator, mut listed) = cluster();
    assert_eq!(listed.len(), 2, "a cluster of two workers");
    let tenants = tenants_on_both_workers(&mut db.conn(), &listed);
    // `.ci/citus` numbers the workers by port, as `workers` lists them.
    let node = "worker1";
    let restarted = listed[0].name.clone();
    let started_before = postmaster_started(&mut listed[0]);
    drop(listed);
    let mut conn = db.conn();
    let on_restarted: Vec<usize> = (0..tenants.len())
        .filter(|&t| placement_of(&mut conn, &tenants[t]) == restarted)
        .collect();

    let mut took = Duration::ZERO;
    let traffic = under(&db, tenants, |traffic| {
        wait_for("calls to commit on the worker before its restart", || {
            traffic.committed_on(&on_restarted) >= COMMITS_AROUND_RESTART
        });
        let begun = Instant::now();
        restart(&dir, node);
        took = begun.elapsed();
        let after = traffic.committed_on(&on_restarted);
        wait_for("calls to commit on the worker after its restart", || {
            traffic.committed_on(&on_restarted) >= after + COMMITS_AROUND_RESTART
        });
    });

    let mut workers = workers(&mut coordinator);
    let started_after = postmaster_started(&mut workers[0]);
    assert_ne!(started_before, started_after, "{node} ({restarted}) restarted");
    let summary = format!("{node} ({restarted}) restarted in {took:?}");
    assert!(
        traffic.nothing.load(Ordering::SeqCst) + traffic.unknown.load(Ordering::SeqCst) > 0,
        "{summary} without failing a call: {:?}",
        tally(&traffic.answers.lock().expect("answers"))
    );

    assert_told_what_committed_without_two_phase_commit(&db, &traffic, &summary, &mut coordinator, &mut workers);
}

/// A worker that makes a commit wait for a synchronous standby it does not
/// have, only for transactions that ask for it (`synchronous_commit = on`,
/// the default made `local`, which is the same without standbys): such a
/// commit is written on the worker and waits there, its answer not yet
/// sent. Put back however the test ends.
struct CommitsAwaitingAStandby<'a> {
    worker: &'a mut Worker,
}

impl<'a> CommitsAwaitingAStandby<'a> {
    fn on(worker: &'a mut Worker) -> CommitsAwaitingAStandby<'a> {
        for statement in [
            "ALTER SYSTEM SET synchronous_commit = 'local'",
            "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
            "SELECT pg_reload_conf()",
        ] {
            diesel::sql_query(statement)
                .execute(&mut worker.conn)
                .unwrap_or_else(|e| panic!("{statement} on {}: {e}", worker.name));
        }
        wait_for("the worker to load its new settings", || {
            crate::lines(
                &mut worker.conn,
                "SELECT current_setting('synchronous_standby_names') AS line",
            ) == ["nobody"]
        });
        CommitsAwaitingAStandby { worker }
    }
}

impl Drop for CommitsAwaitingAStandby<'_> {
    fn drop(&mut self) {
        for statement in [
            "ALTER SYSTEM RESET synchronous_standby_names",
            "ALTER SYSTEM RESET synchronous_commit",
            "SELECT pg_reload_conf()",
        ] {
            let _ = diesel::sql_query(statement).execute(&mut self.worker.conn);
        }
    }
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn a_commit_whose_answer_a_worker_loses_is_told_outcome_unknown() {
    let (db, _coordinator, mut listed) = cluster();
    let tenant = "acct-lost-answer";
    let mut conn = db.conn();
    let home = placement_of(&mut conn, tenant);
    let worker = listed.iter_mut().find(|w| w.name == home).expect("the tenant's worker");
    // The coordinator passes the transaction's own setting on to the worker.
    diesel::sql_query("SET citus.propagate_set_commands = 'local'")
        .execute(&mut conn)
        .expect("propagate SET LOCAL");
    let ids: SessionIds = diesel::sql_query("SELECT pg_backend_pid() AS pid, citus_backend_gpid() AS gpid")
        .get_result(&mut conn)
        .expect("the session's global pid");
    let calls = AtomicUsize::new(0);
    let place = |conn: &mut PgConnection| {
        idempotency::run_idempotent(conn, tenant, "order-1", &PlaceOrder { item: "book" }, |tx| {
            calls.fetch_add(1, Ordering::SeqCst);
            diesel::sql_query("SET LOCAL synchronous_commit = on").execute(tx)?;
            place_order(tx, tenant, "book")
        })
    };

    let waiting = CommitsAwaitingAStandby::on(worker);
    let (told, mut conn) = thread::scope(|s| {
        let caller = s.spawn(|| (place(&mut conn), conn));
        // The worker has committed and waits for the standby before it
        // answers; ending its session there loses the answer.
        let name = format!("citus_internal gpid={}", ids.gpid);
        let query = format!(
            "SELECT pid::text AS line FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND application_name = '{name}'"
        );
        wait_for("the worker's commit to wait for the standby", || {
            !crate::lines(&mut waiting.worker.conn, &query).is_empty()
        });
        crate::lines(
            &mut waiting.worker.conn,
            &query.replace("pid::text AS line", "pg_terminate_backend(pid)::text AS line"),
        );
        let deadline = Instant::now() + PATIENCE;
        while !caller.is_finished() {
            assert!(Instant::now() < deadline, "the caller did not end within {PATIENCE:?}");
            thread::sleep(Duration::from_millis(1));
        }
        caller.join().expect("the caller")
    });
    drop(waiting);

    assert_eq!(
        crate::orders_and_key_records(&mut conn, tenant),
        (1, 1),
        "the worker committed the order and its key record"
    );
    assert!(
        matches!(told, Err(Error::OutcomeUnknown(_))),
        "a commit that may have happened is told OutcomeUnknown, not an error that says nothing committed: {told:?}"
    );
    let retry = place(&mut conn).expect("the retry");
    assert!(retry.is_replayed(), "the retry replays: {retry:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
}
