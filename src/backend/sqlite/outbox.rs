//! SQLite: one writer at a time. A relay claims inside a write transaction
//! that waits for the write lock (`BEGIN IMMEDIATE`), so two relays' claims
//! run one after the other and the second sees the first's leases.

use chrono::{NaiveDateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};
use diesel::sqlite::SqliteConnection;

use crate::backend::outbox::{
    BatchClaim, BlockingOutboxStore, Claimed, HEAD_OF_ITS_KEY, OutboxStore, claim_in_one_statement,
    shared_outbox_statements,
};
use crate::backend::sql_limit;
use crate::row_status::MessageStatus;

// SQLite's clock is the application host's.
impl OutboxStore for SqliteConnection {
    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        claim_in_one_statement(
            &[
                "UPDATE idempotency_outbox SET attempts = attempts + 1, available_at = ?, lease_token = ? \
                 WHERE id IN (SELECT id FROM idempotency_outbox AS o \
                              WHERE status = ? AND (available_at IS NULL OR available_at <= ?) AND ",
                HEAD_OF_ITS_KEY,
                " ORDER BY id LIMIT ?) \
                 RETURNING id, scope, topic, payload, attempts, headers, ordering_key, traceparent, tracestate",
            ],
            claim,
        )
        .load(self)
    }

    shared_outbox_statements!(created_at = crate::sql_time::At(Utc::now().naive_utc()));
}

impl BlockingOutboxStore for SqliteConnection {
    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, batch: usize) -> QueryResult<usize> {
        diesel::sql_query(
            "DELETE FROM idempotency_outbox WHERE id IN \
             (SELECT id FROM idempotency_outbox WHERE status = ? AND delivered_at <= ? LIMIT ?)",
        )
        .bind::<Text, _>(MessageStatus::Delivered)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(batch))
        .execute(self)
    }

    shared_outbox_statements!(blocking);
}
