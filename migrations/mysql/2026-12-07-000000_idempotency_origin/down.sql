ALTER TABLE idempotency_phases DROP COLUMN request_id, DROP COLUMN traceparent;
ALTER TABLE idempotency_keys DROP COLUMN request_id, DROP COLUMN traceparent;
