//! PostgreSQL: relays claim concurrently. The claim locks the due rows it
//! picks with `FOR UPDATE SKIP LOCKED`, so a relay passes over messages
//! another relay is claiming at that moment instead of waiting for them, and
//! writes the lease in the same statement; once it commits, the leased rows
//! are no longer due for anyone until the lease runs out.
//!
//! A trigger announces every new or requeued message on the channel
//! `idempotency_outbox` in the transaction that writes it (see the
//! migration), so a relay service listening there wakes within milliseconds
//! of the commit instead of at its next poll.

use chrono::NaiveDateTime;
use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamp};

use crate::backend::citus;
use crate::backend::outbox::{Claimed, DELIVERED, OutboxStore, PENDING};
use crate::backend::postgres::timezone;
use crate::backend::sql_limit;

/// The channel the migration's trigger notifies.
const CHANNEL: &str = "idempotency_outbox";

impl OutboxStore for PgConnection {
    const ANNOUNCES: bool = true;

    fn claim_batch(
        &mut self,
        now: NaiveDateTime,
        lease_until: NaiveDateTime,
        lease_token: &str,
        batch: usize,
    ) -> QueryResult<Vec<Claimed>> {
        if citus::distributed(self, "idempotency_outbox")? {
            return citus::outbox::claim_batch(self, now, lease_until, lease_token, batch);
        }
        diesel::sql_query(
            "WITH due AS ( \
                 SELECT id FROM idempotency_outbox \
                 WHERE status = $3 AND (available_at IS NULL OR available_at <= $4) \
                 ORDER BY id LIMIT $5 FOR UPDATE SKIP LOCKED) \
             UPDATE idempotency_outbox AS o SET attempts = o.attempts + 1, available_at = $1, lease_token = $2 \
             FROM due WHERE o.id = due.id \
             RETURNING o.id, o.scope, o.topic, o.payload, o.attempts",
        )
        .bind::<Timestamp, _>(lease_until)
        .bind::<Text, _>(lease_token)
        .bind::<Text, _>(PENDING)
        .bind::<Timestamp, _>(now)
        .bind::<BigInt, _>(sql_limit(batch))
        .load(self)
    }

    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, batch: usize) -> QueryResult<usize> {
        if citus::distributed(self, "idempotency_outbox")? {
            return citus::outbox::purge_delivered(self, cutoff, batch);
        }
        // SKIP LOCKED: two purges running at once split the rows instead of
        // queueing behind each other.
        diesel::sql_query(
            "DELETE FROM idempotency_outbox WHERE id IN \
             (SELECT id FROM idempotency_outbox WHERE status = $1 AND delivered_at <= $2 \
              LIMIT $3 FOR UPDATE SKIP LOCKED)",
        )
        .bind::<Text, _>(DELIVERED)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(batch))
        .execute(self)
    }

    fn listen(&mut self) -> QueryResult<bool> {
        self.batch_execute(&format!("LISTEN {CHANNEL}"))?;
        Ok(true)
    }

    fn announced(&mut self) -> QueryResult<bool> {
        let mut any = false;
        for notification in self.notifications_iter() {
            notification?;
            any = true;
        }
        Ok(any)
    }

    fn unlisten(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!("UNLISTEN {CHANNEL}"))
    }

    crate::backend::outbox::shared_queries!(created_at = timezone("UTC", diesel::dsl::now); crate::schema);
}
