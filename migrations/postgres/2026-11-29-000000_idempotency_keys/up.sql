-- One row per (scope, key). A row is committed only together with the
-- operation it guards, so other transactions only ever see 'completed' rows;
-- 'processing' is visible to the claiming transaction alone.
-- Times are UTC, written by the library's clock rather than the database's,
-- so that an injected clock governs retention.
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
