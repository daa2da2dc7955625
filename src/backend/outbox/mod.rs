//! Where outbox messages live: the statements every backend implements.
//!
//! The statements whose DSL is the same everywhere are written once
//! (`statements.rs`), given each backend's expression for the database's
//! time; each backend's `outbox.rs` adds the claim, which differs in how
//! concurrent relays keep off each other's messages, and the purge. The claim and the
//! purge update or delete through a limited subquery, which diesel's DSL
//! cannot express, so they are SQL with bound parameters.

use std::future::Future;

use chrono::NaiveDateTime;
use diesel::QueryResult;

use crate::backend::{BlockingStore, KeyStore};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use crate::row_status::MessageStatus;

pub(crate) mod rows;
pub(crate) mod statements;

pub use rows::{Backlog, BatchClaim, Claimed, DeadRow, Due, MessageId, NewMessage, Settlement};
pub(crate) use statements::shared_outbox_statements;

/// The statements of the outbox that a call's operation and a relay send,
/// one implementation per kind of connection, async-shaped as
/// [`KeyStore`](crate::backend::KeyStore) is, so `enqueue` and the relay's
/// pass are written once for both. A supertrait of the crate's public
/// connection traits, in a private module. Each backend writes
/// `claim_batch`; the rest is `shared_outbox_statements!`.
pub trait OutboxStore: KeyStore {
    /// Writes a new message, created at the database's time.
    fn insert_message(&mut self, message: &NewMessage<'_>) -> impl Future<Output = QueryResult<()>>;

    /// Leases the pending messages `claim` asks for, oldest first: each
    /// gets one more attempt, the claim's `lease_token` and `available_at =
    /// lease_until`, so no other relay claims it before the lease runs out.
    fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> impl Future<Output = QueryResult<Vec<Claimed>>>;

    /// Records how an attempt ended; `false` when the lease was taken over
    /// (or the message requeued) and nothing was written. The message is
    /// named by its scope and id, as a distributed database places it.
    fn settle(
        &mut self,
        message: MessageId<'_>,
        lease_token: &str,
        settlement: &Settlement,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// Records the messages `ids`, handed over under the lease
    /// `lease_token`, as delivered at `at`, in one statement: how many were
    /// written (fewer where a lease was taken over or a message requeued).
    fn mark_delivered(
        &mut self,
        ids: &[String],
        lease_token: &str,
        at: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<usize>>;

    /// Gives a claimed message back unattempted, due at once, for a relay
    /// that stops before handing it over; `false` when the lease was taken
    /// over meanwhile.
    fn release(&mut self, message: MessageId<'_>, lease_token: &str) -> impl Future<Output = QueryResult<bool>>;

    /// When the earliest pending message is due: now for one never
    /// attempted (or given back), otherwise when its lease, its backoff or
    /// its `not_before` ends; `None` without pending messages.
    fn next_due(&mut self) -> impl Future<Output = QueryResult<Option<Due>>>;

    /// The counts behind `Relay::stats`, with `now` deciding what is due.
    fn backlog(&mut self, now: NaiveDateTime) -> impl Future<Output = QueryResult<Backlog>>;

    /// Whether the backend announces new or requeued messages, so that a
    /// relay service has something to listen for. Backends that do not
    /// keep the defaults below: their relays find new messages by polling.
    const ANNOUNCES: bool = false;

    /// Starts listening for announcements of new or requeued messages on
    /// this connection.
    fn listen(&mut self) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(Ok(()))
    }

    /// Waits for the next announcement after [`listen`](OutboxStore::listen),
    /// on a diesel-async connection; on one that
    /// [announces](OutboxStore::ANNOUNCES) nothing, never completes. (A
    /// synchronous connection is asked with `BlockingOutboxStore::announced`,
    /// which never waits.)
    fn announcement(&mut self) -> impl Future<Output = QueryResult<()>> {
        std::future::pending()
    }

    /// Stops listening, so the connection goes back to a pool clean.
    fn unlisten(&mut self) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(Ok(()))
    }
}

/// The claim's condition on a pending message `o`: it is the head of its
/// ordering key, no message of its key enqueued before it (a smaller id)
/// is pending, whether leased, backed off or due; a message without a key
/// always is. So a message that fails holds back the rest of its key until
/// it is delivered or dead, and one claim takes at most one message of a
/// key. Earlier messages only ever leave `pending` (but for a requeue), so
/// a claim that saw one pending at worst passes over a head until the next
/// claim. A literal status, so that the partial index on pending keyed
/// messages serves the lookup.
pub(crate) const HEAD_OF_ITS_KEY: &str = "(o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM idempotency_outbox AS earlier \
     WHERE earlier.ordering_key = o.ordering_key AND earlier.status = 'pending' AND earlier.id < o.id))";

/// The statement that claims in one go whose text is the pieces
/// `claim_sql`, with the parameters of `claim` bound in the order the backends' statements take them: the
/// lease's end, its token, the pending status, now, and the limit.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn claim_in_one_statement<'a, DB>(
    claim_sql: &[&str],
    claim: &BatchClaim<'a>,
) -> diesel::query_builder::BoxedSqlQuery<'a, DB, diesel::query_builder::SqlQuery>
where
    DB: diesel::backend::Backend
        + diesel::sql_types::HasSqlType<diesel::sql_types::Timestamp>
        + diesel::sql_types::HasSqlType<diesel::sql_types::Text>
        + diesel::sql_types::HasSqlType<diesel::sql_types::BigInt>,
    NaiveDateTime: diesel::serialize::ToSql<diesel::sql_types::Timestamp, DB>,
    &'a str: diesel::serialize::ToSql<diesel::sql_types::Text, DB>,
    i64: diesel::serialize::ToSql<diesel::sql_types::BigInt, DB>,
    MessageStatus: diesel::serialize::ToSql<diesel::sql_types::Text, DB>,
{
    use diesel::sql_types::{BigInt, Text, Timestamp};
    diesel::sql_query(claim_sql.concat())
        .into_boxed()
        .bind::<Timestamp, _>(claim.lease_until)
        .bind::<Text, _>(claim.lease_token)
        .bind::<Text, _>(MessageStatus::Pending)
        .bind::<Timestamp, _>(claim.now)
        .bind::<BigInt, _>(crate::backend::sql_limit(claim.limit))
}

/// The outbox's statements that only a synchronous connection runs, for
/// the relay's upkeep on threads (its backlog, dead letters and purge): a
/// supertrait of [`RawConnection`](crate::RawConnection), in a private
/// module, so only the crate implements and calls it. Each backend writes
/// `purge_delivered_batch`; the rest is `shared_outbox_statements!(blocking)`.
pub trait BlockingOutboxStore: OutboxStore + BlockingStore {
    /// Up to `limit` dead messages, oldest first.
    fn dead_messages(&mut self, limit: usize) -> QueryResult<Vec<DeadRow>>;

    /// Makes a dead message pending again with fresh attempts, due at once.
    fn requeue(&mut self, id: &str) -> QueryResult<bool>;

    /// Deletes at most `limit` messages delivered at or before `cutoff`.
    fn purge_delivered_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;

    /// Whether a message was announced since the last look; never waits.
    fn announced(&mut self) -> QueryResult<bool> {
        Ok(false)
    }
}
