//! The single-connection scenarios: one call each of the domain
//! transaction alone, its floors, an idempotent first call, a replay, the
//! two-phase design, a first call with an outbox message and a phased
//! operation, all on one connection, taking turns call by call. Turns
//! rather than one scenario after another, so that a disturbance on the
//! machine lands on all of them alike and their ratios hold within a run.
//!
//! Four scenarios take the first call and the replay apart: `read_floor`
//! is the floor after a replay's read that misses, `rewrite` the floor with
//! the record claimed before the operation and completed after it, as the
//! crate's claims are, `read` a replay's read of a completed record alone,
//! and `tx_replay` that read in a transaction of its own, the least a
//! replay's read costs where no read comes before the transaction.
//! After the timed rounds, each scenario runs again alone to learn what the
//! server did for it (`server.rs`).

use std::time::Instant;

use chrono::Utc;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use idempotency::outbox;
use idempotency::phased::Phased;
use idempotency::{Config, Outcome};
use serde_json::{Value, json};

use crate::args::Sizes;
use crate::db::{
    Bench, CompleteFloorKey, CompletedKey, Db, FloorRecord, KeyTable, REQUEST, REQUEST_HASH, SCOPE, Statement,
};
use crate::db::{bare_keys, floor_keys, idempotency_keys};
use crate::instrument::StatementCounter;
use crate::server;
use crate::stats::{Keys, median, round3};

/// Every single-connection scenario, by the name its figures carry in the
/// report.
pub const SCENARIOS: [&str; 12] = [
    "baseline",
    "floor",
    "bare_floor",
    "read_floor",
    "rewrite",
    "first",
    "two_phase",
    "replay",
    "read",
    "tx_replay",
    "first_outbox",
    "phased",
];
/// Commits of one operation of the `phased` scenario: the claim with its
/// phase, the call recorded as started, the call's result, the finish.
pub const PHASED_COMMITS: usize = 4;

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

/// `floor` after a replay's read of the key, which misses: what the read
/// before the transaction costs a first call.
fn read_floor<C: Bench>(conn: &mut C, key: &str) -> QueryResult<i64> {
    assert!(!conn.find_key(KeyTable::Floor, key)?, "a fresh key has no record");
    floor(conn, key)
}

/// `floor` with the record written twice, as the crate's claims are: claimed
/// before the operation (on PostgreSQL in the `BEGIN`'s round trip, as the
/// crate's claim is), completed by an `UPDATE` of the columns the crate's
/// completion sets after it.
fn rewrite<C: Bench>(conn: &mut C, key: &str) -> QueryResult<i64> {
    conn.begin_claim(&FloorRecord::claimed(SCOPE, key))?;
    let written = conn.place_order().and_then(|id| {
        let completed = conn.send(CompleteFloorKey::now(SCOPE, key, id))?;
        assert_eq!(completed, 1, "the claimed record is completed");
        Ok(id)
    });
    match written {
        Ok(id) => AnsiTransactionManager::commit_transaction(conn).map(|()| id),
        Err(error) => {
            let _ = AnsiTransactionManager::rollback_transaction(conn);
            Err(error)
        }
    }
}

/// A replay's read of a completed record, outside any transaction: what
/// the read before the transaction costs a replay in the database.
fn read<C: Bench>(conn: &mut C, key: &str) -> QueryResult<bool> {
    let found = conn.find_key(KeyTable::Crate, key)?;
    assert!(found, "a completed key has its record");
    Ok(found)
}

/// `read` inside a transaction of its own: the least it costs without the
/// read before the transaction, where a replay would take the write path
/// and find the record there.
fn tx_replay<C: Bench>(conn: &mut C, key: &str) -> QueryResult<bool> {
    conn.transaction(|tx| read(tx, key))
}

pub fn first<C: Bench>(conn: &mut C, config: &Config, key: &str) -> i64 {
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
        "read_floor" => {
            std::hint::black_box(read_floor(conn, key).expect("read_floor"));
        }
        "rewrite" => {
            std::hint::black_box(rewrite(conn, key).expect("rewrite"));
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
        "read" => {
            std::hint::black_box(read(conn, &done[*next_done % done.len()]).expect("read"));
            *next_done += 1;
        }
        "tx_replay" => {
            std::hint::black_box(tx_replay(conn, &done[*next_done % done.len()]).expect("tx_replay"));
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

/// The timed rounds: per scenario the µs and the statements per call; then
/// what the server did for each scenario (`server.rs`).
pub fn single_connection<C: Bench>(db: &Db<C>, sizes: Sizes) -> (Value, Value, Value) {
    let config = Config::default();
    let operation = Phased::new("bench");
    let mut conn = db.conn();
    let counter = StatementCounter::default();
    conn.set_instrumentation(counter.instrumentation());
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
    let mut probe = conn.probe();
    let server = server::measure(&mut conn, &mut probe, &SCENARIOS, sizes.server_calls, |conn, name| {
        call(
            conn,
            (&config, &operation),
            name,
            &keys.next_key(),
            &done,
            &mut next_done,
        );
    });
    (Value::Object(per_call), Value::Object(per_statement), server)
}
