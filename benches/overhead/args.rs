//! The command line and the sizes it picks: a full run's, for figures to
//! quote, or `--quick`'s, every count cut so that CI can keep the bench
//! working in seconds without judging speed.

use std::path::PathBuf;
use std::time::Duration;

use crate::common;

/// How much work each scenario gets.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Rounds of the interleaved single-connection scenarios.
    pub rounds: usize,
    /// Calls of each scenario per round.
    pub calls: usize,
    /// Calls of each scenario in each batch that learns what the server did
    /// for it.
    pub server_calls: usize,
    /// Rounds of the contention scenario, each with a key of its own.
    pub contention_rounds: usize,
    /// Rounds of the scaling scenario, each visiting every thread count.
    pub scaling_rounds: usize,
    /// How long each thread count runs in one scaling round.
    pub scaling_time: Duration,
    /// Existing records in the large table, all expired, later purged.
    pub large_records: i64,
    /// Rounds of the large-table comparison.
    pub large_rounds: usize,
    /// Rows per purge batch.
    pub purge_batch: usize,
    /// Messages the relay delivers in each outbox round.
    pub relay_messages: usize,
    /// Rounds of the relay throughput scenario.
    pub relay_rounds: usize,
    /// Messages committed one by one for the relay latency scenario.
    pub latency_messages: usize,
    /// Their rate, per second.
    pub latency_rate: f64,
}

pub const FULL: Sizes = Sizes {
    rounds: 21,
    calls: 100,
    server_calls: 300,
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

pub const QUICK: Sizes = Sizes {
    rounds: 5,
    calls: 30,
    server_calls: 20,
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

pub struct Args {
    pub backend: String,
    pub quick: bool,
    pub json: Option<PathBuf>,
}

pub fn parse_args() -> Result<Args, String> {
    let mut json = None;
    let common = common::parse_args(
        "usage: overhead --backend sqlite|postgres|mysql|citus|postgres-async [--quick] [--json FILE]",
        |arg, rest| {
            match arg {
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
    })
}
