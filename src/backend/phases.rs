//! Where operations in phases live: the statements every backend
//! implements.
//!
//! Every write of an attempt is guarded by its lease token, so an attempt
//! whose lease was taken over changes nothing. The statements are the same
//! DSL on every backend (`shared_queries!`), except the read that brings
//! the database's time along and the purge.
//!
//! A completer picks abandoned operations without locking what it reads:
//! each pick is a guarded update of one operation, which another
//! completer's concurrent pick of it fails. A locking read (`FOR UPDATE SKIP
//! LOCKED`) would do the same in fewer statements, but a distributed
//! database refuses it on a table spread over several nodes, and the guarded
//! update runs on the node of the operation alone.

use chrono::NaiveDateTime;
use diesel::QueryResult;
use diesel::prelude::*;

use crate::backend::KeyStore;
use crate::schema::idempotency_phases;

pub(crate) const RUNNING: &str = "running";
pub(crate) const COMPLETED: &str = "completed";
pub(crate) const PARKED: &str = "parked";

/// An operation as its first commit writes it.
pub struct NewOperation<'a> {
    pub(crate) scope: &'a str,
    pub(crate) idempotency_key: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) request_hash: &'a str,
    pub(crate) request: Option<&'a str>,
    pub(crate) op_id: &'a str,
    pub(crate) status: &'a str,
    pub(crate) points: &'a str,
    pub(crate) lease_token: &'a str,
    pub(crate) lease_until: NaiveDateTime,
    pub(crate) attempts: i32,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) updated_at: NaiveDateTime,
}

/// An operation as an attempt reads it.
#[derive(Queryable, Selectable, Debug)]
#[diesel(table_name = idempotency_phases)]
pub struct OperationRow {
    pub(crate) operation: String,
    pub(crate) request_hash: String,
    pub(crate) op_id: String,
    pub(crate) status: String,
    pub(crate) points: String,
    pub(crate) response: Option<String>,
    pub(crate) lease_until: Option<NaiveDateTime>,
    pub(crate) expires_at: Option<NaiveDateTime>,
}

/// An attempt's hold on an operation: its key and lease token.
#[derive(Clone, Copy)]
pub struct Lease<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) token: &'a str,
}

/// An operation a completer picked.
#[derive(Queryable, Debug)]
pub struct PickedRow {
    pub(crate) scope: String,
    pub(crate) idempotency_key: String,
    pub(crate) operation: String,
    pub(crate) request: String,
}

/// A parked operation, as listed.
#[derive(Queryable, Debug)]
pub struct ParkedRow {
    pub(crate) scope: String,
    pub(crate) idempotency_key: String,
    pub(crate) operation: String,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
    pub(crate) created_at: NaiveDateTime,
    pub(crate) updated_at: NaiveDateTime,
}

/// The statements of phased operations, one implementation per backend: a
/// supertrait of [`RawConnection`](crate::RawConnection), nameable in
/// bounds. Its methods are the crate's internals: only the crate implements
/// and calls them.
pub trait PhaseStore: KeyStore {
    /// The operation for `(scope, key)` and the database's time, in one
    /// statement.
    #[doc(hidden)]
    fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)>;

    /// Writes a new operation; `false` when one with its key exists.
    #[doc(hidden)]
    fn insert_operation(&mut self, operation: &NewOperation<'_>) -> QueryResult<bool>;

    /// Deletes the completed operation of `(scope, key)` if its retention
    /// ended at `now`, so that the key can start anew.
    #[doc(hidden)]
    fn delete_expired_operation(&mut self, scope: &str, key: &str, now: NaiveDateTime) -> QueryResult<usize>;

    /// Gives the lease of a running operation whose lease is free at `now`
    /// to `lease`, counting an attempt; `false` when another attempt holds
    /// it or it is no longer running.
    #[doc(hidden)]
    fn take_over(&mut self, lease: Lease<'_>, until: NaiveDateTime, now: NaiveDateTime) -> QueryResult<bool>;

    /// Stores the recovery points and renews the lease.
    #[doc(hidden)]
    fn save_points(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> QueryResult<bool>;

    /// Completes the operation with its response.
    #[doc(hidden)]
    fn complete_operation(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        response: &str,
        expires_at: NaiveDateTime,
        now: NaiveDateTime,
    ) -> QueryResult<bool>;

    /// Frees the lease at once after a failed attempt, noting why, and the
    /// completer's pick if a completer made it: the attempt is over, and the
    /// next waits only for the grace period.
    #[doc(hidden)]
    fn release_operation(&mut self, lease: Lease<'_>, error: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Parks a running operation for a person, noting why.
    #[doc(hidden)]
    fn park_operation(&mut self, lease: Lease<'_>, reason: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Picks up to `limit` running operations of `operations` whose lease
    /// is free at `now`, idle since `idle_since` and not taken by another
    /// completer, oldest first, and marks them this completer's until
    /// `until`; an operation another completer picks at the same moment is
    /// picked by one of them.
    #[doc(hidden)]
    fn pick_abandoned(
        &mut self,
        operations: &[&str],
        now: NaiveDateTime,
        idle_since: NaiveDateTime,
        until: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<Vec<PickedRow>>;

    /// Parks a running operation that no attempt holds, noting why: one the
    /// completer cannot resume.
    #[doc(hidden)]
    fn park_unheld(&mut self, scope: &str, key: &str, reason: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Parks the running operations of `operations` that had `max_attempts`
    /// attempts and are idle with a free lease.
    #[doc(hidden)]
    fn park_exhausted(
        &mut self,
        operations: &[&str],
        max_attempts: i32,
        now: NaiveDateTime,
        idle_since: NaiveDateTime,
    ) -> QueryResult<usize>;

    /// Up to `limit` parked operations, oldest first.
    #[doc(hidden)]
    fn parked_operations(&mut self, limit: usize) -> QueryResult<Vec<ParkedRow>>;

    /// Makes a parked operation running again with fresh attempts, a free
    /// lease and the recovery points `points`.
    #[doc(hidden)]
    fn requeue_operation(&mut self, scope: &str, key: &str, points: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Deletes at most `limit` completed operations expired at `cutoff`.
    #[doc(hidden)]
    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;
}

/// The methods of [`PhaseStore`] whose DSL is the same on every backend,
/// expanded into each backend's impl against its schema module (see
/// `crate::backend::shared_queries` for why a macro rather than generic
/// functions): `shared_queries!(crate::schema)`; `strict` before the
/// schema where a duplicate key must fail the insert rather than be
/// ignored.
macro_rules! shared_queries {
    // A backend where diesel's `on_conflict_do_nothing` is MySQL's `INSERT
    // IGNORE`, which would also store a value that does not fit cut short,
    // with a warning: a plain `INSERT`, whose duplicate-key error means the
    // key is taken. (MySQL goes on with the transaction after it.)
    (strict $($schema:tt)+) => {
        $crate::backend::phases::shared_queries!(@statements $($schema)+);

        fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            use diesel::result::{DatabaseErrorKind, Error};
            let insert = diesel::insert_into(p::table).values($crate::backend::phases::operation_values!(p, operation));
            match insert.execute(self) {
                Ok(_) => Ok(true),
                Err(Error::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Ok(false),
                Err(error) => Err(error),
            }
        }
    };
    (@statements $($schema:tt)+) => {
        fn pick_abandoned(
            &mut self,
            operations: &[&str],
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
            until: chrono::NaiveDateTime,
            limit: usize,
        ) -> diesel::QueryResult<Vec<$crate::backend::phases::PickedRow>> {
            use crate::backend::phases::{PickedRow, RUNNING};
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let abandoned = || {
                p::table
                    .filter(p::status.eq(RUNNING))
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
                .load(self)?;
            let mut picked = Vec::with_capacity(candidates.len());
            for row in candidates {
                // Still abandoned when the update runs: not picked meanwhile.
                let still = abandoned().filter(p::scope.eq(&row.scope)).filter(p::idempotency_key.eq(&row.idempotency_key));
                if diesel::update(still).set(p::completer_until.eq(until)).execute(self)? == 1 {
                    picked.push(row);
                }
            }
            Ok(picked)
        }

        fn delete_expired_operation(
            &mut self,
            scope: &str,
            key: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use crate::backend::phases::COMPLETED;
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            diesel::delete(
                p::table
                    .find((scope, key))
                    .filter(p::status.eq(COMPLETED))
                    .filter(p::expires_at.le(now)),
            )
            .execute(self)
        }

        fn take_over(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use crate::backend::phases::RUNNING;
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let free = p::table
                .find((lease.scope, lease.key))
                .filter(p::status.eq(RUNNING))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)));
            let updated = diesel::update(free)
                .set((
                    p::lease_token.eq(lease.token),
                    p::lease_until.eq(until),
                    p::attempts.eq(p::attempts + 1),
                    p::updated_at.eq(now),
                ))
                .execute(self)?;
            Ok(updated == 1)
        }

        fn save_points(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            points: &str,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            $crate::backend::phases::update_held!(self, p, lease, (
                p::points.eq(points),
                p::lease_until.eq(until),
                p::updated_at.eq(now),
            ))
        }

        fn complete_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            points: &str,
            response: &str,
            expires_at: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use crate::backend::phases::COMPLETED;
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            $crate::backend::phases::update_held!(self, p, lease, (
                p::status.eq(COMPLETED),
                p::points.eq(points),
                p::response.eq(response),
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(None::<chrono::NaiveDateTime>),
                p::updated_at.eq(now),
                p::expires_at.eq(expires_at),
            ))
        }

        fn release_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            error: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            $crate::backend::phases::update_held!(self, p, lease, (
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(now),
                p::completer_until.eq(None::<chrono::NaiveDateTime>),
                p::last_error.eq(error),
                p::updated_at.eq(now),
            ))
        }

        fn park_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use crate::backend::phases::PARKED;
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            $crate::backend::phases::update_held!(self, p, lease, (
                p::status.eq(PARKED),
                p::lease_token.eq(None::<String>),
                p::lease_until.eq(None::<chrono::NaiveDateTime>),
                p::last_error.eq(reason),
                p::updated_at.eq(now),
            ))
        }

        fn park_unheld(
            &mut self,
            scope: &str,
            key: &str,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use crate::backend::phases::{PARKED, RUNNING};
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let unheld = p::table
                .find((scope, key))
                .filter(p::status.eq(RUNNING))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)));
            let updated = diesel::update(unheld)
                .set((
                    p::status.eq(PARKED),
                    p::lease_token.eq(None::<String>),
                    p::last_error.eq(reason),
                    p::updated_at.eq(now),
                ))
                .execute(self)?;
            Ok(updated == 1)
        }

        fn park_exhausted(
            &mut self,
            operations: &[&str],
            max_attempts: i32,
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use crate::backend::phases::{PARKED, RUNNING};
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let exhausted = p::table
                .filter(p::status.eq(RUNNING))
                .filter(p::operation.eq_any(operations))
                .filter(p::attempts.ge(max_attempts))
                .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
                .filter(p::updated_at.le(idle_since));
            diesel::update(exhausted)
                .set((
                    p::status.eq(PARKED),
                    p::lease_token.eq(None::<String>),
                    p::lease_until.eq(None::<chrono::NaiveDateTime>),
                    p::last_error.eq(format!("gave up after {max_attempts} attempts")),
                    p::updated_at.eq(now),
                ))
                .execute(self)
        }

        fn parked_operations(&mut self, limit: usize) -> diesel::QueryResult<Vec<$crate::backend::phases::ParkedRow>> {
            use crate::backend::phases::PARKED;
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            p::table
                .filter(p::status.eq(PARKED))
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
                .load(self)
        }

        fn requeue_operation(
            &mut self,
            scope: &str,
            key: &str,
            points: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use crate::backend::phases::{PARKED, RUNNING};
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let updated = diesel::update(p::table.find((scope, key)).filter(p::status.eq(PARKED)))
                .set((
                    p::status.eq(RUNNING),
                    p::points.eq(points),
                    p::attempts.eq(0),
                    p::lease_token.eq(None::<String>),
                    p::lease_until.eq(None::<chrono::NaiveDateTime>),
                    p::completer_until.eq(None::<chrono::NaiveDateTime>),
                    p::updated_at.eq(now),
                ))
                .execute(self)?;
            Ok(updated == 1)
        }
    };
    (@insert $($schema:tt)+) => {
        fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            use $($schema)+::idempotency_phases as p;
            use diesel::prelude::*;
            let inserted = diesel::insert_into(p::table)
                .values($crate::backend::phases::operation_values!(p, operation))
                .on_conflict_do_nothing()
                .execute(self)?;
            Ok(inserted == 1)
        }
    };
    ($($schema:tt)+) => {
        $crate::backend::phases::shared_queries!(@statements $($schema)+);
        $crate::backend::phases::shared_queries!(@insert $($schema)+);
    };
}
pub(crate) use shared_queries;

/// The columns of a new operation's row, in table `$p` (a backend's
/// `idempotency_phases` module), as the inserts of `shared_queries!` write
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
        )
    };
}
pub(crate) use operation_values;

/// Sets `$changes` on the running operation of `$lease` in table `$p`, as
/// long as the lease's token is still its own, and tells whether it did: the
/// guard of every write an attempt makes, so that an attempt whose lease was
/// taken over changes nothing.
macro_rules! update_held {
    ($conn:expr, $p:ident, $lease:expr, $changes:expr $(,)?) => {
        diesel::update(
            $p::table
                .find(($lease.scope, $lease.key))
                .filter($p::status.eq($crate::backend::phases::RUNNING))
                .filter($p::lease_token.eq($lease.token)),
        )
        .set($changes)
        .execute($conn)
        .map(|updated| updated == 1)
    };
}
pub(crate) use update_held;
