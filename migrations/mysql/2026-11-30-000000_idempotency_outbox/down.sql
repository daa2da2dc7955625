DROP TABLE idempotency_outbox;
