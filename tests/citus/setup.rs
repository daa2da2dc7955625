//! `distribute`: what it refuses, and that running it again is harmless.

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use idempotency::citus::distribute;
use idempotency::{Error, Outcome, run_idempotent};

use crate::{Db, PlaceOrder, lines, orders_and_key_records, place_order};

/// The crate's tables as Citus and the catalog see them in the test's
/// schema: the distributed ones, the outbox's triggers, the columns of its
/// primary key.
fn crate_tables(conn: &mut PgConnection) -> (Vec<String>, Vec<String>, Vec<String>) {
    let distributed = lines(
        conn,
        "SELECT logicalrelid::regclass::text AS line FROM pg_dist_partition
         WHERE logicalrelid IN ('idempotency_keys'::regclass, 'idempotency_phases'::regclass,
                                'idempotency_outbox'::regclass)
         ORDER BY 1",
    );
    let triggers = lines(
        conn,
        "SELECT tgname::text AS line FROM pg_trigger
         WHERE tgrelid = 'idempotency_outbox'::regclass AND NOT tgisinternal ORDER BY 1",
    );
    let primary_key = lines(
        conn,
        "SELECT a.attname::text AS line FROM pg_index i
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
         WHERE i.indrelid = 'idempotency_outbox'::regclass AND i.indisprimary ORDER BY 1",
    );
    (distributed, triggers, primary_key)
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn distribute_refuses_a_table_it_cannot_co_locate_with_and_changes_nothing() {
    let db = Db::undistributed();
    let mut conn = db.conn();
    conn.batch_execute(
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY);
         SELECT create_distributed_table('accounts', 'id');
         CREATE TABLE notes (account TEXT NOT NULL);",
    )
    .expect("the tables to refuse");
    let before = crate_tables(&mut conn);
    assert!(before.0.is_empty(), "nothing distributed yet: {before:?}");
    assert_eq!(before.1.len(), 2, "the outbox's triggers: {before:?}");
    assert_eq!(before.2, ["id"], "{before:?}");

    for refused in [
        "no_such_table",
        "accounts",
        "notes",
        "orders', colocate_with => 'none') --",
        "",
    ] {
        let result = distribute(&mut conn, refused);
        assert!(matches!(result, Err(Error::Storage(_))), "{refused:?}: {result:?}");
        assert_eq!(crate_tables(&mut conn), before, "{refused:?} changed nothing");
    }
    assert_eq!(
        orders_and_key_records(&mut conn, "acct-1"),
        (0, 0),
        "orders is still there"
    );
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn distribute_again_is_harmless_and_keeps_the_records() {
    let (_db, mut conn) = Db::with_session();
    let place = |conn: &mut PgConnection| {
        run_idempotent(conn, "acct-1", "order-1", &PlaceOrder { item: "book" }, |tx| {
            place_order(tx, "acct-1", "book")
        })
    };
    let Outcome::Executed(id) = place(&mut conn).expect("the first call") else {
        panic!("the first call executes")
    };
    let distributed = crate_tables(&mut conn);
    assert_eq!(distributed.0.len(), 3, "{distributed:?}");
    assert!(
        distributed.1.is_empty(),
        "no triggers on the distributed outbox: {distributed:?}"
    );
    assert_eq!(distributed.2, ["id", "scope"], "{distributed:?}");

    distribute(&mut conn, "orders").expect("distribute again");
    assert_eq!(crate_tables(&mut conn), distributed);
    assert_eq!(place(&mut conn).expect("the retry"), Outcome::Replayed(id));
    assert_eq!(orders_and_key_records(&mut conn, "acct-1"), (1, 1));
}
