ALTER TABLE idempotency_phases DROP COLUMN request_id;
ALTER TABLE idempotency_phases DROP COLUMN traceparent;
ALTER TABLE idempotency_keys DROP COLUMN request_id;
ALTER TABLE idempotency_keys DROP COLUMN traceparent;
