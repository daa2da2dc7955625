//! PostgreSQL on diesel-async's `AsyncPgConnection`: the statements of
//! `PgConnection`'s [`KeyStore`], the same SQL and the same key lock, sent
//! and awaited. What a statement means and how a failure is read is
//! `PgConnection`'s, in `mod.rs`; only the sending is here.

use chrono::NaiveDateTime;
use diesel::QueryResult;
use diesel::pg::PgConnection;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::Timestamp;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::{HoldBy, HoldByRead, NowAndClaimFirst, claim_sql, database_time, lock_key_sql, lock_wait_ended};
use crate::backend::row_with::{KeyRecord, KeyRecordRow, RowWith, stored_of};
use crate::backend::{
    AsyncStoreConnection, AsyncTransaction, Driver, HeldKey, Hold, Read, Record, Stored, async_transaction_depth,
    async_unwind_to_depth, end_transaction, sealed,
};
use crate::error::is_connection_lost;
use crate::in_flight::InFlight;
use crate::schema;

impl sealed::Sealed for AsyncPgConnection {}

impl AsyncStoreConnection for AsyncPgConnection {}

impl Driver for AsyncPgConnection {
    type Rules = PgConnection;

    async fn read(&mut self, scope: &str, key: &str) -> QueryResult<Read> {
        let ((now, claims_first), row) = RowWith::<NowAndClaimFirst, KeyRecord<Timestamp>>::new(scope, key)
            .get_result::<((NaiveDateTime, bool), KeyRecordRow)>(self)
            .await?;
        Ok(Read {
            record: stored_of(row),
            now,
            claims_first,
        })
    }

    async fn database_now(&mut self) -> QueryResult<NaiveDateTime> {
        diesel::select(database_time()).get_result(self).await
    }

    fn transaction_depth(&mut self) -> QueryResult<u32> {
        async_transaction_depth(self)
    }

    async fn unwind_to_depth(&mut self, depth: u32) -> QueryResult<()> {
        async_unwind_to_depth(self, depth).await
    }

    /// `PgConnection::key_transaction`: the same round trips, each awaited.
    async fn key_transaction<T, E>(
        &mut self,
        held: HeldKey<'_>,
        work: impl AsyncFnOnce(&mut Self, bool) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let HeldKey {
            scope,
            key,
            mut in_flight,
            idle_timeout,
            claim,
        } = held;
        if async_transaction_depth(self)? > 0 {
            let lock = lock_key_sql(scope, key, in_flight, idle_timeout);
            <AnsiTransactionManager as diesel_async::TransactionManager<_>>::begin_transaction(self).await?;
            let mut tx = AsyncTransaction::opened(self);
            let result = match tx.batch_execute(&lock).await.map_err(lock_wait_ended) {
                Ok(()) => work(&mut tx, false).await,
                Err(error) => Err(error.into()),
            };
            return end_transaction(tx, result).await;
        }
        if let Some(claim) = claim.and_then(claim_sql) {
            let begin = format!("BEGIN; {}; {claim}", lock_key_sql(scope, key, in_flight, idle_timeout));
            match AnsiTransactionManager::begin_transaction_sql(self, &begin).await {
                Ok(()) => {
                    let mut tx = AsyncTransaction::opened(self);
                    let result = work(&mut tx, true).await;
                    return end_transaction(tx, result).await;
                }
                Err(error) => {
                    // As on `PgConnection`: BEGIN went through, a duplicate
                    // is a holder's record, anything else is told apart by
                    // the transaction below without waiting again.
                    let _ = self.batch_execute("ROLLBACK").await;
                    if is_connection_lost(&error) {
                        return Err(error.into());
                    }
                    if !matches!(error, DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) {
                        in_flight = InFlight::Reject;
                    }
                }
            }
        }
        let begin = format!("BEGIN; {}", lock_key_sql(scope, key, in_flight, idle_timeout));
        if let Err(error) = AnsiTransactionManager::begin_transaction_sql(self, &begin).await {
            let _ = self.batch_execute("ROLLBACK").await;
            return Err(lock_wait_ended(error).into());
        }
        let mut tx = AsyncTransaction::opened(self);
        let result = work(&mut tx, false).await;
        end_transaction(tx, result).await
    }

    async fn hold(&mut self, record: &Record<'_>, claims_first: bool) -> QueryResult<Hold> {
        super::hold(self, record, claims_first).await
    }

    async fn await_replication(&mut self) -> QueryResult<()> {
        let emit = super::DURABLE_REPLAY;
        if async_transaction_depth(self)? == 0 {
            self.batch_execute(&format!("BEGIN; {emit}; COMMIT")).await
        } else {
            self.batch_execute(emit).await
        }
    }

    crate::backend::keys::key_statements!(async schema: find, claim, store);
}

impl HoldByRead for AsyncPgConnection {
    async fn hold_by(&mut self, scope: &str, key: &str) -> QueryResult<(String, Option<Stored>)> {
        let (hold_by, row) = RowWith::<HoldBy, KeyRecord<Timestamp>>::new(scope, key)
            .get_result::<(String, KeyRecordRow)>(self)
            .await?;
        Ok((hold_by, stored_of(row)))
    }
}
