-- The scope of the call that enqueued a message ('' for a message enqueued
-- outside a call), as the key table holds scopes. A distributed database
-- places a tenant's messages with its keys by it; settling a message names
-- it with its id.
ALTER TABLE idempotency_outbox
    ADD COLUMN scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '';
