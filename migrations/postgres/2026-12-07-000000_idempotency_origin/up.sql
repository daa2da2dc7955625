-- Where a stored result came from, for a replay and a lookup to say, on
-- the key records and the operations in phases:
-- traceparent, the W3C trace context (version 00) of the span the first
-- execution ran in, where the application traces with OpenTelemetry;
-- request_id, the id the application gave the first request (over HTTP,
-- its X-Request-Id). NULL where there was none, and for every record
-- written before these columns.
ALTER TABLE idempotency_keys ADD COLUMN traceparent TEXT;
ALTER TABLE idempotency_keys ADD COLUMN request_id TEXT;
ALTER TABLE idempotency_phases ADD COLUMN traceparent TEXT;
ALTER TABLE idempotency_phases ADD COLUMN request_id TEXT;
