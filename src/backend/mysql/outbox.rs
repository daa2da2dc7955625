//! MySQL and MariaDB: relays claim concurrently, as on PostgreSQL. The claim
//! reads and locks the due rows it picks with `FOR UPDATE SKIP LOCKED`
//! (MySQL 8.0, MariaDB 10.6), so a relay passes over messages another relay
//! is claiming at that moment instead of waiting for them, and then writes
//! the lease to the picked rows by their primary key, in one transaction
//! (neither has `UPDATE ... RETURNING`).
//!
//! A locking read locks every row it walks, not only those it returns, so
//! the statements name their indexes: the pick walks the `(status, id)`
//! index (left to the optimizer it may walk another and lock messages that
//! another relay would take). No index holds the lease token: settling a
//! message then finds it by its primary key alone, and a claim writing
//! leases never inserts into an index that a settle holds a lock in.
//!
//! Claims and purges run at `READ COMMITTED` (see
//! [`read_committed`](super::committed::read_committed)): their locking
//! reads would otherwise lock gaps that settling relays insert into.
//!
//! No notifications: relay services find new messages by polling.

use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Datetime, Text};

use super::clock::UtcNow;
use super::committed::read_committed;
use super::session::{Session, lease};
use crate::backend::outbox::{
    BatchClaim, BlockingOutboxStore, Claimed, HEAD_OF_ITS_KEY, OutboxStore, shared_outbox_statements,
};
use crate::backend::sql_limit;
use crate::row_status::MessageStatus;

impl OutboxStore for MysqlConnection {
    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        claim_batch(self, claim).await
    }

    shared_outbox_statements!(created_at = UtcNow);
}

/// [`OutboxStore::claim_batch`] on either kind of connection: the due
/// messages read and locked, then leased by their primary key, in one
/// transaction at `READ COMMITTED` (a savepoint in a caller's).
pub(super) async fn claim_batch<S: Session>(conn: &mut S, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
    if conn.depth()? == 0 {
        // Applies to the next transaction only; the session keeps its level.
        conn.execute(diesel::sql_query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"))
            .await?;
    }
    conn.within(async |tx: &mut S| {
        // The head condition's subquery is a plain read, which locks
        // nothing and skips nothing: it sees an earlier message of the
        // key that another relay is settling as last committed.
        let mut due: Vec<Claimed> = tx
            .load(
                diesel::sql_query(
                    [
                        "SELECT id, scope, topic, payload, attempts, headers, ordering_key, traceparent, tracestate \
                     FROM idempotency_outbox AS o FORCE INDEX (idempotency_outbox_status_id) \
                     WHERE status = ? AND (available_at IS NULL OR available_at <= ?) AND ",
                        HEAD_OF_ITS_KEY,
                        " ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
                    ]
                    .concat(),
                )
                .into_boxed()
                .bind::<Text, _>(MessageStatus::Pending)
                .bind::<Datetime, _>(claim.now)
                .bind::<BigInt, _>(sql_limit(claim.limit)),
            )
            .await?;
        if due.is_empty() {
            return Ok(due);
        }
        lease(tx, &due, claim).await?;
        for message in &mut due {
            message.attempts += 1;
        }
        Ok(due)
    })
    .await
}

impl BlockingOutboxStore for MysqlConnection {
    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, batch: usize) -> QueryResult<usize> {
        // SKIP LOCKED: two purges running at once split the rows instead of
        // queueing behind each other.
        read_committed(self, |tx| {
            diesel::sql_query(
                "DELETE o FROM \
             (SELECT id FROM idempotency_outbox FORCE INDEX (idempotency_outbox_status_delivered_at) \
              WHERE status = ? AND delivered_at <= ? ORDER BY delivered_at LIMIT ? FOR UPDATE SKIP LOCKED) AS done \
             STRAIGHT_JOIN idempotency_outbox AS o FORCE INDEX (PRIMARY) ON o.id = done.id",
            )
            .bind::<Text, _>(MessageStatus::Delivered)
            .bind::<Datetime, _>(cutoff)
            .bind::<BigInt, _>(sql_limit(batch))
            .execute(tx)
        })
    }

    shared_outbox_statements!(blocking);
}
