//! Retention: an expired key executes again; purging deletes expired records
//! in bounded batches.

use chrono::{Duration, TimeZone, Utc};
use diesel::prelude::*;
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, Outcome};

use crate::common::TestDb;
use crate::common::kept_an_hour;

crate::common::backend_tests!(
    key_replays_until_retention_ends,
    expired_key_executes_again_as_new,
    expired_key_accepts_a_different_request,
    failed_takeover_of_an_expired_key_keeps_the_old_record_until_purged,
    purge_deletes_only_expired_records_in_batches,
    purge_with_exact_multiple_of_batch_size_deletes_all,
    purge_inside_a_caller_transaction_rolls_back_with_it,
    recorded_times_come_with_execution_and_replay_and_a_replay_keeps_them,
    recorded_times_by_the_database_clock_are_the_stored_ones,
    record_expiring_past_the_year_9999_is_kept_until_then,
);

fn key_replays_until_retention_ends<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    let first = place_book::<D>(&config, &mut conn, "first");
    clock.advance(Duration::minutes(59) + Duration::seconds(59));
    let retry = place_book::<D>(&config, &mut conn, "retry");
    assert!(retry.is_replayed());
    assert_eq!(retry.into_inner(), first.into_inner());
    assert_eq!(D::order_count(&mut conn), 1);
}

fn expired_key_executes_again_as_new<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    place_book::<D>(&config, &mut conn, "first");
    clock.advance(Duration::hours(1));
    let again = place_book::<D>(&config, &mut conn, "after expiry");
    assert!(!again.is_replayed(), "expires_at <= now is expired");
    assert_eq!(D::order_count(&mut conn), 2);
    assert_eq!(
        D::key_count(&mut conn),
        1,
        "the old record was replaced, not duplicated"
    );
    // The new record starts a new retention window.
    clock.advance(Duration::minutes(30));
    let retry = place_book::<D>(&config, &mut conn, "retry");
    assert!(retry.is_replayed());
}

fn expired_key_accepts_a_different_request<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    place_book::<D>(&config, &mut conn, "first");
    let early = config.run(&mut conn, "shop", "k", &2, |tx| D::place_order(tx, "book", 2));
    assert!(matches!(early, Err(Error::Mismatch)));
    clock.advance(Duration::hours(2));
    let late = config
        .run(&mut conn, "shop", "k", &2, |tx| D::place_order(tx, "book", 2))
        .expect("after expiry");
    assert!(!late.is_replayed());
}

fn failed_takeover_of_an_expired_key_keeps_the_old_record_until_purged<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    place_book::<D>(&config, &mut conn, "first");
    clock.advance(Duration::hours(2));
    let failed = config.run(&mut conn, "shop", "k", &1, |_| Err::<i64, _>("declined by validation"));
    assert!(matches!(failed, Err(Error::Operation("declined by validation"))));
    assert_eq!(D::key_count(&mut conn), 1, "the rollback restored the expired record");
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 1);
}

/// A database of the test's own, a connection to it, and a policy that
/// keeps records an hour by the clock returned with it.
fn kept_an_hour_on<D: TestDb>() -> (D, D::Conn, ManualClock, Config) {
    let db = D::new();
    let conn = db.conn();
    let (clock, config) = kept_an_hour();
    (db, conn, clock, config)
}

/// The call of key `k` in scope `shop`: an order of one book.
fn place_book<D: TestDb>(config: &Config, conn: &mut D::Conn, what: &str) -> Outcome<i64> {
    config
        .run(conn, "shop", "k", &1, |tx| D::place_order(tx, "book", 1))
        .expect(what)
}

/// `n` calls in the scope `shop`, keys `{prefix}-0` onwards, each
/// returning its number.
fn calls<C: idempotency::StoreConnection>(config: &idempotency::Config, conn: &mut C, prefix: &str, n: i32) {
    for i in 0..n {
        config
            .run(conn, "shop", &format!("{prefix}-{i}"), &i, |_| Ok::<_, Error>(i))
            .expect("a call");
    }
}

fn purge_deletes_only_expired_records_in_batches<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    calls(&config, &mut conn, "old", 25);
    clock.advance(Duration::minutes(30));
    calls(&config, &mut conn, "new", 5);
    clock.advance(Duration::minutes(30));
    // The 25 old records expire now; the 5 new ones in 30 minutes.
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 25);
    assert_eq!(D::key_count(&mut conn), 5);
    assert_eq!(config.purge_expired(&mut conn, 10).expect("second purge"), 0);
    let kept = config
        .run(&mut conn, "shop", "new-3", &3, |_| Ok::<_, Error>(-1))
        .expect("retry");
    assert!(kept.is_replayed(), "unexpired records survive the purge");
}

fn purge_with_exact_multiple_of_batch_size_deletes_all<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    calls(&config, &mut conn, "k", 20);
    clock.advance(Duration::days(1));
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 20);
    assert_eq!(config.purge_expired(&mut conn, 1).expect("purge of nothing"), 0);
    assert_eq!(D::key_count(&mut conn), 0);
}

fn purge_inside_a_caller_transaction_rolls_back_with_it<D: TestDb>() {
    let (_db, mut conn, clock, config) = kept_an_hour_on::<D>();
    config
        .run(&mut conn, "shop", "k", &1, |_| Ok::<_, Error>(1))
        .expect("call");
    clock.advance(Duration::days(1));
    let rolled_back = conn.transaction(|tx| {
        assert_eq!(config.purge_expired(tx, 10).expect("purge"), 1);
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(
        matches!(rolled_back, Err(diesel::result::Error::RollbackTransaction)),
        "{rolled_back:?}"
    );
    assert_eq!(D::key_count(&mut conn), 1);
}

#[test]
#[should_panic(expected = "batch_size must be positive")]
fn purge_refuses_a_zero_batch() {
    let mut conn = idempotency::testing::sqlite_memory();
    let _ = Config::default().purge_expired(&mut conn, 0);
}

#[test]
#[should_panic(expected = "retention must be positive")]
fn zero_retention_is_refused() {
    let _ = Config::default().retention(Duration::zero());
}

#[test]
#[should_panic(expected = "retention must be at most 100 years")]
fn absurd_retention_is_refused() {
    let _ = Config::default().retention(Duration::days(100_000));
}

#[test]
#[should_panic(expected = "in-flight wait must not be negative")]
fn negative_in_flight_wait_is_refused() {
    let _ = Config::default().in_flight(idempotency::InFlight::Wait(Duration::seconds(-1)));
}

#[test]
#[should_panic(expected = "max_key_len must be positive")]
fn zero_key_length_is_refused() {
    let _ = Config::default().max_key_len(0);
}

fn recorded_times_come_with_execution_and_replay_and_a_replay_keeps_them<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // Nanoseconds in the clock, finer than PostgreSQL keeps.
    let start = Utc
        .with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .expect("a valid date")
        + Duration::nanoseconds(123_456_789);
    let clock = ManualClock::at(start);
    let retention = Duration::hours(2);
    let config = Config::default().retention(retention).clock(clock.source());
    let call = |conn: &mut D::Conn| {
        config
            .run_recorded(conn, "shop", "k", &1, |tx| D::place_order(tx, "book", 1))
            .expect("call")
    };

    let first = call(&mut conn);
    assert!(!first.outcome.is_replayed());
    assert_eq!(first.created_at, first.expires_at - retention);
    assert!(
        (first.created_at - start).abs() < Duration::microseconds(1),
        "created when the call began: {}",
        first.created_at
    );

    clock.advance(Duration::minutes(90));
    let replay = call(&mut conn);
    assert!(replay.outcome.is_replayed());
    assert_eq!(replay.outcome.clone().into_inner(), first.outcome.clone().into_inner());
    assert_eq!(
        (replay.created_at, replay.expires_at),
        (first.created_at, first.expires_at),
        "a replay tells the times of the record it replays, and does not extend them"
    );

    clock.set(first.expires_at);
    let again = call(&mut conn);
    assert!(!again.outcome.is_replayed(), "executes anew once expired");
    assert_eq!(
        (again.created_at, again.expires_at),
        (first.expires_at, first.expires_at + retention)
    );
}

fn recorded_times_by_the_database_clock_are_the_stored_ones<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = Config::default();
    let before = Utc::now();
    let call = |conn: &mut D::Conn| {
        config
            .run_recorded(conn, "shop", "k", &1, |tx| D::place_order(tx, "book", 1))
            .expect("call")
    };
    let first = call(&mut conn);
    // On PostgreSQL the server's clock, on the same machine.
    assert!(first.created_at >= before - Duration::seconds(1) && first.created_at <= Utc::now() + Duration::seconds(1));
    assert_eq!(first.expires_at - first.created_at, Duration::hours(24));
    let replay = call(&mut conn);
    assert!(replay.outcome.is_replayed());
    assert_eq!(
        (replay.created_at, replay.expires_at),
        (first.created_at, first.expires_at)
    );
}

/// A clock in the last day of the year 9999: the record's expiry lies past
/// what SQLite's text times and MySQL's `DATETIME` order or hold, and is
/// stored as the last moment they do. It must not read as expired before
/// then: no purge deletes it and a retry replays.
fn record_expiring_past_the_year_9999_is_kept_until_then<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::at(Utc.with_ymd_and_hms(9999, 12, 31, 12, 0, 0).unwrap());
    let config = Config::default().clock(clock.source()).retention(Duration::hours(24));
    let first = config
        .run(&mut conn, "shop", "late", &1, |tx| D::place_order(tx, "late", 1))
        .expect("executes");
    assert_eq!(config.purge_expired(&mut conn, 100).expect("purge"), 0);
    let retry = config
        .run(&mut conn, "shop", "late", &1, |tx| D::place_order(tx, "again", 1))
        .expect("replays");
    assert_eq!(retry.into_inner(), first.into_inner());
    assert_eq!(D::order_count(&mut conn), 1);
}
