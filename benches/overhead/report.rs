//! The report as people read it: markdown tables of the per-call figures
//! and ratios, then one line per multi-threaded scenario. It reads only the
//! JSON that `--json` writes, so the printed figures and the file's are the
//! same numbers.

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
