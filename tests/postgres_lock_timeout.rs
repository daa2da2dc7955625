//! PostgreSQL: the in-flight policy bounds the claim alone. The operation
//! runs, and the caller's transaction goes on, under the caller's own
//! `lock_timeout`. Built with the `postgres` feature only (Cargo.toml).

mod common;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use idempotency::{Config, Error, InFlight};

use common::pg::{Conn, Db};

fn lock_timeout(conn: &mut Conn) -> String {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    diesel::sql_query("SELECT current_setting('lock_timeout') AS value")
        .get_result::<Setting>(conn)
        .expect("read lock_timeout")
        .value
}

#[test]
fn operation_runs_under_the_callers_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    conn.batch_execute("SET lock_timeout = '7s'")
        .expect("set the caller's lock_timeout");
    let config = Config::default().in_flight(InFlight::Reject);

    let seen = config
        .run(&mut conn, "settings", "k-1", &1, |tx| Ok::<_, Error>(lock_timeout(tx)))
        .expect("first call")
        .into_inner();

    assert_eq!(seen, "7s");
    assert_eq!(lock_timeout(&mut conn), "7s");
}

#[test]
fn nested_call_that_claims_nothing_leaves_the_callers_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::milliseconds(250)));

    let after_inner = conn
        .transaction(|conn| {
            conn.batch_execute("SET LOCAL lock_timeout = '3s'")?;
            let outcome = config.run(conn, "settings", "k-1", &1, |tx| {
                // The same key, claimed by the enclosing call on this
                // connection: the inner call claims nothing.
                let inner = config.run(tx, "settings", "k-1", &1, |_| Ok::<_, Error>(String::new()));
                assert!(matches!(inner, Err(Error::InProgress)), "got {inner:?}");
                Ok::<_, Error>(lock_timeout(tx))
            });
            Ok::<_, diesel::result::Error>(outcome.expect("outer call").into_inner())
        })
        .expect("caller's transaction");

    assert_eq!(after_inner, "3s");
}
