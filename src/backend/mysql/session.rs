//! How a MySQL call's statements are sent on either kind of connection
//! ([`Session`]), the statements of its keys and claims, each written
//! once for both, and the guard that keeps a pool from lending a session
//! that still holds what a dropped call took from it ([`TakenSession`]).

use std::future::Future;
use std::ops::{Deref, DerefMut};

use chrono::NaiveDateTime;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::mysql::{Mysql, MysqlConnection};
use diesel::prelude::*;
use diesel::query_builder::{QueryFragment, QueryId};
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::{LoadQuery, RunQueryDslSupport};
use diesel::result::Error as DieselError;

use super::clock::{DatabaseNow, UtcNow};
use super::lock::GetLock;
use crate::backend::keys::{self, Record, Stored};
use crate::backend::outbox::{BatchClaim, Claimed};
use crate::backend::row_with::{KeyRecord, KeyRecordRow, RowWith, stored_of};
use crate::backend::send::{Sent, first};
use crate::backend::transaction::{end_level, transaction_depth, unwind_to_depth};
use crate::schema::idempotency_outbox as o;

/// How MySQL's statements are sent on either kind of connection, so that
/// the rules that decide which to send (`mod.rs`: the key transaction,
/// the hold, the claim, the store, the read) and the statements themselves
/// (below) are written once. Any statement for MySQL goes: the bounds name
/// the backend, not the statement.
pub(super) trait Session: Sized {
    /// Sends `statement` and returns the number of rows it changed.
    fn execute<'c, Q>(&'c mut self, statement: Q) -> Sent<'c, usize>
    where
        Q: QueryFragment<Mysql> + QueryId + Send + 'c;

    /// Sends `query` and returns its rows.
    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static;

    /// How deep the connection's open transactions are nested; 0 outside
    /// one.
    fn depth(&mut self) -> QueryResult<u32>;

    /// Rolls back the levels above `depth`, which an operation that
    /// panicked left open.
    fn unwind(&mut self, depth: u32) -> Sent<'_, ()>;

    /// Runs `work` in a transaction, or a savepoint in a caller's, and
    /// commits it if `work` succeeded and rolls it back otherwise.
    fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> impl Future<Output = Result<T, E>>
    where
        E: From<DieselError>;

    /// Marks the connection's transactions broken: diesel opens no other on
    /// it, and a pool drops it instead of lending it again.
    fn mark_broken(&mut self);
}

impl Session for MysqlConnection {
    fn execute<'c, Q>(&'c mut self, statement: Q) -> Sent<'c, usize>
    where
        Q: QueryFragment<Mysql> + QueryId + Send + 'c,
    {
        Sent::Done(Some(ExecuteDsl::execute(statement, self)))
    }

    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static,
    {
        Sent::Done(Some(RunQueryDsl::load(query, self)))
    }

    fn depth(&mut self) -> QueryResult<u32> {
        transaction_depth(self)
    }

    fn unwind(&mut self, depth: u32) -> Sent<'_, ()> {
        Sent::Done(Some(unwind_to_depth(self, depth)))
    }

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

/// A query that both kinds of MySQL connection load as rows of `U`,
/// borrowing for `'q`: the bound of [`Session::load`], which names the
/// connections rather than the query.
#[cfg(feature = "mysql-async")]
pub(super) trait Loads<'q, U>:
    LoadQuery<'q, MysqlConnection, U>
    + diesel_async::methods::LoadQuery<'q, diesel_async::AsyncMysqlConnection, U>
    + RunQueryDslSupport
    + Send
    + 'q
{
}

#[cfg(feature = "mysql-async")]
impl<'q, U, Q> Loads<'q, U> for Q where
    Q: LoadQuery<'q, MysqlConnection, U>
        + diesel_async::methods::LoadQuery<'q, diesel_async::AsyncMysqlConnection, U>
        + RunQueryDslSupport
        + Send
        + 'q
{
}

/// A query that a MySQL connection loads as rows of `U`, borrowing for
/// `'q`: the bound of [`Session::load`].
#[cfg(not(feature = "mysql-async"))]
pub(super) trait Loads<'q, U>: LoadQuery<'q, MysqlConnection, U> + RunQueryDslSupport + Send + 'q {}

#[cfg(not(feature = "mysql-async"))]
impl<'q, U, Q> Loads<'q, U> for Q where Q: LoadQuery<'q, MysqlConnection, U> + RunQueryDslSupport + Send + 'q {}

/// The database's time and the record of `(scope, key)`, in one statement.
pub(super) async fn now_and_record<C: Session>(
    conn: &mut C,
    scope: &str,
    key: &str,
) -> QueryResult<(NaiveDateTime, Option<Stored>)> {
    let read = RowWith::<DatabaseNow, KeyRecord>::new(scope, key);
    let (now, row): (NaiveDateTime, KeyRecordRow) = first(conn.load(read).await?)?;
    Ok((now, stored_of(row)))
}

/// The database's time (UTC).
pub(super) async fn database_now<C: Session>(conn: &mut C) -> QueryResult<NaiveDateTime> {
    first(conn.load(diesel::select(UtcNow)).await?)
}

/// The record of `(scope, key)`.
pub(super) async fn find_record<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Option<Stored>> {
    first(conn.load(keys::find(scope, key)).await?).optional()
}

/// The row of [`GetLock`]: the lock's name and what `GET_LOCK` returned.
pub(super) async fn get_lock<C: Session>(conn: &mut C, lock: GetLock<'_>) -> QueryResult<(String, Option<i64>)> {
    first(conn.load(lock).await?)
}

/// A plain `INSERT` of `record`, which the primary key refuses for a key
/// that has a record (once the transaction that wrote it, if still open,
/// has ended).
pub(super) async fn insert<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<usize> {
    conn.execute(keys::insert(*record)).await
}

/// Replaces the record of `record`'s key with `record` if its retention
/// has ended: the rows replaced, 0 or 1.
pub(super) async fn take_over<C: Session>(conn: &mut C, record: &Record<'_>) -> QueryResult<usize> {
    conn.execute(keys::take_over(*record)).await
}

/// The record of `(scope, key)`, read with `FOR UPDATE`. (MariaDB does not
/// take diesel's `FOR SHARE`.)
pub(super) async fn find_for_update<C: Session>(conn: &mut C, scope: &str, key: &str) -> QueryResult<Option<Stored>> {
    first(conn.load(keys::find(scope, key).for_update()).await?).optional()
}

/// Leases the messages `due` for `claim`: one more attempt each, due again
/// when the lease ends, and the claim's token.
pub(super) async fn lease<C: Session>(conn: &mut C, due: &[Claimed], claim: &BatchClaim<'_>) -> QueryResult<usize> {
    conn.execute(
        diesel::update(o::table.filter(o::id.eq_any(due.iter().map(|message| &message.id)))).set((
            o::attempts.eq(o::attempts + 1),
            o::available_at.eq(Some(claim.lease_until)),
            o::lease_token.eq(claim.lease_token),
        )),
    )
    .await
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
