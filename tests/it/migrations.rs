//! Upgrading a database of the previous release: its records survive the
//! new migrations and replay as before. MySQL's set, which no release had
//! before, keeps the versions of the others. The crate's migrations are
//! recorded in a schema history of their own, so the application's
//! migrations revert and redo beside them, and a database whose history
//! holds the crate's versions (as releases before recorded them) has them
//! moved on the next run.

use diesel::connection::SimpleConnection;
use diesel::migration::{Migration, MigrationSource};
use diesel::prelude::*;
use diesel_migrations::MigrationHarness;
use idempotency::outbox::Relay;
use idempotency::{Outcome, StoreConnection, run_idempotent};

use crate::common::{TestDb, backend_tests};

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
            "20261205000000",
            "20261206000000",
            "20261207000000"
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
    idempotency::SchemaHistory::new(&mut conn)
        .revert_all_migrations(idempotency::MIGRATIONS)
        .expect("revert every migration");
    let tables: Vec<String> = diesel::dsl::sql::<diesel::sql_types::Text>(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'idempotency%'",
    )
    .load(&mut conn)
    .expect("the tables left");
    assert!(tables.is_empty(), "{tables:?}");
    idempotency::run_migrations(&mut conn).expect("migrate again");
}

/// An application's migrations in a directory of their own, older than the
/// crate's (a project that added the crate later): a table `app_notes`.
fn application_migrations() -> (tempfile::TempDir, diesel_migrations::FileBasedMigrations) {
    let dir = tempfile::tempdir().expect("a directory for the application's migrations");
    let migration = dir.path().join("2020-01-01-000000_app_notes");
    std::fs::create_dir(&migration).expect("the migration's directory");
    std::fs::write(
        migration.join("up.sql"),
        "CREATE TABLE app_notes (id INTEGER PRIMARY KEY)",
    )
    .expect("up.sql");
    std::fs::write(migration.join("down.sql"), "DROP TABLE app_notes").expect("down.sql");
    let source = diesel_migrations::FileBasedMigrations::from_path(dir.path()).expect("the application's migrations");
    (dir, source)
}

/// The versions diesel's own history (the application's) holds.
fn application_history<DB, C>(conn: &mut C) -> Vec<String>
where
    DB: diesel::backend::Backend,
    C: MigrationHarness<DB>,
{
    let applied = conn.applied_migrations().expect("the application's history");
    applied.iter().map(ToString::to_string).collect()
}

/// The versions of the crate's migrations.
fn crate_versions<DB: diesel::backend::Backend>() -> Vec<String>
where
    idempotency::Migrations: MigrationSource<DB>,
{
    let migrations = MigrationSource::<DB>::migrations(&idempotency::MIGRATIONS).expect("the crate's migrations");
    migrations
        .iter()
        .map(|migration| migration.name().version().to_string())
        .collect()
}

/// A call on the crate's tables executes, and its retry replays.
fn calls_work<C: StoreConnection>(conn: &mut C, key: &str) {
    let call =
        |conn: &mut C| run_idempotent(conn, "shop", key, &1, |_| Ok::<_, std::convert::Infallible>(2)).expect("a call");
    assert_eq!(call(conn), Outcome::Executed(2));
    assert_eq!(call(conn), Outcome::Replayed(2));
}

/// Whichever set came first, the application's history holds its own
/// versions only: `revert_last_migration`, `redo` (revert, then run) and
/// `revert_all_migrations` (what the diesel CLI's `migration revert` and
/// `redo` call) find every version they meet among the application's
/// migrations, and leave the crate's tables alone.
fn the_applications_revert_and_redo_pass_the_crates_migrations_by<Db: TestDb>()
where
    Db::Conn: MigrationHarness<<Db::Conn as Connection>::Backend>,
    idempotency::Migrations: MigrationSource<<Db::Conn as Connection>::Backend>,
{
    for crate_first in [false, true] {
        let db = Db::empty();
        let mut conn = db.conn();
        let (_dir, app) = application_migrations();
        if crate_first {
            idempotency::run_migrations(&mut conn).expect("the crate's migrations");
            conn.run_pending_migrations(app.clone())
                .expect("the application's migrations");
        } else {
            conn.run_pending_migrations(app.clone())
                .expect("the application's migrations");
            idempotency::run_migrations(&mut conn).expect("the crate's migrations");
        }
        assert_eq!(application_history(&mut conn), ["20200101000000"]);

        let reverted = conn
            .revert_last_migration(app.clone())
            .expect("revert the application's last migration");
        assert_eq!(reverted.to_string(), "20200101000000");
        conn.run_next_migration(app.clone()).expect("run it again: redo");
        let reverted = conn
            .revert_all_migrations(app.clone())
            .expect("revert all the application's migrations");
        assert_eq!(reverted.len(), 1);
        assert!(application_history(&mut conn).is_empty());

        calls_work(&mut conn, &format!("after-revert-{crate_first}"));
        let mut history = idempotency::SchemaHistory::new(&mut conn);
        assert!(
            !history
                .has_pending_migration(idempotency::MIGRATIONS)
                .expect("the crate's history")
        );
    }
}

/// A database where a release before recorded the crate's migrations in the
/// application's history, through the application's own harness: the next
/// run moves them into the crate's history, keeps their records and the
/// application's versions, and does nothing more the time after.
fn a_history_holding_the_crates_versions_has_them_moved_on_the_next_run<Db: TestDb>()
where
    Db::Conn: MigrationHarness<<Db::Conn as Connection>::Backend>,
    idempotency::Migrations: MigrationSource<<Db::Conn as Connection>::Backend>,
{
    let db = Db::empty();
    let mut conn = db.conn();
    let (_dir, app) = application_migrations();
    conn.run_pending_migrations(app.clone())
        .expect("the application's migrations");
    conn.run_pending_migrations(idempotency::MIGRATIONS)
        .expect("the crate's migrations, as releases before applied them");
    let executed = run_idempotent(&mut conn, "shop", "before-the-move", &1, |_| {
        Ok::<_, std::convert::Infallible>(2)
    });
    assert_eq!(executed.expect("a call before the move"), Outcome::Executed(2));
    idempotency::check_schema(&mut conn).expect("the schema of a release before is complete");

    idempotency::run_migrations(&mut conn).expect("the run that moves the versions");
    assert_eq!(application_history(&mut conn), ["20200101000000"]);
    let mut recorded: Vec<String> = {
        let mut history = idempotency::SchemaHistory::new(&mut conn);
        let applied = history.applied_migrations().expect("the crate's history");
        applied.iter().map(ToString::to_string).collect()
    };
    recorded.sort();
    assert_eq!(recorded, crate_versions::<<Db::Conn as Connection>::Backend>());

    idempotency::run_migrations(&mut conn).expect("a second run");
    let replayed = run_idempotent(&mut conn, "shop", "before-the-move", &1, |_| {
        Ok::<_, std::convert::Infallible>(3)
    });
    assert_eq!(replayed.expect("a retry after the move"), Outcome::Replayed(2));
    conn.revert_last_migration(app).expect("the application's revert");
    calls_work(&mut conn, "after-the-move");
}

/// A service that checks the schema at start, on a database without the
/// crate's tables, stops with the versions it lacks and the call that
/// applies them, and the check leaves the database as it was; once
/// migrated, it starts.
fn a_database_without_the_crates_tables_is_refused_at_start_naming_run_migrations<Db: TestDb>()
where
    idempotency::Migrations: MigrationSource<<Db::Conn as Connection>::Backend>,
{
    let db = Db::empty();
    let mut conn = db.conn();
    let refused = idempotency::check_schema(&mut conn).expect_err("a database without the crate's tables");
    assert!(refused.to_string().contains("idempotency::run_migrations"), "{refused}");
    match refused {
        idempotency::SchemaError::Pending(versions) => {
            assert_eq!(versions, crate_versions::<<Db::Conn as Connection>::Backend>());
        }
        other => panic!("refused for another reason: {other:?}"),
    }
    assert!(
        conn.raw()
            .batch_execute("SELECT version FROM __idempotency_schema_migrations")
            .is_err(),
        "the check created the crate's history"
    );

    idempotency::run_migrations(&mut conn).expect("the crate's migrations");
    idempotency::check_schema(&mut conn).expect("the migrated database");
}

backend_tests!(
    a_database_without_the_crates_tables_is_refused_at_start_naming_run_migrations,
    the_applications_revert_and_redo_pass_the_crates_migrations_by,
    a_history_holding_the_crates_versions_has_them_moved_on_the_next_run,
);
