//! What an idempotent call costs next to the domain transaction alone, on a
//! SQLite file database, on PostgreSQL or on MySQL/MariaDB, all scenarios
//! measured in one run.
//!
//! ```text
//! cargo bench --bench overhead -- --backend sqlite [--quick] [--json FILE] [--statements]
//! cargo bench --features postgres --bench overhead -- --backend postgres [--quick] [--json FILE] [--statements]
//! cargo bench --features mysql --bench overhead -- --backend mysql [--quick] [--json FILE] [--statements]
//! cargo bench --features postgres --bench overhead -- --backend citus [--quick] [--json FILE]
//! ```
//!
//! `--backend citus` measures a Citus cluster (`CITUS_DATABASE_URL`, its
//! coordinator) next to plain PostgreSQL (`DATABASE_URL`) with scenarios of
//! its own: see `benches/citus/mod.rs`.
//!
//! The domain operation is one `INSERT` of an order row. Per-call figures
//! are medians over rounds in which the scenarios take turns call by call
//! (their order rotating), so a disturbance on the machine hits all of them
//! alike and every ratio compares figures of the same run. `--quick` cuts
//! every count so that a run takes seconds; CI uses it to keep the bench
//! working, not to judge speed. `--statements` adds, per scenario, every
//! statement sent and its mean time from send to result. The relay service
//! scenario times messages from their commit to their handler with
//! `Relay::serve` in this process, at two poll intervals.
//!
//! PostgreSQL reads `DATABASE_URL` and works in schemas of its own, dropped
//! at the end; MySQL reads `MYSQL_URL` and works in databases of its own,
//! dropped at the end. SQLite works on WAL files in a temporary directory
//! with `synchronous = FULL`, so that every commit is durable, as on the
//! servers.

#[cfg(feature = "postgres")]
mod citus;
mod common;

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use chrono::{NaiveDateTime, Utc};
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, R2D2Connection};
use idempotency::outbox::{self, Relay};
use idempotency::phased::Phased;
use idempotency::{Config, Outcome, RawConnection};
use serde_json::{Value, json};

/// How much work each scenario gets.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Rounds of the interleaved single-connection scenarios.
    rounds: usize,
    /// Calls of each scenario per round.
    calls: usize,
    /// Rounds of the contention scenario, each with a key of its own.
    contention_rounds: usize,
    /// Rounds of the scaling scenario, each visiting every thread count.
    scaling_rounds: usize,
    /// How long each thread count runs in one scaling round.
    scaling_time: Duration,
    /// Existing records in the large table, all expired, later purged.
    large_records: i64,
    /// Rounds of the large-table comparison.
    large_rounds: usize,
    /// Rows per purge batch.
    purge_batch: usize,
    /// Messages the relay delivers in each outbox round.
    relay_messages: usize,
    /// Rounds of the relay throughput scenario.
    relay_rounds: usize,
    /// Messages committed one by one for the relay latency scenario.
    latency_messages: usize,
    /// Their rate, per second.
    latency_rate: f64,
}

const FULL: Sizes = Sizes {
    rounds: 21,
    calls: 100,
    contention_rounds: 10,
    scaling_rounds: 5,
    scaling_time: Duration::from_millis(1500),
    large_records: 1_000_000,
    large_rounds: 15,
    purge_batch: 500,
    relay_messages: 5_000,
    relay_rounds: 5,
    latency_messages: 400,
    latency_rate: 40.0,
};

const QUICK: Sizes = Sizes {
    rounds: 5,
    calls: 30,
    contention_rounds: 2,
    scaling_rounds: 1,
    scaling_time: Duration::from_millis(300),
    large_records: 20_000,
    large_rounds: 3,
    purge_batch: 500,
    relay_messages: 500,
    relay_rounds: 1,
    latency_messages: 30,
    latency_rate: 100.0,
};

const CONTENTION_THREADS: usize = 32;
const CONTENTION_OP: Duration = Duration::from_millis(10);
const SCALING_THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const SCENARIOS: [&str; 8] = [
    "baseline",
    "floor",
    "bare_floor",
    "first",
    "two_phase",
    "replay",
    "first_outbox",
    "phased",
];
/// Commits of one operation of the `phased` scenario: the claim with its
/// phase, the call recorded as started, the call's result, the finish.
const PHASED_COMMITS: usize = 4;
/// Messages a relay claims per batch in the relay throughput scenario.
const RELAY_BATCH: usize = 100;
/// The poll intervals of the relay latency scenario: `Relay`'s default, and
/// a short one.
const LATENCY_POLLS: [chrono::Duration; 2] = [chrono::Duration::milliseconds(250), chrono::Duration::milliseconds(25)];

struct Args {
    backend: String,
    quick: bool,
    json: Option<PathBuf>,
    statements: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut json = None;
    let mut statements = false;
    let common = common::parse_args(
        "usage: overhead --backend sqlite|postgres|mysql|citus [--quick] [--json FILE] [--statements]",
        |arg, rest| {
            match arg {
                "--statements" => statements = true,
                "--json" => json = Some(PathBuf::from(rest.next().ok_or("--json needs a file name")?)),
                other => return Err(format!("unknown argument {other}")),
            }
            Ok(())
        },
    )?;
    Ok(Args {
        backend: common.backend,
        quick: common.quick,
        json,
        statements,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let sizes = if args.quick { QUICK } else { FULL };
    // Each backend's report, and the function that prints it.
    let (report, print): (Value, fn(&Value, bool)) = match args.backend.as_str() {
        #[cfg(feature = "sqlite")]
        "sqlite" => (run::<diesel::SqliteConnection>(sizes, args.statements), print_report),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => {
            eprintln!("the sqlite backend is not compiled in: build with the sqlite feature");
            return ExitCode::from(2);
        }
        #[cfg(feature = "postgres")]
        "postgres" => (run::<diesel::PgConnection>(sizes, args.statements), print_report),
        #[cfg(not(feature = "postgres"))]
        "postgres" => {
            eprintln!(
                "the postgres backend is not compiled in: run \
                 cargo bench --features postgres --bench overhead -- --backend postgres"
            );
            return ExitCode::from(2);
        }
        #[cfg(feature = "mysql")]
        "mysql" => (run::<diesel::MysqlConnection>(sizes, args.statements), print_report),
        #[cfg(not(feature = "mysql"))]
        "mysql" => {
            eprintln!(
                "the mysql backend is not compiled in: run \
                 cargo bench --features mysql --bench overhead -- --backend mysql"
            );
            return ExitCode::from(2);
        }
        #[cfg(feature = "postgres")]
        "citus" if args.statements => {
            eprintln!("--statements is not measured on citus: its report counts statements per call");
            return ExitCode::from(2);
        }
        #[cfg(feature = "postgres")]
        "citus" => (citus::run(args.quick), citus::print_report),
        #[cfg(not(feature = "postgres"))]
        "citus" => {
            eprintln!(
                "citus needs the postgres backend: run \
                 cargo bench --features postgres --bench overhead -- --backend citus"
            );
            return ExitCode::from(2);
        }
        other => {
            eprintln!("unknown backend {other}: use sqlite, postgres, mysql or citus");
            return ExitCode::from(2);
        }
    };
    print(&report, args.quick);
    if let Some(path) = args.json {
        let text = serde_json::to_string_pretty(&report).expect("serialize the report");
        if let Err(error) = std::fs::write(&path, text + "\n") {
            eprintln!("cannot write {}: {error}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// The median of `values`; the mean of the middle two for an even count.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 0 {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// The nearest-rank percentile `p` (0..=100) of `values`.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// Fresh keys shaped like the random identifiers clients send (32 hex
/// digits), so inserts land all over the key index rather than at its end.
struct Keys(u64);

impl Keys {
    fn new(seed: u64) -> Keys {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Keys(seed ^ nanos | 1)
    }

    fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn next_key(&mut self) -> String {
        format!("{:016x}{:016x}", self.next_u64(), self.next_u64())
    }
}

/// Counts the statements a connection sends: on PostgreSQL each is one
/// round trip to the server.
#[derive(Clone, Default)]
struct StatementCounter(Arc<AtomicU64>);

impl StatementCounter {
    fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let count = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn take(&self) -> u64 {
        self.0.swap(0, Ordering::Relaxed)
    }
}

/// Records how long each purge batch (one `DELETE` statement, its own
/// transaction) takes from start to commit.
#[derive(Clone, Default)]
struct BatchTimer(Arc<Mutex<(Option<Instant>, Vec<f64>)>>);

impl BatchTimer {
    fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let state = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            use diesel::connection::InstrumentationEvent::{FinishQuery, StartQuery};
            let mut state = state.lock().expect("batch timer");
            match event {
                StartQuery { query, .. } if query.to_string().contains("DELETE") => state.0 = Some(Instant::now()),
                FinishQuery { .. } => {
                    if let Some(start) = state.0.take() {
                        state.1.push(start.elapsed().as_secs_f64() * 1000.0);
                    }
                }
                _ => {}
            }
        }
    }

    fn batches_ms(&self) -> Vec<f64> {
        std::mem::take(&mut self.0.lock().expect("batch timer").1)
    }
}

/// Per scenario and statement: how many were sent and their mean time from
/// send to result, which on PostgreSQL includes the round trip.
type Profile = Vec<(String, String, f64, f64)>;

/// Times every statement of the single-connection scenarios (`--statements`).
/// Reading a statement's text costs time of its own, so the per-call figures
/// of a run with it are not the ones to quote.
#[derive(Clone, Default)]
struct Profiler(Arc<Mutex<ProfilerState>>);

#[derive(Default)]
struct ProfilerState {
    scenario: &'static str,
    started: Option<(String, Instant)>,
    totals: BTreeMap<(&'static str, String), (u64, f64)>,
}

impl Profiler {
    fn instrumentation(&self, counter: StatementCounter) -> impl diesel::connection::Instrumentation {
        let state = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            use diesel::connection::InstrumentationEvent::{FinishQuery, StartQuery};
            let mut state = state.lock().expect("profiler");
            match event {
                StartQuery { query, .. } => {
                    counter.0.fetch_add(1, Ordering::Relaxed);
                    let text = query.to_string();
                    let sql = text.split(" -- binds").next().unwrap_or_default();
                    let label: String = sql
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ")
                        .chars()
                        .take(64)
                        .collect();
                    state.started = Some((label, Instant::now()));
                }
                FinishQuery { .. } => {
                    if let Some((label, start)) = state.started.take() {
                        let scenario = state.scenario;
                        let entry = state.totals.entry((scenario, label)).or_default();
                        entry.0 += 1;
                        entry.1 += start.elapsed().as_secs_f64() * 1e6;
                    }
                }
                _ => {}
            }
        }
    }

    fn enter(&self, scenario: &'static str) {
        self.0.lock().expect("profiler").scenario = scenario;
    }

    fn reset(&self) {
        self.0.lock().expect("profiler").totals.clear();
    }

    /// Statements per call and mean µs per statement, for `calls` calls of
    /// each scenario.
    fn report(&self, calls: usize) -> Profile {
        let state = self.0.lock().expect("profiler");
        state
            .totals
            .iter()
            .map(|((scenario, label), (count, total))| {
                (
                    scenario.to_string(),
                    label.clone(),
                    round3(*count as f64 / calls as f64),
                    round3(total / *count as f64),
                )
            })
            .collect()
    }
}

fn print_report(report: &Value, quick: bool) {
    let per_call = &report["per_call_us"];
    let statements = &report["statements_per_call"];
    println!();
    println!(
        "backend: {}{}   (medians of {} rounds of {} calls per scenario, the scenarios taking turns call by call)",
        report["backend"].as_str().unwrap_or("?"),
        if quick { ", quick" } else { "" },
        report["rounds"],
        report["calls_per_round"],
    );
    println!();
    println!("| scenario     | µs per call | statements per call |");
    println!("| ------------ | ----------: | ------------------: |");
    for name in SCENARIOS {
        println!(
            "| {name:<12} | {:>11.1} | {:>19.1} |",
            per_call[name].as_f64().unwrap_or(f64::NAN),
            statements[name].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!();
    println!("| ratio                | value |");
    println!("| -------------------- | ----: |");
    for (name, value) in report["ratios"].as_object().into_iter().flatten() {
        println!("| {name:<20} | {:>5.3} |", value.as_f64().unwrap_or(f64::NAN));
    }
    let contention = &report["contention"];
    println!();
    println!(
        "contention ({} threads, one key, {} ms operation, {} rounds): executions per round {}..{}, errors {}, p50 {:.1} ms, p99 {:.1} ms",
        CONTENTION_THREADS,
        CONTENTION_OP.as_millis(),
        contention["rounds"],
        contention["min_executions"],
        contention["executions"],
        contention["errors"],
        contention["p50_ms"].as_f64().unwrap_or(f64::NAN),
        contention["p99_ms"].as_f64().unwrap_or(f64::NAN),
    );
    print!("scaling (first, calls/s over a pool):");
    for (threads, ops) in report["scaling"].as_object().into_iter().flatten() {
        print!("  {threads} threads {:.0}", ops.as_f64().unwrap_or(f64::NAN));
    }
    println!("  (errors {})", report["scaling_errors"]);
    let large = &report["large_table"];
    println!(
        "large table ({} records): {:.0} calls/s against {:.0} calls/s on an empty table",
        large["records"],
        large["large_ops_per_s"].as_f64().unwrap_or(f64::NAN),
        large["empty_ops_per_s"].as_f64().unwrap_or(f64::NAN),
    );
    let purge = &report["purge"];
    println!(
        "purge ({} expired records, {} per batch): {:.0} rows/s; batches: longest {:.1} ms, p99 {:.1} ms, median {:.1} ms, first {:.1} ms",
        purge["rows"],
        purge["batch_size"],
        purge["rows_per_s"].as_f64().unwrap_or(f64::NAN),
        purge["max_batch_ms"].as_f64().unwrap_or(f64::NAN),
        purge["p99_batch_ms"].as_f64().unwrap_or(f64::NAN),
        purge["median_batch_ms"].as_f64().unwrap_or(f64::NAN),
        purge["first_batch_ms"].as_f64().unwrap_or(f64::NAN),
    );
    let outbox = &report["outbox"];
    println!(
        "outbox: enqueue inside first +{:.1} µs (first with enqueue / first {:.3}); relay {:.0} messages/s ({} messages, batches of {})",
        outbox["enqueue_us"].as_f64().unwrap_or(f64::NAN),
        outbox["first_with_enqueue_over_first"].as_f64().unwrap_or(f64::NAN),
        outbox["relay"]["messages_per_s"].as_f64().unwrap_or(f64::NAN),
        outbox["relay"]["messages"],
        outbox["relay"]["batch_size"],
    );
    let phased = &report["phased"];
    println!(
        "phased (phase, call to a provider that does nothing, finish: {} commits): {:.1} µs per operation, {:.1} µs per commit; per commit / first {:.3}, per commit / baseline {:.3}",
        phased["commits"],
        phased["per_operation_us"].as_f64().unwrap_or(f64::NAN),
        phased["per_commit_us"].as_f64().unwrap_or(f64::NAN),
        phased["per_commit_over_first"].as_f64().unwrap_or(f64::NAN),
        phased["per_commit_over_baseline"].as_f64().unwrap_or(f64::NAN),
    );
    for latency in outbox["latency"].as_array().into_iter().flatten() {
        println!(
            "relay service latency, commit to handler ({} messages at {}/s, woken by {}, poll interval {} ms): p50 {:.1} ms, p99 {:.1} ms, longest {:.1} ms",
            latency["messages"],
            latency["rate_per_s"],
            latency["woken_by"].as_str().unwrap_or("?"),
            latency["poll_interval_ms"],
            latency["p50_ms"].as_f64().unwrap_or(f64::NAN),
            latency["p99_ms"].as_f64().unwrap_or(f64::NAN),
            latency["max_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
    if let Some(profile) = report["statement_profile"].as_array() {
        println!();
        println!(
            "| scenario  | statement                                                        | per call | µs each |"
        );
        println!(
            "| --------- | ---------------------------------------------------------------- | -------: | ------: |"
        );
        for row in profile {
            println!(
                "| {:<9} | {:<64} | {:>8.2} | {:>7.1} |",
                row[0].as_str().unwrap_or("?"),
                row[1].as_str().unwrap_or("?"),
                row[2].as_f64().unwrap_or(f64::NAN),
                row[3].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
}

// The scenarios, each a function generic over the connection: `Bench` below
// is what they need of a backend beyond the crate's `RawConnection` and
// diesel's `Connection`.

diesel::table! {
    orders (id) {
        id -> BigInt,
        item -> Text,
        quantity -> Integer,
    }
}

diesel::table! {
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

diesel::table! {
    /// The key table's twin: its columns, primary key and `expires_at`
    /// index.
    floor_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

diesel::table! {
    /// The same columns without any index: the floor of earlier runs, kept
    /// as a second reference.
    bare_keys (rowid) {
        rowid -> BigInt,
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

#[derive(serde::Serialize)]
struct PlaceOrder<'a> {
    item: &'a str,
    quantity: i32,
}

const REQUEST: PlaceOrder<'static> = PlaceOrder {
    item: "book",
    quantity: 1,
};
/// What the library stores for `REQUEST`: its SHA-256, in hex.
const REQUEST_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const SCOPE: &str = "bench";

/// What the scenarios need of a backend beyond the crate's `RawConnection`
/// and diesel's `Connection`: its database's setup and the statements that
/// differ. Implemented below for each backend compiled in.
trait Bench: RawConnection + R2D2Connection + Send + 'static {
    const NAME: &'static str;

    /// Sets up a new connection, pooled or not.
    fn configure(&mut self) -> QueryResult<()> {
        Ok(())
    }

    /// Creates the bench's own tables in a new database.
    fn create_tables(&mut self) -> QueryResult<()>;

    /// Inserts `records` expired key records into the crate's key table.
    fn fill_expired(&mut self, records: i64) -> QueryResult<usize>;

    /// The domain operation: one order row; returns its id.
    fn place_order(&mut self) -> QueryResult<i64>;

    /// Executes `statement`; returns the number of rows it affected.
    fn send(&mut self, statement: impl Statement) -> QueryResult<usize>;
}

/// A statement that every backend compiled in can execute. diesel checks a
/// statement against each backend apart, so a function generic over the
/// connection hands its statements to [`Bench::send`] as `impl Statement`.
trait Statement: sqlite::Executable + postgres::Executable + mysql::Executable {}

impl<S: sqlite::Executable + postgres::Executable + mysql::Executable> Statement for S {}

/// The order row of the domain operation.
type NewOrder = (
    diesel::dsl::Eq<orders::item, &'static str>,
    diesel::dsl::Eq<orders::quantity, i32>,
);

fn new_order() -> NewOrder {
    (orders::item.eq(REQUEST.item), orders::quantity.eq(REQUEST.quantity))
}

/// The order's `INSERT` returning its id.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
type InsertOrderReturningId =
    diesel::dsl::Returning<diesel::dsl::Values<diesel::dsl::insert_into<orders::table>, NewOrder>, orders::id>;

/// The domain operation on the backends whose `INSERT` returns the id.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn place_order_returning_id<C>(conn: &mut C) -> QueryResult<i64>
where
    C: Connection,
    InsertOrderReturningId: diesel::query_dsl::LoadQuery<'static, C, i64>,
{
    diesel::insert_into(orders::table)
        .values(new_order())
        .returning(orders::id)
        .get_result(conn)
}

/// The key table's columns on SQLite and PostgreSQL, as the crate's
/// migrations have them, for the floor scenarios' tables.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
const KEY_COLUMNS: &str = "scope TEXT NOT NULL, idempotency_key TEXT NOT NULL, request_hash TEXT NOT NULL,
    status TEXT NOT NULL, response TEXT, created_at TIMESTAMP NOT NULL, completed_at TIMESTAMP,
    expires_at TIMESTAMP NOT NULL";

/// A completed key record as the floor scenarios insert it.
#[derive(Insertable)]
#[diesel(table_name = floor_keys)]
#[diesel(table_name = bare_keys)]
struct CompletedKey<'a> {
    scope: &'a str,
    idempotency_key: &'a str,
    request_hash: &'a str,
    status: &'a str,
    response: String,
    created_at: NaiveDateTime,
    completed_at: NaiveDateTime,
    expires_at: NaiveDateTime,
}

impl<'a> CompletedKey<'a> {
    /// The record of `(scope, key)` completed now with the order `id`.
    fn now(scope: &'a str, key: &'a str, id: i64) -> Self {
        let now = Utc::now().naive_utc();
        CompletedKey {
            scope,
            idempotency_key: key,
            request_hash: REQUEST_HASH,
            status: "completed",
            response: id.to_string(),
            created_at: now,
            completed_at: now,
            expires_at: now + chrono::Duration::hours(24),
        }
    }
}

/// The bench's database: its own tables and the crate's, removed at the end.
struct Db<C> {
    scratch: common::Scratch,
    backend: PhantomData<C>,
}

impl<C: Bench> Db<C> {
    fn new() -> Db<C> {
        let scratch = common::Scratch::new(C::NAME, "idem_bench").expect("create the bench database");
        let db: Db<C> = Db {
            scratch,
            backend: PhantomData,
        };
        let mut conn = db.conn();
        conn.create_tables().expect("create the bench tables");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    fn conn(&self) -> C {
        let mut conn = C::establish(self.scratch.url()).expect("connect to the bench database");
        conn.configure().expect("configure the connection");
        conn
    }

    fn pool(&self, size: u32) -> Pool<ConnectionManager<C>> {
        Pool::builder()
            .max_size(size)
            .connection_customizer(Box::new(Configure))
            .build(ConnectionManager::new(self.scratch.url()))
            .expect("build a pool")
    }
}

/// Sets up every pooled connection as [`Db::conn`] does.
#[derive(Debug)]
struct Configure;

impl<C: Bench> CustomizeConnection<C, diesel::r2d2::Error> for Configure {
    fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
        conn.configure().map_err(diesel::r2d2::Error::QueryError)
    }
}

fn baseline<C: Bench>(conn: &mut C) -> QueryResult<i64> {
    conn.transaction(C::place_order)
}

/// The domain transaction plus one plain insert of a completed key record
/// into the key table's twin: no guard, no read, no update afterwards.
fn floor<C: Bench>(conn: &mut C, key: &str) -> QueryResult<i64> {
    floor_into(conn, key, |row| diesel::insert_into(floor_keys::table).values(row))
}

/// `floor` into the table without indexes.
fn bare_floor<C: Bench>(conn: &mut C, key: &str) -> QueryResult<i64> {
    floor_into(conn, key, |row| diesel::insert_into(bare_keys::table).values(row))
}

/// The domain transaction plus the statement `insert` makes of the key's
/// completed record.
fn floor_into<'a, C: Bench, S: Statement>(
    conn: &mut C,
    key: &'a str,
    insert: impl FnOnce(CompletedKey<'a>) -> S,
) -> QueryResult<i64> {
    conn.transaction(|tx| {
        let id = tx.place_order()?;
        tx.send(insert(CompletedKey::now(SCOPE, key, id)))?;
        Ok(id)
    })
}

fn first<C: Bench>(conn: &mut C, config: &Config, key: &str) -> i64 {
    match config.run(conn, SCOPE, key, &REQUEST, C::place_order) {
        Ok(Outcome::Executed(id)) => id,
        other => panic!("a fresh key must execute, got {other:?}"),
    }
}

/// `first` whose operation also enqueues an outbox message, as an order that
/// must send a receipt does.
fn first_outbox<C: Bench>(conn: &mut C, config: &Config, key: &str) -> i64 {
    let outcome = config.run(conn, SCOPE, key, &REQUEST, |tx| {
        let id = tx.place_order().map_err(|e| e.to_string())?;
        outbox::enqueue(tx, "receipts", &json!({ "order": id })).map_err(|e| e.to_string())?;
        Ok::<_, String>(id)
    });
    match outcome {
        Ok(Outcome::Executed(id)) => id,
        other => panic!("a fresh key must execute, got {other:?}"),
    }
}

fn replay<C: Bench>(conn: &mut C, config: &Config, key: &str) -> i64 {
    match config.run(conn, SCOPE, key, &REQUEST, C::place_order) {
        Ok(Outcome::Replayed(id)) => id,
        other => panic!("a completed key must replay, got {other:?}"),
    }
}

/// The common design elsewhere: claim the key in a committed transaction of
/// its own, run the operation in another, store the result in a third.
/// Given its best case: no read before the claim.
fn two_phase<C: Bench>(conn: &mut C, key: &str) -> QueryResult<i64> {
    let now = Utc::now().naive_utc();
    let claimed = conn.send(
        diesel::insert_into(idempotency_keys::table)
            .values((
                idempotency_keys::scope.eq("two-phase"),
                idempotency_keys::idempotency_key.eq(key),
                idempotency_keys::request_hash.eq(REQUEST_HASH),
                idempotency_keys::status.eq("processing"),
                idempotency_keys::created_at.eq(now),
                idempotency_keys::expires_at.eq(now + chrono::Duration::hours(24)),
            ))
            .on_conflict_do_nothing(),
    )?;
    assert_eq!(claimed, 1, "a fresh key must be claimed");
    let id = conn.transaction(C::place_order)?;
    conn.send(diesel::update(idempotency_keys::table.find(("two-phase", key))).set((
        idempotency_keys::status.eq("completed"),
        idempotency_keys::response.eq(id.to_string()),
        idempotency_keys::completed_at.eq(Utc::now().naive_utc()),
    )))?;
    Ok(id)
}

/// A phased operation at its cheapest: the order in its first phase, a call
/// to a provider that does nothing, and a finish that stores the answer.
/// `PHASED_COMMITS` commits.
fn phased<C: Bench>(conn: &mut C, operation: &Phased, key: &str) -> i64 {
    let outcome = operation.run(conn, SCOPE, key, &REQUEST, |s| {
        let id = s.phase("order_placed", C::place_order)?;
        let provider_key_len = s.call("provider_called", |provider_key| {
            Ok::<_, diesel::result::Error>(std::hint::black_box(provider_key).len())
        })?;
        s.finish(|_| Ok::<_, diesel::result::Error>((id, provider_key_len)))
    });
    match outcome {
        Ok(Outcome::Executed((id, _))) => id,
        other => panic!("a fresh key must execute, got {other:?}"),
    }
}

/// One call of scenario `name`: `key` is fresh, `done` holds completed keys
/// for replays.
fn call<C: Bench>(
    conn: &mut C,
    (config, operation): (&Config, &Phased),
    name: &str,
    key: &str,
    done: &[String],
    next_done: &mut usize,
) {
    match name {
        "baseline" => {
            std::hint::black_box(baseline(conn).expect("baseline"));
        }
        "floor" => {
            std::hint::black_box(floor(conn, key).expect("floor"));
        }
        "bare_floor" => {
            std::hint::black_box(bare_floor(conn, key).expect("bare_floor"));
        }
        "first" => {
            std::hint::black_box(first(conn, config, key));
        }
        "two_phase" => {
            std::hint::black_box(two_phase(conn, key).expect("two_phase"));
        }
        "replay" => {
            std::hint::black_box(replay(conn, config, &done[*next_done % done.len()]));
            *next_done += 1;
        }
        "first_outbox" => {
            std::hint::black_box(first_outbox(conn, config, key));
        }
        "phased" => {
            std::hint::black_box(phased(conn, operation, key));
        }
        _ => unreachable!("unknown scenario {name}"),
    }
}

fn single_connection<C: Bench>(db: &Db<C>, sizes: Sizes, profile: bool) -> (Value, Value, Option<Profile>) {
    let config = Config::default();
    let operation = Phased::new("bench");
    let mut conn = db.conn();
    let counter = StatementCounter::default();
    let profiler = Profiler::default();
    if profile {
        conn.set_instrumentation(profiler.instrumentation(counter.clone()));
    } else {
        conn.set_instrumentation(counter.instrumentation());
    }
    let mut keys = Keys::new(1);
    let done: Vec<String> = (0..sizes.calls.max(100)).map(|_| keys.next_key()).collect();
    for key in &done {
        first(&mut conn, &config, key);
    }
    let mut next_done = 0;
    // Warm up: every statement prepared and cached before timing.
    for name in SCENARIOS {
        for _ in 0..5 {
            call(
                &mut conn,
                (&config, &operation),
                name,
                &keys.next_key(),
                &done,
                &mut next_done,
            );
        }
    }
    profiler.reset();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); SCENARIOS.len()];
    let mut statements = [0u64; SCENARIOS.len()];
    // The scenarios take turns call by call, their order rotating, so a
    // disturbance on the machine lands on all of them alike; a round's
    // figure is its mean per call.
    for _ in 0..sizes.rounds {
        let mut elapsed = [0.0f64; SCENARIOS.len()];
        for i in 0..sizes.calls {
            for turn in 0..SCENARIOS.len() {
                let index = (i + turn) % SCENARIOS.len();
                let key = keys.next_key();
                profiler.enter(SCENARIOS[index]);
                counter.take();
                let start = Instant::now();
                call(
                    &mut conn,
                    (&config, &operation),
                    SCENARIOS[index],
                    &key,
                    &done,
                    &mut next_done,
                );
                elapsed[index] += start.elapsed().as_secs_f64();
                statements[index] += counter.take();
            }
        }
        for (index, total) in elapsed.iter().enumerate() {
            samples[index].push(total * 1e6 / sizes.calls as f64);
        }
    }
    let mut per_call = serde_json::Map::new();
    let mut per_statement = serde_json::Map::new();
    for (index, name) in SCENARIOS.iter().enumerate() {
        per_call.insert((*name).into(), json!(round3(median(&samples[index]))));
        let count = statements[index] as f64 / (sizes.rounds * sizes.calls) as f64;
        per_statement.insert((*name).into(), json!(round3(count)));
    }
    let profile = profile.then(|| profiler.report(sizes.rounds * sizes.calls));
    (Value::Object(per_call), Value::Object(per_statement), profile)
}

fn contention<C: Bench>(db: &Db<C>, sizes: Sizes) -> Value {
    let pool = db.pool(CONTENTION_THREADS as u32);
    let config = Config::default();
    let mut keys = Keys::new(2);
    let mut latencies = Vec::new();
    let mut executions_per_round = Vec::new();
    let mut errors = 0;
    for _ in 0..sizes.contention_rounds {
        let key = keys.next_key();
        let executions = AtomicU64::new(0);
        let barrier = Barrier::new(CONTENTION_THREADS);
        let results: Vec<Result<f64, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..CONTENTION_THREADS)
                .map(|_| {
                    let (pool, config, key, executions, barrier) = (&pool, &config, &key, &executions, &barrier);
                    s.spawn(move || {
                        let mut conn = pool.get().expect("a pooled connection");
                        barrier.wait();
                        let start = Instant::now();
                        let result = config.run(&mut conn, SCOPE, key, &REQUEST, |tx| {
                            executions.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(CONTENTION_OP);
                            C::place_order(tx)
                        });
                        let elapsed = start.elapsed().as_secs_f64() * 1000.0;
                        result.map(|_| elapsed).map_err(|error| error.to_string())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a contention thread"))
                .collect()
        });
        for result in results {
            match result {
                Ok(ms) => latencies.push(ms),
                Err(error) => {
                    eprintln!("contention error: {error}");
                    errors += 1;
                }
            }
        }
        executions_per_round.push(executions.load(Ordering::SeqCst));
    }
    json!({
        "executions": executions_per_round.iter().max(),
        "min_executions": executions_per_round.iter().min(),
        "errors": errors,
        "p50_ms": round3(percentile(&latencies, 50.0)),
        "p99_ms": round3(percentile(&latencies, 99.0)),
        "max_ms": round3(percentile(&latencies, 100.0)),
        "threads": CONTENTION_THREADS,
        "rounds": sizes.contention_rounds,
    })
}

fn scaling<C: Bench>(db: &Db<C>, sizes: Sizes) -> (Value, u64) {
    let max_threads = SCALING_THREADS[SCALING_THREADS.len() - 1];
    let pool = db.pool(max_threads as u32);
    let config = Config::default();
    let errors = AtomicU64::new(0);
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); SCALING_THREADS.len()];
    for round in 0..sizes.scaling_rounds {
        for turn in 0..SCALING_THREADS.len() {
            let index = (round + turn) % SCALING_THREADS.len();
            let threads = SCALING_THREADS[index];
            let barrier = Barrier::new(threads);
            let calls: u64 = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (pool, config, barrier, errors) = (&pool, &config, &barrier, &errors);
                        s.spawn(move || {
                            let mut keys = Keys::new(100 + t as u64);
                            let mut conn = pool.get().expect("a pooled connection");
                            barrier.wait();
                            let deadline = Instant::now() + sizes.scaling_time;
                            let mut calls = 0;
                            while Instant::now() < deadline {
                                match config.run(&mut conn, SCOPE, &keys.next_key(), &REQUEST, C::place_order) {
                                    Ok(_) => calls += 1,
                                    Err(_) => {
                                        errors.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                            calls
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("a scaling thread")).sum()
            });
            samples[index].push(calls as f64 / sizes.scaling_time.as_secs_f64());
        }
    }
    let mut result = serde_json::Map::new();
    for (index, threads) in SCALING_THREADS.iter().enumerate() {
        result.insert(threads.to_string(), json!(median(&samples[index]).round()));
    }
    (Value::Object(result), errors.load(Ordering::Relaxed))
}

/// `first` throughput with many existing records against an empty
/// table, in alternating rounds; then the existing records, all
/// expired, are purged.
fn large_table_and_purge<C: Bench>(sizes: Sizes) -> (Value, Value) {
    let empty = Db::<C>::new();
    let large = Db::<C>::new();
    let config = Config::default();
    let mut fill = large.conn();
    let start = Instant::now();
    fill.fill_expired(sizes.large_records).expect("fill the large table");
    eprintln!(
        "filled {} expired records in {:.1} s",
        sizes.large_records,
        start.elapsed().as_secs_f64()
    );
    let mut conns = [empty.conn(), large.conn()];
    let mut keys = Keys::new(3);
    let mut samples = [Vec::new(), Vec::new()];
    for conn in &mut conns {
        for _ in 0..20 {
            first(conn, &config, &keys.next_key());
        }
    }
    // Call by call in turns, as in the single-connection scenarios.
    for _ in 0..sizes.large_rounds {
        let mut elapsed = [0.0f64; 2];
        for i in 0..sizes.calls * 2 {
            for turn in 0..2 {
                let index = (i + turn) % 2;
                let key = keys.next_key();
                let start = Instant::now();
                first(&mut conns[index], &config, &key);
                elapsed[index] += start.elapsed().as_secs_f64();
            }
        }
        for (index, total) in elapsed.iter().enumerate() {
            samples[index].push((sizes.calls * 2) as f64 / total);
        }
    }
    let (empty_ops, large_ops) = (median(&samples[0]), median(&samples[1]));
    let large_table = json!({
        "records": sizes.large_records,
        "empty_ops_per_s": empty_ops.round(),
        "large_ops_per_s": large_ops.round(),
        "ratio": round3(large_ops / empty_ops),
    });

    let timer = BatchTimer::default();
    let mut conn = large.conn();
    conn.set_instrumentation(timer.instrumentation());
    let start = Instant::now();
    let rows = config.purge_expired(&mut conn, sizes.purge_batch).expect("purge");
    let elapsed = start.elapsed().as_secs_f64();
    assert_eq!(
        rows as i64, sizes.large_records,
        "every expired record is purged, no other"
    );
    let batches = timer.batches_ms();
    let purge = json!({
        "rows": rows,
        "batch_size": sizes.purge_batch,
        "batches": batches.len(),
        "rows_per_s": (rows as f64 / elapsed).round(),
        "max_batch_ms": round3(percentile(&batches, 100.0)),
        "p99_batch_ms": round3(percentile(&batches, 99.0)),
        "first_batch_ms": round3(batches.first().copied().unwrap_or(f64::NAN)),
        "median_batch_ms": round3(median(&batches)),
    });
    (large_table, purge)
}

/// Messages per second one relay delivers with a handler that does
/// nothing: the outbox's own cost of claiming and settling.
fn relay_throughput<C: Bench>(db: &Db<C>, sizes: Sizes) -> Value {
    let mut conn = db.conn();
    let relay = Relay::default().batch_size(RELAY_BATCH);
    // Delivers every due message; returns how many.
    let drain = |conn: &mut C| {
        let mut delivered = 0;
        loop {
            let batch = relay
                .run_once(conn, |message| {
                    std::hint::black_box(&message.key);
                    Ok::<_, std::convert::Infallible>(())
                })
                .expect("relay");
            if batch.claimed == 0 {
                return delivered;
            }
            delivered += batch.delivered;
        }
    };
    // The receipts of the `first_outbox` scenario go first, untimed.
    drain(&mut conn);
    let mut rates = Vec::new();
    for _ in 0..sizes.relay_rounds {
        conn.transaction(|tx| {
            for order in 0..sizes.relay_messages {
                outbox::enqueue(tx, "receipts", &json!({ "order": order }))?;
            }
            Ok::<_, outbox::Error>(())
        })
        .expect("enqueue the messages");
        let start = Instant::now();
        let delivered = drain(&mut conn);
        let elapsed = start.elapsed().as_secs_f64();
        assert_eq!(delivered, sizes.relay_messages, "every message delivered once");
        rates.push(delivered as f64 / elapsed);
    }
    json!({
        "messages": sizes.relay_messages,
        "batch_size": RELAY_BATCH,
        "rounds": sizes.relay_rounds,
        "messages_per_s": round3(median(&rates)),
    })
}

/// How long a message waits from its commit to its handler with
/// `Relay::serve` (one worker, defaults but for `poll_interval`) in
/// this process: messages committed one by one at a steady rate,
/// each timed from the moment its commit returned to the moment
/// the handler was called. A relay sleeping between polls wakes
/// through `LISTEN`/`NOTIFY` on PostgreSQL; on SQLite it finds the
/// message at its next poll. On a database of its own: right after
/// the throughput scenario's deliveries, PostgreSQL's outbox index
/// holds their dead entries until a vacuum, which slows every look
/// for pending messages (p50 13 and 20 ms in two trials right after
/// 30,000 deliveries, against 4 ms without them).
fn relay_latency<C: Bench>(sizes: Sizes, poll_interval: chrono::Duration) -> Value {
    use idempotency::Shutdown;
    use std::sync::mpsc;
    let db = Db::<C>::new();
    // One connection for the worker, one for the listener.
    let pool = db.pool(2);
    let mut conn = db.conn();
    let relay = Relay::default().poll_interval(poll_interval);
    let shutdown = Shutdown::new();
    let (handed, handled) = mpsc::channel::<(i64, Instant)>();
    let handler = |message: &idempotency::outbox::Message| {
        let now = Instant::now();
        if message.topic == "latency" {
            let seq = message.payload::<i64>().map_err(|e| e.to_string())?;
            handed.send((seq, now)).map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(())
    };
    let interval = Duration::from_secs_f64(1.0 / sizes.latency_rate);
    let latencies_ms: Vec<f64> = std::thread::scope(|scope| {
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        // A message first, untimed: the relay is up and idle.
        outbox::enqueue(&mut conn, "latency", &-1i64).expect("enqueue");
        assert_eq!(handled.recv().expect("the warm-up message").0, -1);
        let start = Instant::now();
        let mut committed = Vec::with_capacity(sizes.latency_messages);
        for seq in 0..sizes.latency_messages {
            let due = start + interval * seq as u32;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            outbox::enqueue(&mut conn, "latency", &(seq as i64)).expect("enqueue");
            committed.push(Instant::now());
        }
        let mut latencies = vec![f64::NAN; sizes.latency_messages];
        for _ in 0..sizes.latency_messages {
            let (seq, at) = handled.recv().expect("every message delivered");
            let seq = usize::try_from(seq).expect("a sequence number");
            latencies[seq] = at.saturating_duration_since(committed[seq]).as_secs_f64() * 1000.0;
        }
        shutdown.trigger();
        let summary = service.join().expect("the relay service");
        assert_eq!(summary.errors, 0, "the relay met no error");
        latencies
    });
    json!({
        "messages": sizes.latency_messages,
        "rate_per_s": sizes.latency_rate,
        "poll_interval_ms": poll_interval.num_milliseconds(),
        "woken_by": if C::NAME == "postgres" { "notify" } else { "poll" },
        "p50_ms": round3(percentile(&latencies_ms, 50.0)),
        "p99_ms": round3(percentile(&latencies_ms, 99.0)),
        "max_ms": round3(percentile(&latencies_ms, 100.0)),
    })
}

fn run<C: Bench>(sizes: Sizes, profile: bool) -> Value {
    let db = Db::<C>::new();
    eprintln!("single-connection scenarios...");
    let (per_call, statements, profile) = single_connection(&db, sizes, profile);
    eprintln!("contention...");
    let contention = contention(&db, sizes);
    eprintln!("scaling...");
    let (scaling, scaling_errors) = scaling(&db, sizes);
    eprintln!("large table and purge...");
    let (large_table, purge) = large_table_and_purge::<C>(sizes);
    eprintln!("outbox relay...");
    let relay = relay_throughput(&db, sizes);
    eprintln!("relay service latency...");
    let latency: Vec<Value> = LATENCY_POLLS
        .iter()
        .map(|&poll| relay_latency::<C>(sizes, poll))
        .collect();
    let per_call_of = |name: &str| per_call[name].as_f64().unwrap_or(f64::NAN);
    let ratio = |a: &str, b: &str| round3(per_call_of(a) / per_call_of(b));
    json!({
        "backend": C::NAME,
        "rounds": sizes.rounds,
        "calls_per_round": sizes.calls,
        "per_call_us": per_call,
        "statements_per_call": statements,
        "ratios": {
            "first_over_floor": ratio("first", "floor"),
            "first_over_bare_floor": ratio("first", "bare_floor"),
            "first_over_baseline": ratio("first", "baseline"),
            "first_over_two_phase": ratio("first", "two_phase"),
            "replay_over_baseline": ratio("replay", "baseline"),
            "phased_over_first": ratio("phased", "first"),
            "phased_over_baseline": ratio("phased", "baseline"),
            "large_table": large_table["ratio"],
        },
        "contention": contention,
        "scaling": scaling,
        "scaling_errors": scaling_errors,
        "large_table": large_table,
        "purge": purge,
        "outbox": {
            "enqueue_us": round3(
                per_call["first_outbox"].as_f64().unwrap_or(f64::NAN) - per_call["first"].as_f64().unwrap_or(f64::NAN)
            ),
            "first_with_enqueue_over_first": ratio("first_outbox", "first"),
            "relay": relay,
            "latency": latency,
        },
        "phased": {
            "commits": PHASED_COMMITS,
            "per_operation_us": per_call["phased"],
            "per_commit_us": round3(per_call_of("phased") / PHASED_COMMITS as f64),
            "per_commit_over_first": round3(per_call_of("phased") / PHASED_COMMITS as f64 / per_call_of("first")),
            "per_commit_over_baseline": round3(per_call_of("phased") / PHASED_COMMITS as f64 / per_call_of("baseline")),
        },
        "statement_profile": profile,
    })
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use diesel::SqliteConnection;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::query_dsl::methods::ExecuteDsl;

    use super::{Bench, KEY_COLUMNS, Statement, place_order_returning_id};

    /// A statement SQLite executes.
    pub trait Executable: ExecuteDsl<SqliteConnection> {}

    impl<S: ExecuteDsl<SqliteConnection>> Executable for S {}

    /// A WAL file database in a temporary directory, every commit durable:
    /// WAL with `synchronous = FULL` syncs the log on each commit, as
    /// PostgreSQL does.
    impl Bench for SqliteConnection {
        const NAME: &'static str = "sqlite";

        fn configure(&mut self) -> QueryResult<()> {
            self.batch_execute("PRAGMA synchronous = FULL; PRAGMA busy_timeout = 10000;")
        }

        fn create_tables(&mut self) -> QueryResult<()> {
            self.batch_execute(&format!(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL, quantity INTEGER NOT NULL);
                 CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key)) WITHOUT ROWID;
                 CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at);
                 CREATE TABLE bare_keys ({KEY_COLUMNS});"
            ))
        }

        fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
            diesel::sql_query(
                "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)
                 INSERT INTO idempotency_keys
                     (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
                 SELECT 'bench', lower(hex(randomblob(16))), lower(hex(randomblob(32))), 'completed', '12345',
                        '2000-01-01 00:00:00', '2000-01-01 00:00:00', datetime('2000-01-02', '+' || n || ' seconds')
                 FROM g",
            )
            .bind::<diesel::sql_types::BigInt, _>(records)
            .execute(self)
        }

        fn place_order(&mut self) -> QueryResult<i64> {
            place_order_returning_id(self)
        }

        fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
            ExecuteDsl::execute(statement, self)
        }
    }
}

#[cfg(not(feature = "sqlite"))]
mod sqlite {
    pub trait Executable {}

    impl<S> Executable for S {}
}

#[cfg(feature = "postgres")]
mod postgres {
    use diesel::PgConnection;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::query_dsl::methods::ExecuteDsl;

    use super::{Bench, KEY_COLUMNS, Statement, place_order_returning_id};

    /// A statement PostgreSQL executes.
    pub trait Executable: ExecuteDsl<PgConnection> {}

    impl<S: ExecuteDsl<PgConnection>> Executable for S {}

    /// A schema of its own in the database named by `DATABASE_URL`.
    impl Bench for PgConnection {
        const NAME: &'static str = "postgres";

        fn create_tables(&mut self) -> QueryResult<()> {
            self.batch_execute(&format!(
                "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL);
                 CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key));
                 CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at);
                 CREATE TABLE bare_keys ({KEY_COLUMNS});"
            ))
        }

        fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
            let inserted = diesel::sql_query(
                "INSERT INTO idempotency_keys
                     (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
                 SELECT 'bench', md5(g::text), md5(g::text) || md5(g::text), 'completed', '12345',
                        timestamp '2000-01-01', timestamp '2000-01-01', timestamp '2000-01-02' + g * interval '1 second'
                 FROM generate_series(1, $1) AS g",
            )
            .bind::<diesel::sql_types::BigInt, _>(records)
            .execute(self)?;
            self.batch_execute("ANALYZE idempotency_keys")?;
            Ok(inserted)
        }

        fn place_order(&mut self) -> QueryResult<i64> {
            place_order_returning_id(self)
        }

        fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
            ExecuteDsl::execute(statement, self)
        }
    }
}

#[cfg(not(feature = "postgres"))]
mod postgres {
    pub trait Executable {}

    impl<S> Executable for S {}
}

#[cfg(feature = "mysql")]
mod mysql {
    use diesel::MysqlConnection;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::query_dsl::methods::ExecuteDsl;

    use super::{Bench, Statement, new_order, orders};

    /// A statement MySQL executes.
    pub trait Executable: ExecuteDsl<MysqlConnection> {}

    impl<S: ExecuteDsl<MysqlConnection>> Executable for S {}

    diesel::define_sql_function! {
        /// The id the last insert on this connection gave its row.
        fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
    }

    /// The key table's columns, as the crate's MySQL migration has them.
    const KEY_COLUMNS: &str = "scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        request_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        response LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
        created_at DATETIME(6) NOT NULL, completed_at DATETIME(6), expires_at DATETIME(6) NOT NULL";

    /// A database of its own on the server named by `MYSQL_URL`.
    impl Bench for MysqlConnection {
        const NAME: &'static str = "mysql";

        fn create_tables(&mut self) -> QueryResult<()> {
            self.batch_execute(&format!(
                "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, quantity INTEGER NOT NULL);
                 CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key), INDEX floor_keys_expires_at (expires_at))
                     DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
                 CREATE TABLE bare_keys ({KEY_COLUMNS}) DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;"
            ))
        }

        fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
            // Numbers from the cross product of six digit tables: MySQL caps
            // a recursive CTE at 1,000 steps by default.
            let inserted = diesel::sql_query(
                "INSERT INTO idempotency_keys
                     (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
                 SELECT 'bench', MD5(n), SHA2(n, 256), 'completed', '12345',
                        '2000-01-01', '2000-01-01', TIMESTAMP('2000-01-02') + INTERVAL n SECOND
                 FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d + 1 AS n
                       FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS a,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS b,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS c,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS e,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS f,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                             UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS g
                      ) AS numbers
                 WHERE n <= ?",
            )
            .bind::<diesel::sql_types::BigInt, _>(records)
            .execute(self)?;
            self.batch_execute("ANALYZE TABLE idempotency_keys")?;
            Ok(inserted)
        }

        /// MySQL has no `RETURNING`: the id comes from the connection, a
        /// second statement.
        fn place_order(&mut self) -> QueryResult<i64> {
            diesel::insert_into(orders::table).values(new_order()).execute(self)?;
            let id: u64 = diesel::select(last_insert_id()).get_result(self)?;
            Ok(id as i64)
        }

        fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
            ExecuteDsl::execute(statement, self)
        }
    }
}

#[cfg(not(feature = "mysql"))]
mod mysql {
    pub trait Executable {}

    impl<S> Executable for S {}
}
