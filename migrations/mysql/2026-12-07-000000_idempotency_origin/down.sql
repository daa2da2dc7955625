ALTER TABLE idempotency_keys DROP COLUMN request_id, DROP COLUMN traceparent;
