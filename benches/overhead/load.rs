//! The scenarios that a call on one connection cannot show: many threads
//! on one key (contention) or on keys of their own (scaling), a key table
//! of a million records and its purge, and the outbox relay's throughput
//! and latency. They run after the single-connection scenarios, so that
//! their load does not disturb those figures. The large table and the relay
//! latency get databases of their own: the one so that a million records
//! weigh on nothing else, the other so that the throughput scenario's
//! deliveries do not slow it (see `relay_latency`).

use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotency::Config;
use idempotency::outbox::{self, Relay};
use serde_json::{Value, json};

use crate::args::Sizes;
use crate::db::{Bench, Db, REQUEST, SCOPE};
use crate::instrument::BatchTimer;
use crate::scenarios::first;
use crate::stats::{Keys, median, percentile, round3};

/// Threads that call at once with one key, each on a connection of its own.
pub const CONTENTION_THREADS: usize = 32;

/// How long the contended operation runs: long enough for the other
/// threads to arrive while it holds the key.
pub const CONTENTION_OP: Duration = Duration::from_millis(10);

/// The thread counts of the scaling scenario, each on a pool connection of
/// its own.
pub const SCALING_THREADS: [usize; 5] = [1, 2, 4, 8, 16];

/// Messages a relay claims per batch in the relay throughput scenario.
const RELAY_BATCH: usize = 100;

/// The poll intervals of the relay latency scenario: `Relay`'s default, and
/// a short one.
pub const LATENCY_POLLS: [chrono::Duration; 2] =
    [chrono::Duration::milliseconds(250), chrono::Duration::milliseconds(25)];

pub fn contention<C: Bench>(db: &Db<C>, sizes: Sizes) -> Value {
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

pub fn scaling<C: Bench>(db: &Db<C>, sizes: Sizes) -> (Value, u64) {
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
pub fn large_table_and_purge<C: Bench>(sizes: Sizes) -> (Value, Value) {
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
pub fn relay_throughput<C: Bench>(db: &Db<C>, sizes: Sizes) -> Value {
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
pub fn relay_latency<C: Bench>(sizes: Sizes, poll_interval: chrono::Duration) -> Value {
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
