//! Helpers for domain tests: SQLite databases with the migrations applied,
//! a clock that moves only when told to, and the stories that idempotency
//! is for, each run against your own operation and checked.
//!
//! | story | helper |
//! | --- | --- |
//! | the response was lost, the client retries | [`lost_response`] |
//! | the worker crashed after the domain write | [`crash_midway`] |
//! | the client retries after the retention window | [`retry_after_expiry`] |
//! | two copies of one request arrive at once | [`racing_duplicate`] |
//!
//! Everything runs in SQLite inside the test process, in milliseconds.
//! A story helper panics with a message saying which expectation failed, as
//! an assertion does.

use std::fmt::Debug;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};

use chrono::{DateTime, Duration, TimeZone, Utc};
use diesel::connection::SimpleConnection;
use diesel::migration::MigrationSource;
use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel::sqlite::Sqlite;
use diesel_migrations::MigrationHarness;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Config, Error, Outcome, StoreConnection};

/// A new in-memory SQLite database with this crate's migrations applied.
///
/// Each call is a separate database: `:memory:` belongs to one connection.
/// Use a file in a temporary directory where several connections must
/// share one database.
///
/// # Panics
///
/// If SQLite cannot open the database or a migration fails, as a test helper
/// may.
///
/// ```
/// use idempotency::{run_idempotent, testing};
///
/// let mut conn = testing::sqlite_memory();
/// let outcome = run_idempotent(&mut conn, "tests", "k1", &1, |_| Ok::<_, std::convert::Infallible>(2));
/// assert!(matches!(outcome, Ok(idempotency::Outcome::Executed(2))));
/// ```
pub fn sqlite_memory() -> SqliteConnection {
    let mut conn = SqliteConnection::establish(":memory:").expect("open an in-memory SQLite database");
    crate::run_migrations(&mut conn).expect("apply the idempotency migrations");
    conn
}

/// [`sqlite_memory`] behind diesel-async's `SyncConnectionWrapper`
/// (feature `sqlite-async`): an in-memory SQLite database with this
/// crate's tables, for domain tests of code that runs
/// [`run_idempotent_async`](crate::run_idempotent_async). Its statements
/// run on tokio's blocking pool, on the runtime it is made in.
///
/// # Panics
///
/// As [`sqlite_memory`].
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::{run_idempotent_async, testing, Outcome};
///
/// let mut conn = testing::sqlite_memory_async();
/// let outcome = run_idempotent_async(&mut conn, "tests", "k1", &1, async |_: &mut _| Ok::<_, std::convert::Infallible>(2)).await?;
/// assert_eq!(outcome, Outcome::Executed(2));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "sqlite-async")]
pub fn sqlite_memory_async() -> diesel_async::sync_connection_wrapper::SyncConnectionWrapper<SqliteConnection> {
    diesel_async::sync_connection_wrapper::SyncConnectionWrapper::new(sqlite_memory())
}

/// A new in-memory SQLite database with this crate's migrations and then
/// yours applied, for tests of a domain that has its own tables.
///
/// `migrations` is any diesel migration source, usually the
/// `EmbeddedMigrations` of your application
/// (`embed_migrations!("migrations")`).
///
/// # Panics
///
/// If SQLite cannot open the database or a migration fails.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use diesel_migrations::{embed_migrations, EmbeddedMigrations};
///
/// // Your application's migrations, usually `embed_migrations!("migrations")`.
/// const MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");
///
/// let mut conn = idempotency::testing::sqlite_memory_with(MIGRATIONS);
/// diesel::sql_query("INSERT INTO orders (item, quantity) VALUES ('book', 1)").execute(&mut conn)?;
/// # Ok(())
/// # }
/// ```
pub fn sqlite_memory_with<M: MigrationSource<Sqlite>>(migrations: M) -> SqliteConnection {
    let mut conn = sqlite_memory();
    conn.run_pending_migrations(migrations)
        .expect("apply the test's migrations");
    conn
}

/// A clock for [`Config::clock`](crate::Config::clock) that stands still
/// until advanced. Clones share one time, so a test keeps a clone and moves
/// the time under a `Config` that owns another.
///
/// ```
/// use chrono::Duration;
/// use idempotency::testing::ManualClock;
///
/// let clock = ManualClock::new();
/// let start = clock.now();
/// clock.advance(Duration::hours(25));
/// assert_eq!(clock.now() - start, Duration::hours(25));
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at 2030-01-01 00:00:00 UTC, so tests do not depend
    /// on when they run.
    pub fn new() -> Self {
        Self::at(
            Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
                .single()
                .expect("a valid date"),
        )
    }

    /// A clock standing at `start`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::{TimeZone, Utc};
    /// use idempotency::testing::ManualClock;
    ///
    /// let new_year = Utc.with_ymd_and_hms(2031, 1, 1, 0, 0, 0).single().ok_or("a valid date")?;
    /// assert_eq!(ManualClock::at(new_year).now(), new_year);
    /// # Ok(())
    /// # }
    /// ```
    pub fn at(start: DateTime<Utc>) -> Self {
        ManualClock {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// The current time of this clock.
    pub fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the clock forward (or back, with a negative duration).
    ///
    /// # Panics
    ///
    /// If the time would leave chrono's range (about 262,000 years either
    /// way); the clock keeps its time.
    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }

    /// Sets the clock to `to`, forward or back: clones see the new time.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::{TimeZone, Utc};
    /// use idempotency::testing::ManualClock;
    ///
    /// let clock = ManualClock::new();
    /// let shared = clock.clone();
    /// let leap_day = Utc.with_ymd_and_hms(2032, 2, 29, 12, 0, 0).single().ok_or("a valid date")?;
    /// clock.set(leap_day);
    /// assert_eq!(shared.now(), leap_day);
    /// # Ok(())
    /// # }
    /// ```
    pub fn set(&self, to: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }

    /// A time source for [`Config::clock`](crate::Config::clock) that reads
    /// this clock.
    pub fn source(&self) -> impl Fn() -> DateTime<Utc> + Send + Sync + 'static {
        let clock = self.clone();
        move || clock.now()
    }
}

/// A SQLite database in a file of its own in a new temporary directory,
/// with the migrations applied and WAL enabled, for tests that need several
/// connections to one database (in-memory databases belong to one
/// connection). The directory is removed when this value is dropped.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::testing::SqliteFile;
///
/// let db = SqliteFile::new();
/// let (mut a, mut b) = (db.conn(), db.conn());
/// idempotency::run_idempotent(&mut a, "tests", "k1", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
/// let again = idempotency::run_idempotent(&mut b, "tests", "k1", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
/// assert!(again.is_replayed());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct SqliteFile {
    dir: PathBuf,
    path: PathBuf,
}

impl Default for SqliteFile {
    fn default() -> Self {
        Self::new()
    }
}

impl SqliteFile {
    /// A new database file with this crate's migrations applied.
    ///
    /// # Panics
    ///
    /// If the directory or the database cannot be created.
    pub fn new() -> Self {
        let dir = unique_temp_dir();
        let path = dir.join("test.db");
        let db = SqliteFile { dir, path };
        let mut conn = db.conn();
        conn.batch_execute("PRAGMA journal_mode = WAL").expect("enable WAL");
        crate::run_migrations(&mut conn).expect("apply the idempotency migrations");
        db
    }

    /// A new database file with this crate's migrations and then yours
    /// applied; see [`sqlite_memory_with`].
    ///
    /// # Panics
    ///
    /// If the directory or the database cannot be created, or a migration
    /// fails.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::prelude::*;
    /// use diesel_migrations::{embed_migrations, EmbeddedMigrations};
    /// use idempotency::testing::SqliteFile;
    ///
    /// // Your application's migrations, usually `embed_migrations!("migrations")`.
    /// const MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");
    ///
    /// let db = SqliteFile::with_migrations(MIGRATIONS);
    /// diesel::sql_query("INSERT INTO orders (item, quantity) VALUES ('book', 1)").execute(&mut db.conn())?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_migrations<M: MigrationSource<Sqlite>>(migrations: M) -> Self {
        let db = Self::new();
        db.conn()
            .run_pending_migrations(migrations)
            .expect("apply the test's migrations");
        db
    }

    /// The database file, for connections of your own (an r2d2 pool, a
    /// child process).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use diesel::SqliteConnection;
    /// use idempotency::testing::SqliteFile;
    ///
    /// let db = SqliteFile::new();
    /// let url = db.path().to_str().ok_or("path is not utf-8")?;
    /// let pool = Pool::builder().max_size(4).build(ConnectionManager::<SqliteConnection>::new(url))?;
    /// idempotency::run_idempotent(&mut pool.get()?, "tests", "k1", &1, |_| Ok::<_, std::convert::Infallible>(1))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new connection to the database, waiting up to 10 seconds for
    /// another connection's write lock.
    ///
    /// # Panics
    ///
    /// If the database cannot be opened.
    pub fn conn(&self) -> SqliteConnection {
        let url = self.path.to_str().expect("a temporary path in utf-8");
        let mut conn = SqliteConnection::establish(url).expect("open the test database");
        conn.batch_execute("PRAGMA busy_timeout = 10000")
            .expect("set the busy timeout");
        conn
    }
}

impl Drop for SqliteFile {
    fn drop(&mut self) {
        // Best effort: a test that leaked a connection must not fail here.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A directory no other test, in this process or another, is using.
fn unique_temp_dir() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!("idempotency-test-{}-{n}-{nanos}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return dir,
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => panic!("create a temporary directory: {error}"),
        }
    }
}

/// The response to the first call was lost and the client sends the same
/// request again: calls `call` twice and checks that the first call executed
/// and the second replayed the same result. Returns that result.
///
/// `call` is the whole idempotent call, as your handler makes it. Check the
/// domain afterwards: its effect should exist once.
///
/// # Panics
///
/// If a call fails, the first call replays (its key was already spent), the
/// second executes again, or the replay differs from the first result.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::{run_idempotent, testing};
///
/// let mut conn = testing::sqlite_memory();
/// diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
///
/// let order_id = testing::lost_response(&mut conn, |conn| {
///     run_idempotent(conn, "shop", "order-1", &"book", |tx| {
///         diesel::sql_query("INSERT INTO orders (item) VALUES ('book')").execute(tx)?;
///         Ok::<_, diesel::result::Error>(1)
///     })
/// });
/// assert_eq!(order_id, 1);
/// # Ok(())
/// # }
/// ```
pub fn lost_response<C, R, E, F>(conn: &mut C, mut call: F) -> R
where
    F: FnMut(&mut C) -> Result<Outcome<R>, Error<E>>,
    R: PartialEq + Debug,
    E: Debug,
{
    let first = expect_executed(call(conn), "lost_response: the first call", "its key was already spent");
    expect_replay_of(call(conn), &first, "lost_response: the retry", "");
    first
}

/// The value of a call that must have executed; panics naming the story
/// otherwise, with `hint` on what usually causes a replay there.
fn expect_executed<R: Debug, E: Debug>(result: Result<Outcome<R>, Error<E>>, call: &str, hint: &str) -> R {
    match result {
        Ok(Outcome::Executed(value)) => value,
        Ok(Outcome::Replayed(value)) => panic!("{call} replayed {value:?}; {hint}"),
        Err(error) => panic!("{call} failed: {error:?}"),
    }
}

/// Checks that a call replayed `first`; panics naming the story otherwise,
/// with `hint` on what usually causes a new execution there.
fn expect_replay_of<R: PartialEq + Debug, E: Debug>(
    result: Result<Outcome<R>, Error<E>>,
    first: &R,
    call: &str,
    hint: &str,
) {
    match result {
        Ok(Outcome::Replayed(replay)) => {
            assert_eq!(
                &replay, first,
                "{call} replayed another result than the first call returned"
            )
        }
        Ok(Outcome::Executed(value)) => panic!("{call} executed again ({value:?}){hint}"),
        Err(error) => panic!("{call} failed: {error:?}"),
    }
}

/// The worker crashes after the operation wrote to the database and before
/// the transaction committed: runs `op` as an idempotent call for
/// `(scope, key)` with `request`, panics as soon as `op` has returned, and
/// checks that the database is exactly as it was before (every table, the
/// key record included) and that the connection is usable.
///
/// `op` has the shape of a repository function, as for
/// [`Idempotent`](crate::Idempotent). Retry the call afterwards to see that
/// the key was left free: it executes.
///
/// # Panics
///
/// If `op` fails or panics by itself, if the key was already spent (`op` did
/// not run), or if anything written before the crash is still there.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::{testing, Idempotent};
///
/// fn create_order(conn: &mut SqliteConnection, item: &str) -> QueryResult<usize> {
///     diesel::sql_query("INSERT INTO orders (item) VALUES (?)").bind::<diesel::sql_types::Text, _>(item).execute(conn)
/// }
///
/// let mut conn = testing::sqlite_memory();
/// diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
///
/// testing::crash_midway(&mut conn, "shop", "order-1", "book", create_order);
/// // The key stayed free: the retry executes.
/// assert!(!create_order.idempotent(&mut conn, "shop", "order-1", "book")?.is_replayed());
/// # Ok(())
/// # }
/// ```
pub fn crash_midway<C, Q, R, E, F>(conn: &mut C, scope: &str, key: &str, request: &Q, op: F)
where
    C: StoreConnection<Raw = SqliteConnection>,
    Q: Serialize + ?Sized,
    R: Serialize + DeserializeOwned,
    E: Debug,
    F: FnOnce(&mut SqliteConnection, &Q) -> Result<R, E>,
{
    let conn = conn.raw();
    let before = snapshot(conn);
    let depth = crate::backend::transaction_depth(conn).expect("read the transaction state");
    let mut crashed = false;
    let call = panic::catch_unwind(AssertUnwindSafe(|| {
        Config::default().run(conn, scope, key, request, |tx| match op(tx, request) {
            Ok(_) => {
                crashed = true;
                panic!("crash_midway: the simulated crash after the operation's writes")
            }
            Err(error) => Err::<R, E>(error),
        })
    }));
    match call {
        Err(_) if crashed => {}
        Err(payload) => panic::resume_unwind(payload),
        Ok(Ok(_)) => panic!("crash_midway: the key was already spent, so the operation did not run"),
        Ok(Err(error)) => panic!("crash_midway: the call failed before the crash: {error:?}"),
    }
    assert_eq!(
        crate::backend::transaction_depth(conn).expect("read the transaction state"),
        depth,
        "crash_midway: the connection was not left as deep in transactions as it was before"
    );
    let after = snapshot(conn);
    if before != after {
        let mut changed: Vec<&str> = before
            .iter()
            .chain(&after)
            .filter(|table| !before.contains(table) || !after.contains(table))
            .map(|(name, _)| name.as_str())
            .collect();
        changed.sort_unstable();
        changed.dedup();
        panic!("crash_midway: {} changed although the call crashed", changed.join(", "));
    }
}

/// Every table of the database and its rows as text, in a stable order.
fn snapshot(conn: &mut SqliteConnection) -> Vec<(String, Vec<String>)> {
    #[derive(QueryableByName)]
    struct Line {
        #[diesel(sql_type = Text)]
        line: String,
    }
    let lines = |conn: &mut SqliteConnection, query: diesel::query_builder::SqlQuery| -> Vec<String> {
        query
            .load::<Line>(conn)
            .expect("read the database")
            .into_iter()
            .map(|row| row.line)
            .collect()
    };
    let schema = lines(
        conn,
        diesel::sql_query(
            "SELECT type || ' ' || name || ' ' || coalesce(sql, '') AS line FROM sqlite_schema ORDER BY line",
        ),
    );
    let tables = lines(
        conn,
        diesel::sql_query("SELECT name AS line FROM sqlite_schema WHERE type = 'table' ORDER BY name"),
    );
    let mut snapshot = vec![(String::from("sqlite_schema"), schema)];
    for table in tables {
        let columns: Vec<String> = diesel::sql_query("SELECT name AS line FROM pragma_table_info(?) ORDER BY cid")
            .bind::<Text, _>(&table)
            .load::<Line>(conn)
            .expect("read the table's columns")
            .into_iter()
            .map(|row| row.line)
            .collect();
        // Identifiers cannot be bound; they come from the schema and are
        // quoted as SQLite quotes identifiers.
        let row = columns
            .iter()
            .map(|column| format!("quote({})", quote_identifier(column)))
            .collect::<Vec<_>>();
        let query = format!(
            "SELECT {} AS line FROM {} ORDER BY line",
            row.join(" || ',' || "),
            quote_identifier(&table)
        );
        let rows = if columns.is_empty() {
            Vec::new()
        } else {
            lines(conn, diesel::sql_query(query))
        };
        snapshot.push((table, rows));
    }
    snapshot
}

fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The client retries after the retention window ended: calls `call`, moves
/// `clock` to just before the end of `retention` and calls again (a
/// replay), then to its end and calls once more, which executes anew.
/// Returns the results of the two executions.
///
/// `call` must use a [`Config`] whose clock is `clock` and whose retention
/// is `retention`. Check the domain afterwards: the effect now exists twice,
/// unless your domain refuses the duplicate itself.
///
/// # Panics
///
/// If a call fails, or any call does not execute or replay as described.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use chrono::Duration;
/// use idempotency::{testing::{self, ManualClock}, Config};
///
/// let mut conn = testing::sqlite_memory();
/// let clock = ManualClock::new();
/// let config = Config::default().clock(clock.source()).retention(Duration::hours(1));
/// let mut runs = 0;
///
/// let (first, second) = testing::retry_after_expiry(&mut conn, &clock, Duration::hours(1), |conn| {
///     config.run(conn, "shop", "order-1", &"book", |_| {
///         runs += 1;
///         Ok::<_, std::convert::Infallible>(runs)
///     })
/// });
/// assert_eq!((first, second), (1, 2));
/// # Ok(())
/// # }
/// ```
pub fn retry_after_expiry<C, R, E, F>(conn: &mut C, clock: &ManualClock, retention: Duration, mut call: F) -> (R, R)
where
    F: FnMut(&mut C) -> Result<Outcome<R>, Error<E>>,
    R: PartialEq + Debug,
    E: Debug,
{
    let first = expect_executed(
        call(conn),
        "retry_after_expiry: the first call",
        "its key was already spent",
    );
    let just_before = retention - Duration::milliseconds(1);
    clock.advance(just_before);
    expect_replay_of(
        call(conn),
        &first,
        "retry_after_expiry: the retry 1 ms before the retention ended",
        "; is the call's retention shorter than the one given here, or its clock another?",
    );
    clock.advance(retention - just_before);
    let second = expect_executed(
        call(conn),
        "retry_after_expiry: the retry after the retention",
        "does the call's Config use this clock and this retention?",
    );
    (first, second)
}

/// Two copies of one request arrive at the same moment: two threads, each
/// with its own connection to `db`, are released together by a barrier and
/// make `call`. Checks that exactly one executed and the other replayed its
/// result, and returns that result.
///
/// # Panics
///
/// If a call fails or panics, or the two calls do not end as one execution
/// and one replay of the same result.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use idempotency::{run_idempotent, testing::{self, SqliteFile}};
///
/// let db = SqliteFile::new();
/// let runs = AtomicU32::new(0);
/// let result = testing::racing_duplicate(&db, |conn| {
///     run_idempotent(conn, "shop", "order-1", &"book", |_| {
///         Ok::<_, std::convert::Infallible>(runs.fetch_add(1, Ordering::SeqCst) + 1)
///     })
/// });
/// assert_eq!((result, runs.load(Ordering::SeqCst)), (1, 1));
/// # Ok(())
/// # }
/// ```
pub fn racing_duplicate<R, E, F>(db: &SqliteFile, call: F) -> R
where
    F: Fn(&mut SqliteConnection) -> Result<Outcome<R>, Error<E>> + Sync,
    R: PartialEq + Debug + Send,
    E: Debug + Send,
{
    let barrier = Barrier::new(2);
    let race = || {
        let mut conn = db.conn();
        barrier.wait();
        call(&mut conn)
    };
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(race);
        let b = scope.spawn(race);
        let join =
            |handle: std::thread::ScopedJoinHandle<'_, _>| handle.join().unwrap_or_else(|p| panic::resume_unwind(p));
        (join(a), join(b))
    });
    match (a, b) {
        (Ok(Outcome::Executed(executed)), Ok(Outcome::Replayed(replayed)))
        | (Ok(Outcome::Replayed(replayed)), Ok(Outcome::Executed(executed))) => {
            assert_eq!(
                replayed, executed,
                "racing_duplicate: the replay differs from the execution"
            );
            executed
        }
        (Err(error), _) | (_, Err(error)) => panic!("racing_duplicate: a call failed: {error:?}"),
        (a, b) => panic!("racing_duplicate: expected one execution and one replay, got {a:?} and {b:?}"),
    }
}
