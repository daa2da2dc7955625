//! How a statement written as SQL text is sent on either kind of
//! PostgreSQL connection ([`LoadSql`]), so that the relay's claim, and the
//! form Citus takes of it, are written once for both.

use std::future::Future;

use diesel::QueryResult;
use diesel::pg::{Pg, PgConnection};
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::query_dsl::RunQueryDsl;
use diesel::sql_types::{Bool, Text};
use diesel::{QueryableByName, sql_query};

use crate::backend::KeyStore;

/// Sends a statement of SQL text with its parameters bound and loads its
/// rows: at once on `PgConnection`, awaited on diesel-async's
/// `AsyncPgConnection`.
pub(crate) trait LoadSql: KeyStore {
    /// The rows `query` returns.
    fn load_sql<'q, U>(&mut self, query: BoxedSqlQuery<'q, Pg, SqlQuery>) -> impl Future<Output = QueryResult<Vec<U>>>
    where
        U: QueryableByName<Pg> + Send + 'static;
}

impl LoadSql for PgConnection {
    fn load_sql<'q, U>(&mut self, query: BoxedSqlQuery<'q, Pg, SqlQuery>) -> impl Future<Output = QueryResult<Vec<U>>>
    where
        U: QueryableByName<Pg> + Send + 'static,
    {
        std::future::ready(query.load(self))
    }
}

#[cfg(feature = "postgres-async")]
impl LoadSql for diesel_async::AsyncPgConnection {
    fn load_sql<'q, U>(&mut self, query: BoxedSqlQuery<'q, Pg, SqlQuery>) -> impl Future<Output = QueryResult<Vec<U>>>
    where
        U: QueryableByName<Pg> + Send + 'static,
    {
        diesel_async::RunQueryDsl::load(query, self)
    }
}

/// Whether `table` (found through the `search_path`) is distributed by
/// Citus; `false` on a database without the extension.
pub(crate) async fn distributed<C: LoadSql>(conn: &mut C, table: &str) -> QueryResult<bool> {
    #[derive(QueryableByName)]
    struct Answer {
        #[diesel(sql_type = Bool)]
        answer: bool,
    }
    let ask = |query: &'static str| sql_query(query).into_boxed().bind::<Text, _>(table.to_owned());
    let yes = |answers: Vec<Answer>| answers.first().is_some_and(|a| a.answer);
    // Citus's catalog exists only with the extension; a query naming it on
    // a plain server would fail.
    Ok(yes(conn
        .load_sql(ask(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus' AND $1 IS NOT NULL) AS answer",
        ))
        .await?)
        && yes(conn
            .load_sql(ask(
                "SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)) AS answer",
            ))
            .await?))
}
