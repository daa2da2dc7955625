//! The database: a connection pool of any backend, and diesel's sync work
//! run on a pooled connection off the async runtime.

use std::time::Duration;

use anyhow::Context;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, R2D2Connection};
use idempotency::http::{Problem, ProblemKind};

use super::problems::{causes, internal_error, problems};

/// How long a request waits for a pooled connection; then it is answered
/// 503 with `Retry-After`. A transaction here takes milliseconds, so a
/// request that finds no connection free for 2 s meets a database that is
/// overloaded or gone, and the client is better told at once when to come
/// back than held for r2d2's default of 30 s, longer than many clients and
/// proxies wait for a whole response.
pub const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(2);

/// The connection pool of a database of any backend.
pub enum Database {
    /// A SQLite file.
    Sqlite(Pool<ConnectionManager<SqliteConnection>>),
    /// A PostgreSQL database.
    #[cfg(feature = "postgres")]
    Postgres(Pool<ConnectionManager<PgConnection>>),
    /// A MySQL or MariaDB database.
    #[cfg(feature = "mysql")]
    Mysql(Pool<ConnectionManager<MysqlConnection>>),
}

/// Opens `database`: a `postgres://` URL (with the `postgres` feature), a
/// `mysql://` URL (with the `mysql` feature) or the path of a SQLite file,
/// created if missing. A request waits up to `checkout_timeout` for a
/// connection of the pool.
///
/// # Errors
///
/// When the database cannot be opened.
pub fn open(database: &str, checkout_timeout: Duration) -> anyhow::Result<Database> {
    if database.starts_with("postgres://") || database.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        {
            let pool = Pool::builder()
                .max_size(16)
                .min_idle(Some(2))
                .connection_timeout(checkout_timeout)
                .build(ConnectionManager::<PgConnection>::new(database))
                .context("connect to PostgreSQL")?;
            return Ok(Database::Postgres(pool));
        }
        #[cfg(not(feature = "postgres"))]
        anyhow::bail!("this build has no PostgreSQL: build with --features axum,postgres");
    }
    if database.starts_with("mysql://") {
        #[cfg(feature = "mysql")]
        {
            let pool = Pool::builder()
                .max_size(16)
                .min_idle(Some(2))
                .connection_timeout(checkout_timeout)
                .build(ConnectionManager::<MysqlConnection>::new(database))
                .context("connect to MySQL")?;
            return Ok(Database::Mysql(pool));
        }
        #[cfg(not(feature = "mysql"))]
        anyhow::bail!("this build has no MySQL: build with --features axum,mysql");
    }
    // WAL: readers, such as replays, do not wait for the writer.
    SqliteConnection::establish(database)
        .with_context(|| format!("open {database}"))?
        .batch_execute("PRAGMA journal_mode = WAL")
        .context("enable WAL")?;
    let pool = Pool::builder()
        .max_size(8)
        .connection_timeout(checkout_timeout)
        .connection_customizer(Box::new(SqliteSetup))
        .build(ConnectionManager::<SqliteConnection>::new(database))
        .with_context(|| format!("open {database}"))?;
    Ok(Database::Sqlite(pool))
}

/// SQLite connections: wait up to 5 s for the write lock outside
/// idempotent calls (which set their own wait), and make every commit
/// durable.
#[derive(Debug)]
struct SqliteSetup;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqliteSetup {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 5000; PRAGMA synchronous = FULL;")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// What went wrong on a read route's blocking thread.
enum ReadFailure {
    Checkout(diesel::r2d2::PoolError),
    Query(diesel::result::Error),
}

/// Runs sync diesel work on the blocking pool with a pooled connection.
/// No connection within the checkout timeout is a 503 with `Retry-After`,
/// as on the idempotent route: the client may retry.
pub(super) async fn blocking<C, T>(
    pool: &Pool<ConnectionManager<C>>,
    work: impl FnOnce(&mut C) -> QueryResult<T> + Send + 'static,
) -> Result<T, Problem>
where
    C: R2D2Connection + 'static,
    T: Send + 'static,
{
    let pool = pool.clone();
    let task = tokio::task::spawn_blocking(move || {
        let mut conn = pool.get().map_err(ReadFailure::Checkout)?;
        work(&mut conn).map_err(ReadFailure::Query)
    });
    match task.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(ReadFailure::Checkout(error))) => {
            eprintln!("reading orders: no connection: {}", causes(&error));
            Err(problems()
                .problem(ProblemKind::Unavailable)
                .with_detail("the server is busy; retry later"))
        }
        Ok(Err(ReadFailure::Query(error))) => {
            eprintln!("reading orders failed: {}", causes(&error));
            Err(internal_error())
        }
        Err(error) => {
            eprintln!("reading orders failed: {}", causes(&error));
            Err(internal_error())
        }
    }
}
