ALTER TABLE idempotency_outbox
    DROP INDEX idempotency_outbox_ordering_key,
    DROP COLUMN tracestate,
    DROP COLUMN traceparent,
    DROP COLUMN ordering_key,
    DROP COLUMN headers;
