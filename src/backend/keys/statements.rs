//! The key statements, each built by a plain function, and
//! [`KeyStatements`](super::KeyStatements) written once over them for the
//! connections of SQLite and PostgreSQL, of both kinds. MySQL sends
//! [`find`], [`insert`] and [`take_over`] from its own rules: its calls
//! always claim first and complete a claimed record (`mysql/key.rs`).

use diesel::dsl;
use diesel::dsl::{Filter, Find, Le, Set, update};
use diesel::prelude::*;

use super::Record;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use super::{ClaimOutcome, Complete, Hold, KeyRecordChanged, Stored};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use crate::backend::send::{Execute, Load, Sends};
use crate::schema::idempotency_keys as k;
use crate::sql_time::At;

/// The record of `(scope, key)`. A primary key lookup needs no `LIMIT`: a
/// bound one would make SQLite prepare the statement again on every call.
#[dsl::auto_type]
pub(crate) fn find<'a>(scope: &'a str, key: &'a str) -> _ {
    k::table.find((scope, key)).select((
        k::request_hash,
        k::status,
        k::response,
        k::created_at,
        k::expires_at,
        k::caller_hash,
        k::traceparent,
        k::request_id,
    ))
}

/// `record` inserted, which the primary key refuses for a key that has a
/// record.
#[dsl::auto_type]
pub(crate) fn insert<'a>(record: Record<'a>) -> _ {
    dsl::insert_into(k::table).values(record)
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// `record` inserted as a claim unless its key has a record. `DO NOTHING`,
/// not `DO UPDATE`: the claim then knows whether it replaced an expired
/// record, and a fresh key costs PostgreSQL measurably less.
#[dsl::auto_type]
pub(crate) fn insert_claim<'a>(record: Record<'a>) -> _ {
    dsl::insert_into(k::table).values(record).on_conflict_do_nothing()
}

/// [`take_over`]'s statement.
pub(crate) type TakeOver<'a> =
    Set<Filter<update<Find<k::table, (&'a str, &'a str)>>, Le<k::expires_at, At>>, Record<'a>>;

/// The record of `record`'s key replaced with `record`, if its retention
/// (and the grace period of its tombstone, where the policy keeps one) has
/// ended by `record.reusable_by`.
pub(crate) fn take_over(record: Record<'_>) -> TakeOver<'_> {
    dsl::update(k::table.find((record.scope, record.idempotency_key)))
        .filter(k::expires_at.le(At(record.reusable_by)))
        .set(record)
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// The stored record for `(scope, key)`.
pub(crate) async fn find_record<'a, C>(conn: &mut C, scope: &'a str, key: &'a str) -> QueryResult<Option<Stored>>
where
    C: Sends,
    find<'a>: Load<'a, C, Stored>,
{
    find(scope, key).fetch(conn).await.optional()
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// Inserts `record` as a claim, or takes over an expired record with its
/// key: a record that is already there is taken over by a second, guarded
/// statement only if it may be.
pub(crate) async fn claim<'a, C>(conn: &mut C, record: &Record<'a>) -> QueryResult<ClaimOutcome>
where
    C: Sends,
    insert_claim<'a>: Execute<C>,
    TakeOver<'a>: Execute<C>,
{
    if insert_claim(*record).send(conn).await? == 1 {
        return Ok(ClaimOutcome::Inserted);
    }
    Ok(if take_over(*record).send(conn).await? == 1 {
        ClaimOutcome::TookOver
    } else {
        ClaimOutcome::Refused
    })
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// Writes the completed `record` as `hold` requires.
pub(crate) async fn store<'a, C>(conn: &mut C, hold: Hold, record: &'a Record<'a>) -> QueryResult<()>
where
    C: Sends,
    insert<'a>: Execute<C>,
    TakeOver<'a>: Execute<C>,
    Complete<'a>: Execute<C>,
{
    let stored = match hold {
        Hold::Free => insert(*record).send(conn).await?,
        Hold::Expired => match take_over(*record).send(conn).await? {
            // Purged since it was read: a purge deletes expired records
            // without taking the key's lock (only PostgreSQL lets it run
            // meanwhile). The lock still keeps every other call off the key.
            0 => insert(*record).send(conn).await?,
            replaced => replaced,
        },
        Hold::Claimed { .. } => Complete::new(record).send(conn).await?,
        // Nothing of this transaction's to write.
        Hold::Recorded(_) | Hold::ClaimedElsewhere => 0,
    };
    // The key is held by this transaction; anything else means something
    // bypasses the lock, and committing would leave an executed operation
    // without its result.
    KeyRecordChanged::check(stored)
}

/// [`KeyStatements`](super::KeyStatements) for a connection of SQLite or
/// PostgreSQL, of either kind: [`find_record`], [`claim`] and [`store`].
/// An impl per connection, not one for every connection that sends the
/// statements: such an impl would need their bounds for every lifetime,
/// which the compiler cannot prove of diesel's insert statements.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! shared_key_statements {
    ($conn:ty) => {
        impl $crate::backend::KeyStatements for $conn {
            async fn find(&mut self, scope: &str, key: &str) -> diesel::QueryResult<Option<$crate::backend::Stored>> {
                $crate::backend::keys::find_record(self, scope, key).await
            }

            async fn claim(
                &mut self,
                record: &$crate::backend::Record<'_>,
            ) -> diesel::QueryResult<$crate::backend::ClaimOutcome> {
                $crate::backend::keys::claim(self, record).await
            }

            async fn store(
                &mut self,
                hold: $crate::backend::Hold,
                record: &$crate::backend::Record<'_>,
            ) -> diesel::QueryResult<()> {
                $crate::backend::keys::store(self, hold, record).await
            }
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use shared_key_statements;
