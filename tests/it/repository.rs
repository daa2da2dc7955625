//! Repository functions wrapped with `Idempotent`: on plain and pooled
//! connections, with the default policy and with a `Config`.

use diesel::prelude::*;
use idempotency::{Config, Error, Idempotent, KeyError, Outcome};
use serde::Serialize;

use crate::common::TestDb;

#[derive(Serialize)]
struct NewOrder {
    item: String,
    quantity: i32,
}

fn new_order(item: &str, quantity: i32) -> NewOrder {
    NewOrder {
        item: item.to_owned(),
        quantity,
    }
}

#[derive(Debug, PartialEq)]
enum OrderError {
    EmptyOrder,
    Db,
}

crate::common::backend_tests!(
    wrapped_function_executes_once_and_replays,
    wrapped_function_runs_on_a_pooled_connection,
    same_key_with_another_request_is_a_mismatch,
    wrapped_function_error_rolls_back_and_leaves_the_key_free,
    wrapped_function_with_config_uses_its_policy,
    closure_with_the_repository_shape_is_wrapped_too,
);

/// A repository function as applications already have them.
fn create_order<D: TestDb>(conn: &mut D::Conn, order: &NewOrder) -> QueryResult<i64> {
    D::place_order(conn, &order.item, order.quantity)
}

/// Writes, then refuses: the write must not survive.
fn create_checked_order<D: TestDb>(conn: &mut D::Conn, order: &NewOrder) -> Result<i64, OrderError> {
    let id = D::place_order(conn, &order.item, order.quantity).map_err(|_| OrderError::Db)?;
    if order.quantity == 0 {
        Err(OrderError::EmptyOrder)
    } else {
        Ok(id)
    }
}

fn wrapped_function_executes_once_and_replays<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let order = new_order("book", 1);
    let first = create_order::<D>
        .idempotent(&mut conn, "shop", "order-1", &order)
        .expect("first call");
    let Outcome::Executed(id) = first else {
        panic!("expected Executed, got {first:?}")
    };
    let retry = create_order::<D>
        .idempotent(&mut conn, "shop", "order-1", &order)
        .expect("retry");
    assert_eq!(retry, Outcome::Replayed(id));
    assert_eq!(D::order_count(&mut conn), 1);
}

fn wrapped_function_runs_on_a_pooled_connection<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(2);
    let mut pooled = pool.get().expect("pooled connection");
    let order = new_order("book", 1);
    assert!(
        !create_order::<D>
            .idempotent(&mut pooled, "shop", "order-1", &order)
            .expect("first call")
            .is_replayed()
    );
    assert!(
        create_order::<D>
            .idempotent(&mut pooled, "shop", "order-1", &order)
            .expect("retry")
            .is_replayed()
    );
    assert_eq!(D::order_count(&mut pooled), 1);
}

fn same_key_with_another_request_is_a_mismatch<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    create_order::<D>
        .idempotent(&mut conn, "shop", "order-1", &new_order("book", 1))
        .expect("first call");
    let other = create_order::<D>.idempotent(&mut conn, "shop", "order-1", &new_order("book", 2));
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    assert_eq!(D::order_count(&mut conn), 1);
}

fn wrapped_function_error_rolls_back_and_leaves_the_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let failed = create_checked_order::<D>.idempotent(&mut conn, "shop", "order-1", &new_order("book", 0));
    assert!(
        matches!(failed, Err(Error::Operation(OrderError::EmptyOrder))),
        "{failed:?}"
    );
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);
    let fixed = create_checked_order::<D>.idempotent(&mut conn, "shop", "order-1", &new_order("book", 1));
    assert!(matches!(fixed, Ok(Outcome::Executed(_))), "{fixed:?}");
}

fn wrapped_function_with_config_uses_its_policy<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let config = Config::default().max_key_len(8);
    let order = new_order("book", 1);
    let long = create_order::<D>.idempotent_with(&config, &mut conn, "shop", "order-123", &order);
    assert!(
        matches!(long, Err(Error::InvalidKey(KeyError::TooLong { len: 9, max: 8 }))),
        "{long:?}"
    );
    assert_eq!(D::order_count(&mut conn), 0);
    let short = create_order::<D>
        .idempotent_with(&config, &mut conn, "shop", "order-12", &order)
        .expect("short key");
    assert!(!short.is_replayed());
}

fn closure_with_the_repository_shape_is_wrapped_too<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut calls = 0;
    let mut call = |conn: &mut D::Conn| {
        (|tx: &mut D::Conn, order: &NewOrder| {
            calls += 1;
            create_order::<D>(tx, order)
        })
        .idempotent(conn, "shop", "order-1", &new_order("pen", 3))
    };
    call(&mut conn).expect("first call");
    call(&mut conn).expect("retry");
    assert_eq!(calls, 1);
}
