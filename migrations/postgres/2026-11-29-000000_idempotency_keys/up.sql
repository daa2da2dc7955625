-- One row per (scope, key). A row is committed only together with the
-- operation it guards, so other transactions only ever see 'completed' rows;
-- 'processing' is visible to the claiming transaction alone.
-- Times are UTC, written by the database's clock (the statement's time), or
-- by the host's on SQLite, or by a clock the application injects for tests.
CREATE TABLE idempotency_keys (
    scope TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('processing', 'completed')),
    response TEXT,
    created_at TIMESTAMP NOT NULL,
    completed_at TIMESTAMP,
    expires_at TIMESTAMP NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
);

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
