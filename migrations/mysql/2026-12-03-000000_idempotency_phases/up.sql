-- Operations in phases: one row per (scope, key), holding the recovery
-- points of an operation with foreign calls in the middle.
--
-- status: 'running' from the first commit until the operation finishes
-- ('completed', with its response) or is given up ('parked', for a
-- person). A running row is never purged.
-- points: a JSON array of the recovery points committed so far, in order:
-- {"name": phase, "output": JSON text} for a finished phase or call, and
-- {"name": call, "since": time} for a call that was started and has no
-- result yet.
-- op_id: minted at the first commit; the keys of foreign calls derive
-- from it, never from the client's key.
-- lease_token, lease_until: the attempt that may commit now; every commit
-- requires the token, so an attempt whose lease was taken over commits
-- nothing.
-- attempts: how many attempts took the lease; the completer parks an
-- operation after its maximum.
-- completer_until: a completer working on it, so that others pass it by.
-- request: the request as JSON, kept only for operations a completer may
-- finish (Phased::store_requests).
-- Keys and scopes as in the key table; times are UTC, DATETIME(6).
CREATE TABLE idempotency_phases (
    scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    operation TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    request_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    op_id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL CHECK (status IN ('running', 'completed', 'parked')),
    points LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    response LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    lease_token VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    lease_until DATETIME(6),
    attempts INTEGER NOT NULL,
    completer_until DATETIME(6),
    last_error TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    expires_at DATETIME(6),
    PRIMARY KEY (scope, idempotency_key),
    -- The completer looks for running operations idle since a while.
    INDEX idempotency_phases_status_updated_at (status, updated_at),
    -- Purges find completed operations past their retention.
    INDEX idempotency_phases_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
