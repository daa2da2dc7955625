//! The crate's own migrations, embedded in the binary.

use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::store::StoreConnection;

/// This crate's migrations: the `idempotency_keys` table and its index, and
/// the `idempotency_outbox` table of the [outbox](crate::outbox).
///
/// Run them with [`run_migrations`], or with your own
/// [`MigrationHarness`] next to your application's migrations: diesel records
/// them in the same `__diesel_schema_migrations` table under their own
/// versions, `20261129000000` and `20261130000000`.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

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
pub fn run_migrations<C: StoreConnection>(conn: &mut C) -> diesel::migration::Result<()> {
    conn.raw().run_pending_migrations(MIGRATIONS)?;
    Ok(())
}
