//! `--backend citus`: what a call costs on a Citus cluster, next to the same
//! scenarios on plain PostgreSQL, measured in one run.
//!
//! The domain operation inserts an order into `orders(account, id, item)`,
//! distributed by `account` on Citus; the crate's tables are distributed by
//! `scope` and co-located with it by `idempotency::citus::distribute`,
//! and every call's scope is the order's tenant, so that a call runs on one
//! worker. Per call, with the scenarios taking turns call by call:
//!
//! - `baseline`: the domain transaction alone;
//! - `floor`: the domain transaction plus one plain insert of a completed
//!   key record into a twin of the key table, distributed like it: the
//!   overhead bench's `floor`, which its `first / floor` targets refer to;
//! - `first, claim first`: a first call with the setting
//!   `idempotency.claim_first` on, as `distribute` leaves it for the whole
//!   database: the key claimed by a guarded insert before the operation,
//!   correct from any node;
//! - `first, lock`: the same with the setting off: the advisory lock and a
//!   read, which order the calls of one node only (see [`Hold`] for how a
//!   session gets either on Citus);
//! - `replay`: a retry of a completed key, answered by the read before any
//!   transaction, whatever the setting.
//!
//! Each runs through the coordinator (`citus`), through a worker for tenants
//! whose shard that worker holds (`worker, own shard`) and for tenants whose
//! shard the other worker holds (`worker, other shard`), and on the plain
//! PostgreSQL server of `DATABASE_URL` (`postgres`). Citus 13 syncs its
//! metadata to the workers, so a session on a worker reaches every shard.
//! A worker runs only claim-first calls: the lock path is not correct there.
//!
//! Throughput: calls per second of `first` at 1 to 16 threads, each with a
//! connection of its own, every call a key of its own and a tenant picked
//! at random among many, so that both workers take load: on Citus through
//! the coordinator and on plain PostgreSQL, each with either hold. The
//! thread counts and the four databases take turns, round after round.
//!
//! No session waits for its commits to reach the disk (`synchronous_commit
//! = off`), as on the cluster `.ci/citus` starts, whose nodes run with
//! `fsync = off`: plain PostgreSQL is measured on the same terms.
//!
//! The cluster's coordinator is `CITUS_DATABASE_URL`; the bench works in a
//! schema of its own there and on `DATABASE_URL`, with two roles of its own
//! on each server, all dropped at the end.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{Integer, Text};
use idempotency::{Config, Outcome};
use serde_json::{Value, json};

use crate::common::Scratch;
use crate::db::{CompletedKey, KEY_COLUMNS, REQUEST, floor_keys};
use crate::instrument::StatementCounter;
use crate::load::SCALING_THREADS;
use crate::stats::{Keys, median, round3};

diesel::table! {
    orders (account, id) {
        account -> Text,
        id -> BigInt,
        item -> Text,
    }
}

/// How much work each part gets.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Rounds of the per-call scenarios.
    rounds: usize,
    /// Calls of each scenario per round.
    calls: usize,
    /// Rounds of the throughput part, each visiting every database and
    /// thread count.
    throughput_rounds: usize,
    /// How long each database and thread count runs in one round.
    throughput_time: Duration,
}

const FULL: Sizes = Sizes {
    rounds: 15,
    calls: 60,
    throughput_rounds: 3,
    throughput_time: Duration::from_millis(1500),
};

const QUICK: Sizes = Sizes {
    rounds: 3,
    calls: 10,
    throughput_rounds: 1,
    throughput_time: Duration::from_millis(200),
};

/// Tenants, each its own scope and `account`: enough that their hashes
/// spread over the shards of a table (32 by default) and so over both
/// workers.
const TENANTS: usize = 64;

/// How a session holds a key during a first call.
///
/// A session cannot choose with `SET` alone on Citus: the crate reads the
/// setting in the statement that reads the key record, and Citus runs that
/// statement on the worker holding the tenant's shard, in a session it
/// opens there, which has the database's setting (`on`, as `distribute`
/// leaves it). A setting of the session's role reaches those sessions,
/// since Citus opens them as the current role; `SET` covers the session's
/// own node, where a role's setting applies only at login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// `idempotency.claim_first = on`: a guarded insert before the operation.
    ClaimFirst,
    /// `idempotency.claim_first = off`: the advisory lock and a read.
    Lock,
}

impl Hold {
    const BOTH: [Hold; 2] = [Hold::ClaimFirst, Hold::Lock];

    fn name(self) -> &'static str {
        match self {
            Hold::ClaimFirst => "claim first",
            Hold::Lock => "lock",
        }
    }

    fn setting(self) -> &'static str {
        match self {
            Hold::ClaimFirst => "on",
            Hold::Lock => "off",
        }
    }

    /// The role with this hold's setting in the schema `schema`.
    fn role(self, schema: &str) -> String {
        format!("{schema}_{}", self.setting())
    }
}

/// What one call of a scenario does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Baseline,
    Floor,
    First(Hold),
    Replay,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Baseline => "baseline",
            Call::Floor => "floor",
            Call::First(Hold::ClaimFirst) => "first, claim first",
            Call::First(Hold::Lock) => "first, lock",
            Call::Replay => "replay",
        }
    }
}

/// The calls measured through the coordinator and on plain PostgreSQL.
const ALL_CALLS: [Call; 5] = [
    Call::Baseline,
    Call::Floor,
    Call::First(Hold::ClaimFirst),
    Call::First(Hold::Lock),
    Call::Replay,
];
/// The calls measured through a worker: only claim-first calls are correct
/// there.
const WORKER_CALLS: [Call; 3] = [Call::Baseline, Call::Floor, Call::First(Hold::ClaimFirst)];

/// The places calls go, as the report names them.
const CITUS: &str = "citus";
const WORKER_OWN: &str = "worker, own shard";
const WORKER_OTHER: &str = "worker, other shard";
const POSTGRES: &str = "postgres";
const TARGETS: [&str; 4] = [CITUS, WORKER_OWN, WORKER_OTHER, POSTGRES];

/// The bench's schema on one server, with the domain table, the key table's
/// twin and the crate's tables, on Citus all distributed and co-located;
/// and a role for each hold, with the hold's setting and every right on the
/// schema.
struct Db {
    scratch: Scratch,
    /// Dropped after the schema, which holds their grants.
    _roles: Roles,
    schema: String,
}

impl Db {
    fn new(backend: &str) -> Db {
        let scratch = Scratch::new(backend, "idem_bench").expect("create the bench schema");
        let mut conn = PgConnection::establish(scratch.url()).expect("connect to the bench schema");
        let schema: String = diesel::select(diesel::dsl::sql::<Text>("current_schema()"))
            .get_result(&mut conn)
            .expect("read the schema");
        let mut statements = vec![
            "CREATE TABLE orders (account TEXT NOT NULL, id BIGSERIAL, item TEXT NOT NULL, PRIMARY KEY (account, id))"
                .to_owned(),
            format!("CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key))"),
            "CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at)".to_owned(),
        ];
        if backend == "citus" {
            statements.extend([
                "SELECT create_distributed_table('orders', 'account')".to_owned(),
                "SELECT create_distributed_table('floor_keys', 'scope', colocate_with => 'orders')".to_owned(),
            ]);
        }
        // One statement at a time: Citus refuses DDL on distributed tables
        // in a string of several.
        let execute = |conn: &mut PgConnection, statement: &str| {
            conn.batch_execute(statement)
                .unwrap_or_else(|e| panic!("{statement}: {e}"))
        };
        for statement in &statements {
            execute(&mut conn, statement);
        }
        idempotency::run_migrations(&mut conn).expect("migrate");
        if backend == "citus" {
            idempotency::citus::distribute(&mut conn, "orders").expect("distribute the crate's tables");
        }
        let roles = Roles {
            url: scratch.url().to_owned(),
            names: Hold::BOTH.map(|hold| hold.role(&schema)).to_vec(),
        };
        for hold in Hold::BOTH {
            let role = hold.role(&schema);
            for statement in [
                format!("CREATE ROLE {role} LOGIN"),
                format!("ALTER ROLE {role} SET idempotency.claim_first = {}", hold.setting()),
                format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
                format!("GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {role}"),
                format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
            ] {
                execute(&mut conn, &statement);
            }
        }
        Db {
            scratch,
            _roles: roles,
            schema,
        }
    }

    /// A session on `url`, a node of this database, that holds keys as
    /// `hold` says, or as the database does without one.
    ///
    /// Its commits do not wait for the disk: the cluster that `.ci/citus`
    /// starts runs with `fsync = off`, and a plain server that synced every
    /// commit would be compared on its disk rather than on its work.
    fn session(&self, url: &str, hold: Option<Hold>) -> PgConnection {
        let mut conn = PgConnection::establish(url).unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        conn.batch_execute("SET synchronous_commit = off")
            .expect("set synchronous_commit");
        if let Some(hold) = hold {
            conn.batch_execute(&format!(
                "SET ROLE {}; SET idempotency.claim_first = {}",
                hold.role(&self.schema),
                hold.setting()
            ))
            .expect("take the hold's role and setting");
        }
        conn
    }
}

/// Roles made for one run, dropped at its end. Roles belong to the whole
/// server (on Citus, to every node), not to the schema.
struct Roles {
    url: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.url) {
            for name in &self.names {
                let _ = admin.batch_execute(&format!("DROP ROLE IF EXISTS {name}"));
            }
        }
    }
}

/// A worker, reached directly.
struct Worker {
    /// Its URL with the coordinator's user and database and the bench's
    /// schema.
    url: String,
    port: i32,
}

/// The first worker the coordinator lists.
fn first_worker(coordinator: &mut PgConnection, schema: &str) -> Worker {
    #[derive(QueryableByName)]
    struct Node {
        #[diesel(sql_type = Text)]
        url: String,
        #[diesel(sql_type = Integer)]
        nodeport: i32,
    }
    let node = diesel::sql_query(
        "SELECT 'postgres://' || current_user || '@' || nodename || ':' || nodeport || '/' || current_database() AS url,
                nodeport
         FROM pg_dist_node WHERE groupid <> 0 AND noderole = 'primary' AND isactive ORDER BY nodeport LIMIT 1",
    )
    .get_result::<Node>(coordinator)
    .expect("find a worker");
    Worker {
        url: format!("{}?options=-csearch_path%3D{schema}", node.url),
        port: node.nodeport,
    }
}

/// The tenants whose shard the node on `port` holds, and the others.
fn tenants_by_node(coordinator: &mut PgConnection, tenants: &[String], port: i32) -> (Vec<String>, Vec<String>) {
    #[derive(QueryableByName)]
    struct Placement {
        #[diesel(sql_type = Integer)]
        nodeport: i32,
    }
    tenants.iter().cloned().partition(|tenant| {
        diesel::sql_query(
            "SELECT nodeport FROM citus_shards
             WHERE shardid = get_shard_id_for_distribution_column('orders', $1) LIMIT 1",
        )
        .bind::<Text, _>(tenant)
        .get_result::<Placement>(coordinator)
        .expect("find a tenant's shard")
        .nodeport
            == port
    })
}

fn tenants() -> Vec<String> {
    (0..TENANTS).map(|t| format!("tenant-{t:02}")).collect()
}

/// The domain operation: one order of `account`; returns its id.
fn place_order(conn: &mut PgConnection, account: &str) -> QueryResult<i64> {
    diesel::insert_into(orders::table)
        .values((orders::account.eq(account), orders::item.eq(REQUEST.item)))
        .returning(orders::id)
        .get_result(conn)
}

fn baseline(conn: &mut PgConnection, tenant: &str) -> QueryResult<i64> {
    conn.transaction(|tx| place_order(tx, tenant))
}

/// The domain transaction plus one plain insert of the key's completed
/// record into the key table's twin: no guard, no read, no lock.
fn floor(conn: &mut PgConnection, tenant: &str, key: &str) -> QueryResult<i64> {
    conn.transaction(|tx| {
        let id = place_order(tx, tenant)?;
        diesel::insert_into(floor_keys::table)
            .values(CompletedKey::now(tenant, key, id))
            .execute(tx)?;
        Ok(id)
    })
}

fn first(conn: &mut PgConnection, config: &Config, tenant: &str, key: &str) -> i64 {
    match config.run(conn, tenant, key, &REQUEST, |tx| place_order(tx, tenant)) {
        Ok(Outcome::Executed(id)) => id,
        other => panic!("a fresh key must execute, got {other:?}"),
    }
}

fn replay(conn: &mut PgConnection, config: &Config, tenant: &str, key: &str) -> i64 {
    match config.run(conn, tenant, key, &REQUEST, |tx| place_order(tx, tenant)) {
        Ok(Outcome::Replayed(id)) => id,
        other => panic!("a completed key must replay, got {other:?}"),
    }
}

/// One scenario of the per-call part: a call made over and over on a
/// session of its own, each time for the next of its tenants.
struct Scenario {
    target: &'static str,
    call: Call,
    conn: PgConnection,
    counter: StatementCounter,
    tenants: Vec<String>,
    /// Completed keys with their tenants, for replays.
    done: Vec<(String, String)>,
}

impl Scenario {
    fn new(db: &Db, target: &'static str, call: Call, url: &str, tenants: Vec<String>, config: &Config) -> Scenario {
        let hold = match call {
            Call::First(hold) => Some(hold),
            _ => None,
        };
        let mut conn = db.session(url, hold);
        let done = if call == Call::Replay {
            let mut keys = Keys::new(7);
            let done: Vec<(String, String)> = (0..TENANTS * 2)
                .map(|i| (tenants[i % tenants.len()].clone(), keys.next_key()))
                .collect();
            for (tenant, key) in &done {
                first(&mut conn, config, tenant, key);
            }
            done
        } else {
            Vec::new()
        };
        let counter = StatementCounter::default();
        conn.set_instrumentation(counter.instrumentation());
        Scenario {
            target,
            call,
            conn,
            counter,
            tenants,
            done,
        }
    }

    /// Call number `i` of a round, with `key` if it needs a fresh one.
    fn run(&mut self, config: &Config, i: usize, key: &str) {
        let tenant = &self.tenants[i % self.tenants.len()];
        let conn = &mut self.conn;
        let id = match self.call {
            Call::Baseline => baseline(conn, tenant).expect("baseline"),
            Call::Floor => floor(conn, tenant, key).expect("floor"),
            Call::First(_) => first(conn, config, tenant, key),
            Call::Replay => {
                let (tenant, key) = &self.done[i % self.done.len()];
                replay(conn, config, tenant, key)
            }
        };
        std::hint::black_box(id);
    }
}

/// Every scenario: each call through the coordinator and on plain
/// PostgreSQL, and the worker's calls for each kind of tenant.
fn scenarios(citus: &Db, postgres: &Db, config: &Config) -> Vec<Scenario> {
    let mut coordinator = citus.session(citus.scratch.url(), None);
    let worker = first_worker(&mut coordinator, &citus.schema);
    let (own, other) = tenants_by_node(&mut coordinator, &tenants(), worker.port);
    assert!(
        !own.is_empty() && !other.is_empty(),
        "the tenants spread over both workers: {own:?} {other:?}"
    );
    let mut scenarios = Vec::new();
    for (db, target, url, tenants, calls) in [
        (citus, CITUS, citus.scratch.url(), tenants(), &ALL_CALLS[..]),
        (citus, WORKER_OWN, &worker.url, own, &WORKER_CALLS[..]),
        (citus, WORKER_OTHER, &worker.url, other, &WORKER_CALLS[..]),
        (postgres, POSTGRES, postgres.scratch.url(), tenants(), &ALL_CALLS[..]),
    ] {
        for &call in calls {
            scenarios.push(Scenario::new(db, target, call, url, tenants.clone(), config));
        }
    }
    scenarios
}

/// Microseconds and statements per call of every scenario, by target and
/// call: medians over rounds in which the scenarios take turns call by
/// call, their order rotating, so a disturbance lands on all of them alike.
fn per_call(scenarios: &mut [Scenario], config: &Config, sizes: Sizes) -> (Value, Value) {
    let mut keys = Keys::new(1);
    // Warm up: sessions connected to the workers, statements prepared.
    for scenario in scenarios.iter_mut() {
        for i in 0..5 {
            scenario.run(config, i, &keys.next_key());
        }
        scenario.counter.take();
    }
    let n = scenarios.len();
    let mut samples = vec![Vec::new(); n];
    for _ in 0..sizes.rounds {
        let mut elapsed = vec![0.0f64; n];
        for i in 0..sizes.calls {
            for turn in 0..n {
                let index = (i + turn) % n;
                let key = keys.next_key();
                let start = Instant::now();
                scenarios[index].run(config, i, &key);
                elapsed[index] += start.elapsed().as_secs_f64();
            }
        }
        for (index, total) in elapsed.iter().enumerate() {
            samples[index].push(total * 1e6 / sizes.calls as f64);
        }
    }
    let mut micros = json!({});
    let mut counts = json!({});
    for (scenario, samples) in scenarios.iter().zip(&samples) {
        let name = scenario.call.name();
        let statements = scenario.counter.take() as f64 / (sizes.rounds * sizes.calls) as f64;
        micros[scenario.target][name] = json!(round3(median(samples)));
        counts[scenario.target][name] = json!(round3(statements));
    }
    (micros, counts)
}

/// The ratios to read, per target, from the microseconds per call.
fn ratios(micros: &Value) -> Value {
    let pairs = [
        ("first, claim first / floor", Call::First(Hold::ClaimFirst), Call::Floor),
        ("first, lock / floor", Call::First(Hold::Lock), Call::Floor),
        (
            "first, claim first / baseline",
            Call::First(Hold::ClaimFirst),
            Call::Baseline,
        ),
        ("first, lock / baseline", Call::First(Hold::Lock), Call::Baseline),
        (
            "first, claim first / first, lock",
            Call::First(Hold::ClaimFirst),
            Call::First(Hold::Lock),
        ),
        ("replay / baseline", Call::Replay, Call::Baseline),
    ];
    let mut ratios = json!({});
    for target in TARGETS {
        for (name, over, under) in pairs {
            let of = |call: Call| micros[target][call.name()].as_f64();
            if let (Some(over), Some(under)) = (of(over), of(under)) {
                ratios[target][name] = json!(round3(over / under));
            }
        }
    }
    ratios
}

/// A database the throughput part drives, with the hold its sessions take.
struct Load<'a> {
    name: String,
    db: &'a Db,
    hold: Hold,
}

/// Calls per second of `first` at each thread count on each database: the
/// median over rounds, in which every database and thread count takes its
/// turn, the order rotating. Each thread has a connection of its own, kept
/// from round to round. Returns the figures and the calls that failed.
fn throughput(loads: &[Load<'_>], config: &Config, sizes: Sizes) -> (Value, u64) {
    let max_threads = SCALING_THREADS[SCALING_THREADS.len() - 1];
    let tenants = tenants();
    let mut conns: Vec<Vec<PgConnection>> = loads
        .iter()
        .map(|load| {
            (0..max_threads)
                .map(|t| {
                    let mut conn = load.db.session(load.db.scratch.url(), Some(load.hold));
                    // Warm up: the coordinator's connections to the workers
                    // opened, the statements prepared.
                    let mut keys = Keys::new(50 + t as u64);
                    for tenant in tenants.iter().take(4) {
                        first(&mut conn, config, tenant, &keys.next_key());
                    }
                    conn
                })
                .collect()
        })
        .collect();
    let runs: Vec<(usize, usize)> = (0..loads.len())
        .flat_map(|load| (0..SCALING_THREADS.len()).map(move |threads| (load, threads)))
        .collect();
    let mut samples = vec![Vec::new(); runs.len()];
    let mut errors = 0;
    for round in 0..sizes.throughput_rounds {
        for turn in 0..runs.len() {
            let index = (round + turn) % runs.len();
            let (load, threads) = runs[index];
            let threads = SCALING_THREADS[threads];
            let (calls, failed) = drive(&mut conns[load][..threads], &tenants, config, sizes.throughput_time);
            samples[index].push(calls as f64 / sizes.throughput_time.as_secs_f64());
            errors += failed;
        }
    }
    let mut figures = json!({});
    for (index, &(load, threads)) in runs.iter().enumerate() {
        figures[&loads[load].name][SCALING_THREADS[threads].to_string()] = json!(median(&samples[index]).round());
    }
    (figures, errors)
}

/// First calls on every one of `conns`, each in a thread of its own, for
/// `time`: returns the calls that succeeded and those that failed.
fn drive(conns: &mut [PgConnection], tenants: &[String], config: &Config, time: Duration) -> (u64, u64) {
    let barrier = std::sync::Barrier::new(conns.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter_mut()
            .enumerate()
            .map(|(t, conn)| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut keys = Keys::new(100 + t as u64);
                    let (mut calls, mut failed) = (0, 0);
                    barrier.wait();
                    let deadline = Instant::now() + time;
                    while Instant::now() < deadline {
                        let tenant = &tenants[keys.next_u64() as usize % tenants.len()];
                        match config.run(conn, tenant, &keys.next_key(), &REQUEST, |tx| place_order(tx, tenant)) {
                            Ok(_) => calls += 1,
                            Err(error) => {
                                eprintln!("throughput error: {error}");
                                failed += 1;
                            }
                        }
                    }
                    (calls, failed)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a throughput thread"))
            .fold((0, 0), |(calls, failed), (c, f)| (calls + c, failed + f))
    })
}

pub fn run(quick: bool) -> Value {
    let sizes = if quick { QUICK } else { FULL };
    let config = Config::default();
    let citus = Db::new("citus");
    let postgres = Db::new("postgres");
    eprintln!("per-call scenarios...");
    let mut scenarios = scenarios(&citus, &postgres, &config);
    let (micros, statements) = per_call(&mut scenarios, &config, sizes);
    drop(scenarios);
    eprintln!("throughput...");
    let loads: Vec<Load<'_>> = [(CITUS, &citus), (POSTGRES, &postgres)]
        .into_iter()
        .flat_map(|(name, db)| {
            Hold::BOTH.map(|hold| Load {
                name: format!("{name}, {}", hold.name()),
                db,
                hold,
            })
        })
        .collect();
    let (throughput, throughput_errors) = throughput(&loads, &config, sizes);
    json!({
        "backend": "citus",
        "rounds": sizes.rounds,
        "calls_per_round": sizes.calls,
        "tenants": TENANTS,
        "per_call_us": micros,
        "statements_per_call": statements,
        "ratios": ratios(&micros),
        "throughput_calls_per_s": throughput,
        "throughput_seconds": sizes.throughput_time.as_secs_f64(),
        "throughput_rounds": sizes.throughput_rounds,
        "throughput_errors": throughput_errors,
    })
}

pub fn print_report(report: &Value, quick: bool) {
    println!();
    println!(
        "backend: citus{}   (medians of {} rounds of {} calls per scenario, the scenarios taking turns call by call; {} tenants; commits not waiting for the disk)",
        if quick { ", quick" } else { "" },
        report["rounds"],
        report["calls_per_round"],
        report["tenants"],
    );
    let cell = |value: &Value| value.as_f64().map_or("-".to_owned(), |v| format!("{v:.1}"));
    println!();
    print_header("µs per call (statements)", &TARGETS);
    for call in ALL_CALLS {
        print!("| {:<32} |", call.name());
        for target in TARGETS {
            let micros = &report["per_call_us"][target][call.name()];
            let statements = &report["statements_per_call"][target][call.name()];
            let text = if micros.is_null() {
                "-".to_owned()
            } else {
                format!("{} ({})", cell(micros), cell(statements))
            };
            print!(" {text:>19} |");
        }
        println!();
    }
    println!();
    print_header("ratio", &TARGETS);
    let names: Vec<&String> = report["ratios"][POSTGRES]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(n, _)| n)
        .collect();
    for name in names {
        print!("| {name:<32} |");
        for target in TARGETS {
            let value = &report["ratios"][target][name.as_str()];
            let text = value.as_f64().map_or("-".to_owned(), |v| format!("{v:.3}"));
            print!(" {text:>19} |");
        }
        println!();
    }
    println!();
    println!(
        "throughput of first, calls/s ({} s per figure, median of {} rounds, errors {}):",
        report["throughput_seconds"], report["throughput_rounds"], report["throughput_errors"]
    );
    println!();
    let loads: Vec<&String> = report["throughput_calls_per_s"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(n, _)| n)
        .collect();
    print_header("threads", &loads.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    for threads in SCALING_THREADS {
        print!("| {threads:<32} |");
        for load in &loads {
            let value = &report["throughput_calls_per_s"][load.as_str()][threads.to_string()];
            print!(
                " {:>19} |",
                value.as_f64().map_or("-".to_owned(), |v| format!("{v:.0}"))
            );
        }
        println!();
    }
}

fn print_header(first: &str, columns: &[&str]) {
    print!("| {first:<32} |");
    for column in columns {
        print!(" {column:>19} |");
    }
    println!();
    print!("| {} |", "-".repeat(32));
    for _ in columns {
        print!(" {}: |", "-".repeat(18));
    }
    println!();
}
