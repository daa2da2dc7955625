//! Repository functions wrapped with `Idempotent`: on plain and pooled
//! connections, with the default policy and with a `Config`.

mod common;

use diesel::prelude::*;
use idempotency::{Config, Error, Idempotent, KeyError, Outcome};
use serde::Serialize;

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

common::backend_tests! {
    /// A repository function as applications already have them.
    fn create_order(conn: &mut Conn, order: &NewOrder) -> QueryResult<i64> {
        place_order(conn, &order.item, order.quantity)
    }

    /// Writes, then refuses: the write must not survive.
    fn create_checked_order(conn: &mut Conn, order: &NewOrder) -> Result<i64, OrderError> {
        let id = place_order(conn, &order.item, order.quantity).map_err(|_| OrderError::Db)?;
        if order.quantity == 0 { Err(OrderError::EmptyOrder) } else { Ok(id) }
    }

    #[test]
    fn wrapped_function_executes_once_and_replays() {
        let db = Db::new();
        let mut conn = db.conn();
        let order = new_order("book", 1);
        let first = create_order.idempotent(&mut conn, "shop", "order-1", &order).expect("first call");
        let Outcome::Executed(id) = first else { panic!("expected Executed, got {first:?}") };
        let retry = create_order.idempotent(&mut conn, "shop", "order-1", &order).expect("retry");
        assert_eq!(retry, Outcome::Replayed(id));
        assert_eq!(order_count(&mut conn), 1);
    }

    #[test]
    fn wrapped_function_runs_on_a_pooled_connection() {
        let db = Db::new();
        let pool = db.pool(2);
        let mut pooled = pool.get().expect("pooled connection");
        let order = new_order("book", 1);
        assert!(!create_order.idempotent(&mut pooled, "shop", "order-1", &order).expect("first call").is_replayed());
        assert!(create_order.idempotent(&mut pooled, "shop", "order-1", &order).expect("retry").is_replayed());
        assert_eq!(order_count(&mut pooled), 1);
    }

    #[test]
    fn same_key_with_another_request_is_a_mismatch() {
        let db = Db::new();
        let mut conn = db.conn();
        create_order.idempotent(&mut conn, "shop", "order-1", &new_order("book", 1)).expect("first call");
        let other = create_order.idempotent(&mut conn, "shop", "order-1", &new_order("book", 2));
        assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
        assert_eq!(order_count(&mut conn), 1);
    }

    #[test]
    fn wrapped_function_error_rolls_back_and_leaves_the_key_free() {
        let db = Db::new();
        let mut conn = db.conn();
        let failed = create_checked_order.idempotent(&mut conn, "shop", "order-1", &new_order("book", 0));
        assert!(matches!(failed, Err(Error::Operation(OrderError::EmptyOrder))), "{failed:?}");
        assert_eq!(order_count(&mut conn), 0);
        assert_eq!(key_count(&mut conn), 0);
        let fixed = create_checked_order.idempotent(&mut conn, "shop", "order-1", &new_order("book", 1));
        assert!(matches!(fixed, Ok(Outcome::Executed(_))), "{fixed:?}");
    }

    #[test]
    fn wrapped_function_with_config_uses_its_policy() {
        let db = Db::new();
        let mut conn = db.conn();
        let config = Config::default().max_key_len(8);
        let order = new_order("book", 1);
        let long = create_order.idempotent_with(&config, &mut conn, "shop", "order-123", &order);
        assert!(matches!(long, Err(Error::InvalidKey(KeyError::TooLong { len: 9, max: 8 }))), "{long:?}");
        assert_eq!(order_count(&mut conn), 0);
        let short = create_order.idempotent_with(&config, &mut conn, "shop", "order-12", &order).expect("short key");
        assert!(!short.is_replayed());
    }

    #[test]
    fn closure_with_the_repository_shape_is_wrapped_too() {
        let db = Db::new();
        let mut conn = db.conn();
        let mut calls = 0;
        let mut call = |conn: &mut Conn| {
            (|tx: &mut Conn, order: &NewOrder| {
                calls += 1;
                create_order(tx, order)
            })
            .idempotent(conn, "shop", "order-1", &new_order("pen", 3))
        };
        call(&mut conn).expect("first call");
        call(&mut conn).expect("retry");
        assert_eq!(calls, 1);
    }
}
