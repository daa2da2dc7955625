-- The scope of the call that enqueued a message ('' for a message enqueued
-- outside a call). A distributed database places a tenant's messages with
-- its keys by it, so that enqueueing is part of the call's single-shard
-- transaction; settling a message names it with its id.
ALTER TABLE idempotency_outbox ADD COLUMN scope TEXT NOT NULL DEFAULT '';
