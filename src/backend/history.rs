//! The crate's schema history, apart from the application's: its table,
//! its statements, and each backend's side of it ([`History`]), whose
//! methods [`schema_history!`] writes once for every backend.

use chrono::NaiveDateTime;
use diesel::dsl;
use diesel::migration::{self, Migration, MigrationSource, MigrationVersion};
use diesel::prelude::*;
use diesel_migrations::EmbeddedMigrations;

use super::keys::BlockingStore;

/// Creates the crate's schema history where it is missing.
pub(crate) const CREATE_HISTORY: &str = include_str!("../../migrations/schema_history.sql");

diesel::table! {
    /// The crate's schema history.
    __idempotency_schema_migrations (version) {
        version -> VarChar,
        run_on -> Timestamp,
    }
}

diesel::table! {
    /// The application's schema history, diesel's, where releases before
    /// the crate's own history recorded the crate's migrations.
    __diesel_schema_migrations (version) {
        version -> VarChar,
        run_on -> Timestamp,
    }
}

pub(crate) use __diesel_schema_migrations as application;
pub(crate) use __idempotency_schema_migrations as history;

/// A backend's side of the crate's schema history: its migrations, how it
/// finds a table, and the harness's statements, which
/// [`schema_history!`] writes once for every backend.
pub trait History: BlockingStore {
    /// The backend's set of the crate's migrations.
    const MIGRATIONS: EmbeddedMigrations;

    /// Whether a table of this name is where an unqualified statement
    /// would find it.
    fn has_table(&mut self, name: &str) -> QueryResult<bool>;

    /// Runs `migration` and records it in the crate's history.
    fn run_recorded(
        &mut self,
        migration: &dyn Migration<Self::Backend>,
    ) -> migration::Result<MigrationVersion<'static>>;

    /// Reverts `migration` and removes it from the crate's history.
    fn revert_recorded(
        &mut self,
        migration: &dyn Migration<Self::Backend>,
    ) -> migration::Result<MigrationVersion<'static>>;

    /// The versions the crate's history holds, newest first, once the
    /// history exists and holds what diesel's held of the crate's.
    fn recorded(&mut self) -> migration::Result<Vec<MigrationVersion<'static>>>;

    /// The versions of the crate's migrations that neither history holds,
    /// oldest first; read only.
    fn unapplied(&mut self) -> migration::Result<Vec<String>>;
}

/// The versions of a set of migrations, oldest first.
pub(crate) fn versions<DB: diesel::backend::Backend>(set: &EmbeddedMigrations) -> migration::Result<Vec<String>> {
    let mut versions: Vec<String> = MigrationSource::<DB>::migrations(set)?
        .iter()
        .map(|migration| migration.name().version().to_string())
        .collect();
    versions.sort();
    Ok(versions)
}

/// The count a backend's [`History::has_table`] reads.
#[derive(QueryableByName)]
pub(crate) struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) n: i64,
}

/// `version` recorded in the crate's history, applied now.
#[dsl::auto_type]
pub(crate) fn record(version: String) -> _ {
    dsl::insert_into(history::table).values(history::version.eq(version))
}

/// `version` removed from the crate's history.
#[dsl::auto_type]
pub(crate) fn forget(version: String) -> _ {
    dsl::delete(history::table.find(version))
}

/// `version` recorded in the crate's history as applied at `run_on`.
#[dsl::auto_type]
pub(crate) fn record_applied<'a>(version: &'a str, run_on: &'a NaiveDateTime) -> _ {
    dsl::insert_into(history::table).values((history::version.eq(version), history::run_on.eq(run_on)))
}

/// The versions of the crate's history, newest first.
#[dsl::auto_type]
pub(crate) fn recorded_versions() -> _ {
    history::table.select(history::version).order(history::version.desc())
}

/// Which of `versions` the crate's history holds.
#[dsl::auto_type]
pub(crate) fn recorded_of<'a>(versions: &'a [String]) -> _ {
    history::table
        .select(history::version)
        .filter(history::version.eq_any(versions))
}

/// Which of `versions` diesel's history holds, with when each was applied.
#[dsl::auto_type]
pub(crate) fn applied_of<'a>(versions: &'a [String]) -> _ {
    application::table
        .select((application::version, application::run_on))
        .filter(application::version.eq_any(versions))
}

/// Which of `versions` diesel's history holds.
#[dsl::auto_type]
pub(crate) fn applied_versions_of<'a>(versions: &'a [String]) -> _ {
    application::table
        .select(application::version)
        .filter(application::version.eq_any(versions))
}

/// `versions` removed from diesel's history.
#[dsl::auto_type]
pub(crate) fn forget_applied<'a>(versions: &'a [String]) -> _ {
    dsl::delete(application::table.filter(application::version.eq_any(versions)))
}

/// [`History`]'s methods but [`History::has_table`] for the connection
/// type `$conn`, written once: in an `impl History for $conn` block. Each
/// statement is built by its function above; the macro holds no SQL.
macro_rules! schema_history {
    ($conn:ty) => {
        fn run_recorded(
            &mut self,
            migration: &dyn diesel::migration::Migration<Self::Backend>,
        ) -> diesel::migration::Result<diesel::migration::MigrationVersion<'static>> {
            let version = migration.name().version().as_owned();
            let apply = |conn: &mut $conn| -> diesel::migration::Result<()> {
                migration.run(conn)?;
                diesel::RunQueryDsl::execute($crate::backend::history::record(version.to_string()), conn)?;
                Ok(())
            };
            if migration.metadata().run_in_transaction() {
                self.transaction(apply)?;
            } else {
                apply(self)?;
            }
            Ok(version)
        }

        fn revert_recorded(
            &mut self,
            migration: &dyn diesel::migration::Migration<Self::Backend>,
        ) -> diesel::migration::Result<diesel::migration::MigrationVersion<'static>> {
            let version = migration.name().version().as_owned();
            let revert = |conn: &mut $conn| -> diesel::migration::Result<()> {
                migration.revert(conn)?;
                diesel::RunQueryDsl::execute($crate::backend::history::forget(version.to_string()), conn)?;
                Ok(())
            };
            if migration.metadata().run_in_transaction() {
                self.transaction(revert)?;
            } else {
                revert(self)?;
            }
            Ok(version)
        }

        fn recorded(&mut self) -> diesel::migration::Result<Vec<diesel::migration::MigrationVersion<'static>>> {
            use diesel::RunQueryDsl as _;
            use $crate::backend::history as h;

            diesel::connection::SimpleConnection::batch_execute(self, h::CREATE_HISTORY)?;
            if self.has_table("__diesel_schema_migrations")? {
                let ours = h::versions::<Self::Backend>(&Self::MIGRATIONS)?;
                // Moves the crate's versions diesel's history holds, with
                // the times they were applied; a version both hold stays in
                // the crate's only.
                self.transaction(|conn| {
                    let moved: Vec<(String, chrono::NaiveDateTime)> = h::applied_of(&ours).load(conn)?;
                    if moved.is_empty() {
                        return diesel::QueryResult::Ok(());
                    }
                    let kept: Vec<String> = h::recorded_of(&ours).load(conn)?;
                    for (version, run_on) in moved.iter().filter(|(version, _)| !kept.contains(version)) {
                        h::record_applied(version, run_on).execute(conn)?;
                    }
                    h::forget_applied(&ours).execute(conn)?;
                    Ok(())
                })?;
            }
            let versions: Vec<String> = h::recorded_versions().load(self)?;
            Ok(versions
                .into_iter()
                .map(diesel::migration::MigrationVersion::from)
                .collect())
        }

        fn unapplied(&mut self) -> diesel::migration::Result<Vec<String>> {
            use diesel::RunQueryDsl as _;
            use $crate::backend::history as h;

            let ours = h::versions::<Self::Backend>(&Self::MIGRATIONS)?;
            let mut applied: Vec<String> = Vec::new();
            if self.has_table("__idempotency_schema_migrations")? {
                applied.extend(h::recorded_versions().load::<String>(self)?);
            }
            // A database of a release before, whose history is diesel's.
            if self.has_table("__diesel_schema_migrations")? {
                applied.extend(h::applied_versions_of(&ours).load::<String>(self)?);
            }
            Ok(ours
                .into_iter()
                .filter(|version| !applied.contains(version))
                .collect())
        }
    };
}
pub(crate) use schema_history;
