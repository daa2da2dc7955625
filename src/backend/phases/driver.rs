//! How an attempt's statements are sent and awaited: the trait the steps of
//! a phased operation (`phased::attempt`) are written against, as the
//! single call's protocol is against [`Driver`], so that the rules of an
//! attempt exist once for both kinds of connection.
//!
//! Every synchronous connection of the crate is a [`PhaseDriver`] through
//! its [`PhaseStore`], its futures complete when made; the diesel-async
//! connections (feature `diesel-async`) implement it in their backend's
//! folder with `phase_statements!(async ...)`.

use std::future::{Future, ready};
use std::time::Duration;

use chrono::NaiveDateTime;
use diesel::QueryResult;

use super::{Lease, NewOperation, OperationRow, PhaseStore};
use crate::backend::{Driver, KeyStore, block_on};
use crate::in_flight::InFlight;

/// The statements of one attempt of a phased operation, sent and awaited as
/// the connection does. Each method is the [`PhaseStore`] method of the
/// same name, but `write` ([`KeyStore::write`]) and `pause`.
pub trait PhaseDriver: Driver {
    /// [`PhaseStore::read_operation`].
    fn read_operation(
        &mut self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = QueryResult<(Option<OperationRow>, NaiveDateTime)>>;

    /// [`KeyStore::write`], with `work` awaited inside it.
    fn write<T, E>(
        &mut self,
        in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> impl Future<Output = Result<T, E>>
    where
        E: From<diesel::result::Error>;

    /// Waits `duration` before another attempt's lease is looked at again:
    /// the thread sleeps on a synchronous connection, the task on an async
    /// one.
    fn pause(&mut self, duration: Duration) -> impl Future<Output = ()>;

    /// [`PhaseStore::insert_operation`].
    fn insert_operation(&mut self, operation: &NewOperation<'_>) -> impl Future<Output = QueryResult<bool>>;

    /// [`PhaseStore::delete_expired_operation`].
    fn delete_expired_operation(
        &mut self,
        scope: &str,
        key: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<usize>>;

    /// [`PhaseStore::take_over`].
    fn take_over(
        &mut self,
        lease: Lease<'_>,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// [`PhaseStore::save_points`].
    fn save_points(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// [`PhaseStore::complete_operation`].
    fn complete_operation(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        response: &str,
        expires_at: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// [`PhaseStore::release_operation`].
    fn release_operation(
        &mut self,
        lease: Lease<'_>,
        error: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;

    /// [`PhaseStore::park_operation`].
    fn park_operation(
        &mut self,
        lease: Lease<'_>,
        reason: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>>;
}

impl<C: PhaseStore> PhaseDriver for C {
    fn read_operation(
        &mut self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = QueryResult<(Option<OperationRow>, NaiveDateTime)>> {
        ready(PhaseStore::read_operation(self, scope, key))
    }

    fn write<T, E>(
        &mut self,
        in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> impl Future<Output = Result<T, E>>
    where
        E: From<diesel::result::Error>,
    {
        ready(KeyStore::write(self, in_flight, |tx| block_on(work(tx))))
    }

    fn pause(&mut self, duration: Duration) -> impl Future<Output = ()> {
        std::thread::sleep(duration);
        ready(())
    }

    fn insert_operation(&mut self, operation: &NewOperation<'_>) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::insert_operation(self, operation))
    }

    fn delete_expired_operation(
        &mut self,
        scope: &str,
        key: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<usize>> {
        ready(PhaseStore::delete_expired_operation(self, scope, key, now))
    }

    fn take_over(
        &mut self,
        lease: Lease<'_>,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::take_over(self, lease, until, now))
    }

    fn save_points(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        until: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::save_points(self, lease, points, until, now))
    }

    fn complete_operation(
        &mut self,
        lease: Lease<'_>,
        points: &str,
        response: &str,
        expires_at: NaiveDateTime,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::complete_operation(
            self, lease, points, response, expires_at, now,
        ))
    }

    fn release_operation(
        &mut self,
        lease: Lease<'_>,
        error: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::release_operation(self, lease, error, now))
    }

    fn park_operation(
        &mut self,
        lease: Lease<'_>,
        reason: &str,
        now: NaiveDateTime,
    ) -> impl Future<Output = QueryResult<bool>> {
        ready(PhaseStore::park_operation(self, lease, reason, now))
    }
}
