//! The transactions the crate opens itself on a synchronous connection:
//! how deep the connection is in them, the end of a level opened by a
//! `BEGIN` of the backend's choosing, and the levels a panicking operation
//! left open, rolled back.

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;

use super::BlockingStore;

/// How deep the connection's open transactions are nested; 0 outside one.
pub(crate) fn transaction_depth<C: BlockingStore>(conn: &mut C) -> QueryResult<u32> {
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()?;
    Ok(depth.map_or(0, |depth| depth.get()))
}

/// Rolls back the levels an operation opened and left open when it panicked,
/// so that the caller's own level can be rolled back as usual.
pub(crate) fn unwind_to_depth<C: BlockingStore>(conn: &mut C, depth: u32) -> QueryResult<()> {
    while transaction_depth(conn)? > depth {
        AnsiTransactionManager::rollback_transaction(conn)?;
    }
    Ok(())
}

/// Ends the level of `conn` that `work` ran in, opened just before it:
/// commits it if `result` is a success and rolls it back otherwise, as
/// diesel's own `transaction` does for the `BEGIN` it sends itself.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn end_level<C, T, E>(conn: &mut C, result: Result<T, E>) -> Result<T, E>
where
    C: BlockingStore,
    E: From<diesel::result::Error>,
{
    match result {
        Ok(value) => {
            AnsiTransactionManager::commit_transaction(conn)?;
            Ok(value)
        }
        Err(error) => match AnsiTransactionManager::rollback_transaction(conn) {
            Ok(()) | Err(diesel::result::Error::BrokenTransactionManager) => Err(error),
            Err(rollback_error) => Err(rollback_error.into()),
        },
    }
}
