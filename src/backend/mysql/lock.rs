//! The statements of a key's named lock: taking it, releasing it, and the
//! bound on how long the server waits for an idle client meanwhile.

use diesel::mysql::Mysql;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::query_dsl::RunQueryDslSupport;
use diesel::sql_types::{BigInt, Double, Nullable, Text};

/// `SELECT name, GET_LOCK(name, seconds)`: takes the named lock of a key,
/// waiting up to `seconds`, and returns its name with 1 (taken), 0 (the wait
/// ran out) or NULL (an error, such as the session being killed).
///
/// Lock names are one name space for the whole server, so the name also
/// hashes the current database: two databases on one server keep their keys
/// apart. MySQL takes names of at most 64 characters: `idempotency:` and 52
/// hex digits. A query type of its own, so that diesel prepares it once per
/// connection.
pub(super) struct GetLock<'a> {
    pub(super) key: &'a str,
    pub(super) seconds: f64,
}

impl QueryId for GetLock<'_> {
    type QueryId = GetLock<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for GetLock<'_> {
    type SqlType = (Text, Nullable<BigInt>);
}

impl QueryFragment<Mysql> for GetLock<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        out.push_sql("SELECT name, GET_LOCK(name, ");
        out.push_bind_param::<Double, _>(&self.seconds)?;
        out.push_sql(") FROM (SELECT CONCAT('idempotency:', LEFT(SHA2(CONCAT(");
        out.push_bind_param::<Text, _>(self.key)?;
        out.push_sql(", ':', COALESCE(DATABASE(), '')), 256), 52)) AS name) AS lock_name");
        Ok(())
    }
}

impl RunQueryDslSupport for GetLock<'_> {}

/// `SELECT RELEASE_LOCK(name)`.
pub(super) struct ReleaseLock<'a>(pub(super) &'a str);

impl QueryId for ReleaseLock<'_> {
    type QueryId = ReleaseLock<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for ReleaseLock<'_> {
    type SqlType = Nullable<BigInt>;
}

impl QueryFragment<Mysql> for ReleaseLock<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        out.push_sql("SELECT RELEASE_LOCK(");
        out.push_bind_param::<Text, _>(self.0)?;
        out.push_sql(")");
        Ok(())
    }
}

/// The statements that bound how long the server waits for the client of
/// a call that holds its key: the session's `wait_timeout`, lowered from
/// before the key's lock is taken until after it is released, and then put
/// back. The caller's value waits in a user variable per nesting depth, so
/// that a nested call puts back its caller's bound, not the session's.
/// Lock and restore share one statement, the release, so a call sends one
/// statement more than without the bound. One text per depth, which diesel
/// prepares once per connection.
pub(super) enum IdleBound<'a> {
    /// Keeps the session's `wait_timeout` and lowers it to this many
    /// seconds, unless it is lower already.
    Set(i64),
    /// Releases the named lock and puts the kept value back.
    ReleaseAndRestore(&'a str),
    /// Puts the kept value back (a lock that was never taken).
    Restore,
}

/// An [`IdleBound`] statement of the call at transaction depth `depth`.
pub(super) struct IdleStatement<'a> {
    pub(super) depth: u32,
    pub(super) bound: IdleBound<'a>,
}

impl QueryId for IdleStatement<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Mysql> for IdleStatement<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        let kept = format!("@idempotency_wait_timeout_{}", self.depth);
        match &self.bound {
            IdleBound::Set(seconds) => {
                out.push_sql(&format!(
                    "SET {kept} = @@SESSION.wait_timeout, SESSION wait_timeout = LEAST("
                ));
                out.push_bind_param::<BigInt, _>(seconds)?;
                out.push_sql(", @@SESSION.wait_timeout)");
            }
            IdleBound::ReleaseAndRestore(name) => {
                out.push_sql("SET @idempotency_released = RELEASE_LOCK(");
                out.push_bind_param::<Text, _>(*name)?;
                out.push_sql(&format!("), SESSION wait_timeout = {kept}"));
            }
            IdleBound::Restore => out.push_sql(&format!("SET SESSION wait_timeout = {kept}")),
        }
        Ok(())
    }
}
