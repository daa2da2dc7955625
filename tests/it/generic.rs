//! Code written once over `C: StoreConnection` compiles and runs on every
//! backend, on a plain and on a pooled connection, and nests.

use std::convert::Infallible;

use idempotency::outbox::{self, Relay};
use idempotency::{Error, Outcome, StoreConnection, run_idempotent};

use crate::common::TestDb;

crate::common::backend_tests!(
    generic_call_executes_replays_and_delivers_once_on_a_plain_connection,
    generic_call_executes_replays_and_delivers_once_on_a_pooled_connection,
    generic_nested_call_runs_on_a_plain_connection,
    generic_nested_call_runs_on_a_pooled_connection,
    a_raw_connection_is_the_one_bound_generic_code_needs,
);

fn place_with_receipt<C: StoreConnection>(conn: &mut C, key: &str) -> Result<Outcome<u32>, Error<outbox::Error>> {
    run_idempotent(conn, "shop", key, &"book", |tx| {
        outbox::enqueue(tx, "receipts", &"book")?;
        Ok(1)
    })
}

fn deliver_all<C: StoreConnection>(conn: &mut C) -> Result<usize, outbox::Error> {
    Ok(Relay::default().run_once(conn, |_m| Ok::<_, Infallible>(()))?.delivered)
}

/// A checkout whose operation places the order with an idempotent call of
/// its own, on the connection the operation was given.
fn checkout<C: StoreConnection>(conn: &mut C, key: &str) -> Result<Outcome<u32>, Error<Error<outbox::Error>>> {
    run_idempotent(conn, "checkout", key, &"basket", |tx| {
        let placed = place_with_receipt(tx, key)?;
        Ok(placed.into_inner() + 1)
    })
}

fn executes_replays_and_delivers_once<C: StoreConnection>(conn: &mut C) {
    assert_eq!(
        place_with_receipt(conn, "order-1").expect("first call"),
        Outcome::Executed(1)
    );
    assert_eq!(
        place_with_receipt(conn, "order-1").expect("retry"),
        Outcome::Replayed(1)
    );
    assert_eq!(deliver_all(conn).expect("first relay run"), 1, "one message");
    assert_eq!(deliver_all(conn).expect("second relay run"), 0, "delivered once");
}

fn nested_call_executes_replays_and_delivers_once<C: StoreConnection>(conn: &mut C) {
    assert_eq!(checkout(conn, "order-1").expect("first call"), Outcome::Executed(2));
    assert_eq!(checkout(conn, "order-1").expect("retry"), Outcome::Replayed(2));
    assert_eq!(deliver_all(conn).expect("first relay run"), 1, "one message");
    assert_eq!(deliver_all(conn).expect("second relay run"), 0, "delivered once");
}

fn generic_call_executes_replays_and_delivers_once_on_a_plain_connection<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    executes_replays_and_delivers_once(&mut conn);
    assert_eq!(D::key_count(&mut conn), 1);
}

fn generic_call_executes_replays_and_delivers_once_on_a_pooled_connection<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(1);
    let mut pooled = pool.get().expect("pooled connection");
    executes_replays_and_delivers_once(&mut pooled);
    assert_eq!(D::key_count(&mut pooled), 1);
}

fn generic_nested_call_runs_on_a_plain_connection<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    nested_call_executes_replays_and_delivers_once(&mut conn);
    assert_eq!(D::key_count(&mut conn), 2, "the checkout's key and the order's");
    assert!(!D::in_transaction(&mut conn));
}

fn generic_nested_call_runs_on_a_pooled_connection<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(1);
    let mut pooled = pool.get().expect("pooled connection");
    nested_call_executes_replays_and_delivers_once(&mut pooled);
    assert_eq!(D::key_count(&mut pooled), 2, "the checkout's key and the order's");
    assert!(!D::in_transaction(&mut pooled));
}

/// Generic code over the plain connection: `RawConnection` is the one
/// bound it needs.
fn deliver_on_raw<C>(conn: &mut C) -> Result<usize, outbox::Error>
where
    C: idempotency::RawConnection,
{
    deliver_all(conn)
}

fn a_raw_connection_is_the_one_bound_generic_code_needs<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    assert_eq!(
        place_with_receipt(&mut conn, "named-1").expect("the call"),
        Outcome::Executed(1)
    );
    assert_eq!(deliver_on_raw(&mut conn).expect("the relay"), 1);
}
