//! MySQL and MariaDB as the bench runs them: a database of its own on the
//! server `MYSQL_URL` names, with the key table's columns as the crate's
//! MySQL migration declares them, so that the floor scenarios compare with
//! the same collations and widths. MySQL has no `RETURNING`: the domain
//! operation takes two statements here, which the floor shares.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use diesel::MysqlConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::sql_types::{BigInt, Text};
use serde_json::Value;

use crate::db::{Bench, KeyTable, Statement, find_key_in, new_order, orders};
use crate::server::{Figure, Probe, Task};

/// A statement MySQL executes.
pub trait Executable: ExecuteDsl<MysqlConnection> {}

impl<S: ExecuteDsl<MysqlConnection>> Executable for S {}

diesel::define_sql_function! {
    /// The id the last insert on this connection gave its row.
    fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
}

/// The key table's columns, as the crate's MySQL migration has them.
const KEY_COLUMNS: &str = "scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    response LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    created_at DATETIME(6) NOT NULL, completed_at DATETIME(6), expires_at DATETIME(6) NOT NULL";

/// A database of its own on the server named by `MYSQL_URL`.
impl Bench for MysqlConnection {
    const NAME: &'static str = "mysql";

    type Probe = MysqlProbe;

    fn create_tables(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!(
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, quantity INTEGER NOT NULL);
             CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key), INDEX floor_keys_expires_at (expires_at))
                 DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
             CREATE TABLE bare_keys ({KEY_COLUMNS}) DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;"
        ))
    }

    fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
        // Numbers from the cross product of six digit tables: MySQL caps
        // a recursive CTE at 1,000 steps by default.
        let inserted = diesel::sql_query(
            "INSERT INTO idempotency_keys
                 (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
             SELECT 'bench', MD5(n), SHA2(n, 256), 'completed', '12345',
                    '2000-01-01', '2000-01-01', TIMESTAMP('2000-01-02') + INTERVAL n SECOND
             FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d + 1 AS n
                   FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS a,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS b,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS c,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS e,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS f,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS g
                  ) AS numbers
             WHERE n <= ?",
        )
        .bind::<diesel::sql_types::BigInt, _>(records)
        .execute(self)?;
        self.batch_execute("ANALYZE TABLE idempotency_keys")?;
        Ok(inserted)
    }

    /// MySQL has no `RETURNING`: the id comes from the connection, a
    /// second statement.
    fn place_order(&mut self) -> QueryResult<i64> {
        diesel::insert_into(orders::table).values(new_order()).execute(self)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(self)?;
        Ok(id as i64)
    }

    fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
        ExecuteDsl::execute(statement, self)
    }

    fn find_key(&mut self, table: KeyTable, key: &str) -> QueryResult<bool> {
        find_key_in(self, table, key)
    }

    fn probe(&mut self) -> MysqlProbe {
        MysqlProbe::new(self)
    }
}

/// What MySQL and MariaDB tell of a connection's work: the redo log the
/// server wrote (`Innodb_os_log_written`, a count of the whole server), the
/// rows this session read and wrote (its handler counts, which
/// `Innodb_rows_*` would give for the whole server only, and MariaDB 10.11
/// not at all), and the CPU time of the thread that serves the connection,
/// where it runs on this host.
///
/// An update leaves its old version in the undo log, which InnoDB's purge
/// removes after the commit, writing redo of its own; a reading waits for
/// the purge to catch up (MariaDB's `Innodb_history_list_length` at 0), so
/// that a batch's redo includes the purge of what it left, and none of the
/// batch before.
pub struct MysqlProbe {
    /// Where the status variables are: `information_schema` on MariaDB,
    /// `performance_schema` on MySQL 8.
    schema: Option<&'static str>,
    /// Whether the server tells the length of its purge backlog.
    history: bool,
    /// What a reading adds to the session's counters itself.
    own: BTreeMap<String, i64>,
    thread: Option<Task>,
    notes: Vec<String>,
}

/// The session's handler counts and the server's redo log, by status name.
#[derive(QueryableByName)]
struct Status {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    value: i64,
}

#[derive(QueryableByName)]
struct ThreadId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// How long a reading waits for InnoDB's purge to catch up.
const PURGE_WAIT: Duration = Duration::from_secs(10);

/// The transactions whose undo log InnoDB's purge has yet to remove.
fn history_length(conn: &mut MysqlConnection, schema: &str) -> QueryResult<i64> {
    Ok(diesel::sql_query(format!(
        "SELECT 'history' AS name, CAST(variable_value AS SIGNED) AS value FROM {schema}.global_status \
         WHERE UPPER(variable_name) = 'INNODB_HISTORY_LIST_LENGTH'"
    ))
    .get_result::<Status>(conn)?
    .value)
}

const SESSION_COUNTS: &str = "'HANDLER_READ_KEY', 'HANDLER_WRITE', 'HANDLER_UPDATE', 'ROWS_READ'";

impl MysqlProbe {
    fn new(conn: &mut MysqlConnection) -> MysqlProbe {
        let mut probe = MysqlProbe {
            schema: None,
            history: false,
            own: BTreeMap::new(),
            thread: None,
            notes: Vec::new(),
        };
        let mut failures = Vec::new();
        for schema in ["information_schema", "performance_schema"] {
            match probe.status(conn, schema) {
                Ok(_) => {
                    probe.schema = Some(schema);
                    break;
                }
                Err(error) => failures.push(format!("{schema}: {error}")),
            }
        }
        match probe.schema {
            Some(schema) => {
                probe.history = history_length(conn, schema).is_ok();
                if !probe.history {
                    probe.notes.push(
                        "redo: the purge of the undo log is not waited for (no Innodb_history_list_length), \
                         so a batch's redo may hold some of the batch before's"
                            .to_owned(),
                    );
                }
                // The reading's own counts show in the reading after it.
                let first = probe.status(conn, schema).unwrap_or_default();
                let second = probe.status(conn, schema).unwrap_or_default();
                probe.own = second
                    .iter()
                    .map(|(name, value)| (name.clone(), value - first.get(name).copied().unwrap_or(0)))
                    .collect();
            }
            None => probe.notes.push(format!(
                "redo log and rows: not measured (no status table: {})",
                failures.join("; ")
            )),
        }
        let thread =
            diesel::sql_query("SELECT tid AS id FROM information_schema.processlist WHERE id = CONNECTION_ID()")
                .get_result::<ThreadId>(conn)
                .or_else(|_| {
                    diesel::sql_query(
                    "SELECT thread_os_id AS id FROM performance_schema.threads WHERE processlist_id = CONNECTION_ID()",
                )
                .get_result::<ThreadId>(conn)
                });
        probe.thread = match thread {
            Ok(thread) => Task::server(thread.id as u64, &["mariadbd", "mysqld"])
                .map_err(|reason| probe.notes.push(format!("server CPU: not measured ({reason})")))
                .ok(),
            Err(error) => {
                probe.notes.push(format!(
                    "server CPU: not measured (the thread that serves the connection is not known: {error})"
                ));
                None
            }
        };
        probe
    }

    fn status(&self, conn: &mut MysqlConnection, schema: &str) -> QueryResult<BTreeMap<String, i64>> {
        let rows: Vec<Status> = diesel::sql_query(format!(
            "SELECT UPPER(variable_name) AS name, CAST(variable_value AS SIGNED) AS value \
             FROM {schema}.session_status WHERE UPPER(variable_name) IN ({SESSION_COUNTS}) \
             UNION ALL \
             SELECT UPPER(variable_name), CAST(variable_value AS SIGNED) \
             FROM {schema}.global_status WHERE UPPER(variable_name) = 'INNODB_OS_LOG_WRITTEN'"
        ))
        .load(conn)?;
        Ok(rows.into_iter().map(|row| (row.name, row.value)).collect())
    }
}

impl Probe<MysqlConnection> for MysqlProbe {
    type Reading = BTreeMap<String, i64>;

    fn read(&mut self, conn: &mut MysqlConnection) -> Option<Self::Reading> {
        let schema = self.schema?;
        if self.history {
            let deadline = Instant::now() + PURGE_WAIT;
            loop {
                match history_length(conn, schema) {
                    Ok(0) => break,
                    Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    Ok(_) => {
                        self.notes.push(format!(
                            "the purge had not caught up after {} s before a reading (other sessions' \
                             transactions?): that batch's redo holds some of another's",
                            PURGE_WAIT.as_secs()
                        ));
                        break;
                    }
                    Err(error) => {
                        self.notes
                            .push(format!("the purge's backlog could not be read: {error}"));
                        break;
                    }
                }
            }
        }
        self.status(conn, schema)
            .map_err(|error| {
                self.notes
                    .push(format!("a reading of the server's counters failed: {error}"))
            })
            .ok()
    }

    fn figures(
        &mut self,
        _conn: &mut MysqlConnection,
        before: &Self::Reading,
        after: &Self::Reading,
        calls: usize,
    ) -> (Vec<Figure>, Value) {
        let per = |name: &str| match (before.get(name), after.get(name)) {
            (Some(before), Some(after)) => {
                (after - before - self.own.get(name).copied().unwrap_or(0)) as f64 / calls as f64
            }
            _ => f64::NAN,
        };
        let figures = vec![
            Figure::new("redo_bytes", "redo bytes", per("INNODB_OS_LOG_WRITTEN")),
            Figure::new("rows_read", "rows read", per("ROWS_READ")),
            Figure::new("index_lookups", "index lookups", per("HANDLER_READ_KEY")),
            Figure::new("inserted", "rows inserted", per("HANDLER_WRITE")),
            Figure::new("updated", "rows updated", per("HANDLER_UPDATE")),
        ];
        (figures, Value::Null)
    }

    fn server_task(&self) -> Option<&Task> {
        self.thread.as_ref()
    }

    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }
}
