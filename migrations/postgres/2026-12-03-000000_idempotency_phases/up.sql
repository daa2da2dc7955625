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
-- Times are UTC.
CREATE TABLE idempotency_phases (
    scope TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    operation TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    request TEXT,
    op_id TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'parked')),
    points TEXT NOT NULL,
    response TEXT,
    lease_token TEXT,
    lease_until TIMESTAMP,
    attempts INTEGER NOT NULL,
    completer_until TIMESTAMP,
    last_error TEXT,
    created_at TIMESTAMP NOT NULL,
    updated_at TIMESTAMP NOT NULL,
    expires_at TIMESTAMP,
    PRIMARY KEY (scope, idempotency_key)
);

-- The completer looks for running operations idle since a while.
CREATE INDEX idempotency_phases_status_updated_at ON idempotency_phases (status, updated_at);
-- Purges find completed operations past their retention.
CREATE INDEX idempotency_phases_expires_at ON idempotency_phases (expires_at);
