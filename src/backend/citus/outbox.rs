//! The outbox distributed by `scope`: the relay's claim and the purge of
//! delivered messages, one scope at a time.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Text, Timestamp};

use super::{purge_by_scope, scopes};
use crate::backend::outbox::{Claimed, DELIVERED, PENDING};
use crate::backend::sql_limit;

/// `OutboxStore::claim_batch` on a distributed outbox: the oldest due
/// messages are read across shards without locks; then each scope's share
/// is leased by one statement on its shard, which passes over messages
/// another relay is claiming and leases only those still due, so two relays
/// never lease one message at once.
pub(crate) fn claim_batch(
    conn: &mut PgConnection,
    now: NaiveDateTime,
    lease_until: NaiveDateTime,
    lease_token: &str,
    batch: usize,
) -> QueryResult<Vec<Claimed>> {
    #[derive(QueryableByName)]
    struct Due {
        #[diesel(sql_type = Text)]
        scope: String,
        #[diesel(sql_type = Text)]
        id: String,
    }
    let due: Vec<Due> = diesel::sql_query(
        "SELECT scope, id FROM idempotency_outbox \
         WHERE status = $1 AND (available_at IS NULL OR available_at <= $2) ORDER BY id LIMIT $3",
    )
    .bind::<Text, _>(PENDING)
    .bind::<Timestamp, _>(now)
    .bind::<BigInt, _>(sql_limit(batch))
    .load(conn)?;
    let mut by_scope: Vec<(String, Vec<String>)> = Vec::new();
    for Due { scope, id } in due {
        match by_scope.iter_mut().find(|(s, _)| *s == scope) {
            Some((_, ids)) => ids.push(id),
            None => by_scope.push((scope, vec![id])),
        }
    }
    let mut claimed = Vec::new();
    for (scope, ids) in by_scope {
        claimed.extend(
            diesel::sql_query(
                "UPDATE idempotency_outbox SET attempts = attempts + 1, available_at = $1, lease_token = $2 \
                 WHERE scope = $3 AND id IN \
                 (SELECT id FROM idempotency_outbox \
                  WHERE scope = $3 AND id = ANY($4) AND status = $5 AND (available_at IS NULL OR available_at <= $6) \
                  FOR UPDATE SKIP LOCKED) \
                 RETURNING id, scope, topic, payload, attempts",
            )
            .bind::<Timestamp, _>(lease_until)
            .bind::<Text, _>(lease_token)
            .bind::<Text, _>(&scope)
            .bind::<Array<Text>, _>(&ids)
            .bind::<Text, _>(PENDING)
            .bind::<Timestamp, _>(now)
            .load::<Claimed>(conn)?,
        );
    }
    Ok(claimed)
}

/// `OutboxStore::purge_delivered_batch` on a distributed outbox.
pub(crate) fn purge_delivered(conn: &mut PgConnection, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
    let delivered = scopes(
        conn,
        diesel::sql_query(
            "SELECT DISTINCT scope FROM idempotency_outbox WHERE status = $1 AND delivered_at <= $2 LIMIT $3",
        )
        .bind::<Text, _>(DELIVERED)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(limit)),
    )?;
    purge_by_scope(conn, delivered, limit, |conn, scope, left| {
        diesel::sql_query(
            "DELETE FROM idempotency_outbox WHERE scope = $1 AND id IN \
             (SELECT id FROM idempotency_outbox WHERE scope = $1 AND status = $2 AND delivered_at <= $3 \
              LIMIT $4 FOR UPDATE SKIP LOCKED)",
        )
        .bind::<Text, _>(scope)
        .bind::<Text, _>(DELIVERED)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(left)
        .execute(conn)
    })
}
