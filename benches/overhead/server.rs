//! What the server did for each single-connection scenario, beside the time
//! a call takes: after the timed rounds, each scenario runs a batch of
//! calls alone on the same connection, between two readings of what the
//! backend's server counts (its [`Probe`]); then every statement is timed
//! while the scenarios take turns call by call. A time alone cannot say where the microseconds of a
//! call go; what the server wrote, read and computed for it can.
//!
//! Besides a backend's own counters, the CPU time of two threads is read
//! from Linux's `/proc/<id>/schedstat`: the bench's own (the crate, diesel
//! and the client library; on SQLite the database as well) and, where the
//! server runs on this host, the server process or thread that serves the
//! connection. Neither is a count a server keeps for a client, so both
//! are said to be not measured where `/proc` does not show them. The rest
//! of a call's time is waiting: for round trips, for the log's flush at
//! commit, for the scheduler.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{Map, Value, json};

use crate::stats::round3;

/// The CPU time of one thread or process, from `/proc/<id>/schedstat`,
/// whose first field is the nanoseconds it ran. The kernel brings that
/// count up to date when the task stops running, or at a scheduler tick
/// (every few milliseconds): a server's task is read while it waits for
/// the next statement, the calling thread after it yields.
pub struct Task {
    path: PathBuf,
    this_thread: bool,
}

impl Task {
    /// The calling thread.
    pub fn this_thread() -> Result<Task, String> {
        let task = Task {
            path: PathBuf::from("/proc/thread-self/schedstat"),
            this_thread: true,
        };
        task.cpu_ns()
            .map(|_| task)
            .ok_or_else(|| String::from("/proc/thread-self/schedstat is not readable"))
    }

    /// Thread or process `id` of this host, if the process it belongs to is
    /// one of `names`: a server reached over the network, or in a container
    /// of its own, has ids this host does not know, or knows as another
    /// process.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub fn server(id: u64, names: &[&str]) -> Result<Task, String> {
        let status = std::fs::read_to_string(format!("/proc/{id}/status"))
            .map_err(|_| format!("the server's task {id} is not a process of this host"))?;
        let group = status
            .lines()
            .find_map(|line| line.strip_prefix("Tgid:"))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned();
        let name = std::fs::read_to_string(format!("/proc/{group}/comm")).unwrap_or_default();
        if !names.contains(&name.trim()) {
            return Err(format!(
                "task {id} of this host is {}, not the server: the server runs elsewhere",
                name.trim()
            ));
        }
        let task = Task {
            path: PathBuf::from(format!("/proc/{id}/schedstat")),
            this_thread: false,
        };
        task.cpu_ns()
            .map(|_| task)
            .ok_or_else(|| format!("/proc/{id}/schedstat is not readable"))
    }

    pub fn cpu_ns(&self) -> Option<u64> {
        if self.this_thread {
            // A yield brings the running thread's count up to date.
            std::thread::yield_now();
        }
        std::fs::read_to_string(&self.path)
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }
}

/// One per-call figure of a scenario: its key in the JSON, the heading it
/// prints under, and its value.
pub struct Figure {
    pub key: &'static str,
    pub label: &'static str,
    pub value: f64,
}

impl Figure {
    pub fn new(key: &'static str, label: &'static str, value: f64) -> Figure {
        Figure { key, label, value }
    }
}

/// What a backend's server tells of the work done on one connection.
pub trait Probe<C> {
    /// The server's counters now, and where they stand.
    type Reading;

    /// Reads the counters. `None` where nothing can be read; the reason is
    /// among [`notes`](Probe::notes).
    fn read(&mut self, conn: &mut C) -> Option<Self::Reading>;

    /// The per-call figures of a batch of `calls` calls between `before`
    /// and `after`, and details of the batch worth keeping beside them.
    fn figures(
        &mut self,
        conn: &mut C,
        before: &Self::Reading,
        after: &Self::Reading,
        calls: usize,
    ) -> (Vec<Figure>, Value);

    /// The server's thread or process that runs this connection's
    /// statements, where this host shows it.
    fn server_task(&self) -> Option<&Task>;

    /// Whatever this probe does not measure on this server, and why.
    fn notes(&self) -> Vec<String>;
}

/// Times every statement of the batches it is installed for, and the
/// server's CPU time for each where the server's task is known: from the
/// answer to the statement before (or the start of the call) to this
/// statement's answer, so that a statement carries the server's work after
/// the previous answer (the end of a transaction, statistics).
#[derive(Clone, Default)]
pub struct StatementTimer(Arc<Mutex<TimerState>>);

#[derive(Default)]
struct TimerState {
    scenario: &'static str,
    started: Option<(String, Instant)>,
    server: Option<Arc<Task>>,
    last_server_ns: Option<u64>,
    /// Per scenario and statement: statements, client µs, server CPU µs.
    totals: BTreeMap<(&'static str, String), (u64, f64, f64)>,
}

impl StatementTimer {
    pub fn new(server: Option<Arc<Task>>) -> StatementTimer {
        StatementTimer(Arc::new(Mutex::new(TimerState {
            server,
            ..TimerState::default()
        })))
    }

    pub fn instrumentation(&self) -> impl diesel::connection::Instrumentation {
        let state = Arc::clone(&self.0);
        move |event: diesel::connection::InstrumentationEvent<'_>| {
            use diesel::connection::InstrumentationEvent::{FinishQuery, StartQuery};
            let mut state = state.lock().expect("statement timer");
            match event {
                StartQuery { query, .. } => {
                    state.started = Some((label(&query.to_string()), Instant::now()));
                }
                FinishQuery { .. } => {
                    if let Some((label, start)) = state.started.take() {
                        let client_us = start.elapsed().as_secs_f64() * 1e6;
                        let now_ns = state.server.as_ref().and_then(|task| task.cpu_ns());
                        let server_us = match (state.last_server_ns, now_ns) {
                            (Some(last), Some(now)) => now.saturating_sub(last) as f64 / 1e3,
                            _ => f64::NAN,
                        };
                        state.last_server_ns = now_ns;
                        let scenario = state.scenario;
                        let entry = state.totals.entry((scenario, label)).or_default();
                        entry.0 += 1;
                        entry.1 += client_us;
                        entry.2 += server_us;
                    }
                }
                _ => {}
            }
        }
    }

    /// Starts a call of `scenario`.
    pub fn enter(&self, scenario: &'static str) {
        let mut state = self.0.lock().expect("statement timer");
        state.scenario = scenario;
        state.last_server_ns = state.server.as_ref().and_then(|task| task.cpu_ns());
    }

    /// Per scenario and statement, for `calls` calls of each scenario: the
    /// statements per call, their mean time from send to result, and the
    /// server's mean CPU time for each.
    pub fn report(&self, calls: usize) -> Vec<Value> {
        let state = self.0.lock().expect("statement timer");
        state
            .totals
            .iter()
            .map(|((scenario, label), (count, client, server))| {
                json!({
                    "scenario": scenario,
                    "statement": label,
                    "per_call": round3(*count as f64 / calls as f64),
                    "us_each": round3(client / *count as f64),
                    "server_cpu_us_each": finite(round3(server / *count as f64)),
                })
            })
            .collect()
    }
}

/// A statement as the tables print it: its SQL without the binds, white
/// space collapsed, at most 64 characters.
fn label(text: &str) -> String {
    let sql = text.split(" -- binds").next().unwrap_or_default();
    sql.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(64)
        .collect()
}

/// `value`, or null where it was not measured.
fn finite(value: f64) -> Value {
    if value.is_finite() { json!(value) } else { Value::Null }
}

/// Runs each of `scenarios` in a batch of `calls` calls alone through
/// `call`, between two readings of `probe`, then again with every statement
/// timed; the report's `server` section.
pub fn measure<C, P>(
    conn: &mut C,
    probe: &mut P,
    scenarios: &[&'static str],
    calls: usize,
    mut call: impl FnMut(&mut C, &'static str),
) -> Value
where
    C: diesel::Connection,
    P: Probe<C>,
{
    let client = Task::this_thread().map_err(|reason| format!("client CPU: not measured ({reason})"));
    // The per-call batches run without the statement timer, which costs
    // client CPU time of its own.
    let untimed = || |_: diesel::connection::InstrumentationEvent<'_>| {};
    conn.set_instrumentation(untimed());
    let mut per_call = Map::new();
    let mut details = Map::new();
    let mut columns: Vec<(&'static str, &'static str)> = Vec::new();
    for &scenario in scenarios {
        // Every statement prepared and every page in the cache first.
        for _ in 0..5 {
            call(conn, scenario);
        }
        let before = probe.read(conn);
        let cpu = |task: Option<&Task>| task.and_then(Task::cpu_ns);
        let client_before = cpu(client.as_ref().ok());
        let server_before = cpu(probe.server_task());
        let start = Instant::now();
        for _ in 0..calls {
            call(conn, scenario);
        }
        let wall_us = start.elapsed().as_secs_f64() * 1e6 / calls as f64;
        let server_after = cpu(probe.server_task());
        let client_after = cpu(client.as_ref().ok());
        let after = probe.read(conn);
        let per = |before: Option<u64>, after: Option<u64>| match (before, after) {
            (Some(before), Some(after)) => after.saturating_sub(before) as f64 / 1e3 / calls as f64,
            _ => f64::NAN,
        };
        let (client_us, server_us) = (per(client_before, client_after), per(server_before, server_after));
        // On SQLite the server's work is the client's.
        let server_work = if probe.server_task().is_some() { server_us } else { 0.0 };
        let mut figures = vec![
            Figure::new("batch_us", "µs in the batch", wall_us),
            Figure::new("client_cpu_us", "client CPU µs", client_us),
            Figure::new("server_cpu_us", "server CPU µs", server_us),
            // Round trips, the commit's flush, the scheduler: the time
            // neither side spent computing.
            Figure::new("wait_us", "waiting µs", wall_us - client_us - server_work),
        ];
        if let (Some(before), Some(after)) = (&before, &after) {
            let (more, detail) = probe.figures(conn, before, after, calls);
            figures.extend(more);
            if !detail.is_null() {
                details.insert(scenario.into(), detail);
            }
        }
        let mut values = Map::new();
        for figure in figures {
            if !columns.iter().any(|(key, _)| *key == figure.key) {
                columns.push((figure.key, figure.label));
            }
            values.insert(figure.key.into(), finite(round3(figure.value)));
        }
        per_call.insert(scenario.into(), Value::Object(values));
    }
    let timer = StatementTimer::new(probe.server_task().map(|task| {
        Arc::new(Task {
            path: task.path.clone(),
            this_thread: false,
        })
    }));
    conn.set_instrumentation(timer.instrumentation());
    // Turns, as in the timed rounds: the statements of every scenario meet
    // the same weather (a commit's flush takes ten times longer while other
    // work writes to the disk), so their times compare.
    for i in 0..calls {
        for turn in 0..scenarios.len() {
            let scenario = scenarios[(i + turn) % scenarios.len()];
            timer.enter(scenario);
            call(conn, scenario);
        }
    }
    conn.set_instrumentation(untimed());
    // What the probe learned it could not measure, each once, in the order
    // it learned it.
    let mut notes: Vec<String> = client.err().into_iter().collect();
    for note in probe.notes() {
        if !notes.contains(&note) {
            notes.push(note);
        }
    }
    json!({
        "calls": calls,
        "notes": notes,
        "columns": columns.iter().map(|(key, label)| json!([key, label])).collect::<Vec<_>>(),
        "per_call": per_call,
        "details": details,
        "statements": timer.report(calls),
    })
}
