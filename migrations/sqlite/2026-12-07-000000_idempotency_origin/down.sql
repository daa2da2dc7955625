ALTER TABLE idempotency_keys DROP COLUMN request_id;
ALTER TABLE idempotency_keys DROP COLUMN traceparent;
