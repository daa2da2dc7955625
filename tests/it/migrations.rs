//! Upgrading a database of the previous release: its records survive the
//! new migrations and replay as before. MySQL's set, which no release had
//! before, keeps the versions of the others.

use diesel::connection::SimpleConnection;
use diesel::migration::{Migration, MigrationSource};
use diesel::prelude::*;
use diesel_migrations::MigrationHarness;
use idempotency::outbox::Relay;
use idempotency::{Outcome, StoreConnection, run_idempotent};

use crate::common::TestDb;

/// The last migration of the previous release: the outbox.
const PREVIOUS_RELEASE: &str = "20261130000000";

/// Applies the crate's migrations up to the previous release only, writes
/// records under that schema, and upgrades it with the crate's migrations;
/// returns the calls recorded before the upgrade.
fn upgrade_from_the_previous_release<DB, C>(conn: &mut C) -> Vec<Outcome<String>>
where
    DB: diesel::backend::Backend,
    C: MigrationHarness<DB> + StoreConnection,
    idempotency::Migrations: MigrationSource<DB>,
{
    let migrations = MigrationSource::<DB>::migrations(&idempotency::MIGRATIONS).expect("the crate's migrations");
    let previous: Vec<&Box<dyn Migration<DB>>> = migrations
        .iter()
        .filter(|migration| migration.name().version().to_string().as_str() <= PREVIOUS_RELEASE)
        .collect();
    assert_eq!(previous.len(), 2, "the previous release had two migrations");
    // Creates diesel's table of applied migrations, as the first run of the
    // previous release did.
    conn.applied_migrations().expect("diesel's migration table");
    for migration in previous {
        conn.run_migration(&**migration)
            .expect("apply a migration of the previous release");
    }
    let calls = write_old_records(conn);
    idempotency::run_migrations(conn).expect("the upgrade");
    calls
}

/// A key record as the previous release wrote it: the columns it had.
#[derive(QueryableByName)]
struct OldRecord {
    #[diesel(sql_type = diesel::sql_types::Text)]
    request_hash: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    response: String,
}

/// Records written under the previous release's schema: executed calls and
/// an undelivered message. The calls' records are written as that release
/// wrote them, with its columns, since the crate of today writes columns
/// added since; their fingerprints and responses are those the crate
/// computes for the calls, taken from an in-memory database.
fn write_old_records<C: StoreConnection>(conn: &mut C) -> Vec<Outcome<String>> {
    let mut scratch = idempotency::testing::sqlite_memory();
    let calls: Vec<Outcome<String>> = (0..3)
        .map(|n| {
            let key = format!("order-{n}");
            let call = run_idempotent(&mut scratch, "shop", &key, &n, |_| {
                Ok::<_, std::convert::Infallible>(format!("order {n} placed"))
            })
            .expect("a call on a scratch database");
            let old: OldRecord =
                diesel::sql_query("SELECT request_hash, response FROM idempotency_keys WHERE idempotency_key = ?")
                    .bind::<diesel::sql_types::Text, _>(&key)
                    .get_result(&mut scratch)
                    .expect("the scratch record");
            conn.raw()
                .batch_execute(&format!(
                    "INSERT INTO idempotency_keys \
                     (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at) \
                     VALUES ('shop', '{key}', '{}', 'completed', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, \
                             '2100-01-01 00:00:00')",
                    old.request_hash,
                    old.response.replace('\'', "''"),
                ))
                .expect("a record on the old schema");
            call
        })
        .collect();
    // As the previous release enqueued it: without a scope, which the
    // crate of today writes.
    conn.raw()
        .batch_execute(
            "INSERT INTO idempotency_outbox (id, topic, payload, status, attempts, created_at) \
             VALUES ('0192f1f4-2c4a-7000-8000-000000000000', 'receipts', '\"order 0\"', 'pending', 0, \
                     CURRENT_TIMESTAMP)",
        )
        .expect("a message on the old schema");
    calls
}

/// After the upgrade every old call replays its result and the old message
/// is delivered.
fn assert_old_records_survive<C: StoreConnection>(conn: &mut C, calls: Vec<Outcome<String>>) {
    for (n, call) in calls.into_iter().enumerate() {
        let replayed = run_idempotent(conn, "shop", &format!("order-{n}"), &n, |_| {
            Ok::<_, std::convert::Infallible>(String::from("executed again"))
        })
        .expect("a retry after the upgrade");
        assert_eq!(replayed, Outcome::Replayed(call.into_inner()));
    }
    let delivered = Relay::default()
        .run_once(conn, |message| {
            assert_eq!(message.payload::<String>().expect("the old payload"), "order 0");
            Ok::<_, std::convert::Infallible>(())
        })
        .expect("the relay after the upgrade");
    assert_eq!(delivered.delivered, 1);
}

#[test]
fn sqlite_upgrade_keeps_records_and_moves_keys_to_a_table_without_rowid() {
    let db = crate::common::sqlite::Db::empty();
    let mut conn = db.conn();
    let calls = upgrade_from_the_previous_release(&mut conn);

    #[derive(QueryableByName)]
    struct Sql {
        #[diesel(sql_type = diesel::sql_types::Text)]
        sql: String,
    }
    let table: Sql = diesel::sql_query("SELECT sql FROM sqlite_schema WHERE name = 'idempotency_keys'")
        .get_result(&mut conn)
        .expect("the key table's definition");
    assert!(table.sql.contains("WITHOUT ROWID"), "{}", table.sql);
    assert_old_records_survive(&mut conn, calls);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_upgrade_keeps_records_and_adds_the_new_tables() {
    let db = crate::common::pg::Db::empty();
    let mut conn = db.conn();
    let calls = upgrade_from_the_previous_release(&mut conn);
    assert_old_records_survive(&mut conn, calls);
    let phased = idempotency::phased::Phased::new("after-upgrade").run(&mut conn, "shop", "p-1", &1, |s| {
        s.finish(|_| Ok::<_, std::convert::Infallible>(1))
    });
    assert_eq!(phased.expect("the new table works"), Outcome::Executed(1));
}

/// The versions of a migration set.
#[cfg(feature = "mysql")]
fn versions<DB: diesel::backend::Backend>() -> Vec<String>
where
    idempotency::Migrations: MigrationSource<DB>,
{
    MigrationSource::<DB>::migrations(&idempotency::MIGRATIONS)
        .expect("the crate's migrations")
        .iter()
        .map(|migration| migration.name().version().to_string())
        .collect()
}

/// MySQL's set is new: one migration per table, with the columns it had
/// then, under the version that table has in every other set, and the
/// migrations added since under the versions every set shares, so the
/// versions a database records mean the same tables on every backend. Its
/// down migrations leave nothing behind.
#[cfg(feature = "mysql")]
#[test]
fn mysql_migrations_keep_the_versions_of_the_other_sets_and_revert_cleanly() {
    let mysql = versions::<diesel::mysql::Mysql>();
    assert_eq!(
        mysql,
        [
            "20261129000000",
            "20261130000000",
            "20261203000000",
            "20261204000000",
            "20261205000000"
        ]
    );
    let sqlite = versions::<diesel::sqlite::Sqlite>();
    assert!(mysql.iter().all(|version| sqlite.contains(version)), "{sqlite:?}");
    #[cfg(feature = "postgres")]
    {
        let postgres = versions::<diesel::pg::Pg>();
        assert!(mysql.iter().all(|version| postgres.contains(version)), "{postgres:?}");
    }

    let db = crate::common::mysql::Db::empty();
    let mut conn = db.conn();
    idempotency::run_migrations(&mut conn).expect("migrate");
    let calls = write_old_records(&mut conn);
    assert_old_records_survive(&mut conn, calls);
    conn.revert_all_migrations(idempotency::MIGRATIONS)
        .expect("revert every migration");
    let tables: Vec<String> = diesel::dsl::sql::<diesel::sql_types::Text>(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'idempotency%'",
    )
    .load(&mut conn)
    .expect("the tables left");
    assert!(tables.is_empty(), "{tables:?}");
    idempotency::run_migrations(&mut conn).expect("migrate again");
}
