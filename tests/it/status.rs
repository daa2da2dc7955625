//! `Config::status` and `Phased::status`: what became of a key in a scope
//! for a request: no record, in progress, completed with its stored result,
//! expired, parked. A record of another request (another operation) is no
//! record at all to the lookup.

use std::sync::mpsc;
use std::thread;

use chrono::Duration;
use idempotency::phased::Phased;
use idempotency::{Config, Error, KeyError, KeyStatus, Recorded};

use crate::common::TestDb;
use crate::common::kept_an_hour;

crate::common::backend_tests!(
    an_unknown_key_has_no_record,
    a_completed_key_gives_its_stored_result_and_times_until_it_expires,
    a_key_held_by_a_call_in_progress_is_in_progress_then_completed,
    a_failed_call_leaves_no_record,
    another_scope_never_sees_the_key,
    a_key_the_rules_refuse_is_an_invalid_key,
    a_record_of_another_request_is_no_record,
    a_phased_operation_is_seen_running_then_finished_by_its_own_request_only,
    a_parked_phased_operation_is_parked,
);

fn an_unknown_key_has_no_record<D: TestDb>() {
    let db = D::new();
    let (_, config) = kept_an_hour();
    let status = config
        .status::<_, i64>(&mut db.conn(), "shop", "k", &1)
        .expect("status");
    assert_eq!(status, KeyStatus::NoRecord);
    assert_eq!(D::key_count(&mut db.conn()), 0, "a lookup writes nothing");
}

fn a_completed_key_gives_its_stored_result_and_times_until_it_expires<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = kept_an_hour();
    let first = recorded_book::<D>(&config, &mut conn);
    let id = first.outcome.into_inner();

    clock.advance(Duration::minutes(59));
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k", &1).expect("status"),
        KeyStatus::Completed {
            response: id,
            created_at: first.created_at,
            expires_at: first.expires_at,
            origin: first.origin,
        }
    );
    clock.advance(Duration::minutes(1));
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k", &1).expect("status"),
        KeyStatus::Expired {
            expired_at: first.expires_at
        }
    );
    assert_eq!(D::order_count(&mut conn), 1, "a lookup runs nothing");
}

fn a_key_held_by_a_call_in_progress_is_in_progress_then_completed<D: TestDb>() {
    let db = D::new();
    let (_, config) = kept_an_hour();
    let (entered, in_op) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let (db, config) = (&db, &config);
    thread::scope(|scope| {
        let call = scope.spawn(move || {
            config.run(&mut db.conn(), "shop", "k", &1, |tx| {
                // The call holds the key from before its operation runs.
                entered.send(()).expect("the test waits");
                released.recv().expect("the test releases");
                D::place_order(tx, "book", 1)
            })
        });
        in_op.recv().expect("the call entered its operation");
        let during = config.status::<_, i64>(&mut db.conn(), "shop", "k", &1);
        release.send(()).expect("the call waits");
        let id = call.join().expect("no panic").expect("the call").into_inner();
        assert_eq!(during.expect("status"), KeyStatus::InProgress);
        let after = config
            .status::<_, i64>(&mut db.conn(), "shop", "k", &1)
            .expect("status");
        assert!(
            matches!(after, KeyStatus::Completed { response, .. } if response == id),
            "{after:?}"
        );
    });
}

fn a_failed_call_leaves_no_record<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (_, config) = kept_an_hour();
    let failed = config.run(&mut conn, "shop", "k", &1, |tx| {
        D::place_order(tx, "book", 1)?;
        Err::<i64, _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k", &1).expect("status"),
        KeyStatus::NoRecord
    );
}

fn another_scope_never_sees_the_key<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (_, config) = kept_an_hour();
    config
        .run(&mut conn, "tenant-a", "k", &1, |tx| D::place_order(tx, "book", 1))
        .expect("first");
    assert_eq!(
        config.status::<_, i64>(&mut conn, "tenant-b", "k", &1).expect("status"),
        KeyStatus::NoRecord
    );
}

fn a_key_the_rules_refuse_is_an_invalid_key<D: TestDb>() {
    let db = D::new();
    let (_, config) = kept_an_hour();
    let refused = config.status::<_, i64>(&mut db.conn(), "shop", "two words", &1);
    assert!(
        matches!(
            refused,
            Err(Error::InvalidKey(KeyError::InvalidCharacter { position: 3 }))
        ),
        "{refused:?}"
    );
}

fn a_record_of_another_request_is_no_record<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = kept_an_hour();
    let first = recorded_book::<D>(&config, &mut conn);
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k", &2).expect("status"),
        KeyStatus::NoRecord,
        "a replay would refuse another request: the lookup knows of nothing"
    );
    assert!(matches!(
        config.status::<_, i64>(&mut conn, "shop", "k", &1).expect("status"),
        KeyStatus::Completed { response, .. } if response == first.outcome.into_inner()
    ));
    clock.advance(Duration::hours(1));
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k", &2).expect("status"),
        KeyStatus::NoRecord,
        "nor that it expired"
    );
}

/// A ride whose foreign call fails once as `"fail"` asks, then charges.
fn ride<D: TestDb>(
    phased: &Phased,
    conn: &mut D::Conn,
    key: &str,
    rider: &str,
    fail: bool,
) -> Result<idempotency::Outcome<String>, Error<std::io::Error>> {
    phased.run(conn, "riders", key, rider, |s| {
        let charge = s.call_at_most_once("charged", |provider_key| match fail {
            true => Err(std::io::Error::other("the provider is down")),
            false => Ok(format!("ch_{}", &provider_key[..8])),
        })?;
        s.finish(|_| Ok::<_, std::io::Error>(charge))
    })
}

fn a_phased_operation_is_seen_running_then_finished_by_its_own_request_only<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (_, config) = kept_an_hour();
    let create_ride = Phased::new("create-ride").config(config.clone());
    let status = |conn: &mut D::Conn, phased: &Phased, key, rider: &str| {
        phased.status::<_, String>(conn, "riders", key, rider).expect("status")
    };
    assert_eq!(status(&mut conn, &create_ride, "r-1", "ada"), KeyStatus::NoRecord);

    // Started, its call recorded, then failed: a retry resumes it.
    let failed = ride::<D>(&create_ride, &mut conn, "r-1", "ada", true);
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    assert_eq!(status(&mut conn, &create_ride, "r-1", "ada"), KeyStatus::InProgress);
    assert_eq!(status(&mut conn, &create_ride, "r-1", "bob"), KeyStatus::NoRecord);

    let charged = ride::<D>(&create_ride, &mut conn, "r-2", "ada", false).expect("charged");
    let KeyStatus::Completed { response, .. } = status(&mut conn, &create_ride, "r-2", "ada") else {
        panic!("a finished operation is completed");
    };
    assert_eq!(response, charged.into_inner());
    assert_eq!(status(&mut conn, &create_ride, "r-2", "bob"), KeyStatus::NoRecord);
    let refund = Phased::new("refund-ride").config(config.clone());
    assert_eq!(status(&mut conn, &refund, "r-2", "ada"), KeyStatus::NoRecord);
    assert_eq!(
        config
            .status::<_, String>(&mut conn, "riders", "r-2", "ada")
            .expect("status"),
        KeyStatus::NoRecord,
        "a single call's lookup is not a phased operation's"
    );
}

fn a_parked_phased_operation_is_parked<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (_, config) = kept_an_hour();
    let create_ride = Phased::new("create-ride").config(config);
    assert!(ride::<D>(&create_ride, &mut conn, "r-3", "ada", true).is_err());
    // The call made at most once was interrupted: never made again.
    let parked = ride::<D>(&create_ride, &mut conn, "r-3", "ada", false);
    assert!(matches!(parked, Err(Error::Parked)), "{parked:?}");
    assert_eq!(
        create_ride
            .status::<_, String>(&mut conn, "riders", "r-3", "ada")
            .expect("status"),
        KeyStatus::Parked
    );
    assert_eq!(
        create_ride
            .status::<_, String>(&mut conn, "riders", "r-3", "bob")
            .expect("status"),
        KeyStatus::NoRecord
    );
}

/// The first call of key `k` in scope `shop`, recorded: an order of one
/// book.
fn recorded_book<D: TestDb>(config: &Config, conn: &mut D::Conn) -> Recorded<i64> {
    config
        .run_recorded(conn, "shop", "k", &1, |tx| D::place_order(tx, "book", 1))
        .expect("first")
}
