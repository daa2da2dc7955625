//! What an async caller is told matches what committed while the server
//! ends sessions at random moments, as on the sync side
//! (`killed_sessions.rs`, whose rules of truth this shares): diesel-async's
//! client reports a lost connection in its own words, and the crate must
//! read them as the sync client's. Workers place orders through async
//! calls, each with a key of its own, while a killer thread ends one of
//! their sessions every few milliseconds; every answer is then compared
//! with what the database holds, and every failed call retried.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

use idempotency::{Config, InFlight};

use crate::common::asynchronous::{AsyncServerDb, async_backend_tests};
use crate::killed_sessions::{
    MOST_CALLS_PER_WORKER, SCOPE, Told, UnderKills, WORKERS, assert_every_order_once_after_the_retries,
    assert_faults_hit, assert_retry_replays_what_committed, assert_told_what_committed, told,
};

async_backend_tests!(server: killed_sessions_leave_every_async_call_told_what_committed);

async fn killed_sessions_leave_every_async_call_told_what_committed<D: AsyncServerDb>() {
    let db = D::new();
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(5)));
    let race = UnderKills::new();
    let ready = AtomicUsize::new(0);
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
        let (db, race, ready, place) = (&db, &race, &ready, &place);
        async move {
            let mut conn = db.connect().await;
            race.on_session(worker, D::session_of(&mut conn).await);
            ready.fetch_add(1, Ordering::SeqCst);
            for n in 0..MOST_CALLS_PER_WORKER {
                if race.stopped() {
                    break;
                }
                let key = format!("w{worker}-{n}");
                let answer = told(&place(&mut conn, &key).await);
                if race.told(worker, key, answer) {
                    conn = db.connect().await;
                    race.on_session(worker, D::session_of(&mut conn).await);
                }
            }
        }
    });
    thread::scope(|s| {
        s.spawn(|| {
            let all_ready = || ready.load(Ordering::SeqCst) == WORKERS;
            race.kill::<D>(&mut db.conn(), all_ready, || false);
        });
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(futures_util::future::join_all(workers))
        });
    });
    let (answers, kills) = race.into_answers();
    assert_faults_hit(&answers, kills);

    let mut check = db.conn();
    let records = assert_told_what_committed::<D>(&mut check, &answers);

    let mut conn = db.connect().await;
    for (key, answer) in answers.iter().filter(|(_, answer)| *answer != Told::Committed) {
        let retry = place(&mut conn, key)
            .await
            .unwrap_or_else(|error| panic!("the retry of {key} ({answer:?}) failed: {error}"));
        assert_retry_replays_what_committed(key, *answer, retry.is_replayed(), &records);
    }
    assert_every_order_once_after_the_retries::<D>(&mut check, answers.len());
}
