//! SQLite on diesel-async's `SyncConnectionWrapper<SqliteConnection>`:
//! every statement runs on tokio's blocking pool, as the wrapper runs
//! them. The write transaction is `SqliteConnection`'s own, opened and
//! ended in one hop each (the wait for the write lock included, which
//! sleeps on the blocking thread, never on a tokio worker); the operation
//! runs between them on the wrapper, in that transaction.
//!
//! A future dropped inside the transaction leaves it open on the wrapped
//! connection, and with it the database's write lock: the wrapper then
//! counts as broken, and a pool drops it, which closes the connection and
//! rolls the transaction back. A connection used without a pool must be
//! dropped too.

use chrono::{NaiveDateTime, Utc};
use diesel::QueryResult;
use diesel::result::Error as DieselError;
use diesel::sqlite::SqliteConnection;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_async::{AsyncConnection, TransactionManager};

use super::{close_write, hold, open_write, settle};
use crate::backend::outbox::{OutboxDriver, outbox_statements};
use crate::backend::phases::{OperationRow, PhaseDriver, PhaseStore, phase_statements};
use crate::backend::{AsyncStoreConnection, Driver, HeldKey, Hold, KeyStore, Read, Record, sealed, unwind_to_depth};
use crate::in_flight::InFlight;
use crate::schema;

/// The connection the wrapper runs its statements on.
type Wrapped = SyncConnectionWrapper<SqliteConnection>;

impl sealed::Sealed for Wrapped {}

impl AsyncStoreConnection for Wrapped {}

impl Driver for Wrapped {
    type Rules = SqliteConnection;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        let (scope, key) = (scope.to_owned(), key.to_owned());
        self.spawn_blocking(move |conn| KeyStore::read(conn, &scope, &key))
            .await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        Ok(Utc::now().naive_utc())
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        let status = <<Wrapped as AsyncConnection>::TransactionManager as TransactionManager<Wrapped>>::transaction_manager_status_mut(self);
        let depth = status.transaction_depth()?;
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
        PhaseDriver::write(self, held.in_flight, async |tx| work(tx, false).await).await
    }

    async fn hold(&mut self, record: &Record<'_>, _claims_first: bool) -> QueryResult<Hold> {
        hold(self, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        Ok(())
    }

    crate::backend::keys::key_statements!(async schema: find, claim, store);
}

impl PhaseDriver for Wrapped {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        let (scope, key) = (scope.to_owned(), key.to_owned());
        self.spawn_blocking(move |conn| PhaseStore::read_operation(conn, &scope, &key))
            .await
    }

    async fn write<T, E>(
        &mut self,
        in_flight: InFlight,
        work: impl AsyncFnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let previous = self.spawn_blocking(move |conn| open_write(conn, in_flight)).await?;
        let result = work(self).await;
        let succeeded = result.is_ok();
        let closed = self
            .spawn_blocking(move |conn| Ok(close_write(conn, previous, succeeded)))
            .await?;
        settle(result, closed)
    }

    async fn pause(&mut self, duration: std::time::Duration) {
        tokio::time::sleep(duration).await;
    }

    phase_statements!(async schema: insert_operation, delete_expired_operation, take_over, save_points, complete_operation, release_operation, park_operation);
}

impl OutboxDriver for Wrapped {
    outbox_statements!(async schema, created_at = Utc::now().naive_utc(); insert_message);
}
