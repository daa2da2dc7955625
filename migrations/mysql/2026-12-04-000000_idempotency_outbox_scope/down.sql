ALTER TABLE idempotency_outbox DROP COLUMN scope;
