//! The single call: execute once, replay, mismatch, errors, panics, nesting.

use std::convert::Infallible;

use diesel::prelude::*;
use idempotency::{Config, Error, Outcome, run_idempotent};
use serde::{Deserialize, Serialize};

use crate::common::TestDb;

#[derive(Serialize)]
struct PlaceOrder<'a> {
    item: &'a str,
    quantity: i32,
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
enum Placed {
    Accepted { order_id: i64 },
    Rejected { reason: String },
}

#[derive(Debug, PartialEq)]
enum DomainError {
    OutOfStock,
    Db(String),
}

impl From<diesel::result::Error> for DomainError {
    fn from(error: diesel::result::Error) -> Self {
        DomainError::Db(error.to_string())
    }
}

crate::common::backend_tests!(
    first_call_executes_and_retry_replays,
    mismatched_request_is_rejected,
    operation_error_rolls_back_and_leaves_key_free,
    remembered_failure_is_stored_and_replayed,
    replay_does_not_call_the_operation,
    same_key_under_two_scopes_is_two_operations,
    undecodable_stored_response_is_a_codec_error_not_a_rerun,
    unserializable_result_rolls_back,
    unserializable_request_is_refused_before_anything_runs,
    panicking_operation_leaves_nothing_and_connection_usable,
    panic_inside_a_nested_transaction_of_the_operation_unwinds_it_too,
    pooled_connection_runs_repository_functions_on_the_raw_connection,
    panicking_operation_on_a_pooled_connection_does_not_poison_the_pool,
    nested_call_commits_and_rolls_back_with_the_caller,
    failing_nested_call_leaves_the_caller_transaction_usable,
    reentrant_call_with_the_same_key_is_in_progress,
    sql_metacharacters_in_scope_key_and_request_are_inert,
    config_run_uses_its_own_policy,
    result_one_byte_over_the_bound_rolls_back_and_leaves_the_key_free,
    result_at_the_bound_is_stored_and_replays,
);

fn place<D: TestDb>(
    conn: &mut D::Conn,
    key: &str,
    item: &str,
    quantity: i32,
) -> Result<Outcome<Placed>, Error<DomainError>> {
    let request = PlaceOrder { item, quantity };
    run_idempotent(conn, "shop", key, &request, |tx| {
        if quantity <= 0 {
            return Err(DomainError::OutOfStock);
        }
        let order_id = D::place_order(tx, item, quantity)?;
        Ok(Placed::Accepted { order_id })
    })
}

fn first_call_executes_and_retry_replays<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let first = place::<D>(&mut conn, "k-1", "book", 1).expect("first call");
    let Outcome::Executed(placed) = first else {
        panic!("expected Executed, got {first:?}")
    };
    let retry = place::<D>(&mut conn, "k-1", "book", 1).expect("retry");
    assert_eq!(retry, Outcome::Replayed(placed));
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1);
}

fn mismatched_request_is_rejected<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let first = place::<D>(&mut conn, "k-1", "book", 1)
        .expect("first call")
        .into_inner();
    let other = place::<D>(&mut conn, "k-1", "book", 2);
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(
        place::<D>(&mut conn, "k-1", "book", 1).expect("original retry"),
        Outcome::Replayed(first)
    );
}

fn operation_error_rolls_back_and_leaves_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let failed = run_idempotent(&mut conn, "shop", "k-err", &"req", |tx| {
        D::place_order(tx, "book", 1)?;
        Err::<Placed, _>(DomainError::OutOfStock)
    });
    assert!(
        matches!(failed, Err(Error::Operation(DomainError::OutOfStock))),
        "{failed:?}"
    );
    assert_eq!(D::order_count(&mut conn), 0, "the domain write was rolled back");
    assert_eq!(D::key_count(&mut conn), 0, "no key record was left");

    // The same key with a corrected request executes.
    let fixed = place::<D>(&mut conn, "k-err", "book", 1).expect("corrected retry");
    assert!(matches!(fixed, Outcome::Executed(Placed::Accepted { .. })), "{fixed:?}");
    assert_eq!(D::order_count(&mut conn), 1);
}

fn remembered_failure_is_stored_and_replayed<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut calls = 0;
    let mut decline = |conn: &mut D::Conn| {
        run_idempotent(conn, "payments", "charge-1", &"card 1234", |_| {
            calls += 1;
            Ok::<_, Infallible>(Placed::Rejected {
                reason: "card declined".into(),
            })
        })
    };
    assert!(matches!(
        decline(&mut conn),
        Ok(Outcome::Executed(Placed::Rejected { .. }))
    ));
    assert!(matches!(
        decline(&mut conn),
        Ok(Outcome::Replayed(Placed::Rejected { .. }))
    ));
    assert_eq!(calls, 1);
}

fn replay_does_not_call_the_operation<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut calls = 0;
    for _ in 0..3 {
        run_idempotent(&mut conn, "shop", "k-calls", &1, |_| {
            calls += 1;
            Ok::<_, Infallible>(calls)
        })
        .expect("call");
    }
    assert_eq!(calls, 1);
}

fn same_key_under_two_scopes_is_two_operations<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let a = run_idempotent(&mut conn, "tenant-a", "k", &1, |tx| D::place_order(tx, "a", 1)).expect("tenant a");
    let b = run_idempotent(&mut conn, "tenant-b", "k", &1, |tx| D::place_order(tx, "b", 1)).expect("tenant b");
    assert!(!a.is_replayed() && !b.is_replayed());
    assert_ne!(a.into_inner(), b.into_inner());
    assert_eq!(D::order_count(&mut conn), 2);
    // Each scope replays its own result.
    let again = run_idempotent(&mut conn, "tenant-b", "k", &1, |tx| D::place_order(tx, "b", 1)).expect("retry b");
    assert!(again.is_replayed());
}

fn undecodable_stored_response_is_a_codec_error_not_a_rerun<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    run_idempotent(&mut conn, "shop", "k-codec", &1, |tx| D::place_order(tx, "book", 1)).expect("first call");
    let mut calls = 0;
    let retry = run_idempotent(&mut conn, "shop", "k-codec", &1, |_| {
        calls += 1;
        Ok::<_, Infallible>(String::from("a different shape"))
    });
    assert!(matches!(retry, Err(Error::Codec(_))), "{retry:?}");
    assert_eq!(calls, 0);
    assert_eq!(D::order_count(&mut conn), 1);
}

/// A call of `request` whose operation places an order and returns
/// `result`: asserts that it fails with `Codec` and leaves no order and no
/// key record.
fn assert_codec_error_and_nothing_written<D: TestDb, Q: Serialize, R>(request: &Q, result: R)
where
    R: Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let db = D::new();
    let mut conn = db.conn();
    let refused = run_idempotent(&mut conn, "shop", "k-codec", request, |tx| {
        D::place_order(tx, "book", 1)?;
        Ok::<_, diesel::result::Error>(result)
    });
    assert!(matches!(refused, Err(Error::Codec(_))), "{refused:?}");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);
}

fn unserializable_result_rolls_back<D: TestDb>() {
    let mut map = std::collections::HashMap::new();
    map.insert(vec![1u8], 1);
    assert_codec_error_and_nothing_written::<D, _, _>(&1, map);
}

fn unserializable_request_is_refused_before_anything_runs<D: TestDb>() {
    let mut request = std::collections::HashMap::new();
    request.insert((1, 2), "tuple keys are not json object keys");
    assert_codec_error_and_nothing_written::<D, _, _>(&request, 0_i64);
}

fn panicking_operation_leaves_nothing_and_connection_usable<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = run_idempotent(&mut conn, "shop", "k-panic", &1, |tx| {
            D::place_order(tx, "book", 1)?;
            panic!("worker crashed mid-operation");
            #[allow(unreachable_code)]
            Ok::<i64, diesel::result::Error>(0)
        });
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);
    // Not left inside the rolled-back transaction: this call commits.
    let retry = run_idempotent(&mut conn, "shop", "k-panic", &1, |tx| D::place_order(tx, "book", 1)).expect("retry");
    assert!(!retry.is_replayed());
    assert_eq!(D::order_count(&mut db.conn()), 1);
}

fn panic_inside_a_nested_transaction_of_the_operation_unwinds_it_too<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = run_idempotent(&mut conn, "shop", "k-nested-panic", &1, |tx| {
            tx.transaction(|inner| -> QueryResult<()> {
                D::place_order(inner, "book", 1)?;
                panic!("crash inside a savepoint");
            })
        });
    }));
    assert_eq!(crate::common::panic_message(panicked), "crash inside a savepoint");
    assert!(
        !D::in_transaction(&mut conn),
        "the operation's savepoint and the call's transaction were unwound"
    );
    let retry = run_idempotent(&mut conn, "shop", "k-nested-panic", &1, |tx| {
        D::place_order(tx, "book", 1)
    })
    .expect("retry");
    assert!(!retry.is_replayed());
    assert_eq!(D::order_count(&mut db.conn()), 1);
}

fn pooled_connection_runs_repository_functions_on_the_raw_connection<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut pooled = pool.get().expect("pooled connection");
    // `place_order` takes the plain diesel connection, as repository
    // functions do.
    let outcome = run_idempotent(&mut pooled, "shop", "k-pool", &1, |tx: &mut D::Conn| {
        D::place_order(tx, "book", 1)
    })
    .expect("pooled call");
    assert!(!outcome.is_replayed());
    let retry = run_idempotent(&mut pooled, "shop", "k-pool", &1, |tx| D::place_order(tx, "book", 1)).expect("retry");
    assert!(retry.is_replayed());
    assert_eq!(D::order_count(&mut pooled), 1);
}

fn panicking_operation_on_a_pooled_connection_does_not_poison_the_pool<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(1);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut pooled = pool.get().expect("pooled connection");
        let _ = run_idempotent(&mut pooled, "shop", "k-pool-panic", &1, |tx| {
            D::place_order(tx, "book", 1)?;
            panic!("boom");
            #[allow(unreachable_code)]
            Ok::<i64, diesel::result::Error>(0)
        });
    }));
    assert_eq!(crate::common::panic_message(result), "boom");
    // The only connection of the pool, or its replacement, works and is
    // not inside a transaction.
    let mut pooled = pool.get().expect("connection after the panic");
    let retry = run_idempotent(&mut pooled, "shop", "k-pool-panic", &1, |tx| {
        D::place_order(tx, "book", 1)
    })
    .expect("retry on the pool");
    assert!(!retry.is_replayed());
    drop(pooled);
    assert_eq!(D::order_count(&mut db.conn()), 1);
    assert_eq!(D::key_count(&mut db.conn()), 1);
}

fn nested_call_commits_and_rolls_back_with_the_caller<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let rolled_back = conn.transaction(|outer| {
        let nested = run_idempotent(outer, "shop", "k-nested", &1, |tx| D::place_order(tx, "book", 1));
        assert!(!nested.expect("nested call").is_replayed());
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(rolled_back.is_err(), "the caller gives up");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);

    conn.transaction(|outer| {
        let first = run_idempotent(outer, "shop", "k-nested", &1, |tx| D::place_order(tx, "book", 1))?;
        let again = run_idempotent(outer, "shop", "k-nested", &1, |tx| D::place_order(tx, "book", 1))?;
        assert!(!first.is_replayed());
        assert!(
            again.is_replayed(),
            "a second call inside the same transaction sees the first"
        );
        Ok::<_, Error<diesel::result::Error>>(())
    })
    .expect("committed caller");
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1);
}

fn failing_nested_call_leaves_the_caller_transaction_usable<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    conn.transaction(|outer| {
        D::place_order(outer, "before", 1)?;
        let failed = run_idempotent(outer, "shop", "k-inner", &1, |tx| {
            D::place_order(tx, "inner", 1)?;
            Err::<i64, _>(DomainError::OutOfStock)
        });
        assert!(matches!(failed, Err(Error::Operation(DomainError::OutOfStock))));
        D::place_order(outer, "after", 1)?;
        Ok::<_, diesel::result::Error>(())
    })
    .expect("caller commits");
    assert_eq!(D::order_count(&mut conn), 2, "only the inner savepoint was rolled back");
    assert_eq!(D::key_count(&mut conn), 0);
}

fn reentrant_call_with_the_same_key_is_in_progress<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let outer = run_idempotent(&mut conn, "shop", "k-re", &1, |tx| {
        let inner = run_idempotent(tx, "shop", "k-re", &1, |_| Ok::<_, Infallible>(2));
        assert!(matches!(inner, Err(Error::InProgress)), "{inner:?}");
        Ok::<_, Infallible>(1)
    });
    assert_eq!(outer.expect("outer call"), Outcome::Executed(1));
}

fn sql_metacharacters_in_scope_key_and_request_are_inert<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let nasty = "x'); DROP TABLE orders; --";
    let key = "k';DELETE\"FROM`idempotency_keys;--";
    let first = run_idempotent(&mut conn, nasty.replace(' ', "_").as_str(), key, &nasty, |tx| {
        D::place_order(tx, nasty, 1)
    })
    .expect("call with metacharacters");
    assert!(!first.is_replayed());
    let again = run_idempotent(&mut conn, nasty.replace(' ', "_").as_str(), key, &nasty, |tx| {
        D::place_order(tx, nasty, 1)
    })
    .expect("retry with metacharacters");
    assert!(again.is_replayed());
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1);
}

/// Whether `error` refuses a key of 9 characters where 8 are the most.
fn nine_chars_over_eight<E>(error: Option<&Error<E>>) -> bool {
    matches!(
        error,
        Some(Error::InvalidKey(idempotency::KeyError::TooLong { len: 9, max: 8 }))
    )
}

fn config_run_uses_its_own_policy<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = Config::default().max_key_len(8);
    let long = config.run(&mut conn, "shop", "123456789", &1, |tx| D::place_order(tx, "book", 1));
    assert!(nine_chars_over_eight(long.as_ref().err()), "{long:?}");
    let fits = config.run(&mut conn, "shop", "12345678x", &1, |tx| D::place_order(tx, "book", 1));
    assert!(nine_chars_over_eight(fits.as_ref().err()), "{fits:?}");
    assert!(
        config
            .run(&mut conn, "shop", "1234567x", &1, |tx| D::place_order(tx, "book", 1))
            .is_ok()
    );
}

/// A call under a bound of 100 bytes whose result stores as `len` bytes: a
/// string of `len - 2` characters, quoted.
fn place_sized<D: TestDb>(conn: &mut D::Conn, len: usize) -> Result<Outcome<String>, Error<DomainError>> {
    Config::default()
        .max_response_len(100)
        .run(conn, "shop", "k-sized", &"sized", |tx| {
            D::place_order(tx, "book", 1)?;
            Ok("x".repeat(len - 2))
        })
}

fn result_one_byte_over_the_bound_rolls_back_and_leaves_the_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let refused = place_sized::<D>(&mut conn, 101);
    assert!(
        matches!(refused, Err(Error::ResponseTooLarge { len: 101, max: 100 })),
        "{refused:?}"
    );
    assert_eq!(D::order_count(&mut conn), 0, "the domain write was rolled back");
    assert_eq!(D::key_count(&mut conn), 0, "no key record was left");
    let smaller = place_sized::<D>(&mut conn, 100).expect("the key is free");
    assert!(matches!(smaller, Outcome::Executed(_)), "{smaller:?}");
}

fn result_at_the_bound_is_stored_and_replays<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let first = place_sized::<D>(&mut conn, 100).expect("at the bound");
    assert_eq!(first, Outcome::Executed("x".repeat(98)));
    assert_eq!(D::key_count(&mut conn), 1);
    let retry = place_sized::<D>(&mut conn, 100).expect("replay");
    assert_eq!(retry, Outcome::Replayed("x".repeat(98)));
    assert_eq!(D::order_count(&mut conn), 1);
}
