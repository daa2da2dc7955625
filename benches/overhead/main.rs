//! What an idempotent call costs next to the domain transaction alone, on a
//! SQLite file database, on PostgreSQL or on MySQL/MariaDB, all scenarios
//! measured in one run.
//!
//! ```text
//! cargo bench --bench overhead -- --backend sqlite [--quick] [--json FILE]
//! cargo bench --features postgres --bench overhead -- --backend postgres [--quick] [--json FILE]
//! cargo bench --features mysql --bench overhead -- --backend mysql [--quick] [--json FILE]
//! cargo bench --features postgres --bench overhead -- --backend citus [--quick] [--json FILE]
//! cargo bench --features postgres-async --bench overhead -- --backend postgres-async [--quick] [--json FILE]
//! ```
//!
//! `--backend postgres-async` measures the diesel-async call next to the
//! sync one on PostgreSQL: see `asynchronous.rs`. `--backend citus` measures a Citus cluster (`CITUS_DATABASE_URL`, its
//! coordinator) next to plain PostgreSQL (`DATABASE_URL`) with scenarios of
//! its own: see `benches/citus/mod.rs`.
//!
//! The domain operation is one `INSERT` of an order row. Per-call figures
//! are medians over rounds in which the scenarios take turns call by call
//! (their order rotating), so a disturbance on the machine hits all of them
//! alike and every ratio compares figures of the same run. `--quick` cuts
//! every count so that a run takes seconds; CI uses it to keep the bench
//! working, not to judge speed. Beside each scenario's time the report
//! gives what the server did for it, per call and per statement: the log
//! it wrote, the rows and pages it touched, its CPU time and the client's
//! (`server.rs`, each backend's probe in its module). The relay service
//! scenario times messages from their commit to their handler with
//! `Relay::serve` in this process, at two poll intervals.
//!
//! PostgreSQL reads `DATABASE_URL` and works in schemas of its own, dropped
//! at the end; MySQL reads `MYSQL_URL` and works in databases of its own,
//! dropped at the end. SQLite works on WAL files in a temporary directory
//! with `synchronous = FULL`, so that every commit is durable, as on the
//! servers.

// `common` is the HTTP bench's too, so it sits beside both benches, as do
// the Citus scenarios, with scenarios of their own behind `--backend citus`.
#[cfg(feature = "postgres")]
#[path = "../citus/mod.rs"]
mod citus;
#[path = "../common/mod.rs"]
mod common;

mod args;
#[cfg(feature = "postgres-async")]
mod asynchronous;
mod db;
mod instrument;
mod load;
mod report;
mod scenarios;
mod server;
mod stats;

// A backend not compiled in still takes part in `db::Statement`, which
// names all three: its stand-in accepts every statement.
#[cfg(not(all(feature = "sqlite", feature = "postgres", feature = "mysql")))]
mod absent;
#[cfg(not(feature = "mysql"))]
use absent as mysql;
#[cfg(not(feature = "postgres"))]
use absent as postgres;
#[cfg(not(feature = "sqlite"))]
use absent as sqlite;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::process::ExitCode;

use serde_json::{Value, json};

use args::{FULL, QUICK, Sizes, parse_args};
use db::{Bench, Db};
use load::{LATENCY_POLLS, contention, large_table_and_purge, relay_latency, relay_throughput, scaling};
use report::print_report;
use scenarios::{PHASED_COMMITS, single_connection};
use stats::round3;

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
        "sqlite" => (run::<diesel::SqliteConnection>(sizes), print_report),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => {
            eprintln!("the sqlite backend is not compiled in: build with the sqlite feature");
            return ExitCode::from(2);
        }
        #[cfg(feature = "postgres")]
        "postgres" => (run::<diesel::PgConnection>(sizes), print_report),
        #[cfg(not(feature = "postgres"))]
        "postgres" => {
            eprintln!(
                "the postgres backend is not compiled in: run \
                 cargo bench --features postgres --bench overhead -- --backend postgres"
            );
            return ExitCode::from(2);
        }
        #[cfg(feature = "mysql")]
        "mysql" => (run::<diesel::MysqlConnection>(sizes), print_report),
        #[cfg(not(feature = "mysql"))]
        "mysql" => {
            eprintln!(
                "the mysql backend is not compiled in: run \
                 cargo bench --features mysql --bench overhead -- --backend mysql"
            );
            return ExitCode::from(2);
        }
        #[cfg(feature = "postgres-async")]
        "postgres-async" => (asynchronous::run(sizes), asynchronous::print_report),
        #[cfg(not(feature = "postgres-async"))]
        "postgres-async" => {
            eprintln!(
                "postgres-async needs the postgres and diesel-async features: run \
                 cargo bench --features postgres-async --bench overhead -- --backend postgres-async"
            );
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
            eprintln!("unknown backend {other}: use sqlite, postgres, mysql, citus or postgres-async");
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

fn run<C: Bench>(sizes: Sizes) -> Value {
    let db = Db::<C>::new();
    eprintln!("single-connection scenarios, then what the server did for each...");
    let (per_call, statements, server) = single_connection(&db, sizes);
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
        "above_floor": above_floor(&per_call_of, &server),
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
        "server": server,
    })
}

/// Where the µs of a first call above the floor go, as the scenarios that
/// take it apart measure them, and the share of retries above which the
/// read before the transaction saves more on replays than it costs first
/// calls: once from the timed rounds, and once from the times of the
/// scenarios' statements with the commit of those that write left out. A
/// commit's flush is the same for all of them, and the part of a call
/// whose time moves most with what else the disk does.
fn above_floor(per_call: &impl Fn(&str) -> f64, server: &Value) -> Value {
    let in_statements = |name: &str| {
        let writes = !matches!(name, "read" | "tx_replay");
        server["statements"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|row| row["scenario"] == name && !(writes && row["statement"] == "COMMIT"))
            .map(|row| row["per_call"].as_f64().unwrap_or(f64::NAN) * row["us_each"].as_f64().unwrap_or(f64::NAN))
            .fold(0.0, |sum, us| sum + us)
    };
    json!({
        "timed": parts(per_call),
        "in_statements": parts(&in_statements),
    })
}

/// `first - floor`, taken apart with `read_floor`, `rewrite`, `read` and
/// `tx_replay`, each scenario's µs by `us`.
fn parts(us: &impl Fn(&str) -> f64) -> Value {
    let above = us("first") - us("floor");
    let read = us("read_floor") - us("floor");
    let rewrite = us("rewrite") - us("floor");
    // What a replay pays without the read before the transaction: at least
    // its read inside a transaction of its own.
    let saved = us("tx_replay") - us("read");
    json!({
        "first_us": round3(above),
        "read_us": round3(read),
        "rewrite_us": round3(rewrite),
        "rest_us": round3(above - read - rewrite),
        "replay_saved_us": round3(saved),
        "break_even_retry_share": round3(read / (read + saved)),
    })
}
