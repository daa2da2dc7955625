//! Transactions at `READ COMMITTED` for the services' locking reads.

use diesel::mysql::MysqlConnection;
use diesel::prelude::*;

use crate::backend::transaction::transaction_depth;

/// Runs `f` in a transaction of its own at `READ COMMITTED`, or in a
/// savepoint at the caller's level inside a caller's transaction.
///
/// Under `REPEATABLE READ` a locking read locks the gaps it walks as well
/// as the rows; an insert into such a gap (a relay marking a message
/// delivered moves its index entry) then waits for the picking transaction,
/// which may itself wait for that insert's row: a deadlock. At
/// `READ COMMITTED` a locking read locks the rows it returns and no gaps.
pub(crate) fn read_committed<T>(
    conn: &mut MysqlConnection,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    if transaction_depth(conn)? == 0 {
        // Applies to the next transaction only; the session keeps its level.
        diesel::sql_query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(conn)?;
    }
    conn.transaction(f)
}
