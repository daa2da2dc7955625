//! The outbox distributed by `scope`: the relay's claim, one scope at a
//! time.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Text, Timestamp};

use super::super::session::Session;
use crate::backend::outbox::{BatchClaim, Claimed};
use crate::backend::sql_limit;
use crate::row_status::MessageStatus;

/// `OutboxStore::claim_batch` on a distributed outbox: the oldest due
/// messages are read across shards without locks; then each scope's share
/// is leased by one statement on its shard, which passes over messages
/// another relay is claiming and leases only those still due, so two relays
/// never lease one message at once.
pub(crate) async fn claim_batch<C: Session>(conn: &mut C, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
    #[derive(QueryableByName)]
    struct Due {
        #[diesel(sql_type = Text)]
        scope: String,
        #[diesel(sql_type = Text)]
        id: String,
    }
    // The head of each ordering key (see `HEAD_OF_ITS_KEY`): a correlated
    // subquery that does not join on the distribution column is not
    // distributable, so the heads are one aggregate across the shards,
    // which Citus plans ahead of the read. Earlier messages of a key only
    // leave `pending`, so a head read here is still one when its shard
    // leases it.
    let due: Vec<Due> = conn
        .load(
            diesel::sql_query(
                "WITH heads AS (SELECT min(id) AS id FROM idempotency_outbox \
                        WHERE status = $1 AND ordering_key IS NOT NULL GROUP BY ordering_key) \
         SELECT scope, id FROM idempotency_outbox \
         WHERE status = $1 AND (available_at IS NULL OR available_at <= $2) \
         AND (ordering_key IS NULL OR id IN (SELECT id FROM heads)) ORDER BY id LIMIT $3",
            )
            .into_boxed()
            .bind::<Text, _>(MessageStatus::Pending)
            .bind::<Timestamp, _>(claim.now)
            .bind::<BigInt, _>(sql_limit(claim.limit)),
        )
        .await?;
    // The relay orders what it claimed by id itself.
    let mut by_scope: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for Due { scope, id } in due {
        by_scope.entry(scope).or_default().push(id);
    }
    let mut claimed = Vec::new();
    for (scope, ids) in by_scope {
        let leased = conn
            .load::<_, Claimed>(
                diesel::sql_query(
                    "UPDATE idempotency_outbox SET attempts = attempts + 1, available_at = $1, lease_token = $2 \
                 WHERE scope = $3 AND id IN \
                 (SELECT id FROM idempotency_outbox \
                  WHERE scope = $3 AND id = ANY($4) AND status = $5 AND (available_at IS NULL OR available_at <= $6) \
                  FOR UPDATE SKIP LOCKED) \
                 RETURNING id, scope, topic, payload, attempts, headers, ordering_key, traceparent, tracestate",
                )
                .into_boxed()
                .bind::<Timestamp, _>(claim.lease_until)
                .bind::<Text, _>(claim.lease_token)
                .bind::<Text, _>(&scope)
                .bind::<Array<Text>, _>(&ids)
                .bind::<Text, _>(MessageStatus::Pending)
                .bind::<Timestamp, _>(claim.now),
            )
            .await?;
        claimed.extend(leased);
    }
    Ok(claimed)
}
