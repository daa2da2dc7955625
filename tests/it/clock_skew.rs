//! A process whose clock is hours off, against PostgreSQL: retention is
//! decided by the server's clock, so the skewed process replays what every
//! other process still keeps. The skewed process is a child run under
//! libfaketime, which shifts every clock the child reads but the monotonic
//! one.

use std::path::Path;

use chrono::{Duration, NaiveDateTime, Utc};
use diesel::prelude::*;
use idempotency::{Config, Outcome};

use crate::common::TestDb;
use crate::common::child::{Child, parent_database};
use crate::common::pg::Db;

/// The line the child prints: its clock's lead over the server's, and its
/// outcome.
const CHILD_REPORT: &str = "skewed-child skew_minutes=";
/// Where Debian's libfaketime package puts the library.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

const KEY: &str = "order-skewed";
const REQUEST: &str = "one book";

fn retention() -> Config {
    Config::default().retention(Duration::hours(2))
}

fn place(config: &Config, conn: &mut diesel::PgConnection, item: &str) -> Outcome<i64> {
    config
        .run(conn, "shop", KEY, REQUEST, |tx| Db::place_order(tx, item, 1))
        .expect("the call succeeds")
}

/// The child: the same call as the parent's, on a clock three hours ahead.
fn skewed_child(url: &str) -> ! {
    let mut conn = diesel::PgConnection::establish(url).expect("the child connects");
    let server: NaiveDateTime = diesel::select(diesel::dsl::sql::<diesel::sql_types::Timestamp>(
        "timezone('UTC', now())",
    ))
    .get_result(&mut conn)
    .expect("the server's time");
    let lead = Utc::now().naive_utc() - server;
    let outcome = place(&retention(), &mut conn, "skewed");
    println!(
        "\n{CHILD_REPORT}{} replayed={}",
        lead.num_minutes(),
        outcome.is_replayed()
    );
    std::process::exit(0);
}

#[test]
fn a_process_whose_clock_runs_hours_ahead_replays_what_the_others_keep() {
    if let Some(url) = parent_database() {
        skewed_child(&url);
    }
    assert!(
        Path::new(FAKETIME).exists(),
        "this test runs a child on a shifted clock with libfaketime: apt-get install libfaketime (.ci/run does)"
    );
    let db = Db::new();
    let mut conn = db.conn();
    let first = place(&retention(), &mut conn, "first");
    assert!(!first.is_replayed());

    let test = crate::common::test_path(
        module_path!(),
        "a_process_whose_clock_runs_hours_ahead_replays_what_the_others_keep",
    );
    let mut child = Child::start_with(&test, db.url(), |command| {
        command
            .env("LD_PRELOAD", FAKETIME)
            .env("FAKETIME", "+3h")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    });
    let report = child.wait_for("its clock and outcome", |line| {
        line.split_once(CHILD_REPORT).map(|(_, report)| report.to_owned())
    });
    assert!(child.wait().success());
    let (lead, replayed) = report.split_once(" replayed=").expect("the report's two fields");
    let lead: i64 = lead.parse().expect("minutes");
    assert!(
        lead >= 179,
        "the child's clock runs three hours ahead, not {lead} minutes"
    );
    assert_eq!(replayed, "true", "a retry within the server's retention replays");
    assert_eq!(Db::order_count(&mut conn), 1, "nothing executed twice");

    // The same lead as an injected clock is used as it is: the record looks
    // expired to that process, which executes the key again. This is what
    // the database's clock guards against.
    let ahead = retention().clock(|| Utc::now() + Duration::hours(3));
    assert!(!place(&ahead, &mut conn, "ahead").is_replayed());
    assert_eq!(Db::order_count(&mut conn), 2);
}
