-- caller_hash: who may look a record up and at which endpoints, as the
-- HTTP layer writes it: the SHA-256 (hex) of the canonical JSON of the
-- caller's principal and the endpoint the key was bound to (method,
-- matched route, path parameters; null for a key across endpoints). A
-- lookup answers a record only to a caller and endpoint whose hash is
-- this one. NULL for a record written outside the HTTP layer, and for
-- every record written before this column: no HTTP lookup answers those.
ALTER TABLE idempotency_keys ADD COLUMN caller_hash TEXT;
ALTER TABLE idempotency_phases ADD COLUMN caller_hash TEXT;
