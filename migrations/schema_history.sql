-- The crate's own schema history: the versions of the crate's migrations
-- applied to this database, kept apart from the application's
-- `__diesel_schema_migrations`. The same statement on every backend.
CREATE TABLE IF NOT EXISTS __idempotency_schema_migrations (
    version VARCHAR(50) PRIMARY KEY NOT NULL,
    run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
);
