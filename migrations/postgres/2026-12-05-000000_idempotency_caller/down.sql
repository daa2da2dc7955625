ALTER TABLE idempotency_phases DROP COLUMN caller_hash;
ALTER TABLE idempotency_keys DROP COLUMN caller_hash;
