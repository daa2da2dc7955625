//! The transactions the crate opens itself: how deep a connection is in
//! them, one opened by a `BEGIN` of the backend's choosing, and the levels
//! a panicking operation left open, rolled back.

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

/// Runs `f` in a transaction opened by `begin` (which must open exactly one
/// level), committing if `f` succeeds and rolling back otherwise, as
/// diesel's own `transaction` does for its fixed `BEGIN`.
#[cfg(feature = "postgres")]
pub(crate) fn transaction_with<C, T, E>(
    conn: &mut C,
    begin: impl FnOnce(&mut C) -> QueryResult<()>,
    f: impl FnOnce(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    C: BlockingStore,
    E: From<diesel::result::Error>,
{
    begin(conn)?;
    match f(conn) {
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
