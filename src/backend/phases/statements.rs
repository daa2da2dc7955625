//! The phase statements whose DSL is the same on every backend (see
//! `keys/statements.rs` for why a macro rather than generic functions).

/// The methods of [`PhaseStore`](super::PhaseStore) but `read_operation`,
/// `write` and `pause`, and of [`BlockingPhaseStore`](super::BlockingPhaseStore)
/// but `purge_operations_batch`, for the tables of a schema module:
/// `insert_operation` (on conflict, nothing) or `insert_operation_strictly`
/// (a duplicate key fails the insert, for MySQL), `delete_expired_operation`,
/// `take_over`, `save_points`, `complete_operation`, `release_operation` and
/// `park_operation` of the first; `pick_abandoned`, `park_unheld`,
/// `park_exhausted`, `parked_operations` and `requeue_operation` of the
/// second. Inside the impl, naming each method it takes:
///
/// - `phase_statements!(ready schema: take_over, ...)`: `async fn`s of a
///   synchronous connection, whose statements complete as they are sent;
/// - `phase_statements!(async schema: ...)`: the same, each statement
///   awaited, for a diesel-async connection;
/// - `phase_statements!(blocking schema: ...)`: plain `fn`s, for
///   [`BlockingPhaseStore`](super::BlockingPhaseStore).
macro_rules! phase_statements {
    (async $schema:ident: $($method:ident),+ $(,)?) => {
        $($crate::backend::phases::phase_statements!(@$method $schema [async] [.await] [diesel_async::RunQueryDsl]);)+
    };
    (ready $schema:ident: $($method:ident),+ $(,)?) => {
        $($crate::backend::phases::phase_statements!(@$method $schema [async] [] [diesel::RunQueryDsl]);)+
    };
    (blocking $schema:ident: $($method:ident),+ $(,)?) => {
        $($crate::backend::phases::phase_statements!(@$method $schema [] [] [diesel::RunQueryDsl]);)+
    };
    (@pick_abandoned $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn pick_abandoned(
            &mut self,
            operations: &[&str],
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
            until: chrono::NaiveDateTime,
            limit: usize,
        ) -> diesel::QueryResult<Vec<$crate::backend::phases::rows::PickedRow>> {
            use $crate::backend::phases::rows::PickedRow;
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{BoolExpressionMethods, ExpressionMethods, NullableExpressionMethods, QueryDsl};
            use $($run)* as _;
            let abandoned = || {
                p::table
                    .filter(p::status.eq(OperationStatus::Running))
                    .filter(p::operation.eq_any(operations))
                    // Without its request an operation waits for its client's retry.
                    .filter(p::request.is_not_null())
                    .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
                    .filter(p::updated_at.le(idle_since))
                    .filter(p::completer_until.is_null().or(p::completer_until.le(now)))
            };
            let candidates: Vec<PickedRow> = abandoned()
                .order(p::updated_at)
                .limit($crate::backend::sql_limit(limit))
                .select((p::scope, p::idempotency_key, p::operation, p::request.assume_not_null()))
                .load(self)$($await)*?;
            let mut picked = Vec::with_capacity(candidates.len());
            for row in candidates {
                // Still abandoned when the update runs: not picked meanwhile.
                let still = abandoned().filter(p::scope.eq(&row.scope)).filter(p::idempotency_key.eq(&row.idempotency_key));
                if diesel::update(still).set(p::completer_until.eq(until)).execute(self)$($await)*? == 1 {
                    picked.push(row);
                }
            }
            Ok(picked)
        }
    };
    (@delete_expired_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn delete_expired_operation(
            &mut self,
            scope: &str,
            key: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            diesel::delete(
                p::table
                    .find((scope, key))
                    .filter(p::status.eq(OperationStatus::Completed))
                    .filter(p::expires_at.le(now)),
            )
            .execute(self)$($await)*
        }
    };
    (@take_over $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn take_over(
            &mut self,
            lease: $crate::backend::phases::rows::Lease<'_>,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{BoolExpressionMethods, ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let free = p::table
                .find((lease.scope, lease.key))
                .filter(p::status.eq(OperationStatus::Running))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)));
            let updated = diesel::update(free)
                .set((
                    p::lease_token.eq(lease.token),
                    p::lease_until.eq(until),
                    p::attempts.eq(p::attempts + 1),
                    p::updated_at.eq(now),
                ))
                .execute(self)$($await)*?;
            Ok(updated == 1)
        }
    };
    (@save_points $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn save_points(
            &mut self,
            lease: $crate::backend::phases::rows::Lease<'_>,
            points: &str,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            $crate::backend::phases::update_held!(self [$($await)*], p, lease, (
                p::points.eq(points),
                p::lease_until.eq(until),
                p::updated_at.eq(now),
            ))
        }
    };
    (@complete_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn complete_operation(
            &mut self,
            lease: $crate::backend::phases::rows::Lease<'_>,
            points: &str,
            response: &str,
            expires_at: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            $crate::backend::phases::update_held!(self [$($await)*], p, lease, (
                p::status.eq(OperationStatus::Completed),
                p::points.eq(points),
                p::response.eq(response),
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(None::<chrono::NaiveDateTime>),
                p::updated_at.eq(now),
                p::expires_at.eq(expires_at),
            ))
        }
    };
    (@release_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn release_operation(
            &mut self,
            lease: $crate::backend::phases::rows::Lease<'_>,
            error: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            $crate::backend::phases::update_held!(self [$($await)*], p, lease, (
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(now),
                p::completer_until.eq(None::<chrono::NaiveDateTime>),
                p::last_error.eq(error),
                p::updated_at.eq(now),
            ))
        }
    };
    (@park_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn park_operation(
            &mut self,
            lease: $crate::backend::phases::rows::Lease<'_>,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            $crate::backend::phases::update_held!(self [$($await)*], p, lease, (
                p::status.eq(OperationStatus::Parked),
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(None::<chrono::NaiveDateTime>),
                p::last_error.eq(reason),
                p::updated_at.eq(now),
            ))
        }
    };
    (@park_unheld $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn park_unheld(
            &mut self,
            scope: &str,
            key: &str,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{BoolExpressionMethods, ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let unheld = p::table
                .find((scope, key))
                .filter(p::status.eq(OperationStatus::Running))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)));
            let updated = diesel::update(unheld)
                .set((
                    p::status.eq(OperationStatus::Parked),
                    p::lease_token.eq(None::<String>),
                    p::last_error.eq(reason),
                    p::updated_at.eq(now),
                ))
                .execute(self)$($await)*?;
            Ok(updated == 1)
        }
    };
    (@park_exhausted $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn park_exhausted(
            &mut self,
            operations: &[&str],
            max_attempts: i32,
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{BoolExpressionMethods, ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let exhausted = p::table
                .filter(p::status.eq(OperationStatus::Running))
                .filter(p::operation.eq_any(operations))
                .filter(p::attempts.ge(max_attempts))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
                .filter(p::updated_at.le(idle_since));
            diesel::update(exhausted)
                .set((
                    p::status.eq(OperationStatus::Parked),
                    p::lease_token.eq(None::<String>),
                    p::lease_until.eq(None::<chrono::NaiveDateTime>),
                    p::last_error.eq(format!("gave up after {max_attempts} attempts")),
                    p::updated_at.eq(now),
                ))
                .execute(self)$($await)*
        }
    };
    (@parked_operations $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn parked_operations(&mut self, limit: usize) -> diesel::QueryResult<Vec<$crate::backend::phases::rows::ParkedRow>> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            p::table
                .filter(p::status.eq(OperationStatus::Parked))
                .order(p::updated_at)
                .limit($crate::backend::sql_limit(limit))
                .select((
                    p::scope,
                    p::idempotency_key,
                    p::operation,
                    p::attempts,
                    p::last_error,
                    p::created_at,
                    p::updated_at,
                ))
                .load(self)$($await)*
        }
    };
    (@requeue_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn requeue_operation(
            &mut self,
            scope: &str,
            key: &str,
            points: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::OperationStatus;
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let updated = diesel::update(p::table.find((scope, key)).filter(p::status.eq(OperationStatus::Parked)))
                .set((
                    p::status.eq(OperationStatus::Running),
                    p::points.eq(points),
                    p::attempts.eq(0),
                    p::lease_token.eq(None::<String>),
                    p::lease_until.eq(None::<chrono::NaiveDateTime>),
                    p::completer_until.eq(None::<chrono::NaiveDateTime>),
                    p::updated_at.eq(now),
                ))
                .execute(self)$($await)*?;
            Ok(updated == 1)
        }
    };
    (@insert_operation $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::rows::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            use $schema::idempotency_phases as p;
            use diesel::{ExpressionMethods};
            use $($run)* as _;
            let inserted = diesel::insert_into(p::table)
                .values($crate::backend::phases::operation_values!(p, operation))
                .on_conflict_do_nothing()
                .execute(self)$($await)*?;
            Ok(inserted == 1)
        }
    };
    // A backend where diesel's `on_conflict_do_nothing` is MySQL's `INSERT
    // IGNORE`, which would also store a value that does not fit cut short,
    // with a warning: a plain `INSERT`, whose duplicate-key error means the
    // key is taken. (MySQL goes on with the transaction after it.)
    (@insert_operation_strictly $schema:ident [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::rows::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            use $schema::idempotency_phases as p;
            use diesel::ExpressionMethods;
            use $($run)* as _;
            use diesel::result::{DatabaseErrorKind, Error};
            let insert = diesel::insert_into(p::table).values($crate::backend::phases::operation_values!(p, operation));
            match insert.execute(self)$($await)* {
                Ok(_) => Ok(true),
                Err(Error::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Ok(false),
                Err(error) => Err(error),
            }
        }
    };
}
pub(crate) use phase_statements;

/// The columns of a new operation's row, in table `$p` (a backend's
/// `idempotency_phases` module), as the inserts of `phase_statements!` write
/// them.
macro_rules! operation_values {
    ($p:ident, $operation:expr) => {
        (
            $p::scope.eq($operation.scope),
            $p::idempotency_key.eq($operation.idempotency_key),
            $p::operation.eq($operation.operation),
            $p::request_hash.eq($operation.request_hash),
            $p::request.eq($operation.request),
            $p::op_id.eq($operation.op_id),
            $p::status.eq($operation.status),
            $p::points.eq($operation.points),
            $p::lease_token.eq($operation.lease_token),
            $p::lease_until.eq($operation.lease_until),
            $p::attempts.eq($operation.attempts),
            $p::created_at.eq($operation.created_at),
            $p::updated_at.eq($operation.updated_at),
            $p::caller_hash.eq($operation.caller_hash),
            $p::traceparent.eq($operation.traceparent),
            $p::request_id.eq($operation.request_id),
        )
    };
}
pub(crate) use operation_values;

/// Sets `$changes` on the running operation of `$lease` in table `$p`, as
/// long as the lease's token is still its own, and tells whether it did: the
/// guard of every write an attempt makes, so that an attempt whose lease was
/// taken over changes nothing.
macro_rules! update_held {
    ($conn:ident [$($await:tt)*], $p:ident, $lease:expr, $changes:expr $(,)?) => {
        diesel::update(
            $p::table
                .find(($lease.scope, $lease.key))
                .filter($p::status.eq($crate::row_status::OperationStatus::Running))
                .filter($p::lease_token.eq($lease.token)),
        )
        .set($changes)
        .execute($conn)$($await)*
        .map(|updated| updated == 1)
    };
}
pub(crate) use update_held;
