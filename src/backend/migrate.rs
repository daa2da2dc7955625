//! The crate's own migrations, embedded in the binary, one set per backend.
//!
//! Each set is in its backend's SQL, with the same versions for the same
//! tables: `20261129000000` the key table, `20261130000000` the outbox,
//! `20261203000000` operations in phases (MySQL's set was written with its
//! final columns and has no others), `20261204000000` the outbox's scope,
//! `20261205000000` the callers a record is answered to (`caller_hash`).
//! Where a backend needs a step the others lack (SQLite's key table without
//! a rowid, PostgreSQL's outbox notifications), its set has a migration
//! under a version no other set uses, so a database records the same
//! versions for the same tables
//! whichever set created it.

use diesel::migration::{self, Migration, MigrationSource};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};

use crate::backend::StoreConnection;

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");

#[cfg(feature = "mysql")]
pub(crate) const MYSQL: EmbeddedMigrations = embed_migrations!("migrations/mysql");

/// This crate's migrations: the `idempotency_keys` table and its index, and
/// the `idempotency_outbox` table of the [outbox](crate::outbox), for
/// whichever backend the harness runs them on.
///
/// Run them with [`run_migrations`], or with your own
/// [`MigrationHarness`](diesel_migrations::MigrationHarness) next to your
/// application's migrations: diesel records them in the same
/// `__diesel_schema_migrations` table under their own versions
/// (`20261129000000` onwards), so they never clash with yours.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
///
/// // Your application's own migrations.
/// const APP_MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");
///
/// let mut conn = SqliteConnection::establish(":memory:")?;
/// conn.run_pending_migrations(idempotency::MIGRATIONS)?;
/// conn.run_pending_migrations(APP_MIGRATIONS)?;
/// assert!(conn.has_pending_migration(idempotency::MIGRATIONS).map(|pending| !pending)?);
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

/// Applies the pending migrations of [`MIGRATIONS`] on `conn`.
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
    use crate::backend::KeyStore;
    conn.raw().apply_migrations()
}
