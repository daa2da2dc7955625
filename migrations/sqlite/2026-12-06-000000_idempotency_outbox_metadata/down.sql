DROP INDEX idempotency_outbox_ordering_key;
ALTER TABLE idempotency_outbox DROP COLUMN tracestate;
ALTER TABLE idempotency_outbox DROP COLUMN traceparent;
ALTER TABLE idempotency_outbox DROP COLUMN ordering_key;
ALTER TABLE idempotency_outbox DROP COLUMN headers;
