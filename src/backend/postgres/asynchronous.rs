//! PostgreSQL on diesel-async's `AsyncPgConnection`: the statements of
//! `PgConnection`'s [`BlockingStore`], the same SQL and the same key lock, sent
//! and awaited. What a statement means and how a failure is read is
//! `PgConnection`'s, in `mod.rs`; only the sending is here.
//!
//! Each statement is awaited before the next is sent, though the
//! connection could pipeline them: `BEGIN` and `COMMIT` go through
//! diesel-async's transaction manager, which holds the connection by
//! `&mut`, and a statement diesel does not cache (the takeover of an
//! expired record) is sent only after its prepare's answer, so a statement
//! polled beside it could overtake it. The measurements are in the async
//! guide ("What it costs").

use chrono::NaiveDateTime;
use diesel::QueryResult;
use diesel::result::Error as DieselError;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager};
use futures_util::StreamExt;

use super::clock::{DatabaseNow, database_time};
use super::key::{await_replication, complete_at_database_time, database_now, hold, key_transaction, read};
use super::outbox::{CHANNEL, claim_batch};
use super::session::{Loads, Session};
use crate::backend::outbox::{BatchClaim, Claimed, OutboxStore, shared_outbox_statements};
use crate::backend::phases::{OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::row_with::{OperationColumns, OperationColumnsRow, RowWith, operation_of};
use crate::backend::send::{Awaited, Sends, Sent};
use crate::backend::{
    AsyncStoreConnection, AsyncTransaction, HeldKey, Hold, KeyStore, Read, Record, async_transaction_depth,
    async_unwind_to_depth, end_transaction, sealed,
};

impl sealed::Sealed for AsyncPgConnection {}

impl AsyncStoreConnection for AsyncPgConnection {}

impl Sends for AsyncPgConnection {
    type Way = Awaited;
}

crate::backend::keys::shared_key_statements!(AsyncPgConnection);

impl KeyStore for AsyncPgConnection {
    type Rules = diesel::pg::Pg;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        read(self, scope, key).await
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        database_now(self).await
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        async_transaction_depth(self)
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        async_unwind_to_depth(self, depth).await
    }

    async fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        key_transaction(self, held, work).await
    }

    async fn hold(&mut self, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold> {
        hold(self, record, claims_first).await
    }

    const CLAIMS_AT_DATABASE_TIME: bool = true;

    async fn complete_at_database_time(&mut self, record: &Record<'_>) -> QueryResult<(NaiveDateTime, NaiveDateTime)> {
        complete_at_database_time(self, record).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        await_replication(self).await
    }
}

impl Session for AsyncPgConnection {
    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static,
    {
        Sent::Awaited(Box::pin(RunQueryDsl::load(query, self)))
    }

    async fn begin_with(&mut self, sql: &str) -> QueryResult<()> {
        AnsiTransactionManager::begin_transaction_sql(self, sql).await
    }

    async fn savepoint(&mut self) -> QueryResult<()> {
        <AnsiTransactionManager as TransactionManager<Self>>::begin_transaction(self).await
    }

    async fn batch(&mut self, sql: &str) -> QueryResult<()> {
        self.batch_execute(sql).await
    }

    async fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let mut tx = AsyncTransaction::opened(self);
        let result = work(&mut tx).await;
        end_transaction(tx, result).await
    }
}

impl PhaseStore for AsyncPgConnection {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        let (now, columns) = RowWith::<DatabaseNow, OperationColumns>::new(scope, key)
            .get_result::<(NaiveDateTime, OperationColumnsRow)>(self)
            .await?;
        Ok((operation_of(columns), now))
    }

    async fn pause(&mut self, duration: std::time::Duration) {
        tokio::time::sleep(duration).await;
    }

    shared_phase_statements!();
}

impl OutboxStore for AsyncPgConnection {
    const ANNOUNCES: bool = true;

    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        claim_batch(self, claim).await
    }

    async fn listen(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!("LISTEN {CHANNEL}")).await
    }

    async fn announcement(&mut self) -> QueryResult<()> {
        // The stream never ends: without a notification it stays pending.
        match std::pin::pin!(self.notifications_stream()).next().await {
            Some(notification) => notification.map(drop),
            None => std::future::pending().await,
        }
    }

    async fn unlisten(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!("UNLISTEN {CHANNEL}")).await
    }

    shared_outbox_statements!(created_at = database_time());
}
