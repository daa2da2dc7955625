//! The story helpers of `idempotency::testing` catch the mistakes they are
//! meant to catch.

use std::convert::Infallible;

use chrono::Duration;
use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::prelude::*;
use idempotency::testing::{self, ManualClock, SqliteFile};
use idempotency::{Config, Error, Outcome, run_idempotent};

fn create_table(conn: &mut SqliteConnection) {
    conn.batch_execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)")
        .expect("create orders");
}

fn insert(conn: &mut SqliteConnection, item: &str) -> QueryResult<usize> {
    diesel::sql_query("INSERT INTO orders (item) VALUES (?)")
        .bind::<diesel::sql_types::Text, _>(item)
        .execute(conn)
}

#[test]
#[should_panic(expected = "lost_response: the retry executed again")]
fn lost_response_catches_a_call_without_a_key() {
    let mut conn = testing::sqlite_memory();
    create_table(&mut conn);
    testing::lost_response(&mut conn, |conn| {
        insert(conn, "book").map(Outcome::Executed).map_err(Error::Operation)
    });
}

#[test]
#[should_panic(expected = "lost_response: the first call replayed")]
fn lost_response_catches_a_key_already_spent() {
    let mut conn = testing::sqlite_memory();
    let call = |conn: &mut SqliteConnection| run_idempotent(conn, "shop", "k1", &1, |_| Ok::<_, Infallible>(1));
    call(&mut conn).expect("spend the key");
    testing::lost_response(&mut conn, call);
}

#[test]
#[should_panic(expected = "crash_midway: orders changed although the call crashed")]
fn crash_midway_catches_writes_committed_by_the_operation_itself() {
    let mut conn = testing::sqlite_memory();
    create_table(&mut conn);
    // A repository function that ends the transaction it was given.
    testing::crash_midway(&mut conn, "shop", "k1", "book", |tx, item: &str| {
        insert(tx, item)?;
        tx.batch_execute("COMMIT; BEGIN")
    });
}

#[test]
#[should_panic(expected = "crash_midway: the key was already spent")]
fn crash_midway_catches_a_key_already_spent() {
    let mut conn = testing::sqlite_memory();
    create_table(&mut conn);
    run_idempotent(&mut conn, "shop", "k1", "book", |tx| insert(tx, "book")).expect("spend the key");
    testing::crash_midway(&mut conn, "shop", "k1", "book", insert);
}

#[test]
#[should_panic(expected = "crash_midway: the call failed before the crash")]
fn crash_midway_reports_an_operation_that_fails_first() {
    let mut conn = testing::sqlite_memory();
    testing::crash_midway(&mut conn, "shop", "k1", "book", insert);
}

#[test]
fn crash_midway_leaves_the_connection_usable() {
    let mut conn = testing::sqlite_memory();
    create_table(&mut conn);
    testing::crash_midway(&mut conn, "shop", "k1", "book", insert);
    insert(&mut conn, "pen").expect("the connection works outside any transaction");
    conn.transaction(|tx| insert(tx, "cup"))
        .expect("and opens transactions");
}

#[test]
fn crash_midway_inside_a_callers_transaction_leaves_it_open() {
    let mut conn = testing::sqlite_memory();
    create_table(&mut conn);
    conn.begin_test_transaction().expect("the caller's transaction");
    testing::crash_midway(&mut conn, "shop", "k1", "book", insert);
    insert(&mut conn, "pen").expect("the caller's transaction goes on");
    let depth = AnsiTransactionManager::transaction_manager_status_mut(&mut conn)
        .transaction_depth()
        .expect("the transaction state");
    assert_eq!(
        depth.map(|depth| depth.get()),
        Some(1),
        "still inside the caller's transaction"
    );
}

#[test]
#[should_panic(expected = "does the call's Config use this clock")]
fn retry_after_expiry_catches_a_config_without_the_clock() {
    let mut conn = testing::sqlite_memory();
    let clock = ManualClock::new();
    testing::retry_after_expiry(&mut conn, &clock, Duration::hours(24), |conn| {
        run_idempotent(conn, "shop", "k1", &1, |_| Ok::<_, Infallible>(1))
    });
}

#[test]
#[should_panic(expected = "is the call's retention shorter than the one given here")]
fn retry_after_expiry_catches_a_shorter_retention_than_claimed() {
    let mut conn = testing::sqlite_memory();
    let clock = ManualClock::new();
    let config = Config::default().clock(clock.source()).retention(Duration::hours(1));
    testing::retry_after_expiry(&mut conn, &clock, Duration::hours(2), |conn| {
        config.run(conn, "shop", "k1", &1, |_| Ok::<_, Infallible>(1))
    });
}

#[test]
#[should_panic(expected = "racing_duplicate: expected one execution and one replay")]
fn racing_duplicate_catches_a_call_without_a_key() {
    let db = SqliteFile::new();
    create_table(&mut db.conn());
    testing::racing_duplicate(&db, |conn| {
        insert(conn, "book").map(Outcome::Executed).map_err(Error::Operation)
    });
}

#[test]
fn sqlite_memory_with_applies_the_crate_migrations_before_yours() {
    use diesel_migrations::{EmbeddedMigrations, embed_migrations};
    const MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let outcome = run_idempotent(&mut conn, "shop", "k1", "book", |tx| {
        tx.batch_execute("INSERT INTO orders (item, quantity) VALUES ('book', 1); INSERT INTO refunds (order_id, reason) VALUES (1, 'damaged')")
    });
    assert!(
        !outcome
            .expect("a call writing to the application's tables")
            .is_replayed()
    );
}

#[test]
fn sqlite_file_is_removed_when_dropped() {
    let db = SqliteFile::new();
    let path = db.path().to_owned();
    assert!(path.exists());
    drop(db);
    assert!(!path.exists());
}
