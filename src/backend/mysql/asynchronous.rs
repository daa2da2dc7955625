//! MySQL and MariaDB on diesel-async's `AsyncMysqlConnection`: the
//! statements of `MysqlConnection`'s [`BlockingStore`](crate::backend::BlockingStore),
//! the same SQL, the same named lock and the same idle bound, sent and
//! awaited. The rules that decide which to send, and how a failure is read,
//! are `MysqlConnection`'s, in `mod.rs`; only the sending is here.
//!
//! diesel-async's MySQL client reports what the server refused with the
//! kinds diesel knows (a duplicate key is a `UniqueViolation`), and
//! everything else, a lost connection and a deadlock among it, as `Unknown`
//! with its own text, which `crate::error` reads.

use chrono::NaiveDateTime;
use diesel::QueryResult;
use diesel::mysql::Mysql;
use diesel::query_builder::{QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel_async::{AnsiTransactionManager, AsyncMysqlConnection, RunQueryDsl, TransactionManager};

use super::clock::{DatabaseNow, UtcNow};
use super::outbox::claim_batch;
use super::session::{Loads, Session};
use crate::backend::outbox::{BatchClaim, Claimed, OutboxStore, shared_outbox_statements};
use crate::backend::phases::{OperationRow, PhaseStore, shared_phase_statements};
use crate::backend::row_with::{OperationColumns, OperationColumnsRow, RowWith, operation_of};
use crate::backend::send::{Awaited, Sends, Sent};
use crate::backend::{
    AsyncStoreConnection, AsyncTransaction, async_transaction_depth, async_unwind_to_depth, end_transaction, sealed,
};

impl sealed::Sealed for AsyncMysqlConnection {}

impl AsyncStoreConnection for AsyncMysqlConnection {}

impl Sends for AsyncMysqlConnection {
    type Way = Awaited;
}

impl Session for AsyncMysqlConnection {
    fn depth(&mut self) -> QueryResult<u32> {
        async_transaction_depth(self)
    }

    fn unwind(&mut self, depth: u32) -> Sent<'_, ()> {
        Sent::Awaited(Box::pin(async_unwind_to_depth(self, depth)))
    }

    fn execute<'c, Q>(&'c mut self, statement: Q) -> Sent<'c, usize>
    where
        Q: QueryFragment<Mysql> + QueryId + Send + 'c,
    {
        Sent::Awaited(Box::pin(diesel_async::methods::ExecuteDsl::execute(statement, self)))
    }

    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static,
    {
        Sent::Awaited(Box::pin(RunQueryDsl::load(query, self)))
    }

    async fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        <AnsiTransactionManager as TransactionManager<Self>>::begin_transaction(self).await?;
        let mut tx = AsyncTransaction::opened(self);
        let result = work(&mut tx).await;
        end_transaction(tx, result).await
    }

    fn mark_broken(&mut self) {
        <AnsiTransactionManager as TransactionManager<Self>>::transaction_manager_status_mut(self).set_in_error();
    }
}

impl PhaseStore for AsyncMysqlConnection {
    async fn read_operation(&mut self, scope: &str, key: &str) -> QueryResult<(Option<OperationRow>, NaiveDateTime)> {
        let (now, columns) = RowWith::<DatabaseNow, OperationColumns>::new(scope, key)
            .get_result::<(NaiveDateTime, OperationColumnsRow)>(self)
            .await?;
        Ok((operation_of(columns), now))
    }

    async fn pause(&mut self, duration: std::time::Duration) {
        tokio::time::sleep(duration).await;
    }

    shared_phase_statements!(insert strictly);
}

impl OutboxStore for AsyncMysqlConnection {
    async fn claim_batch(&mut self, claim: &BatchClaim<'_>) -> QueryResult<Vec<Claimed>> {
        claim_batch(self, claim).await
    }

    shared_outbox_statements!(created_at = UtcNow);
}
