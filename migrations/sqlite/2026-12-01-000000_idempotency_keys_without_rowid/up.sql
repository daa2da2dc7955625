-- The key table without a rowid. A rowid table keeps the primary key twice:
-- the rows in a b-tree by rowid, and (scope, idempotency_key) again in the
-- primary key's index. Without a rowid the rows live in the primary key's
-- b-tree itself, so every call writes one b-tree fewer. SQLite cannot change
-- this in place: the records move to a new table, which takes the old name.
CREATE TABLE idempotency_keys_without_rowid (
    scope TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('processing', 'completed')),
    response TEXT,
    created_at TIMESTAMP NOT NULL,
    completed_at TIMESTAMP,
    expires_at TIMESTAMP NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
) WITHOUT ROWID;

INSERT INTO idempotency_keys_without_rowid
    (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
SELECT scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at
FROM idempotency_keys;

DROP TABLE idempotency_keys;

ALTER TABLE idempotency_keys_without_rowid RENAME TO idempotency_keys;

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
