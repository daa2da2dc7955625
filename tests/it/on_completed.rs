//! The reject policy for completed keys (`Config::on_completed`): the same
//! request under a completed key is `Error::AlreadyCompleted` and runs
//! nothing, while every other answer of the contract stays as it is.

use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::{Duration, TimeZone, Utc};
use idempotency::phased::Phased;
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, KeyStatus, OnCompleted, Outcome};

use crate::common::TestDb;

crate::common::backend_tests!(
    a_completed_key_is_rejected_and_its_operation_runs_once,
    another_request_is_still_a_mismatch_and_a_free_key_still_executes,
    the_key_executes_anew_once_its_retention_has_ended,
    a_lookup_still_answers_the_stored_result,
    a_finished_phased_operation_is_rejected_and_runs_no_phase_again,
);

fn rejecting() -> Config {
    Config::default().on_completed(OnCompleted::Reject)
}

/// Places an order under `key` for `item`, counting the operation's runs.
fn place<D: TestDb>(
    config: &Config,
    conn: &mut D::Conn,
    key: &str,
    item: &str,
    runs: &AtomicUsize,
) -> Result<Outcome<i64>, Error<diesel::result::Error>> {
    config.run(conn, "shop", key, &item, |tx| {
        runs.fetch_add(1, Ordering::SeqCst);
        D::place_order(tx, item, 1)
    })
}

fn a_completed_key_is_rejected_and_its_operation_runs_once<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = rejecting();
    let runs = AtomicUsize::new(0);

    let first = place::<D>(&config, &mut conn, "k-1", "book", &runs).expect("the first call");
    assert!(matches!(first, Outcome::Executed(_)), "{first:?}");
    for _ in 0..2 {
        let again = place::<D>(&config, &mut conn, "k-1", "book", &runs);
        assert!(matches!(again, Err(Error::AlreadyCompleted)), "{again:?}");
        let error = again.expect_err("rejected");
        assert_eq!(error.status_code(), 409);
        assert!(!error.is_retryable(), "the same request cannot succeed again");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_eq!(D::order_count(&mut conn), 1, "one order");
    assert_eq!(D::key_count(&mut conn), 1, "the record is kept as it was");

    // The default replays: the policy is the only thing that changed.
    let replayed = place::<D>(&Config::default(), &mut conn, "k-1", "book", &runs).expect("a replay");
    assert_eq!(replayed, Outcome::Replayed(first.into_inner()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

fn another_request_is_still_a_mismatch_and_a_free_key_still_executes<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = rejecting();
    let runs = AtomicUsize::new(0);

    place::<D>(&config, &mut conn, "k-1", "book", &runs).expect("the first call");
    let other = place::<D>(&config, &mut conn, "k-1", "pen", &runs);
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    let fresh = place::<D>(&config, &mut conn, "k-2", "pen", &runs).expect("a new key");
    assert!(matches!(fresh, Outcome::Executed(_)), "{fresh:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(D::order_items(&mut conn), ["book", "pen"]);
}

fn the_key_executes_anew_once_its_retention_has_ended<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::at(Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).single().expect("a date"));
    let config = rejecting().retention(Duration::hours(1)).clock(clock.source());
    let runs = AtomicUsize::new(0);

    place::<D>(&config, &mut conn, "k-1", "book", &runs).expect("the first call");
    clock.advance(Duration::minutes(59));
    let within = place::<D>(&config, &mut conn, "k-1", "book", &runs);
    assert!(matches!(within, Err(Error::AlreadyCompleted)), "{within:?}");
    clock.advance(Duration::minutes(2));
    let after = place::<D>(&config, &mut conn, "k-1", "book", &runs).expect("the key is free again");
    assert!(matches!(after, Outcome::Executed(_)), "{after:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(D::order_count(&mut conn), 2);
}

fn a_lookup_still_answers_the_stored_result<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = rejecting();
    let runs = AtomicUsize::new(0);

    let first = place::<D>(&config, &mut conn, "k-1", "book", &runs).expect("the first call");
    let status: KeyStatus<i64> = config.status(&mut conn, "shop", "k-1", &"book").expect("a lookup");
    let KeyStatus::Completed { response, .. } = status else {
        panic!("the stored result: {status:?}")
    };
    assert_eq!(response, first.into_inner());
}

fn a_finished_phased_operation_is_rejected_and_runs_no_phase_again<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let order = Phased::new("place_order").config(rejecting());
    let phases = AtomicUsize::new(0);
    let run = |conn: &mut D::Conn| {
        order.run(conn, "shop", "k-1", &"book", |s| {
            let id = s.phase("placed", |tx| {
                phases.fetch_add(1, Ordering::SeqCst);
                D::place_order(tx, "book", 1)
            })?;
            s.finish(|_| Ok::<_, diesel::result::Error>(id))
        })
    };

    let first = run(&mut conn).expect("the first run");
    assert!(matches!(first, Outcome::Executed(_)), "{first:?}");
    let again = run(&mut conn);
    assert!(matches!(again, Err(Error::AlreadyCompleted)), "{again:?}");
    assert_eq!(phases.load(Ordering::SeqCst), 1, "no phase ran again");
    assert_eq!(D::order_count(&mut conn), 1);
}

/// The async calls share the single call's path: the policy holds there
/// as well.
#[cfg(feature = "sqlite-async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn an_async_call_under_the_reject_policy_rejects_its_completed_key() {
    let mut conn = idempotency::testing::sqlite_memory_async();
    let config = rejecting();
    let runs = AtomicUsize::new(0);
    let charge = async |conn: &mut _| {
        config
            .run_async(conn, "payments", "charge-1", &500, async |_: &mut _| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::convert::Infallible>(500)
            })
            .await
    };
    let first = charge(&mut conn).await.expect("the first call");
    assert_eq!(first, Outcome::Executed(500));
    let again = charge(&mut conn).await;
    assert!(matches!(again, Err(Error::AlreadyCompleted)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
