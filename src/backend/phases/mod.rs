//! Where operations in phases live: the statements every backend
//! implements, an attempt's ([`PhaseStore`], on both kinds of connection)
//! and the services' ([`BlockingPhaseStore`], on synchronous ones).
//!
//! Every write of an attempt is guarded by its lease token, so an attempt
//! whose lease was taken over changes nothing. The statements are the same
//! DSL on every backend (`statements.rs`), except the read that brings the
//! database's time along and the purge.
//!
//! A completer picks abandoned operations without locking what it reads:
//! each pick is a guarded update of one operation, which another
//! completer's concurrent pick of it fails. A locking read (`FOR UPDATE SKIP
//! LOCKED`) would do the same in fewer statements, but a distributed
//! database refuses it on a table spread over several nodes, and the guarded
//! update runs on the node of the operation alone.

use std::future::Future;
use std::time::Duration;

use chrono::NaiveDateTime;
use diesel::QueryResult;

use crate::backend::{BlockingStore, KeyStore};

pub(crate) mod rows;
pub(crate) mod statements;

pub use rows::{Lease, NewOperation, OperationRow, ParkedRow, PickedRow};
pub(crate) use statements::shared_phase_statements;

/// The statements of one attempt of a phased operation, one implementation
/// per kind of connection, async-shaped as [`KeyStore`] is: the trait the
/// steps of a phased operation (`phased::attempt`) are written against, so
/// that the rules of an attempt exist once for both kinds. Every write of
/// an attempt is guarded by its lease token. A supertrait of the crate's
/// public connection traits, in a private module.
pub trait PhaseStore: KeyStore {
    /// The operation for `(scope, key)` and the database's time, in one
    /// statement.
    fn read_operation(
        &mut self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = QueryResult<(Option<OperationRow>, NaiveDateTime)>>;

    /// Waits `duration` before another attempt's lease is looked at again:
    /// the thread sleeps on a synchronous connection, the task on an async
    /// one.
    fn pause(&mut self, duration: Duration) -> impl Future<Output = ()>;

    /// Writes a new operation; `false` when one with its key exists.
    fn insert_operation(&mut self, operation: &NewOperation<'_>) -> impl Future<Output = QueryResult<bool>>;

    /// Deletes the completed operation of `(scope, key)` if its retention
    /// ended at or before `now` (which a policy that keeps tombstones sets
    /// a grace period back), so that the key can start anew.
    fn delete_expired_operation(
        &mut self,
        scope: &str,
        key: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<usize>>;

    /// Gives the lease of a running operation whose lease is free at `now`
    /// to `lease`, counting an attempt; `false` when another attempt holds
    /// it or it is no longer running.
    fn take_over(
        &mut self,
        lease: Lease<'_>,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// Stores the recovery points and renews the lease.
    fn save_points(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// Completes the operation with its response.
    fn complete_operation(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        response: &str,
        expires_at: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// Frees the lease at once after a failed attempt, noting why, and the
    /// completer's pick if a completer made it: the attempt is over, and the
    /// next waits only for the grace period.
    fn release_operation(
        &mut self,
        lease: Lease<'_>,
        error: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// Parks a running operation for a person, noting why.
    fn park_operation(
        &mut self,
        lease: Lease<'_>,
        reason: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;
}

/// What only a synchronous connection runs on operations in phases: the
/// completer's picks, the lists and requeues of parked operations, and
/// the purge. Each backend writes `purge_operations_batch`; the rest is
/// `shared_phase_statements!(blocking)`.
pub trait BlockingPhaseStore: PhaseStore + BlockingStore {
    /// Picks up to `limit` running operations of `operations` whose lease
    /// is free at `now`, idle since `idle_since` and not taken by another
    /// completer, oldest first, and marks them this completer's until
    /// `until`; an operation another completer picks at the same moment is
    /// picked by one of them.
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
    fn park_unheld(&mut self, scope: &str, key: &str, reason: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Parks the running operations of `operations` that had `max_attempts`
    /// attempts and are idle with a free lease.
    fn park_exhausted(
        &mut self,
        operations: &[&str],
        max_attempts: i32,
        now: NaiveDateTime,
        idle_since: NaiveDateTime,
    ) -> QueryResult<usize>;

    /// Up to `limit` parked operations, oldest first.
    fn parked_operations(&mut self, limit: usize) -> QueryResult<Vec<ParkedRow>>;

    /// Makes a parked operation running again with fresh attempts, a free
    /// lease and the recovery points `points`.
    fn requeue_operation(&mut self, scope: &str, key: &str, points: &str, now: NaiveDateTime) -> QueryResult<bool>;

    /// Deletes at most `limit` completed operations expired at `cutoff`.
    fn purge_operations_batch(&mut self, cutoff: NaiveDateTime, limit: usize) -> QueryResult<usize>;

    /// Turns at most `limit` completed operations that expired after
    /// `after` and at or before `cutoff` into tombstones: their response,
    /// stored request and recovery points cleared. Operations already
    /// cleared are not counted.
    fn tombstone_operations_batch(
        &mut self,
        after: NaiveDateTime,
        cutoff: NaiveDateTime,
        limit: usize,
    ) -> QueryResult<usize>;
}
