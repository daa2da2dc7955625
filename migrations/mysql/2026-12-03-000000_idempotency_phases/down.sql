DROP TABLE idempotency_phases;
