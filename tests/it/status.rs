//! `Config::status`: what became of a key in a scope, without the request:
//! no record, in progress, completed with its stored result, expired.

use std::sync::mpsc;
use std::thread;

use chrono::Duration;
use idempotency::{Error, KeyError, KeyStatus};

use crate::common::TestDb;
use crate::common::kept_an_hour;

crate::common::backend_tests!(
    an_unknown_key_has_no_record,
    a_completed_key_gives_its_stored_result_and_times_until_it_expires,
    a_key_held_by_a_call_in_progress_is_in_progress_then_completed,
    a_failed_call_leaves_no_record,
    another_scope_never_sees_the_key,
    a_key_the_rules_refuse_is_an_invalid_key,
);

fn an_unknown_key_has_no_record<D: TestDb>() {
    let db = D::new();
    let (_, config) = kept_an_hour();
    let status = config.status::<_, i64>(&mut db.conn(), "shop", "k").expect("status");
    assert_eq!(status, KeyStatus::NoRecord);
    assert_eq!(D::key_count(&mut db.conn()), 0, "a lookup writes nothing");
}

fn a_completed_key_gives_its_stored_result_and_times_until_it_expires<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = kept_an_hour();
    let first = config
        .run_recorded(&mut conn, "shop", "k", &1, |tx| D::place_order(tx, "book", 1))
        .expect("first");
    let id = first.outcome.into_inner();

    clock.advance(Duration::minutes(59));
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k").expect("status"),
        KeyStatus::Completed {
            response: id,
            created_at: first.created_at,
            expires_at: first.expires_at,
        }
    );
    clock.advance(Duration::minutes(1));
    assert_eq!(
        config.status::<_, i64>(&mut conn, "shop", "k").expect("status"),
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
        let during = config.status::<_, i64>(&mut db.conn(), "shop", "k");
        release.send(()).expect("the call waits");
        let id = call.join().expect("no panic").expect("the call").into_inner();
        assert_eq!(during.expect("status"), KeyStatus::InProgress);
        let after = config.status::<_, i64>(&mut db.conn(), "shop", "k").expect("status");
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
        config.status::<_, i64>(&mut conn, "shop", "k").expect("status"),
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
        config.status::<_, i64>(&mut conn, "tenant-b", "k").expect("status"),
        KeyStatus::NoRecord
    );
}

fn a_key_the_rules_refuse_is_an_invalid_key<D: TestDb>() {
    let db = D::new();
    let (_, config) = kept_an_hour();
    let refused = config.status::<_, i64>(&mut db.conn(), "shop", "two words");
    assert!(
        matches!(
            refused,
            Err(Error::InvalidKey(KeyError::InvalidCharacter { position: 3 }))
        ),
        "{refused:?}"
    );
}
