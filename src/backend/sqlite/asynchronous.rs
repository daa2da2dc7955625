//! SQLite on diesel-async's `SyncConnectionWrapper<SqliteConnection>`:
//! every statement runs on tokio's blocking pool, as the wrapper runs
//! them. The write transaction is `SqliteConnection`'s own, opened and
//! ended in one hop each (the wait for the write lock included, which
//! sleeps on the blocking thread, never on a tokio worker); the operation
//! runs between them on the wrapper, in that transaction.
//!
//! A future dropped while a statement runs makes the wrapper wait for the
//! statement with `block_in_place`, which panics on a current-thread
//! runtime: every call refuses such a runtime before its first statement
//! ([`UnsupportedRuntime`]).
//!
//! A future dropped inside the transaction leaves it open on the wrapped
//! connection, and with it the database's write lock. [`Writing`] then
//! marks the connection's transactions broken, as diesel-async's own
//! transaction manager is marked on the other backends: every later call on
//! it fails with `BrokenTransactionManager` instead of running in a
//! transaction that never commits, and a pool drops it, which closes the
//! connection and rolls the transaction back. A connection used without a
//! pool must be dropped too.

use chrono::{NaiveDateTime, Utc};
use diesel::QueryResult;
use diesel::result::Error as DieselError;
use diesel::sqlite::SqliteConnection;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_async::{AsyncConnection, TransactionManager};
use tokio::runtime::{Handle, RuntimeFlavor};

use super::write::{close_write, hold, open_write, settle};
use crate::backend::outbox::{Backlog, BatchClaim, Claimed, Due, MessageId, NewMessage, OutboxStore, Settlement};
use crate::backend::phases::{OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::send::{Awaited, Sends};
use crate::backend::{AsyncStoreConnection, HeldKey, Hold, KeyStore, Read, Record, block_on, sealed, unwind_to_depth};
use crate::error::UnsupportedRuntime;
use crate::in_flight::InFlight;

/// The connection the wrapper runs its statements on.
type Wrapped = SyncConnectionWrapper<SqliteConnection>;

impl sealed::Sealed for Wrapped {}

/// Refuses a runtime where a blocking section panics, before a call sends
/// its first statement: the wrapper would block in place there if the
/// call were dropped while a statement runs. Outside any runtime blocking
/// is allowed, and the wrapper runs its statements on a runtime of its own.
fn blocking_allowed() -> QueryResult<()> {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::CurrentThread => {
            Err(DieselError::QueryBuilderError(Box::new(UnsupportedRuntime)))
        }
        _ => Ok(()),
    }
}

/// The transaction status of the connection the wrapper holds.
fn status(conn: &mut Wrapped) -> &mut diesel::connection::TransactionManagerStatus {
    <<Wrapped as AsyncConnection>::TransactionManager as TransactionManager<Wrapped>>::transaction_manager_status_mut(
        conn,
    )
}

/// A connection on which a write transaction is being opened, used or
/// ended, `depth` levels deep before it. Dropped with more levels open
/// than that (its call's future was dropped at an `await`), it marks the
/// connection's transactions broken, so that nothing runs in the open
/// transaction any more. The future of a statement still running is
/// dropped first, and the wrapper waits for the statement then, so the
/// wrapped connection is free when this looks at it.
struct Writing<'c> {
    conn: &'c mut Wrapped,
    depth: u32,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        let status = status(self.conn);
        if matches!(status.transaction_depth(), Ok(Some(depth)) if depth.get() > self.depth) {
            status.set_in_error();
        }
    }
}

impl AsyncStoreConnection for Wrapped {}

impl Sends for Wrapped {
    type Way = Awaited;
}

crate::backend::keys::shared_key_statements!(Wrapped);

impl KeyStore for Wrapped {
    type Rules = diesel::sqlite::Sqlite;

    async fn write<T, E>(
        &mut self,
        in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        blocking_allowed()?;
        let depth = self.transaction_depth()?;
        // Armed before the transaction opens: a future dropped while the
        // `BEGIN` waits for the write lock may leave it open as well.
        let writing = Writing { conn: self, depth };
        let previous = writing
            .conn
            .spawn_blocking(move |conn| open_write(conn, in_flight))
            .await?;
        let result = work(writing.conn).await;
        let succeeded = result.is_ok();
        let closed = writing
            .conn
            .spawn_blocking(move |conn| Ok(close_write(conn, previous, succeeded)))
            .await?;
        settle(result, closed)
    }

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        blocking_allowed()?;
        // A connection whose transaction a dropped call left open answers
        // nothing, not even from what that transaction wrote.
        self.transaction_depth()?;
        let (scope, key) = (scope.to_owned(), key.to_owned());
        self.spawn_blocking(move |conn| block_on(KeyStore::read(conn, &scope, &key)))
            .await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        Ok(Utc::now().naive_utc())
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        let depth = status(self).transaction_depth()?;
        Ok(depth.map_or(0, |depth| depth.get()))
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        self.spawn_blocking(move |conn| unwind_to_depth(conn, depth)).await
    }

    async fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        self.write(held.in_flight, async |tx: &mut Self| work(tx, false).await)
            .await
    }

    async fn hold(&mut self, record: &Record<'_>, _claims_first: bool) -> QueryResult<Hold> {
        hold(self, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        Ok(())
    }
}

impl PhaseStore for Wrapped {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        blocking_allowed()?;
        self.transaction_depth()?;
        let (scope, key) = (scope.to_owned(), key.to_owned());
        self.spawn_blocking(move |conn| block_on(PhaseStore::read_operation(conn, &scope, &key)))
            .await
    }

    async fn pause(&mut self, duration: std::time::Duration) {
        tokio::time::sleep(duration).await;
    }

    shared_phase_statements!();
}

impl OutboxStore for Wrapped {
    async fn insert_message(&mut self, message: &NewMessage<'_>) -> QueryResult<()> {
        // Also outside a call, so the runtime is checked here as well.
        blocking_allowed()?;
        let (id, scope, topic, payload, not_before) = (
            message.id.to_owned(),
            message.scope.to_owned(),
            message.topic.to_owned(),
            message.payload.to_owned(),
            message.not_before,
        );
        let owned = |text: Option<&str>| text.map(str::to_owned);
        let (headers, ordering_key, traceparent, tracestate) = (
            owned(message.headers),
            owned(message.ordering_key),
            owned(message.traceparent),
            owned(message.tracestate),
        );
        self.spawn_blocking(move |conn| {
            block_on(OutboxStore::insert_message(
                conn,
                &NewMessage {
                    id: &id,
                    scope: &scope,
                    topic: &topic,
                    payload: &payload,
                    not_before,
                    headers: headers.as_deref(),
                    ordering_key: ordering_key.as_deref(),
                    traceparent: traceparent.as_deref(),
                    tracestate: tracestate.as_deref(),
                },
            ))
        })
        .await
    }

    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        blocking_allowed()?;
        let (now, lease_until, lease_token, limit) =
            (claim.now, claim.lease_until, claim.lease_token.to_owned(), claim.limit);
        self.spawn_blocking(move |conn| {
            block_on(OutboxStore::claim_batch(
                conn,
                &BatchClaim {
                    now,
                    lease_until,
                    lease_token: &lease_token,
                    limit,
                },
            ))
        })
        .await
    }

    async fn settle(
        &mut self,
        message: MessageId<'_>,
        lease_token: &str,
        settlement: &Settlement,
    ) -> QueryResult<bool> {
        blocking_allowed()?;
        let (scope, id, lease_token, settlement) = (
            message.scope.to_owned(),
            message.id.to_owned(),
            lease_token.to_owned(),
            settlement.clone(),
        );
        self.spawn_blocking(move |conn| {
            block_on(OutboxStore::settle(
                conn,
                MessageId { scope: &scope, id: &id },
                &lease_token,
                &settlement,
            ))
        })
        .await
    }

    async fn mark_delivered(&mut self, ids: &[String], lease_token: &str, at: NaiveDateTime) -> QueryResult<usize> {
        blocking_allowed()?;
        let (ids, lease_token) = (ids.to_vec(), lease_token.to_owned());
        self.spawn_blocking(move |conn| block_on(OutboxStore::mark_delivered(conn, &ids, &lease_token, at)))
            .await
    }

    async fn release(&mut self, message: MessageId<'_>, lease_token: &str) -> QueryResult<bool> {
        blocking_allowed()?;
        let (scope, id, lease_token) = (message.scope.to_owned(), message.id.to_owned(), lease_token.to_owned());
        self.spawn_blocking(move |conn| {
            block_on(OutboxStore::release(
                conn,
                MessageId { scope: &scope, id: &id },
                &lease_token,
            ))
        })
        .await
    }

    async fn backlog(&mut self, now: NaiveDateTime) -> QueryResult<Backlog> {
        blocking_allowed()?;
        self.spawn_blocking(move |conn| block_on(OutboxStore::backlog(conn, now)))
            .await
    }

    async fn next_due(&mut self) -> QueryResult<Option<Due>> {
        blocking_allowed()?;
        self.spawn_blocking(|conn| block_on(OutboxStore::next_due(conn))).await
    }
}
