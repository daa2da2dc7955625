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
use diesel::sql_types::{Text, Timestamp};

use super::citus;
use super::clock::database_time;
use super::expired::Expired;
use super::purge::purge;
use super::session::{Session, distributed};
use crate::backend::outbox::{
    BatchClaim, BlockingOutboxStore, Claimed, HEAD_OF_ITS_KEY, OutboxStore, claim_in_one_statement,
    shared_outbox_statements,
};
use crate::row_status::MessageStatus;

/// The channel the migration's trigger notifies.
pub(super) const CHANNEL: &str = "idempotency_outbox";

impl OutboxStore for PgConnection {
    const ANNOUNCES: bool = true;

    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        claim_batch(self, claim).await
    }

    async fn listen(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!("LISTEN {CHANNEL}"))
    }

    async fn unlisten(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!("UNLISTEN {CHANNEL}"))
    }

    shared_outbox_statements!(created_at = database_time());
}

/// [`OutboxStore::claim_batch`] on either kind of connection: in one
/// statement, or by scope on an outbox Citus distributes.
pub(super) async fn claim_batch<C: Session>(conn: &mut C, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
    if distributed(conn, "idempotency_outbox").await? {
        return citus::outbox::claim_batch(conn, claim).await;
    }
    conn.load(claim_in_one_statement(
        &[
            "WITH due AS ( \
             SELECT id FROM idempotency_outbox AS o \
             WHERE status = $3 AND (available_at IS NULL OR available_at <= $4) AND ",
            HEAD_OF_ITS_KEY,
            " ORDER BY id LIMIT $5 FOR UPDATE OF o SKIP LOCKED) \
         UPDATE idempotency_outbox AS o SET attempts = o.attempts + 1, available_at = $1, lease_token = $2 \
         FROM due WHERE o.id = due.id \
         RETURNING o.id, o.scope, o.topic, o.payload, o.attempts, o.headers, o.ordering_key, o.traceparent, o.tracestate",
        ],
        claim,
    ))
    .await
}

impl BlockingOutboxStore for PgConnection {
    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, batch: usize) -> QueryResult<usize> {
        let delivered = Expired {
            table: "idempotency_outbox",
            key: "id",
            condition: "status = $1 AND delivered_at <= $2",
            set: None,
            bind: &|rows| {
                rows.bind::<Text, _>(MessageStatus::Delivered)
                    .bind::<Timestamp, _>(cutoff)
            },
        };
        purge(self, &delivered, batch)
    }

    fn announced(&mut self) -> QueryResult<bool> {
        let mut any = false;
        for notification in self.notifications_iter() {
            notification?;
            any = true;
        }
        Ok(any)
    }

    shared_outbox_statements!(blocking);
}
