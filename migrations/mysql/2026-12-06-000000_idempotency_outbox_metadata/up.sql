-- What a message carries for a broker, all NULL when not set:
-- headers: a JSON object of string to string.
-- ordering_key: messages sharing one are handed over in enqueue (id)
-- order; a pending message holds back the later ones of its key. Visible
-- ASCII of at most 255 bytes, as a topic.
-- traceparent, tracestate: the W3C trace context captured at enqueue.
ALTER TABLE idempotency_outbox
    ADD COLUMN headers LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    ADD COLUMN ordering_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin,
    ADD COLUMN traceparent VARCHAR(55) CHARACTER SET ascii COLLATE ascii_bin,
    ADD COLUMN tracestate VARCHAR(512) CHARACTER SET ascii COLLATE ascii_bin,
    -- A claim looks for a pending message of the same key enqueued
    -- earlier; the claim's locking read does not walk this index.
    ADD INDEX idempotency_outbox_ordering_key (ordering_key, status, id);
