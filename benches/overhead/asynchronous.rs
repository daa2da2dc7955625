//! The async call next to the sync one, in one run (`--backend
//! postgres-async`): on one database, a `PgConnection` and an
//! `AsyncPgConnection` each run the floor (the domain transaction plus one
//! insert of a key-shaped record), a first call and a replay, all six
//! scenarios taking turns call by call as the single-connection scenarios
//! do. The async scenarios are driven by a current-thread tokio runtime,
//! one `block_on` per call, as a server's worker would poll them. Each
//! connection counts its statements and its round trips (a statement
//! pipelined behind another shares that one's round trip).

use std::time::Instant;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use idempotency::{Config, Outcome};
use serde_json::{Value, json};

use crate::args::Sizes;
use crate::db::{CompletedKey, Db, REQUEST, SCOPE, floor_keys, new_order, orders};
use crate::instrument::RoundTripCounter;
use crate::stats::{Keys, median, round3};

/// The scenarios, by the names their figures carry in the report.
pub const SCENARIOS: [&str; 6] = ["floor", "first", "replay", "async_floor", "async_first", "async_replay"];

/// The connections and the runtime the scenarios share.
struct Connections {
    sync: PgConnection,
    r#async: AsyncPgConnection,
    runtime: tokio::runtime::Runtime,
    config: Config,
}

impl Connections {
    /// One call of scenario `name` with `key`; `done` is a key already
    /// answered, for the replays.
    fn call(&mut self, name: &str, key: &str, done: &str) {
        let Connections {
            sync,
            r#async,
            runtime,
            config,
        } = self;
        match name {
            "floor" => {
                sync.transaction(|tx| {
                    let id = diesel::insert_into(orders::table)
                        .values(new_order())
                        .returning(orders::id)
                        .get_result::<i64>(tx)?;
                    diesel::RunQueryDsl::execute(
                        diesel::insert_into(floor_keys::table).values(CompletedKey::now(SCOPE, key, id)),
                        tx,
                    )
                })
                .expect("the floor");
            }
            "first" => expect_executed(config.run(sync, SCOPE, key, &REQUEST, |tx| {
                diesel::insert_into(orders::table)
                    .values(new_order())
                    .returning(orders::id)
                    .get_result::<i64>(tx)
            })),
            "replay" => {
                expect_replayed(config.run(sync, SCOPE, done, &REQUEST, |_| Ok::<i64, diesel::result::Error>(0)))
            }
            "async_floor" => runtime
                .block_on(r#async.transaction::<_, diesel::result::Error, _>(async |tx| {
                    let id = diesel_async::RunQueryDsl::get_result::<i64>(
                        diesel::insert_into(orders::table)
                            .values(new_order())
                            .returning(orders::id),
                        tx,
                    )
                    .await?;
                    diesel_async::RunQueryDsl::execute(
                        diesel::insert_into(floor_keys::table).values(CompletedKey::now(SCOPE, key, id)),
                        tx,
                    )
                    .await
                }))
                .map(drop)
                .expect("the async floor"),
            "async_first" => expect_executed(runtime.block_on(config.run_async(
                r#async,
                SCOPE,
                key,
                &REQUEST,
                async |tx: &mut AsyncPgConnection| {
                    diesel_async::RunQueryDsl::get_result::<i64>(
                        diesel::insert_into(orders::table)
                            .values(new_order())
                            .returning(orders::id),
                        tx,
                    )
                    .await
                },
            ))),
            "async_replay" => expect_replayed(runtime.block_on(config.run_async(
                r#async,
                SCOPE,
                done,
                &REQUEST,
                async |_: &mut AsyncPgConnection| Ok::<i64, diesel::result::Error>(0),
            ))),
            other => unreachable!("no scenario {other}"),
        }
    }
}

fn expect_executed<E: std::fmt::Debug>(outcome: Result<Outcome<i64>, idempotency::Error<E>>) {
    assert!(
        matches!(outcome, Ok(Outcome::Executed(_))),
        "a fresh key must execute, got {outcome:?}"
    );
}

fn expect_replayed<E: std::fmt::Debug>(outcome: Result<Outcome<i64>, idempotency::Error<E>>) {
    assert!(
        matches!(outcome, Ok(Outcome::Replayed(_))),
        "a done key must replay, got {outcome:?}"
    );
}

/// Runs the scenarios on a bench database of its own; the report.
pub fn run(sizes: Sizes) -> Value {
    let db = Db::<PgConnection>::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut r#async = runtime
        .block_on(AsyncPgConnection::establish(db.url()))
        .expect("an async connection to the bench database");
    let counter = RoundTripCounter::default();
    let mut sync = db.conn();
    sync.set_instrumentation(counter.instrumentation());
    r#async.set_instrumentation(counter.instrumentation());
    let mut conns = Connections {
        sync,
        r#async,
        runtime,
        config: Config::default(),
    };
    let mut keys = Keys::new(2);
    let done = keys.next_key();
    conns.call("first", &done, &done);
    // Warm up: every statement prepared and cached before timing.
    for name in SCENARIOS {
        for _ in 0..5 {
            conns.call(name, &keys.next_key(), &done);
        }
    }
    counter.take();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); SCENARIOS.len()];
    let mut counts = [(0u64, 0u64); SCENARIOS.len()];
    for _ in 0..sizes.rounds {
        let mut elapsed = [0.0f64; SCENARIOS.len()];
        for i in 0..sizes.calls {
            for turn in 0..SCENARIOS.len() {
                let index = (i + turn) % SCENARIOS.len();
                let key = keys.next_key();
                let start = Instant::now();
                conns.call(SCENARIOS[index], &key, &done);
                elapsed[index] += start.elapsed().as_secs_f64();
                let (statements, round_trips) = counter.take();
                counts[index].0 += statements;
                counts[index].1 += round_trips;
            }
        }
        for (index, total) in elapsed.iter().enumerate() {
            samples[index].push(total * 1e6 / sizes.calls as f64);
        }
    }
    let per_call: serde_json::Map<String, Value> = SCENARIOS
        .iter()
        .enumerate()
        .map(|(index, name)| ((*name).to_owned(), json!(round3(median(&samples[index])))))
        .collect();
    let calls = (sizes.rounds * sizes.calls) as f64;
    let per_call_count = |count: fn(&(u64, u64)) -> u64| -> serde_json::Map<String, Value> {
        SCENARIOS
            .iter()
            .zip(&counts)
            .map(|(name, counted)| ((*name).to_owned(), json!(round3(count(counted) as f64 / calls))))
            .collect()
    };
    let of = |name: &str| per_call[name].as_f64().unwrap_or(f64::NAN);
    json!({
        "backend": "postgres-async",
        "rounds": sizes.rounds,
        "calls_per_round": sizes.calls,
        "per_call_us": per_call,
        "statements_per_call": per_call_count(|counted| counted.0),
        "round_trips_per_call": per_call_count(|counted| counted.1),
        "ratios": {
            "first_over_floor": round3(of("first") / of("floor")),
            "async_first_over_async_floor": round3(of("async_first") / of("async_floor")),
            "async_first_over_first": round3(of("async_first") / of("first")),
            "async_floor_over_floor": round3(of("async_floor") / of("floor")),
            "async_replay_over_replay": round3(of("async_replay") / of("replay")),
        },
    })
}

/// Prints the report of [`run`].
pub fn print_report(report: &Value, quick: bool) {
    println!();
    println!(
        "backend: {}{}   (medians of {} rounds of {} calls per scenario, the scenarios taking turns call by call)",
        report["backend"].as_str().unwrap_or("?"),
        if quick { ", quick" } else { "" },
        report["rounds"],
        report["calls_per_round"],
    );
    println!();
    println!("| scenario     | µs per call | statements per call | round trips per call |");
    println!("| ------------ | ----------: | ------------------: | -------------------: |");
    for name in SCENARIOS {
        println!(
            "| {name:<12} | {:>11.1} | {:>19.2} | {:>20.2} |",
            report["per_call_us"][name].as_f64().unwrap_or(f64::NAN),
            report["statements_per_call"][name].as_f64().unwrap_or(f64::NAN),
            report["round_trips_per_call"][name].as_f64().unwrap_or(f64::NAN),
        );
    }
    println!();
    println!("| ratio                        | value |");
    println!("| ---------------------------- | ----: |");
    for (name, value) in report["ratios"].as_object().into_iter().flatten() {
        println!("| {name:<28} | {:>5.3} |", value.as_f64().unwrap_or(f64::NAN));
    }
}
