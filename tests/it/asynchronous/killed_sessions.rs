//! What an async caller is told matches what committed while the server
//! ends sessions at random moments, as on the sync side
//! (`killed_sessions.rs`, whose rules of truth this shares): diesel-async's
//! client reports a lost connection in its own words, and the crate must
//! read them as the sync client's. Workers place orders through async
//! calls, each with a key of its own, while a killer thread ends one of
//! their sessions every few milliseconds; every answer is then compared
//! with what the database holds, and every failed call retried.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use idempotency::{Config, InFlight};

use crate::common::asynchronous::{AsyncServerDb, async_backend_tests};
use crate::killed_sessions::{
    ENOUGH, Jitter, LEAST, MOST, MOST_CALLS_PER_WORKER, SCOPE, Told, WORKERS, assert_faults_hit,
    assert_told_what_committed, orders_placed, told,
};

async_backend_tests!(server: killed_sessions_leave_every_async_call_told_what_committed);

async fn killed_sessions_leave_every_async_call_told_what_committed<D: AsyncServerDb>() {
    let db = D::new();
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(5)));
    let sessions: Vec<AtomicI64> = (0..WORKERS).map(|_| AtomicI64::new(0)).collect();
    let answers = Mutex::new(Vec::new());
    let (unknown, nothing) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let (stop, kills, ready) = (AtomicBool::new(false), AtomicUsize::new(0), AtomicUsize::new(0));
    let place = async |conn: &mut D::Async, key: &str| {
        config
            .run_async(conn, SCOPE, key, key, async |tx: &mut D::Async| {
                D::insert_order(tx, key).await
            })
            .await
    };
    // The workers run side by side on this task; the killer on a thread of
    // its own, with a synchronous connection.
    let workers = (0..WORKERS).map(|worker| {
        let (db, sessions, answers, ready) = (&db, &sessions, &answers, &ready);
        let (unknown, nothing, stop, place) = (&unknown, &nothing, &stop, &place);
        async move {
            let mut conn = db.connect().await;
            sessions[worker].store(D::session_of(&mut conn).await, Ordering::SeqCst);
            ready.fetch_add(1, Ordering::SeqCst);
            for n in 0..MOST_CALLS_PER_WORKER {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let key = format!("w{worker}-{n}");
                let answer = told(&place(&mut conn, &key).await);
                answers.lock().expect("answers").push((key, answer));
                if answer == Told::Committed {
                    continue;
                }
                match answer {
                    Told::Unknown => unknown.fetch_add(1, Ordering::SeqCst),
                    _ => nothing.fetch_add(1, Ordering::SeqCst),
                };
                sessions[worker].store(0, Ordering::SeqCst);
                conn = db.connect().await;
                sessions[worker].store(D::session_of(&mut conn).await, Ordering::SeqCst);
            }
        }
    });
    thread::scope(|s| {
        s.spawn(|| {
            let mut admin = db.conn();
            let mut jitter = Jitter::new();
            let started = Instant::now();
            loop {
                let elapsed = started.elapsed();
                let enough = unknown.load(Ordering::SeqCst) >= ENOUGH && nothing.load(Ordering::SeqCst) >= ENOUGH;
                if elapsed >= MOST || (elapsed >= LEAST && enough) {
                    break;
                }
                thread::sleep(Duration::from_micros(2_000 + jitter.below(8_000)));
                if ready.load(Ordering::SeqCst) < WORKERS {
                    continue;
                }
                let victim = usize::try_from(jitter.below(WORKERS as u64)).expect("a worker index");
                let id = sessions[victim].load(Ordering::SeqCst);
                if id != 0 {
                    D::kill_session(&mut admin, id);
                    kills.fetch_add(1, Ordering::SeqCst);
                }
            }
            stop.store(true, Ordering::SeqCst);
        });
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(futures_util::future::join_all(workers))
        });
    });
    let answers = answers.into_inner().expect("answers");
    assert_faults_hit(&answers, kills.into_inner());

    let mut check = db.conn();
    let records = assert_told_what_committed::<D>(&mut check, &answers);

    let mut conn = db.connect().await;
    for (key, answer) in answers.iter().filter(|(_, answer)| *answer != Told::Committed) {
        let retry = place(&mut conn, key)
            .await
            .unwrap_or_else(|error| panic!("the retry of {key} ({answer:?}) failed: {error}"));
        assert_eq!(
            retry.is_replayed(),
            records.contains(key),
            "the retry of {key} ({answer:?}) replays exactly when the call committed"
        );
    }
    let orders = orders_placed::<D>(&mut check);
    assert_eq!(
        orders.iter().collect::<HashSet<_>>().len(),
        orders.len(),
        "a retry placed an order again"
    );
    assert_eq!(
        orders.len(),
        answers.len(),
        "every call's order exists once after the retries"
    );
}
