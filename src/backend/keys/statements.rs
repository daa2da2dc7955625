//! The key statements whose DSL is the same on every backend that takes
//! them. diesel's query types are concrete per table and connection, so a
//! generic function would need a bound for every intermediate query type;
//! the bodies are written once here, one arm per method of
//! [`KeyStore`](super::KeyStore), and each backend's impl names the methods
//! it takes from them.

/// The methods `find`, `claim` and `store` of
/// [`KeyStore`](super::KeyStore) for the tables of a schema module:
/// `key_statements!(ready schema: find, claim, store);` inside the impl. (MySQL,
/// whose calls always claim first, takes `find` only: it only ever
/// completes a claimed record, with a statement it prepares once, and
/// claims with statements of its own.)
///
/// Both write `async fn`s: `key_statements!(ready schema: ...)` for a
/// synchronous connection, whose statements complete as they are sent;
/// `key_statements!(async schema: ...)` for a diesel-async connection,
/// each statement awaited. The statements exist once for both kinds.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
macro_rules! key_statements {
    (async $schema:ident: $($method:ident),+ $(,)?) => {
        $($crate::backend::keys::key_statements!(@$method $schema [async] [.await] [diesel_async::RunQueryDsl]);)+
    };
    (ready $schema:ident: $($method:ident),+ $(,)?) => {
        $($crate::backend::keys::key_statements!(@$method $schema [async] [] [diesel::RunQueryDsl]);)+
    };
    (@find $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn find(&mut self, scope: &str, key: &str) -> diesel::QueryResult<Option<$crate::backend::Stored>> {
            use $schema::idempotency_keys as k;
            use diesel::{OptionalExtension, QueryDsl};
            use $($run)* as _;
            // A primary key lookup needs no LIMIT; a bound LIMIT would make
            // SQLite prepare the statement again on every call.
            k::table
                .find((scope, key))
                .select($crate::backend::keys::stored_columns!(k))
                .get_result(self)
                $($await)*
                .optional()
        }
    };
    (@claim $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn claim(&mut self, record: &$crate::backend::Record<'_>) -> diesel::QueryResult<$crate::backend::ClaimOutcome> {
            use $schema::idempotency_keys as k;
            use $crate::backend::ClaimOutcome;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            // DO NOTHING, not DO UPDATE: the claim then knows whether it
            // replaced an expired record, and a fresh key costs PostgreSQL
            // measurably less. A record that is already there is taken over
            // by a second, guarded statement only if its retention (and the
            // grace period of its tombstone, where the policy keeps one) has
            // ended.
            let inserted = diesel::insert_into(k::table)
                .values(record)
                .on_conflict_do_nothing()
                .execute(self)
                $($await)*?;
            if inserted == 1 {
                return Ok(ClaimOutcome::Inserted);
            }
            let taken_over = diesel::update(k::table.find((record.scope, record.idempotency_key)))
                .filter(k::expires_at.le(record.reusable_by))
                .set(record)
                .execute(self)
                $($await)*?;
            Ok(if taken_over == 1 {
                ClaimOutcome::TookOver
            } else {
                ClaimOutcome::Refused
            })
        }
    };
    (@store $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn store(
            &mut self,
            hold: $crate::backend::Hold,
            record: &$crate::backend::Record<'_>,
        ) -> diesel::QueryResult<()> {
            use $schema::idempotency_keys as k;
            use $crate::backend::keys::{Hold, KeyRecordChanged};
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let completed = $crate::backend::keys::record_values!(k, record);
            let stored = match hold {
                Hold::Free => diesel::insert_into(k::table)
                    .values((k::scope.eq(record.scope), k::idempotency_key.eq(record.idempotency_key), completed))
                    .execute(self)
                    $($await)*?,
                Hold::Expired => {
                    let replaced = diesel::update(k::table.find((record.scope, record.idempotency_key)))
                        .filter(k::expires_at.le(record.reusable_by))
                        .set(completed)
                        .execute(self)
                        $($await)*?;
                    if replaced == 0 {
                        // Purged since it was read: a purge deletes expired
                        // records without taking the key's lock (only
                        // PostgreSQL lets it run meanwhile). The lock still
                        // keeps every other call off the key.
                        diesel::insert_into(k::table)
                            .values((k::scope.eq(record.scope), k::idempotency_key.eq(record.idempotency_key), completed))
                            .execute(self)
                            $($await)*?
                    } else {
                        replaced
                    }
                }
                Hold::Claimed { .. } => $crate::backend::keys::Complete::<diesel::sql_types::Timestamp>::new(record)
                    .execute(self)
                    $($await)*?,
                // Nothing of this transaction's to write.
                Hold::Recorded(_) | Hold::ClaimedElsewhere => 0,
            };
            // The key is held by this transaction; anything else means
            // something bypasses the lock, and committing would leave an
            // executed operation without its result.
            KeyRecordChanged::check(stored)
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) use key_statements;

/// The columns of a key record besides its key, in table `$k` (a backend's
/// `idempotency_keys` module), as a call writes them.
macro_rules! record_values {
    ($k:ident, $record:expr) => {
        (
            $k::request_hash.eq($record.request_hash),
            $k::status.eq($record.status),
            $k::response.eq($record.response),
            $k::created_at.eq($record.created_at),
            $k::completed_at.eq($record.completed_at),
            $k::expires_at.eq($record.expires_at),
            $k::caller_hash.eq($record.caller_hash),
            $k::traceparent.eq($record.traceparent),
            $k::request_id.eq($record.request_id),
        )
    };
}
pub(crate) use record_values;

/// The columns of a [`Stored`](crate::backend::Stored) record, in table
/// `$k` (a backend's `idempotency_keys` module), in its fields' order.
macro_rules! stored_columns {
    ($k:ident) => {
        (
            $k::request_hash,
            $k::status,
            $k::response,
            $k::created_at,
            $k::expires_at,
            $k::caller_hash,
            $k::traceparent,
            $k::request_id,
        )
    };
}
pub(crate) use stored_columns;
