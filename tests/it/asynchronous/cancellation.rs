//! A call's future dropped at any of its `await`s (a timeout, a server
//! whose client hung up) changes nothing by halves: what the database holds
//! afterwards is the whole call or nothing of it, the pool never lends the
//! connection again inside a transaction or holding the key's lock, and a
//! retry of the key is served within the in-flight wait. Proven by cutting
//! one call after longer and longer times, from before its first statement
//! to after its commit, and checking each cut against the database.

use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use idempotency::{Config, InFlight, KeyStatus, Outcome};

use crate::common::TestDb;
use crate::common::asynchronous::{AsyncServerDb, async_backend_tests};
use crate::common::wait::wait_for;

async_backend_tests!(server: a_dropped_async_call_leaves_all_of_it_or_nothing_and_a_retry_is_served);

/// How much longer each cut lets the call run than the one before.
const STEP: Duration = Duration::from_micros(150);

async fn a_dropped_async_call_leaves_all_of_it_or_nothing_and_a_retry_is_served<D: AsyncServerDb>() {
    let db = D::new();
    let pool = db.async_pool(1).await;
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(5)));
    let mut admin = db.conn();
    let (mut dropped_inside, mut dropped_outside) = (0, 0);
    let mut cut = Duration::ZERO;
    for attempt in 0.. {
        assert!(attempt < 2_000, "a call never finished within {cut:?}");
        let key = format!("order-{attempt}");
        let mut conn = pool.get().await.expect("a connection from the pool");
        let session = D::session_of(&mut conn).await;
        let call = config.run_async(&mut *conn, "shop", &key, &key, async |tx: &mut D::Async| {
            D::insert_order(tx, &key).await?;
            Ok::<_, diesel::result::Error>(1)
        });
        let started = Instant::now();
        let finished = tokio::time::timeout(cut, call).await;
        let ran_for = started.elapsed();
        let broken = conn.is_broken();
        match (&finished, broken) {
            (Ok(outcome), _) => assert_eq!(outcome.as_ref().expect("the whole call"), &Outcome::Executed(1)),
            (Err(_), true) => dropped_inside += 1,
            (Err(_), false) => dropped_outside += 1,
        }
        // Back to the pool, which drops a connection left in a transaction.
        drop(conn);
        if broken {
            tokio::task::block_in_place(|| {
                wait_for("the dropped connection's session to end", || {
                    !D::session_exists(&mut admin, session)
                })
            });
        }

        let mut conn = pool.get().await.expect("a connection from the pool");
        assert!(!conn.is_broken(), "the pool lends no connection inside a transaction");
        let lent = D::session_of(&mut conn).await;
        assert!(
            D::session_is_idle(&mut admin, lent),
            "the lent session is in no transaction"
        );
        let orders = orders_of::<D>(&mut admin, &key);
        let status = config
            .status::<_, i32>(&mut admin, "shop", &key)
            .expect("the key's status");
        match (orders, &status) {
            (0, KeyStatus::NoRecord) | (1, KeyStatus::Completed { response: 1, .. }) => {}
            other => panic!("cut after {ran_for:?}: orders and record {other:?} are not one whole call"),
        }
        let retried = config
            .run_async(&mut *conn, "shop", &key, &key, async |tx: &mut D::Async| {
                D::insert_order(tx, &key).await?;
                Ok::<_, diesel::result::Error>(1)
            })
            .await
            .expect("the retry is served");
        let expected = if orders == 0 {
            Outcome::Executed(1)
        } else {
            Outcome::Replayed(1)
        };
        assert_eq!(retried, expected, "cut after {ran_for:?}");
        assert_eq!(
            orders_of::<D>(&mut admin, &key),
            1,
            "one order for the key after its retry"
        );
        if finished.is_ok() {
            break;
        }
        cut += STEP;
    }
    assert!(
        dropped_inside > 0 && dropped_outside > 0,
        "the cuts fell inside the transaction ({dropped_inside}) and outside it ({dropped_outside})"
    );
}

/// The orders placed for `key`, whose item is the key itself.
fn orders_of<D: TestDb>(conn: &mut D::Conn, key: &str) -> usize {
    D::orders(conn).iter().filter(|(_, item)| item == key).count()
}
