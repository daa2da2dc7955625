//! PostgreSQL: the read brings the server's time along, and completers pick
//! abandoned operations with `FOR UPDATE SKIP LOCKED`, passing over those
//! another completer is picking at that moment.

use chrono::NaiveDateTime;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamp};

use super::store::{COMPLETED, OperationRow, PhaseStore, PickedRow, pick_abandoned};
use crate::store::postgres::{DatabaseNow, Lookup, row_with};
use crate::store::sql_limit;

/// The columns of an operation that an attempt reads, in the order of
/// [`OperationRow`].
struct Operation;

impl Lookup for Operation {
    const TABLE: &'static str = "idempotency_phases";
    const COLUMNS: &'static str =
        "r.request_hash, r.op_id, r.status, r.points, r.response, r.lease_until, r.expires_at";
    type SqlType = (
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Text>,
        Nullable<Timestamp>,
        Nullable<Timestamp>,
    );
}

type OperationColumns = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<NaiveDateTime>,
    Option<NaiveDateTime>,
);

impl PhaseStore for PgConnection {
    fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        let (now, columns) = row_with::<DatabaseNow, Operation, (NaiveDateTime, OperationColumns)>(self, scope, key)?;
        let row = match columns {
            (Some(request_hash), Some(op_id), Some(status), Some(points), response, lease_until, expires_at) => {
                Some(OperationRow {
                    request_hash,
                    op_id,
                    status,
                    points,
                    response,
                    lease_until,
                    expires_at,
                })
            }
            _ => None,
        };
        Ok((row, now))
    }

    fn pick_abandoned(
        &mut self,
        operations: &[&str],
        now: NaiveDateTime,
        idle_since: NaiveDateTime,
        until: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<Vec<PickedRow>> {
        // Locks taken by the pick are held until its transaction commits.
        self.transaction(|tx| {
            pick_abandoned!(
                [crate::schema::idempotency_phases],
                tx,
                operations,
                now,
                idle_since,
                until,
                limit,
                for_update,
                skip_locked
            )
        })
    }

    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize> {
        // SKIP LOCKED: an expired operation that a live request is starting
        // anew is not worth waiting for.
        diesel::sql_query(
            "DELETE FROM idempotency_phases WHERE ctid IN \
             (SELECT ctid FROM idempotency_phases WHERE status = $1 AND expires_at <= $2 \
              LIMIT $3 FOR UPDATE SKIP LOCKED)",
        )
        .bind::<Text, _>(COMPLETED)
        .bind::<Timestamp, _>(cutoff)
        .bind::<BigInt, _>(sql_limit(limit))
        .execute(self)
    }

    super::store::shared_queries!(crate::schema);
}
