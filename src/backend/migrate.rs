//! The crate's own migrations, embedded in the binary, one set per backend.
//!
//! Each set is in its backend's SQL, with the same versions for the same
//! tables: `20261129000000` the key table, `20261130000000` the outbox,
//! `20261203000000` operations in phases (MySQL's set was written with its
//! final columns and has no others), `20261204000000` the outbox's scope,
//! `20261205000000` the callers a record is answered to (`caller_hash`),
//! `20261206000000` the outbox's metadata, `20261207000000` where the
//! result of a key record or an operation came from (`traceparent`,
//! `request_id`).
//! Where a backend needs a step the others lack (SQLite's key table without
//! a rowid, PostgreSQL's outbox notifications), its set has a migration
//! under a version no other set uses, so a database records the same
//! versions for the same tables
//! whichever set created it.
//!
//! The database records them in a schema history of the crate's own,
//! `__idempotency_schema_migrations` (its one statement in
//! `migrations/schema_history.sql`), never in the application's
//! `__diesel_schema_migrations`, whose newest version diesel's
//! `revert_last_migration` (and the diesel CLI's `migration revert` and
//! `redo`) looks up in the application's own migrations.

use diesel::migration::{self, Migration, MigrationSource, MigrationVersion};
use diesel::prelude::*;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use super::connection::{RawConnection, StoreConnection};
use super::history::History;

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");

#[cfg(feature = "mysql")]
pub(crate) const MYSQL: EmbeddedMigrations = embed_migrations!("migrations/mysql");

/// This crate's migrations: the `idempotency_keys` table and its index, the
/// `idempotency_outbox` table of the [outbox](crate::outbox) and the
/// `idempotency_phases` table of [phased operations](crate::phased), for
/// whichever backend the harness runs them on.
///
/// Apply them with [`run_migrations`], which records them in the crate's
/// own schema history, `__idempotency_schema_migrations`, beside your
/// application's `__diesel_schema_migrations`: your migrations and the
/// diesel CLI (`diesel migration run`, `revert`, `redo`) never see them.
/// To revert them, or to ask what is pending, give `MIGRATIONS` to a
/// [`SchemaHistory`], the harness that keeps that history; a harness of
/// your own (`conn.run_pending_migrations(MIGRATIONS)`) would record them
/// in your history, where diesel's `revert_last_migration` then fails to
/// find them among your migrations.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
/// use idempotency::SchemaHistory;
///
/// // Your application's own migrations.
/// const APP_MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");
///
/// let mut conn = SqliteConnection::establish(":memory:")?;
/// conn.run_pending_migrations(APP_MIGRATIONS)?;
/// idempotency::run_migrations(&mut conn)?;
/// assert!(!SchemaHistory::new(&mut conn).has_pending_migration(idempotency::MIGRATIONS)?);
/// // Your history holds your migrations only: reverting the last one reverts yours.
/// conn.revert_last_migration(APP_MIGRATIONS)?;
/// # Ok(())
/// # }
/// ```
pub const MIGRATIONS: Migrations = Migrations(());

/// The type of [`MIGRATIONS`]: a diesel migration source for every backend
/// this build supports.
#[derive(Debug, Clone, Copy)]
pub struct Migrations(());

#[cfg(feature = "sqlite")]
impl MigrationSource<diesel::sqlite::Sqlite> for Migrations {
    fn migrations(&self) -> migration::Result<Vec<Box<dyn Migration<diesel::sqlite::Sqlite>>>> {
        SQLITE.migrations()
    }
}

#[cfg(feature = "postgres")]
impl MigrationSource<diesel::pg::Pg> for Migrations {
    fn migrations(&self) -> migration::Result<Vec<Box<dyn Migration<diesel::pg::Pg>>>> {
        POSTGRES.migrations()
    }
}

#[cfg(feature = "mysql")]
impl MigrationSource<diesel::mysql::Mysql> for Migrations {
    fn migrations(&self) -> migration::Result<Vec<Box<dyn Migration<diesel::mysql::Mysql>>>> {
        MYSQL.migrations()
    }
}

/// Applies the pending migrations of [`MIGRATIONS`] on `conn`, recorded
/// in the crate's schema history (see [`SchemaHistory`]). Call it at
/// start-up, before serving: a call on a database without the crate's
/// tables fails with [`Error::Storage`](crate::Error::Storage) at every
/// request.
///
/// # Errors
///
/// The migration harness's error when a migration fails; it is rolled back.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
///
/// let mut conn = SqliteConnection::establish(":memory:")?;
/// idempotency::run_migrations(&mut conn)?;
/// // Applying them again finds nothing pending.
/// idempotency::run_migrations(&mut conn)?;
/// # Ok(())
/// # }
/// ```
pub fn run_migrations<C: StoreConnection>(conn: &mut C) -> migration::Result<()> {
    SchemaHistory::new(conn).run_pending_migrations(<C::Raw as History>::MIGRATIONS)?;
    Ok(())
}

/// Checks, changing nothing, that the database of `conn` has every
/// migration of [`MIGRATIONS`]: for the start of a service that leaves
/// migrating to a deployment step, so that a database without the crate's
/// tables stops it at once with the fix named, not every request later
/// with a 500.
///
/// # Errors
///
/// [`SchemaError::Pending`] with the versions the database lacks;
/// [`SchemaError::Unreadable`] when the database cannot be asked.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::SchemaError;
///
/// let mut conn = SqliteConnection::establish(":memory:")?;
/// let missing = idempotency::check_schema(&mut conn);
/// assert!(matches!(missing, Err(SchemaError::Pending(_))));
/// assert!(missing.unwrap_err().to_string().contains("idempotency::run_migrations"));
///
/// idempotency::run_migrations(&mut conn)?;
/// idempotency::check_schema(&mut conn)?;
/// # Ok(())
/// # }
/// ```
pub fn check_schema<C: StoreConnection>(conn: &mut C) -> Result<(), SchemaError> {
    let pending = conn.raw().unapplied().map_err(SchemaError::Unreadable)?;
    if pending.is_empty() {
        Ok(())
    } else {
        Err(SchemaError::Pending(pending))
    }
}

/// Why [`check_schema`] refused a database.
#[derive(Debug)]
#[non_exhaustive]
pub enum SchemaError {
    /// The versions of the crate's migrations that the database lacks,
    /// oldest first: apply them with [`run_migrations`].
    Pending(Vec<String>),
    /// The database could not be asked which migrations it has.
    Unreadable(Box<dyn std::error::Error + Send + Sync>),
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchemaError::Pending(versions) => write!(
                f,
                "the database lacks the idempotency crate's migrations {}: apply them with \
                 `idempotency::run_migrations(&mut conn)` before serving",
                versions.join(", ")
            ),
            SchemaError::Unreadable(_) => f.write_str("the database's idempotency migrations could not be read"),
        }
    }
}

impl std::error::Error for SchemaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SchemaError::Pending(_) => None,
            SchemaError::Unreadable(error) => Some(&**error),
        }
    }
}

/// The crate's schema history on a connection: a diesel
/// [`MigrationHarness`](diesel_migrations::MigrationHarness) for
/// [`MIGRATIONS`] that records them in `__idempotency_schema_migrations`,
/// never in your application's `__diesel_schema_migrations`.
///
/// [`run_migrations`] applies them through it; use it yourself to list
/// what is applied or pending, or to revert the crate's migrations. Its
/// first use on a database where a release before recorded the crate's
/// migrations in `__diesel_schema_migrations` moves those versions into the
/// crate's history, in one transaction; your own versions stay where they
/// are.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use diesel_migrations::MigrationHarness;
/// use idempotency::{SchemaHistory, MIGRATIONS};
///
/// let mut conn = SqliteConnection::establish(":memory:")?;
/// let mut history = SchemaHistory::new(&mut conn);
/// history.run_pending_migrations(MIGRATIONS)?;
/// assert!(!history.has_pending_migration(MIGRATIONS)?);
/// // Reverting them drops the crate's tables.
/// history.revert_all_migrations(MIGRATIONS)?;
/// assert!(history.has_pending_migration(MIGRATIONS)?);
/// # Ok(())
/// # }
/// ```
pub struct SchemaHistory<'a, C> {
    conn: &'a mut C,
}

impl<'a, C: RawConnection> SchemaHistory<'a, C> {
    /// The crate's schema history on `conn` (or the connection behind a
    /// pooled one).
    pub fn new<S: StoreConnection<Raw = C>>(conn: &'a mut S) -> Self {
        SchemaHistory { conn: conn.raw() }
    }
}

impl<C> MigrationHarness<<C as Connection>::Backend> for SchemaHistory<'_, C>
where
    C: RawConnection,
{
    fn run_migration(
        &mut self,
        migration: &dyn Migration<<C as Connection>::Backend>,
    ) -> migration::Result<MigrationVersion<'static>> {
        self.conn.run_recorded(migration)
    }

    fn revert_migration(
        &mut self,
        migration: &dyn Migration<<C as Connection>::Backend>,
    ) -> migration::Result<MigrationVersion<'static>> {
        self.conn.revert_recorded(migration)
    }

    fn applied_migrations(&mut self) -> migration::Result<Vec<MigrationVersion<'static>>> {
        self.conn.recorded()
    }
}
