//! PostgreSQL test databases: a schema of its own per test in the database
//! named by `DATABASE_URL`, reached through `search_path`, and dropped when
//! the test ends. Without `DATABASE_URL` the tests fail; they never skip.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};

use super::{Isolation, ServerDb, TestDb};

pub struct Db {
    url: String,
    _schema: super::OnServer,
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "the postgres tests need DATABASE_URL, e.g. DATABASE_URL=postgres://localhost/test \
         cargo test --features postgres",
    )
}

impl TestDb for Db {
    type Conn = PgConnection;
    const BACKEND: &'static str = "postgres";
    const SETUP: &'static str =
        "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL)";
    const SERVICE_SETUP: &'static str = "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, \
        account TEXT NOT NULL, item TEXT NOT NULL, quantity INTEGER NOT NULL)";
    const WRITES_KEY_RECORD_ONCE: bool = false;

    fn empty() -> Db {
        let base_url = database_url();
        let schema = super::unique_name("idem_test");
        let url = super::own::url_with_search_path(&base_url, &schema);
        let create = format!("CREATE SCHEMA {schema}");
        let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
        let own = super::OnServer::create::<PgConnection>(&base_url, &create, drop);
        Db { url, _schema: own }
    }

    fn url(&self) -> &str {
        &self.url
    }

    super::same_on_every_backend!(PgConnection, with_returning);

    fn await_order_writers(conn: &mut PgConnection) {
        // A COMMIT a client sent just before it died may still be in the
        // server's hands; this lock waits for every transaction that wrote
        // orders to end.
        conn.transaction(|tx| diesel::sql_query("LOCK TABLE orders IN SHARE MODE").execute(tx))
            .expect("wait for the transactions that wrote orders");
    }
}

impl ServerDb for Db {
    fn session_id(conn: &mut PgConnection) -> i64 {
        backend_pid(conn).into()
    }

    fn kill_session(admin: &mut PgConnection, id: i64) {
        diesel::sql_query("SELECT pg_terminate_backend($1)")
            .bind::<Integer, _>(pid(id))
            .execute(admin)
            .expect("terminate a backend");
    }

    fn session_exists(admin: &mut PgConnection, id: i64) -> bool {
        backend_state(admin, pid(id)).is_some()
    }

    fn session_is_idle(admin: &mut PgConnection, id: i64) -> bool {
        backend_state(admin, pid(id)).as_deref() == Some("idle")
    }

    fn session_waits_for_a_key(admin: &mut PgConnection, id: i64) -> bool {
        diesel::sql_query("SELECT count(*) AS n FROM pg_locks WHERE pid = $1 AND NOT granted")
            .bind::<Integer, _>(pid(id))
            .get_result::<Count>(admin)
            .expect("read pg_locks")
            .n
            > 0
    }

    fn key_lock_holder(&self, admin: &mut PgConnection, scope: &str, key: &str) -> Option<i64> {
        // The crate's lock: the two-integer advisory lock on the first 64
        // bits of the key's hash; `pg_locks` shows both halves as oids.
        let hash = super::key_hash(scope, key);
        let half = |bytes: &[u8]| i64::from(u32::from_be_bytes(bytes.try_into().expect("four bytes")));
        #[derive(QueryableByName)]
        struct Holder {
            #[diesel(sql_type = BigInt)]
            pid: i64,
        }
        diesel::sql_query(
            "SELECT pid::bigint AS pid FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND classid::bigint = $1 AND objid::bigint = $2",
        )
        .bind::<BigInt, _>(half(&hash[..4]))
        .bind::<BigInt, _>(half(&hash[4..8]))
        .get_result::<Holder>(admin)
        .optional()
        .expect("read pg_locks")
        .map(|holder| holder.pid)
    }

    fn lock_wait_setting(conn: &mut PgConnection) -> String {
        show_lock_timeout(conn)
    }

    fn set_lock_wait_to_seven_seconds(tx: &mut PgConnection) -> QueryResult<String> {
        tx.batch_execute("SET LOCAL lock_timeout = '7s'")?;
        Ok("7s".to_owned())
    }

    fn set_session_isolation(conn: &mut PgConnection, isolation: Isolation) {
        conn.batch_execute(&format!(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {}",
            isolation.sql()
        ))
        .expect("set the session's isolation level");
    }

    fn isolation(conn: &mut PgConnection) -> QueryResult<String> {
        #[derive(QueryableByName)]
        struct Level {
            #[diesel(sql_type = Text)]
            level: String,
        }
        Ok(
            diesel::sql_query("SELECT current_setting('transaction_isolation') AS level")
                .get_result::<Level>(conn)?
                .level,
        )
    }

    fn isolation_name(isolation: Isolation) -> String {
        isolation.sql().to_lowercase()
    }
}

/// A session id as the backend pid it is.
fn pid(id: i64) -> i32 {
    i32::try_from(id).expect("a backend pid")
}

/// The server process serving `conn`.
pub fn backend_pid(conn: &mut PgConnection) -> i32 {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(conn)
        .expect("read the backend pid")
        .pid
}

/// The session's `lock_timeout` as `SHOW` reports it.
pub fn show_lock_timeout(conn: &mut PgConnection) -> String {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = Text)]
        lock_timeout: String,
    }
    diesel::sql_query("SHOW lock_timeout")
        .get_result::<Setting>(conn)
        .expect("show lock_timeout")
        .lock_timeout
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The state of session `pid` in `pg_stat_activity` (`idle`, `idle in
/// transaction`, ...); `None` once the session has ended.
pub fn backend_state(admin: &mut PgConnection, pid: i32) -> Option<String> {
    activity(admin, pid, "state")
}

/// Column `column` of session `pid` in `pg_stat_activity`, empty where it is
/// null; `None` once the session has ended.
pub fn activity(admin: &mut PgConnection, pid: i32, column: &str) -> Option<String> {
    #[derive(QueryableByName)]
    struct Activity {
        #[diesel(sql_type = Text)]
        value: String,
    }
    diesel::sql_query(format!(
        "SELECT coalesce({column}::text, '') AS value FROM pg_stat_activity WHERE pid = $1"
    ))
    .bind::<Integer, _>(pid)
    .get_result::<Activity>(admin)
    .optional()
    .expect("read pg_stat_activity")
    .map(|row| row.value)
}
