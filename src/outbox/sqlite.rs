//! SQLite: one writer at a time. The relay claims inside its write
//! transaction (`BEGIN IMMEDIATE`), so two relays' claims run one after the
//! other and the second sees the first's leases.

use chrono::NaiveDateTime;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};
use diesel::sqlite::SqliteConnection;

use super::store::{Claimed, OutboxBackend};
use crate::store::sql_limit;

impl OutboxBackend for SqliteConnection {
    fn claim_batch(
        &mut self,
        now: NaiveDateTime,
        lease_until: NaiveDateTime,
        lease_token: &str,
        batch: usize,
    ) -> QueryResult<Vec<Claimed>> {
        diesel::sql_query(
            "UPDATE idempotency_outbox SET attempts = attempts + 1, available_at = ?, lease_token = ? \
             WHERE id IN (SELECT id FROM idempotency_outbox \
                          WHERE status = 'pending' AND (available_at IS NULL OR available_at <= ?) \
                          ORDER BY id LIMIT ?) \
             RETURNING id, topic, payload, attempts",
        )
        .bind::<Timestamp, _>(lease_until)
        .bind::<Text, _>(lease_token)
        .bind::<Timestamp, _>(now)
        .bind::<BigInt, _>(sql_limit(batch))
        .load(self)
    }

    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, batch: usize) -> QueryResult<usize> {
        diesel::sql_query(
            "DELETE FROM idempotency_outbox WHERE id IN \
             (SELECT id FROM idempotency_outbox WHERE status = 'delivered' AND delivered_at <= ? LIMIT ?)",
        )
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(batch))
        .execute(self)
    }

    super::store::shared_queries!();
}
