//! The report as people read it: markdown tables of the per-call figures
//! and ratios, one line per multi-threaded scenario, and the run's column
//! of the performance guide's table. It reads only the JSON that `--json`
//! writes, so the printed figures and the file's are the same numbers.

use serde_json::Value;

use crate::load::{CONTENTION_OP, CONTENTION_THREADS};
use crate::scenarios::SCENARIOS;

pub fn print_report(report: &Value, quick: bool) {
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
    print_guide_column(report);
    print_above_floor(&report["above_floor"]);
    print_server(report);
}

fn print_above_floor(above: &Value) {
    println!();
    for (view, how) in [
        ("timed", "in the timed rounds"),
        (
            "in_statements",
            "in its statements, the commit of each that writes left out",
        ),
    ] {
        let number = |key: &str| above[view][key].as_f64().unwrap_or(f64::NAN);
        println!(
            "first above floor, {how}: {:.1} µs = the read before the transaction {:.1} (read_floor - floor) \
             + the record claimed then completed {:.1} (rewrite - floor) + the rest {:.1} (the key's lock, the crate's own work)",
            number("first_us"),
            number("read_us"),
            number("rewrite_us"),
            number("rest_us"),
        );
        let (read, saved) = (number("read_us"), number("replay_saved_us"));
        if read > 0.0 && saved > 0.0 {
            println!(
                "  the read before the transaction saves a replay at least {saved:.1} µs (tx_replay - read): \
                 it pays where more than {:.1} % of calls are retries of completed keys",
                number("break_even_retry_share") * 100.0,
            );
        } else {
            println!(
                "  the read before the transaction: costs a first call {read:.1} µs, saves a replay {saved:.1} µs \
                 (tx_replay - read); a difference within this run's noise decides no policy"
            );
        }
    }
}

/// What the server did for each scenario, per call and per statement.
fn print_server(report: &Value) {
    let server = &report["server"];
    let number = |value: &Value, decimals: usize| match value.as_f64() {
        Some(value) => format!("{value:.decimals$}"),
        None => String::from("—"),
    };
    println!();
    println!(
        "what the server did, per call ({} calls of each scenario alone, after the timed rounds):",
        server["calls"]
    );
    for note in server["notes"].as_array().into_iter().flatten() {
        println!("- {}", note.as_str().unwrap_or("?"));
    }
    let columns: Vec<(&str, &str)> = server["columns"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|column| (column[0].as_str().unwrap_or("?"), column[1].as_str().unwrap_or("?")))
        .collect();
    println!();
    print!("| scenario     | µs per call |");
    for (_, label) in &columns {
        print!(" {label} |");
    }
    println!();
    print!("| ------------ | ----------: |");
    for (_, label) in &columns {
        print!(" {}: |", "-".repeat(label.chars().count().max(2) - 1));
    }
    println!();
    for name in SCENARIOS {
        print!(
            "| {name:<12} | {:>11.1} |",
            report["per_call_us"][name].as_f64().unwrap_or(f64::NAN)
        );
        for (key, label) in &columns {
            let decimals = if *key == "hot_share" { 3 } else { 1 };
            print!(
                " {:>width$} |",
                number(&server["per_call"][name][*key], decimals),
                width = label.chars().count()
            );
        }
        println!();
    }
    let details = &server["details"];
    if details
        .as_object()
        .is_some_and(|details| details.values().any(|detail| detail.get("wal_records").is_some()))
    {
        println!();
        println!("WAL records of the scenario's transactions, per call (pg_walinspect): kind count × bytes each");
        for name in SCENARIOS {
            let Some(kinds) = details[name]["wal_records"].as_array() else {
                continue;
            };
            let kinds: Vec<String> = kinds
                .iter()
                .map(|kind| {
                    let fpi = kind["fpi_bytes_per_call"].as_f64().unwrap_or(0.0);
                    format!(
                        "{} {} × {}{}",
                        kind["kind"].as_str().unwrap_or("?"),
                        number(&kind["per_call"], 2),
                        number(&kind["bytes_each"], 0),
                        if fpi > 0.0 {
                            format!(" (+{fpi:.0} B of page images)")
                        } else {
                            String::new()
                        }
                    )
                })
                .collect();
            if kinds.is_empty() {
                println!("- {name}: none");
            } else {
                println!("- {name}: {}", kinds.join(", "));
            }
        }
    }
    println!();
    println!("every statement, per call (the scenarios taking turns again, every statement timed):");
    println!();
    println!(
        "| scenario     | statement                                                        | per call | µs each | server CPU µs each |"
    );
    println!(
        "| ------------ | ---------------------------------------------------------------- | -------: | ------: | -----------------: |"
    );
    for row in server["statements"].as_array().into_iter().flatten() {
        println!(
            "| {:<12} | {:<64} | {:>8.2} | {:>7.1} | {:>18} |",
            row["scenario"].as_str().unwrap_or("?"),
            row["statement"].as_str().unwrap_or("?"),
            row["per_call"].as_f64().unwrap_or(f64::NAN),
            row["us_each"].as_f64().unwrap_or(f64::NAN),
            number(&row["server_cpu_us_each"], 1),
        );
    }
    if details.as_object().is_some_and(|details| {
        details
            .values()
            .any(|detail| detail.get("pg_stat_statements").is_some())
    }) {
        println!();
        println!("every statement as pg_stat_statements counts it, per call:");
        println!();
        println!(
            "| scenario     | statement                                                        | per call | exec µs | plan µs | buffers hit | read | dirtied | WAL bytes |"
        );
        println!(
            "| ------------ | ---------------------------------------------------------------- | -------: | ------: | ------: | ----------: | ---: | ------: | --------: |"
        );
        for name in SCENARIOS {
            for row in details[name]["pg_stat_statements"].as_array().into_iter().flatten() {
                println!(
                    "| {:<12} | {:<64} | {:>8} | {:>7} | {:>7} | {:>11} | {:>4} | {:>7} | {:>9} |",
                    name,
                    row["statement"].as_str().unwrap_or("?"),
                    number(&row["per_call"], 2),
                    number(&row["exec_us_each"], 1),
                    number(&row["plan_us_each"], 1),
                    number(&row["buffers_hit_each"], 1),
                    number(&row["buffers_read_each"], 1),
                    number(&row["buffers_dirtied_each"], 1),
                    number(&row["wal_bytes_each"], 0),
                );
            }
        }
    }
}

/// The run as one column of the performance guide's table, rows and
/// formats as the guide has them, so that a new run's figures go into the
/// guide by pasting rather than by copying numbers one by one.
fn print_guide_column(report: &Value) {
    let number = |value: &Value| value.as_f64().unwrap_or(f64::NAN);
    let per_call = |name: &str| format!("{:.1} µs", number(&report["per_call_us"][name]));
    let ratio = |name: &str| format!("{:.3}", number(&report["ratios"][name]));
    let statements = &report["statements_per_call"];
    let contention = &report["contention"];
    let executions = if contention["min_executions"] == contention["executions"] {
        format!("{} execution per round", contention["executions"])
    } else {
        format!(
            "{} to {} executions per round",
            contention["min_executions"], contention["executions"]
        )
    };
    let scaling = report["scaling"].as_object().into_iter().flatten();
    let (threads, calls): (Vec<String>, Vec<String>) = scaling
        .map(|(threads, calls)| (threads.clone(), format!("{:.0}", number(calls))))
        .unzip();
    let large = &report["large_table"];
    let purge = &report["purge"];
    let outbox = &report["outbox"];
    let rows = [
        (
            "`baseline`: the domain transaction alone".to_owned(),
            per_call("baseline"),
        ),
        (
            "`floor`: plus one insert into a table like the key table".to_owned(),
            per_call("floor"),
        ),
        ("`first`: `run_idempotent`, fresh key".to_owned(), per_call("first")),
        (
            "statements per `first` (per `floor`)".to_owned(),
            format!("{} ({})", number(&statements["first"]), number(&statements["floor"])),
        ),
        (
            "`two_phase`: claim, operation, store in three commits".to_owned(),
            per_call("two_phase"),
        ),
        ("`replay`: a retry of a completed key".to_owned(), per_call("replay")),
        ("`first / floor`".to_owned(), ratio("first_over_floor")),
        ("`first / bare_floor`".to_owned(), ratio("first_over_bare_floor")),
        ("`first / baseline`".to_owned(), ratio("first_over_baseline")),
        ("`first / two_phase`".to_owned(), ratio("first_over_two_phase")),
        ("`replay / baseline`".to_owned(), ratio("replay_over_baseline")),
        (
            format!(
                "contention: {} threads, one key, {} ms operation, {} rounds",
                contention["threads"],
                CONTENTION_OP.as_millis(),
                contention["rounds"]
            ),
            format!(
                "{executions}, {} errors, p50 {:.1} ms, p99 {:.1} ms",
                contention["errors"],
                number(&contention["p50_ms"]),
                number(&contention["p99_ms"])
            ),
        ),
        (
            format!("scaling of `first`, calls/s at {} threads", threads.join(" / ")),
            calls.join(" / "),
        ),
        (
            format!(
                "`large_table`: `first` with {} records against none (calls/s)",
                grouped(number(&large["records"]))
            ),
            format!(
                "{:.3} ({:.0} against {:.0})",
                number(&large["ratio"]),
                number(&large["large_ops_per_s"]),
                number(&large["empty_ops_per_s"])
            ),
        ),
        (
            format!(
                "purge of {} expired records, {} per batch",
                grouped(number(&purge["rows"])),
                purge["batch_size"]
            ),
            format!(
                "{} rows/s; batches: median {:.1} ms, p99 {:.1} ms, longest {:.1} ms",
                grouped(number(&purge["rows_per_s"])),
                number(&purge["median_batch_ms"]),
                number(&purge["p99_batch_ms"]),
                number(&purge["max_batch_ms"])
            ),
        ),
        (
            "outbox: `first` whose operation also enqueues one message".to_owned(),
            format!(
                "+{:.1} µs (× {:.3})",
                number(&outbox["enqueue_us"]),
                number(&outbox["first_with_enqueue_over_first"])
            ),
        ),
        (
            format!(
                "outbox: one relay, no-op handler, batches of {}",
                outbox["relay"]["batch_size"]
            ),
            format!("{} messages/s", grouped(number(&outbox["relay"]["messages_per_s"]))),
        ),
        (
            format!(
                "phased: phase, provider call, finish ({} commits), per commit / `first`",
                report["phased"]["commits"]
            ),
            format!("{:.3}", number(&report["phased"]["per_commit_over_first"])),
        ),
    ];
    println!();
    println!("the performance guide's column for this run:");
    println!();
    println!("| | {} |", report["backend"].as_str().unwrap_or("?"));
    println!("| --- | ---: |");
    for (label, value) in rows {
        println!("| {label} | {value} |");
    }
}

/// `value` rounded to a whole number, its thousands set apart by commas.
fn grouped(value: f64) -> String {
    if !value.is_finite() {
        return value.to_string();
    }
    let digits = format!("{:.0}", value.abs());
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    if value < 0.0 { format!("-{out}") } else { out }
}
