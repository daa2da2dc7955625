-- What a message carries for a broker, all NULL when not set:
-- headers: a JSON object of string to string.
-- ordering_key: messages sharing one are handed over in enqueue (id)
-- order; a pending message holds back the later ones of its key.
-- traceparent, tracestate: the W3C trace context captured at enqueue.
ALTER TABLE idempotency_outbox ADD COLUMN headers TEXT;
ALTER TABLE idempotency_outbox ADD COLUMN ordering_key TEXT;
ALTER TABLE idempotency_outbox ADD COLUMN traceparent TEXT;
ALTER TABLE idempotency_outbox ADD COLUMN tracestate TEXT;
-- A claim looks for a pending message of the same key enqueued earlier.
CREATE INDEX idempotency_outbox_ordering_key ON idempotency_outbox (ordering_key, id)
    WHERE status = 'pending' AND ordering_key IS NOT NULL;
