//! Racing requests over real connections: a pool of real connections to a
//! file SQLite database or the PostgreSQL server, threads released together.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;

use chrono::Duration;
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent};

use crate::common::TestDb;
use crate::common::race::assert_one_executed_and_all_saw_it;
use crate::common::wait::{self, Barrier};

crate::common::backend_tests!(
    concurrent_retries_execute_once,
    overlapping_keys_execute_once_each,
    reject_policy_fails_fast_while_the_key_is_held,
    wait_policy_times_out_while_the_key_stays_held,
);

fn concurrent_retries_execute_once<D: TestDb>() {
    const THREADS: usize = 16;
    let db = D::new();
    // Smaller than the thread count: the barrier comes before checkout.
    let pool = db.pool(8);
    let barrier = Arc::new(Barrier::new(THREADS));
    let calls = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (pool, barrier, calls) = (pool.clone(), barrier.clone(), calls.clone());
            thread::spawn(move || {
                barrier.wait();
                let mut conn = pool.get().expect("pooled connection");
                run_idempotent(&mut conn, "shop", "one-key", &"order", |tx| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    // Work that keeps the key held while the others arrive.
                    thread::sleep(std::time::Duration::from_millis(20));
                    D::place_order(tx, "book", 1)
                })
                .expect("every request succeeds")
            })
        })
        .collect();
    let outcomes: Vec<Outcome<i64>> = handles.into_iter().map(|h| wait::join(h, "a racing thread")).collect();

    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_one_executed_and_all_saw_it(outcomes);
    assert_eq!(D::order_count(&mut db.conn()), 1);
}

fn overlapping_keys_execute_once_each<D: TestDb>() {
    const THREADS: usize = 8;
    const KEYS: usize = 40;
    let db = D::new();
    let pool = db.pool(4);
    let barrier = Arc::new(Barrier::new(THREADS));
    let calls: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, barrier, calls) = (pool.clone(), barrier.clone(), calls.clone());
            thread::spawn(move || {
                barrier.wait();
                // Every thread visits every key, starting at a different one.
                (0..KEYS)
                    .map(|i| (i + t * 5) % KEYS)
                    .map(|k| {
                        let mut conn = pool.get().expect("pooled connection");
                        let outcome = run_idempotent(&mut conn, "shop", &format!("key-{k}"), &k, |tx| {
                            calls[k].fetch_add(1, Ordering::SeqCst);
                            D::place_order(tx, &format!("item-{k}"), 1)
                        })
                        .expect("every request succeeds");
                        (k, outcome.into_inner())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut seen: HashMap<usize, i64> = HashMap::new();
    for handle in handles {
        for (k, value) in wait::join(handle, "a racing thread") {
            assert_eq!(*seen.entry(k).or_insert(value), value, "key {k} answered two values");
        }
    }
    for (k, count) in calls.iter().enumerate() {
        assert_eq!(count.load(Ordering::SeqCst), 1, "key {k} executed once");
    }
    assert_eq!(D::order_count(&mut db.conn()), i64::try_from(KEYS).expect("small"));
}

/// Holds `key` in an open transaction on its own thread until `release`
/// fires; returns once the key is held.
fn hold_key<D: TestDb>(db: &D, key: &'static str, release: mpsc::Receiver<()>) -> thread::JoinHandle<Outcome<i64>> {
    let mut conn = db.conn();
    let (held_tx, held_rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        run_idempotent(&mut conn, "shop", key, &1, |tx| {
            let id = D::place_order(tx, "held", 1)?;
            held_tx.send(()).expect("signal held");
            wait::recv(&release, "release");
            Ok::<_, diesel::result::Error>(id)
        })
        .expect("holder commits")
    });
    wait::recv(&held_rx, "the holder claims the key");
    handle
}

fn reject_policy_fails_fast_while_the_key_is_held<D: TestDb>() {
    let db = D::new();
    let (release, released) = mpsc::channel();
    let holder = hold_key(&db, "held-key", released);

    let mut conn = db.conn();
    let config = Config::default().in_flight(InFlight::Reject);
    let calls = AtomicUsize::new(0);
    let result = config.run(&mut conn, "shop", "held-key", &1, |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        D::place_order(tx, "second", 1)
    });
    assert!(matches!(result, Err(Error::InProgress)), "{result:?}");
    assert_eq!(result.expect_err("in progress").status_code(), 409);
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    release.send(()).expect("release the holder");
    let first = wait::join(holder, "the holder thread").into_inner();
    // The same connection is usable and now replays the holder's result.
    let retry = config
        .run(&mut conn, "shop", "held-key", &1, |tx| D::place_order(tx, "second", 1))
        .expect("retry");
    assert_eq!(retry, Outcome::Replayed(first));
    assert_eq!(D::order_count(&mut conn), 1);
}

fn wait_policy_times_out_while_the_key_stays_held<D: TestDb>() {
    let db = D::new();
    let (release, released) = mpsc::channel();
    let holder = hold_key(&db, "slow-key", released);

    let mut conn = db.conn();
    let config = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(200)));
    let result = config.run(&mut conn, "shop", "slow-key", &1, |tx| D::place_order(tx, "second", 1));
    assert!(matches!(result, Err(Error::InProgress)), "{result:?}");

    release.send(()).expect("release the holder");
    wait::join(holder, "the holder thread");
    let retry = config
        .run(&mut conn, "shop", "slow-key", &1, |tx| D::place_order(tx, "second", 1))
        .expect("retry");
    assert!(retry.is_replayed());
    assert_eq!(D::order_count(&mut conn), 1);
}

mod sqlite_busy_timeout {
    use super::*;
    use crate::common::sqlite::Db;
    use diesel::prelude::*;

    fn busy_timeout(conn: &mut diesel::SqliteConnection) -> i32 {
        #[derive(QueryableByName)]
        struct Timeout {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            timeout: i32,
        }
        diesel::sql_query("PRAGMA busy_timeout")
            .get_result::<Timeout>(conn)
            .expect("read busy_timeout")
            .timeout
    }

    #[test]
    fn busy_timeout_follows_the_in_flight_policy_while_the_call_writes() {
        let db = Db::new();
        let mut conn = db.conn();
        // The harness gives its connections a busy timeout of their own.
        assert_eq!(busy_timeout(&mut conn), 10_000);

        let wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(2500)));
        let inside = wait
            .run(&mut conn, "shop", "a", &1, |tx| Ok::<_, Error>(busy_timeout(tx)))
            .expect("call");
        assert_eq!(inside.into_inner(), 2500);
        assert_eq!(busy_timeout(&mut conn), 10_000, "the caller's busy timeout is put back");

        let reject = Config::default().in_flight(InFlight::Reject);
        let inside = reject
            .run(&mut conn, "shop", "b", &1, |tx| Ok::<_, Error>(busy_timeout(tx)))
            .expect("call");
        assert_eq!(inside.into_inner(), 0);
        assert_eq!(busy_timeout(&mut conn), 10_000);

        let failed = run_idempotent(&mut conn, "shop", "c", &1, |tx| Err::<i32, _>(busy_timeout(tx)));
        assert!(
            matches!(failed, Err(Error::Operation(5000))),
            "the default policy waits 5 s: {failed:?}"
        );
        assert_eq!(busy_timeout(&mut conn), 10_000, "also after a rolled-back call");

        let clock = idempotency::testing::ManualClock::new();
        let purging = Config::default().in_flight(InFlight::Reject).clock(clock.source());
        purging.purge_expired(&mut conn, 10).expect("purge");
        assert_eq!(busy_timeout(&mut conn), 10_000, "and after a purge");
    }

    /// On a connection whose busy timeout is diesel's default, 0, the write
    /// lock is polled for as it is: the only settings a call sends are the
    /// policy's wait once it holds the lock and the caller's 0 put back.
    #[test]
    fn a_busy_timeout_of_zero_is_not_set_again_before_the_lock() {
        let db = Db::new();
        let mut conn = db.conn();
        diesel::connection::SimpleConnection::batch_execute(&mut conn, "PRAGMA busy_timeout = 0").expect("no timeout");
        let sets = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&sets);
        conn.set_instrumentation(move |event: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
                let text = query.to_string();
                let sql = text.split(" -- binds").next().unwrap_or_default();
                if sql.contains("busy_timeout =") {
                    seen.lock().expect("statements").push(sql.to_owned());
                }
            }
        });
        let wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(2500)));
        let inside = wait
            .run(&mut conn, "shop", "a", &1, |tx| Ok::<_, Error>(busy_timeout(tx)))
            .expect("call");
        assert_eq!(inside.into_inner(), 2500);
        assert_eq!(
            std::mem::take(&mut *sets.lock().expect("statements")),
            ["PRAGMA busy_timeout = 2500", "PRAGMA busy_timeout = 0"]
        );
        let reject = Config::default().in_flight(InFlight::Reject);
        let inside = reject
            .run(&mut conn, "shop", "b", &1, |tx| Ok::<_, Error>(busy_timeout(tx)))
            .expect("call");
        assert_eq!(inside.into_inner(), 0);
        assert_eq!(*sets.lock().expect("statements"), ["PRAGMA busy_timeout = 0"]);
        assert_eq!(busy_timeout(&mut conn), 0);
    }

    #[test]
    fn replay_reads_without_the_write_lock() {
        let db = Db::new();
        let mut conn = db.conn();
        run_idempotent(&mut conn, "shop", "done", &1, |_| Ok::<_, Error>(7)).expect("first");

        // Another writer holds the database lock; a replay still answers at
        // once, even under the reject policy.
        let (release, released) = mpsc::channel::<()>();
        let (held_tx, held_rx) = mpsc::channel();
        let mut writer = db.conn();
        let holder = thread::spawn(move || {
            writer
                .immediate_transaction(|_| {
                    held_tx.send(()).expect("signal");
                    wait::recv(&released, "release");
                    Ok::<_, diesel::result::Error>(())
                })
                .expect("writer transaction");
        });
        wait::recv(&held_rx, "the writer holds the lock");
        let reject = Config::default().in_flight(InFlight::Reject);
        let replay = reject
            .run(&mut conn, "shop", "done", &1, |_| Ok::<_, Error>(0))
            .expect("replay");
        assert_eq!(replay, Outcome::Replayed(7));
        let fresh = reject.run(&mut conn, "shop", "fresh", &1, |_| Ok::<_, Error>(0));
        assert!(
            matches!(fresh, Err(Error::InProgress)),
            "a new key needs the lock: {fresh:?}"
        );
        release.send(()).expect("release");
        wait::join(holder, "the writer thread");
    }

    /// Outside WAL mode a reader is locked out while a writer commits; with
    /// connections that have no busy timeout of their own, the replay read
    /// must not turn that into a failed request.
    #[test]
    fn rollback_journal_readers_wait_for_writers() {
        const THREADS: usize = 8;
        const ITEMS: usize = 300;
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = dir.path().join("journal.db").to_str().expect("utf-8 path").to_owned();
        {
            let mut conn = diesel::SqliteConnection::establish(&url).expect("open");
            diesel::connection::SimpleConnection::batch_execute(
                &mut conn,
                "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL, quantity INTEGER NOT NULL)",
            )
            .expect("create orders");
            idempotency::run_migrations(&mut conn).expect("migrate");
        }
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (url, barrier) = (url.clone(), barrier.clone());
                thread::spawn(move || {
                    let mut conn = diesel::SqliteConnection::establish(&url).expect("open");
                    barrier.wait();
                    // Every thread runs every item, so replays read while
                    // other threads commit.
                    (0..ITEMS)
                        .map(|i| (i + t * 50) % ITEMS)
                        .filter(|&i| {
                            run_idempotent(&mut conn, "jobs", &format!("item-{i}"), &i, |tx| {
                                Db::place_order(tx, "item", 1)
                            })
                            .is_err()
                        })
                        .count()
                })
            })
            .collect();
        let failures: usize = handles.into_iter().map(|h| wait::join(h, "a reading thread")).sum();
        assert_eq!(failures, 0);
        let mut conn = diesel::SqliteConnection::establish(&url).expect("open");
        assert_eq!(Db::order_count(&mut conn), i64::try_from(ITEMS).expect("small"));
    }
}
