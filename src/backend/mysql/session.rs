//! How a MySQL call's statements are sent on either kind of connection
//! ([`Session`]), each statement written once for both ([`sends!`]), and
//! the guard that keeps a pool from lending a session that still holds
//! what a dropped call took from it ([`TakenSession`]).

use std::future::Future;
use std::ops::{Deref, DerefMut};

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::mysql::{Mysql, MysqlConnection};
use diesel::prelude::*;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::result::Error as DieselError;

use diesel::dsl::Eq;

use super::lock::{GetLock, IdleStatement, ReleaseLock};
use super::schema::idempotency_keys as k;
use crate::backend::keys::{KeyStore, Record, Stored};
use crate::backend::outbox::{BatchClaim, Claimed};
use crate::backend::transaction::end_level;
use crate::row_status::RecordStatus;

/// How MySQL's statements are sent on either kind of connection, so that
/// the rules that decide which to send (`mod.rs`: the key transaction,
/// the hold, the claim, the store, the read) are written once. The
/// statements themselves are written once as well, in [`sends!`].
pub(super) trait Session: KeyStore<Rules = Mysql> {
    /// The database's time and the record of `(scope, key)`, in one
    /// statement.
    fn now_and_record(
        &mut self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = QueryResult<(NaiveDateTime, Option<Stored>)>>;

    /// The row of [`GetLock`]: the lock's name and what `GET_LOCK` returned.
    fn get_lock(&mut self, lock: GetLock<'_>) -> impl Future<Output = QueryResult<(String, Option<i64>)>>;

    /// Runs an [`IdleStatement`].
    fn idle(&mut self, statement: IdleStatement<'_>) -> impl Future<Output = QueryResult<()>>;

    /// Runs a [`ReleaseLock`].
    fn release(&mut self, lock: ReleaseLock<'_>) -> impl Future<Output = QueryResult<()>>;

    /// A plain `INSERT` of `record`, which the primary key refuses for a
    /// key that has a record (once the transaction that wrote it, if still
    /// open, has ended).
    fn insert(&mut self, record: &Record<'_>) -> impl Future<Output = QueryResult<usize>>;

    /// Replaces the record of `record`'s key with `record` if its retention
    /// has ended: the rows replaced, 0 or 1.
    fn take_over(&mut self, record: &Record<'_>) -> impl Future<Output = QueryResult<usize>>;

    /// The record of `(scope, key)`, read with `FOR UPDATE`. (MariaDB does
    /// not take diesel's `FOR SHARE`.)
    fn find_for_update(&mut self, scope: &str, key: &str) -> impl Future<Output = QueryResult<Option<Stored>>>;

    /// Runs [`Complete`](crate::backend::keys::Complete) for `record`: the records
    /// completed, 0 or 1.
    fn complete(&mut self, record: &Record<'_>) -> impl Future<Output = QueryResult<usize>>;

    /// Sends a statement of SQL text with its parameters bound: the rows
    /// changed.
    fn execute_sql(&mut self, query: BoxedSqlQuery<'_, Mysql, SqlQuery>) -> impl Future<Output = QueryResult<usize>>;

    /// Sends a statement of SQL text that reads outbox messages a relay
    /// claims, with its parameters bound.
    fn load_claimed(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> impl Future<Output = QueryResult<Vec<Claimed>>>;

    /// Leases the messages `due` for `claim`: one more attempt each, due
    /// again when the lease ends, and the claim's token.
    fn lease(&mut self, due: &[Claimed], claim: &BatchClaim<'_>) -> impl Future<Output = QueryResult<usize>>;

    /// Runs `work` in a transaction, or a savepoint in a caller's, and
    /// commits it if `work` succeeded and rolls it back otherwise.
    fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> impl Future<Output = Result<T, E>>
    where
        E: From<DieselError>;

    /// Marks the connection's transactions broken: diesel opens no other on
    /// it, and a pool drops it instead of lending it again.
    fn mark_broken(&mut self);
}

/// The statements of [`Session`] whose DSL both kinds of connection share,
/// as the methods of its impl: `sends!([] [diesel::RunQueryDsl])` for
/// `MysqlConnection`, `sends!([.await] [diesel_async::RunQueryDsl])` for
/// diesel-async's, which awaits each. On the synchronous connection each
/// method's future is complete when first polled.
macro_rules! sends {
    ([$($await:tt)*] [$($run:tt)*]) => {
        async fn now_and_record(
            &mut self,
            scope: &str,
            key: &str,
        ) -> diesel::QueryResult<(chrono::NaiveDateTime, Option<$crate::backend::Stored>)> {
            use $($run)* as _;
            use $crate::backend::row_with::{KeyRecord, KeyRecordRow, RowWith, stored_of};
            let (now, row) = RowWith::<$crate::backend::mysql::clock::DatabaseNow, KeyRecord<diesel::sql_types::Datetime>>::new(scope, key)
                .get_result::<(chrono::NaiveDateTime, KeyRecordRow)>(self)
                $($await)*?;
            Ok((now, stored_of(row)))
        }

        async fn get_lock(&mut self, lock: $crate::backend::mysql::lock::GetLock<'_>) -> diesel::QueryResult<(String, Option<i64>)> {
            use $($run)* as _;
            lock.get_result(self)$($await)*
        }

        async fn idle(&mut self, statement: $crate::backend::mysql::lock::IdleStatement<'_>) -> diesel::QueryResult<()> {
            use $($run)* as _;
            statement.execute(self)$($await)*.map(drop)
        }

        async fn release(&mut self, lock: $crate::backend::mysql::lock::ReleaseLock<'_>) -> diesel::QueryResult<()> {
            use $($run)* as _;
            lock.execute(self)$($await)*.map(drop)
        }

        async fn insert(&mut self, record: &$crate::backend::Record<'_>) -> diesel::QueryResult<usize> {
            use $($run)* as _;
            use diesel::ExpressionMethods;
            use $crate::backend::mysql::schema::idempotency_keys as k;
            diesel::insert_into(k::table)
                .values((
                    k::scope.eq(record.scope),
                    k::idempotency_key.eq(record.idempotency_key),
                    $crate::backend::mysql::session::written(record),
                ))
                .execute(self)
                $($await)*
        }

        async fn take_over(&mut self, record: &$crate::backend::Record<'_>) -> diesel::QueryResult<usize> {
            use $($run)* as _;
            use diesel::{ExpressionMethods, QueryDsl};
            use $crate::backend::mysql::schema::idempotency_keys as k;
            diesel::update(k::table.find((record.scope, record.idempotency_key)))
                .filter(k::expires_at.le(record.reusable_by))
                .set($crate::backend::mysql::session::written(record))
                .execute(self)
                $($await)*
        }

        async fn find_for_update(
            &mut self,
            scope: &str,
            key: &str,
        ) -> diesel::QueryResult<Option<$crate::backend::Stored>> {
            use $($run)* as _;
            use diesel::{OptionalExtension, QueryDsl};
            $crate::backend::keys::find(scope, key)
                .for_update()
                .get_result(self)
                $($await)*
                .optional()
        }

        async fn complete(&mut self, record: &$crate::backend::Record<'_>) -> diesel::QueryResult<usize> {
            use $($run)* as _;
            $crate::backend::keys::Complete::<diesel::sql_types::Datetime>::new(record).execute(self)$($await)*
        }

        async fn execute_sql(
            &mut self,
            query: diesel::query_builder::BoxedSqlQuery<'_, diesel::mysql::Mysql, diesel::query_builder::SqlQuery>,
        ) -> diesel::QueryResult<usize> {
            use $($run)* as _;
            query.execute(self)$($await)*
        }

        async fn load_claimed(
            &mut self,
            query: diesel::query_builder::BoxedSqlQuery<'_, diesel::mysql::Mysql, diesel::query_builder::SqlQuery>,
        ) -> diesel::QueryResult<Vec<$crate::backend::outbox::Claimed>> {
            use $($run)* as _;
            query.load(self)$($await)*
        }

        async fn lease(
            &mut self,
            due: &[$crate::backend::outbox::Claimed],
            claim: &$crate::backend::outbox::BatchClaim<'_>,
        ) -> diesel::QueryResult<usize> {
            use $($run)* as _;
            use diesel::{ExpressionMethods, QueryDsl};
            use $crate::backend::mysql::schema::idempotency_outbox as o;
            diesel::update(o::table.filter(o::id.eq_any(due.iter().map(|message| &message.id))))
                .set((
                    o::attempts.eq(o::attempts + 1),
                    o::available_at.eq(claim.lease_until),
                    o::lease_token.eq(claim.lease_token),
                ))
                .execute(self)
                $($await)*
        }
    };
}
#[cfg(feature = "mysql-async")]
pub(super) use sends;

impl Session for MysqlConnection {
    sends!([][diesel::RunQueryDsl]);

    async fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        AnsiTransactionManager::begin_transaction(self)?;
        let result = work(self).await;
        end_level(self, result)
    }

    fn mark_broken(&mut self) {
        AnsiTransactionManager::transaction_manager_status_mut(self).set_in_error();
    }
}

/// The connection of a call whose session holds what the call took from
/// it (the key's named lock, the lowered `wait_timeout`), until the call
/// has given it back. Dropped before that (its call's future was dropped
/// at an `await`), it marks the connection broken: a pool drops it instead
/// of lending a session that may hold a key, and the server frees the key
/// when the session closes. A synchronous call always gets to the end.
pub(super) struct TakenSession<'c, C: Session> {
    conn: &'c mut C,
    taken: bool,
}

impl<'c, C: Session> TakenSession<'c, C> {
    /// `conn`, about to send the first statement that takes from its
    /// session.
    pub(super) fn taking(conn: &'c mut C) -> Self {
        TakenSession { conn, taken: true }
    }

    /// The call has given back what it took, or marked the connection
    /// broken where it could not.
    pub(super) fn given_back(mut self) {
        self.taken = false;
    }
}

impl<C: Session> Deref for TakenSession<'_, C> {
    type Target = C;
    fn deref(&self) -> &C {
        self.conn
    }
}

impl<C: Session> DerefMut for TakenSession<'_, C> {
    fn deref_mut(&mut self) -> &mut C {
        self.conn
    }
}

impl<C: Session> Drop for TakenSession<'_, C> {
    fn drop(&mut self) {
        if self.taken {
            self.conn.mark_broken();
        }
    }
}

/// The columns a claim writes besides the key: `Record`'s own `Insertable`
/// and `AsChangeset` are for the other backends' table.
pub(super) type Written<'a> = (
    Eq<k::request_hash, &'a str>,
    Eq<k::status, RecordStatus>,
    Eq<k::response, Option<&'a str>>,
    Eq<k::created_at, NaiveDateTime>,
    Eq<k::completed_at, Option<NaiveDateTime>>,
    Eq<k::expires_at, NaiveDateTime>,
    Eq<k::caller_hash, Option<&'a str>>,
    Eq<k::traceparent, Option<&'a str>>,
    Eq<k::request_id, Option<&'a str>>,
);

pub(super) fn written<'a>(record: &Record<'a>) -> Written<'a> {
    (
        k::request_hash.eq(record.request_hash),
        k::status.eq(record.status),
        k::response.eq(record.response),
        k::created_at.eq(record.created_at),
        k::completed_at.eq(record.completed_at),
        k::expires_at.eq(record.expires_at),
        k::caller_hash.eq(record.caller_hash),
        k::traceparent.eq(record.traceparent),
        k::request_id.eq(record.request_id),
    )
}
