//! The phase statements that are the same on every backend, each built by
//! a plain function, and sent by a connection's
//! [`PhaseStore`](super::PhaseStore) and
//! [`BlockingPhaseStore`](super::BlockingPhaseStore)
//! (`shared_phase_statements!`); what takes more than one statement or
//! reads what one returned is written once here, over the connection.

use chrono::NaiveDateTime;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_dsl::LoadQuery;
use diesel::query_dsl::methods::ExecuteDsl;
#[cfg(feature = "mysql")]
use diesel::result::{DatabaseErrorKind, Error as DieselError};

use super::rows::{Lease, NewOperation, PickedRow};
#[cfg(feature = "mysql")]
use crate::backend::send::{Execute, Sends};
use crate::backend::sql_limit;
use crate::row_status::OperationStatus;
use crate::schema::idempotency_phases as p;
use crate::sql_time::At;

/// `operation` inserted, which the primary key refuses for a key that has
/// an operation.
#[cfg(feature = "mysql")]
#[dsl::auto_type]
pub(crate) fn new_operation<'a>(operation: NewOperation<'a>) -> _ {
    dsl::insert_into(p::table).values(operation)
}

/// `operation` inserted unless its key has an operation.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[dsl::auto_type]
pub(crate) fn new_operation_if_free<'a>(operation: NewOperation<'a>) -> _ {
    dsl::insert_into(p::table).values(operation).on_conflict_do_nothing()
}

/// The completed operation of `(scope, key)` deleted if it expired by
/// `now`.
#[dsl::auto_type]
pub(crate) fn expired_operation<'a>(scope: &'a str, key: &'a str, now: At) -> _ {
    let completed: OperationStatus = OperationStatus::Completed;
    dsl::delete(
        p::table
            .find((scope, key))
            .filter(p::status.eq(completed))
            .filter(p::expires_at.le(now)),
    )
}

/// The operation of `(scope, key)` while it runs and no lease holds it at
/// `now`.
#[dsl::auto_type]
fn unheld<'a>(scope: &'a str, key: &'a str, now: At) -> _ {
    let running: OperationStatus = OperationStatus::Running;
    p::table
        .find((scope, key))
        .filter(p::status.eq(running))
        .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
}

/// The unheld operation of `lease`'s key leased to `lease` until `until`,
/// one attempt more.
#[dsl::auto_type]
pub(crate) fn taken_over<'a>(lease: Lease<'a>, until: At, now: At) -> _ {
    let scope: &'a str = lease.scope;
    let key: &'a str = lease.key;
    let token: &'a str = lease.token;
    let one: i32 = 1;
    let target: unheld<'a> = unheld(scope, key, now);
    dsl::update(target).set((
        p::lease_token.eq(token),
        p::lease_until.eq(until),
        p::attempts.eq(p::attempts + one),
        p::updated_at.eq(now),
    ))
}

/// The running operation of `lease`, as long as the lease's token is still
/// its own: the guard of every write an attempt makes, so that an attempt
/// whose lease was taken over changes nothing.
#[dsl::auto_type]
fn held<'a>(lease: Lease<'a>) -> _ {
    let scope: &'a str = lease.scope;
    let key: &'a str = lease.key;
    let token: &'a str = lease.token;
    let running: OperationStatus = OperationStatus::Running;
    dsl::update(
        p::table
            .find((scope, key))
            .filter(p::status.eq(running))
            .filter(p::lease_token.eq(token)),
    )
}

/// The held operation's recovery points `points` saved, its lease renewed
/// until `until`.
#[dsl::auto_type]
pub(crate) fn points_saved<'a>(lease: Lease<'a>, points: &'a str, until: At, now: At) -> _ {
    let target: held<'a> = held(lease);
    target.set((p::points.eq(points), p::lease_until.eq(until), p::updated_at.eq(now)))
}

/// The held operation completed with `response`, kept until `expires_at`.
#[dsl::auto_type]
pub(crate) fn completed<'a>(lease: Lease<'a>, points: &'a str, response: &'a str, expires_at: At, now: At) -> _ {
    let target: held<'a> = held(lease);
    let status: OperationStatus = OperationStatus::Completed;
    let no_token: Option<&'a str> = None;
    let no_lease: Option<NaiveDateTime> = None;
    target.set((
        p::status.eq(status),
        p::points.eq(points),
        p::response.eq(response),
        p::lease_token.eq(no_token),
        p::lease_until.eq(no_lease),
        p::updated_at.eq(now),
        p::expires_at.eq(expires_at),
    ))
}

/// The held operation given back after `error`, free for the next attempt
/// at once.
#[dsl::auto_type]
pub(crate) fn released<'a>(lease: Lease<'a>, error: &'a str, now: At) -> _ {
    let target: held<'a> = held(lease);
    let no_token: Option<&'a str> = None;
    let no_completer: Option<NaiveDateTime> = None;
    target.set((
        p::lease_token.eq(no_token),
        p::lease_until.eq(now),
        p::completer_until.eq(no_completer),
        p::last_error.eq(error),
        p::updated_at.eq(now),
    ))
}

/// The held operation parked for `reason`.
#[dsl::auto_type]
pub(crate) fn parked<'a>(lease: Lease<'a>, reason: &'a str, now: At) -> _ {
    let target: held<'a> = held(lease);
    let status: OperationStatus = OperationStatus::Parked;
    let no_token: Option<&'a str> = None;
    let no_lease: Option<NaiveDateTime> = None;
    target.set((
        p::status.eq(status),
        p::lease_token.eq(no_token),
        p::lease_until.eq(no_lease),
        p::last_error.eq(reason),
        p::updated_at.eq(now),
    ))
}

/// The running operations named `operations` that no attempt and no
/// completer holds at `now`, idle since `idle_since`, with their request.
#[dsl::auto_type]
fn abandoned<'a>(operations: &'a [&'a str], now: At, idle_since: At) -> _ {
    let running: OperationStatus = OperationStatus::Running;
    p::table
        .filter(p::status.eq(running))
        .filter(p::operation.eq_any(operations))
        // Without its request an operation waits for its client's retry.
        .filter(p::request.is_not_null())
        .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
        .filter(p::updated_at.le(idle_since))
        .filter(p::completer_until.is_null().or(p::completer_until.le(now)))
}

/// Up to `limit` abandoned operations, the longest idle first.
#[dsl::auto_type]
pub(crate) fn abandoned_list<'a>(operations: &'a [&'a str], now: At, idle_since: At, limit: i64) -> _ {
    let found: abandoned<'a> = abandoned(operations, now, idle_since);
    found.order(p::updated_at).limit(limit).select((
        p::scope,
        p::idempotency_key,
        p::operation,
        p::request.assume_not_null(),
    ))
}

/// The operation of `(scope, key)` held by a completer until `until`, if it
/// is still abandoned: not picked meanwhile.
#[dsl::auto_type]
pub(crate) fn picked<'a, 'k>(
    operations: &'a [&'a str],
    now: At,
    idle_since: At,
    scope: &'k str,
    key: &'k str,
    until: At,
) -> _ {
    let found: abandoned<'a> = abandoned(operations, now, idle_since);
    dsl::update(found.filter(p::scope.eq(scope)).filter(p::idempotency_key.eq(key))).set(p::completer_until.eq(until))
}

/// The operation of `(scope, key)` parked for `reason` if no lease holds
/// it.
#[dsl::auto_type]
pub(crate) fn unheld_parked<'a>(scope: &'a str, key: &'a str, reason: &'a str, now: At) -> _ {
    let target: unheld<'a> = unheld(scope, key, now);
    let status: OperationStatus = OperationStatus::Parked;
    let no_token: Option<&'a str> = None;
    dsl::update(target).set((
        p::status.eq(status),
        p::lease_token.eq(no_token),
        p::last_error.eq(reason),
        p::updated_at.eq(now),
    ))
}

/// The running operations named `operations` that spent `max_attempts`
/// attempts, unheld and idle since `idle_since`, parked with `reason`.
#[dsl::auto_type]
pub(crate) fn exhausted_parked<'a>(
    operations: &'a [&'a str],
    max_attempts: i32,
    reason: String,
    now: At,
    idle_since: At,
) -> _ {
    let running: OperationStatus = OperationStatus::Running;
    let status: OperationStatus = OperationStatus::Parked;
    let no_token: Option<&'a str> = None;
    let no_lease: Option<NaiveDateTime> = None;
    dsl::update(
        p::table
            .filter(p::status.eq(running))
            .filter(p::operation.eq_any(operations))
            .filter(p::attempts.ge(max_attempts))
            .filter(p::lease_until.is_null().or(p::lease_until.le(now)))
            .filter(p::updated_at.le(idle_since)),
    )
    .set((
        p::status.eq(status),
        p::lease_token.eq(no_token),
        p::lease_until.eq(no_lease),
        p::last_error.eq(reason),
        p::updated_at.eq(now),
    ))
}

/// Up to `limit` parked operations, the longest parked first.
#[dsl::auto_type]
pub(crate) fn parked_list(limit: i64) -> _ {
    let status: OperationStatus = OperationStatus::Parked;
    p::table
        .filter(p::status.eq(status))
        .order(p::updated_at)
        .limit(limit)
        .select((
            p::scope,
            p::idempotency_key,
            p::operation,
            p::attempts,
            p::last_error,
            p::created_at,
            p::updated_at,
        ))
}

/// The parked operation of `(scope, key)` running again from `points`,
/// with fresh attempts and free for the next one at once.
#[dsl::auto_type]
pub(crate) fn requeued<'a>(scope: &'a str, key: &'a str, points: &'a str, now: At) -> _ {
    let parked: OperationStatus = OperationStatus::Parked;
    let running: OperationStatus = OperationStatus::Running;
    let fresh: i32 = 0;
    let no_token: Option<&'a str> = None;
    let no_lease: Option<NaiveDateTime> = None;
    let no_completer: Option<NaiveDateTime> = None;
    dsl::update(p::table.find((scope, key)).filter(p::status.eq(parked))).set((
        p::status.eq(running),
        p::points.eq(points),
        p::attempts.eq(fresh),
        p::lease_token.eq(no_token),
        p::lease_until.eq(no_lease),
        p::completer_until.eq(no_completer),
        p::updated_at.eq(now),
    ))
}

/// [`PhaseStore::insert_operation`](super::PhaseStore::insert_operation)
/// by a plain `INSERT`, whose duplicate-key error means the key is taken:
/// for MySQL, where diesel's `on_conflict_do_nothing` is `INSERT IGNORE`,
/// which would also store a value that does not fit cut short, with a
/// warning. (MySQL goes on with the transaction after the error.)
#[cfg(feature = "mysql")]
pub(crate) async fn insert_operation_strictly<'a, C>(conn: &mut C, operation: &NewOperation<'a>) -> QueryResult<bool>
where
    C: Sends,
    new_operation<'a>: Execute<C>,
{
    match new_operation(*operation).send(conn).await {
        Ok(_) => Ok(true),
        Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Ok(false),
        Err(error) => Err(error),
    }
}

/// [`BlockingPhaseStore::pick_abandoned`](super::BlockingPhaseStore::pick_abandoned):
/// each candidate picked by a guarded update of its own, which another
/// completer's concurrent pick of it fails.
pub(crate) fn pick_abandoned<'a, C>(
    conn: &mut C,
    operations: &'a [&'a str],
    now: NaiveDateTime,
    idle_since: NaiveDateTime,
    until: NaiveDateTime,
    limit: usize,
) -> QueryResult<Vec<PickedRow>>
where
    C: Connection,
    abandoned_list<'a>: LoadQuery<'a, C, PickedRow>,
    for<'k> picked<'a, 'k>: ExecuteDsl<C>,
{
    let (now, idle_since, until) = (At(now), At(idle_since), At(until));
    let candidates = abandoned_list(operations, now, idle_since, sql_limit(limit)).load(conn)?;
    let mut picked_rows = Vec::with_capacity(candidates.len());
    for row in candidates {
        if picked(operations, now, idle_since, &row.scope, &row.idempotency_key, until).execute(conn)? == 1 {
            picked_rows.push(row);
        }
    }
    Ok(picked_rows)
}

/// [`PhaseStore`](super::PhaseStore)'s statements that every backend
/// shares, inserting a new operation as `insert_operation_strictly` does
/// or, by default, skipping a conflicting row (`ON CONFLICT DO NOTHING`),
/// and [`BlockingPhaseStore`](super::BlockingPhaseStore)'s (`blocking`),
/// for one connection: each statement built by its function above and sent
/// on the connection, which is one type here, so nothing needs bounds. Holds
/// no SQL.
macro_rules! shared_phase_statements {
    (insert strictly) => {
        async fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            $crate::backend::phases::statements::insert_operation_strictly(self, operation).await
        }

        $crate::backend::phases::shared_phase_statements!(@attempt);
    };
    () => {
        async fn insert_operation(
            &mut self,
            operation: &$crate::backend::phases::NewOperation<'_>,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            let statement = $crate::backend::phases::statements::new_operation_if_free(*operation);
            Ok(statement.send(self).await? == 1)
        }

        $crate::backend::phases::shared_phase_statements!(@attempt);
    };
    (@attempt) => {
        async fn delete_expired_operation(
            &mut self,
            scope: &str,
            key: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use $crate::backend::send::Execute as _;
            let statement = $crate::backend::phases::statements::expired_operation(scope, key, $crate::sql_time::At(now));
            statement.send(self).await
        }

        async fn take_over(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            use $crate::sql_time::At;
            let statement = $crate::backend::phases::statements::taken_over(lease, At(until), At(now));
            Ok(statement.send(self).await? == 1)
        }

        async fn save_points(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            points: &str,
            until: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            use $crate::sql_time::At;
            let statement = $crate::backend::phases::statements::points_saved(lease, points, At(until), At(now));
            Ok(statement.send(self).await? == 1)
        }

        async fn complete_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            points: &str,
            response: &str,
            expires_at: chrono::NaiveDateTime,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            use $crate::sql_time::At;
            let statement =
                $crate::backend::phases::statements::completed(lease, points, response, At(expires_at), At(now));
            Ok(statement.send(self).await? == 1)
        }

        async fn release_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            error: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            let statement = $crate::backend::phases::statements::released(lease, error, $crate::sql_time::At(now));
            Ok(statement.send(self).await? == 1)
        }

        async fn park_operation(
            &mut self,
            lease: $crate::backend::phases::Lease<'_>,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            let statement = $crate::backend::phases::statements::parked(lease, reason, $crate::sql_time::At(now));
            Ok(statement.send(self).await? == 1)
        }
    };
    (blocking) => {
        fn pick_abandoned(
            &mut self,
            operations: &[&str],
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
            until: chrono::NaiveDateTime,
            limit: usize,
        ) -> diesel::QueryResult<Vec<$crate::backend::phases::PickedRow>> {
            $crate::backend::phases::statements::pick_abandoned(self, operations, now, idle_since, until, limit)
        }

        fn park_unheld(
            &mut self,
            scope: &str,
            key: &str,
            reason: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            let statement = $crate::backend::phases::statements::unheld_parked(scope, key, reason, $crate::sql_time::At(now));
            Ok(statement.execute(self)? == 1)
        }

        fn park_exhausted(
            &mut self,
            operations: &[&str],
            max_attempts: i32,
            now: chrono::NaiveDateTime,
            idle_since: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use diesel::RunQueryDsl as _;
            use $crate::sql_time::At;
            let reason = format!("gave up after {max_attempts} attempts");
            let statement =
                $crate::backend::phases::statements::exhausted_parked(operations, max_attempts, reason, At(now), At(idle_since));
            statement.execute(self)
        }

        fn parked_operations(&mut self, limit: usize) -> diesel::QueryResult<Vec<$crate::backend::phases::ParkedRow>> {
            use diesel::RunQueryDsl as _;
            $crate::backend::phases::statements::parked_list($crate::backend::sql_limit(limit)).load(self)
        }

        fn requeue_operation(
            &mut self,
            scope: &str,
            key: &str,
            points: &str,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            let statement = $crate::backend::phases::statements::requeued(scope, key, points, $crate::sql_time::At(now));
            Ok(statement.execute(self)? == 1)
        }
    };
}
pub(crate) use shared_phase_statements;
