//! How PostgreSQL's statements are sent on either kind of connection
//! ([`Session`]): any query of PostgreSQL's loaded, and a transaction
//! opened with SQL text of the crate's own and ended, so that the key
//! transaction, the read after the lock, the relay's claim and the form
//! Citus takes of it are written once for both.

use std::future::Future;

use diesel::QueryResult;
use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::pg::{Pg, PgConnection};
use diesel::query_dsl::{LoadQuery, RunQueryDslSupport};
use diesel::result::Error as DieselError;
use diesel::sql_types::{Bool, Text};
use diesel::{QueryableByName, RunQueryDsl, sql_query};

use crate::backend::KeyStore;
use crate::backend::send::{Sent, first};
use crate::backend::transaction::end_level;

/// How PostgreSQL's statements are sent on either kind of connection. Any
/// query goes: the bounds name the backend's connections, not the query.
pub(crate) trait Session: KeyStore<Rules = Pg> {
    /// Sends `query` and returns its rows.
    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static;

    /// Opens a transaction with `sql`, whose first statement is `BEGIN`.
    fn begin_with(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>>;

    /// Opens a savepoint in the caller's transaction.
    fn savepoint(&mut self) -> impl Future<Output = QueryResult<()>>;

    /// Sends `sql` as it is, as one simple query.
    fn batch(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>>;

    /// Runs `work` in the level just opened, then commits that level if
    /// `work` succeeded and rolls it back otherwise.
    fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> impl Future<Output = Result<T, E>>
    where
        E: From<DieselError>;
}

/// A query that both kinds of PostgreSQL connection load as rows of `U`,
/// borrowing for `'q`: the bound of [`Session::load`].
#[cfg(feature = "postgres-async")]
pub(crate) trait Loads<'q, U>:
    LoadQuery<'q, PgConnection, U>
    + diesel_async::methods::LoadQuery<'q, diesel_async::AsyncPgConnection, U>
    + RunQueryDslSupport
    + Send
    + 'q
{
}

#[cfg(feature = "postgres-async")]
impl<'q, U, Q> Loads<'q, U> for Q where
    Q: LoadQuery<'q, PgConnection, U>
        + diesel_async::methods::LoadQuery<'q, diesel_async::AsyncPgConnection, U>
        + RunQueryDslSupport
        + Send
        + 'q
{
}

/// A query that a PostgreSQL connection loads as rows of `U`, borrowing
/// for `'q`: the bound of [`Session::load`].
#[cfg(not(feature = "postgres-async"))]
pub(crate) trait Loads<'q, U>: LoadQuery<'q, PgConnection, U> + RunQueryDslSupport + Send + 'q {}

#[cfg(not(feature = "postgres-async"))]
impl<'q, U, Q> Loads<'q, U> for Q where Q: LoadQuery<'q, PgConnection, U> + RunQueryDslSupport + Send + 'q {}

impl Session for PgConnection {
    fn load<'c, 'q: 'c, Q, U>(&'c mut self, query: Q) -> Sent<'c, Vec<U>>
    where
        Q: Loads<'q, U>,
        U: Send + 'static,
    {
        Sent::Done(Some(RunQueryDsl::load(query, self)))
    }

    fn begin_with(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(AnsiTransactionManager::begin_transaction_sql(self, sql))
    }

    fn savepoint(&mut self) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(<AnsiTransactionManager as TransactionManager<Self>>::begin_transaction(
            self,
        ))
    }

    fn batch(&mut self, sql: &str) -> impl Future<Output = QueryResult<()>> {
        std::future::ready(self.batch_execute(sql))
    }

    async fn within<T, E>(&mut self, work: impl AsyncFnOnce(&mut Self) -> Result<T, E>) -> Result<T, E>
    where
        E: From<DieselError>,
    {
        let result = work(self).await;
        end_level(self, result)
    }
}

/// Whether `table` (found through the `search_path`) is distributed by
/// Citus; `false` on a database without the extension.
pub(crate) async fn distributed<C: Session>(conn: &mut C, table: &str) -> QueryResult<bool> {
    #[derive(QueryableByName)]
    struct Answer {
        #[diesel(sql_type = Bool)]
        answer: bool,
    }
    let ask = |query: &'static str| sql_query(query).into_boxed().bind::<Text, _>(table.to_owned());
    let yes = |answer: QueryResult<Answer>| answer.map(|answer| answer.answer);
    // Citus's catalog exists only with the extension; a query naming it on
    // a plain server would fail.
    Ok(yes(first(
        conn.load(ask(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus' AND $1 IS NOT NULL) AS answer",
        ))
        .await?,
    ))? && yes(first(
        conn.load(ask(
            "SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)) AS answer",
        ))
        .await?,
    ))?)
}
