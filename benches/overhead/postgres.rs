//! PostgreSQL as the bench runs it: a schema of its own in the database
//! `DATABASE_URL` names. The large table is analysed once filled, as
//! autovacuum would do in time, so that the planner knows its size.

use diesel::PgConnection;
use diesel::connection::{AnsiTransactionManager, SimpleConnection};
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::sql_types::{BigInt, Bool, Double, Text};
use serde_json::{Value, json};

use crate::db::{Bench, FloorRecord, KEY_COLUMNS, KeyTable, Statement, find_key_in, place_order_returning_id};
use crate::server::{Figure, Probe, Task};
use crate::stats::round3;

/// A statement PostgreSQL executes.
pub trait Executable: ExecuteDsl<PgConnection> {}

impl<S: ExecuteDsl<PgConnection>> Executable for S {}

/// A schema of its own in the database named by `DATABASE_URL`.
impl Bench for PgConnection {
    const NAME: &'static str = "postgres";

    type Probe = PgProbe;

    fn create_tables(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!(
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL);
             CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key));
             CREATE INDEX floor_keys_expires_at ON floor_keys (expires_at);
             CREATE TABLE bare_keys ({KEY_COLUMNS});"
        ))
    }

    fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
        let inserted = diesel::sql_query(
            "INSERT INTO idempotency_keys
                 (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
             SELECT 'bench', md5(g::text), md5(g::text) || md5(g::text), 'completed', '12345',
                    timestamp '2000-01-01', timestamp '2000-01-01', timestamp '2000-01-02' + g * interval '1 second'
             FROM generate_series(1, $1) AS g",
        )
        .bind::<diesel::sql_types::BigInt, _>(records)
        .execute(self)?;
        self.batch_execute("ANALYZE idempotency_keys")?;
        Ok(inserted)
    }

    fn place_order(&mut self) -> QueryResult<i64> {
        place_order_returning_id(self)
    }

    fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
        ExecuteDsl::execute(statement, self)
    }

    fn find_key(&mut self, table: KeyTable, key: &str) -> QueryResult<bool> {
        find_key_in(self, table, key)
    }

    /// The claim as the crate's is sent: simple-query text after `BEGIN`, in
    /// its round trip, the values written as literals.
    fn begin_claim(&mut self, claim: &FloorRecord<'_>) -> QueryResult<()> {
        let text = |value: &str| format!("E'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"));
        let time = |at: chrono::NaiveDateTime| format!("'{}'::timestamp", at.format("%Y-%m-%d %H:%M:%S%.6f"));
        let sql = format!(
            "BEGIN; INSERT INTO floor_keys (scope, idempotency_key, request_hash, status, created_at, expires_at) \
             VALUES ({}, {}, {}, {}, {}, {})",
            text(claim.scope),
            text(claim.idempotency_key),
            text(claim.request_hash),
            text(claim.status),
            time(claim.created_at),
            time(claim.expires_at),
        );
        AnsiTransactionManager::begin_transaction_sql(self, &sql)
    }

    fn probe(&mut self) -> PgProbe {
        PgProbe::new(self)
    }
}

/// What PostgreSQL tells of a connection's work: the log it wrote (the
/// insert position of the write-ahead log, a count of the whole server, and
/// with `pg_walinspect` the records of this connection's transactions by
/// kind), the rows and buffers of the bench schema's tables (the
/// statistics views, flushed on demand since PostgreSQL 15), the CPU time
/// of the connection's backend process (where it runs on this host), and
/// with `pg_stat_statements` every statement's time, buffers and log.
pub struct PgProbe {
    /// Whether the session's statistics can be flushed before a reading.
    flush: bool,
    /// The schema `pg_walinspect`'s functions are in.
    walinspect: Option<String>,
    /// The schema `pg_stat_statements`'s view is in.
    statements: Option<String>,
    backend: Option<Task>,
    notes: Vec<String>,
}

/// The counters of a [`PgProbe`] at one moment.
pub struct PgReading {
    lsn: String,
    counters: Counters,
    statements: Vec<StatementRow>,
}

#[derive(QueryableByName, Clone, Copy, Default)]
struct Counters {
    #[diesel(sql_type = Double)]
    wal: f64,
    #[diesel(sql_type = Double)]
    inserted: f64,
    #[diesel(sql_type = Double)]
    updated: f64,
    #[diesel(sql_type = Double)]
    hot_updated: f64,
    #[diesel(sql_type = Double)]
    hit: f64,
    #[diesel(sql_type = Double)]
    read: f64,
}

#[derive(QueryableByName)]
struct Lsn {
    #[diesel(sql_type = Text)]
    lsn: String,
}

/// One statement's totals in `pg_stat_statements`.
#[derive(QueryableByName, Clone)]
struct StatementRow {
    #[diesel(sql_type = BigInt)]
    queryid: i64,
    #[diesel(sql_type = Bool)]
    toplevel: bool,
    #[diesel(sql_type = Text)]
    query: String,
    #[diesel(sql_type = Double)]
    calls: f64,
    #[diesel(sql_type = Double)]
    exec_ms: f64,
    #[diesel(sql_type = Double)]
    plan_ms: f64,
    #[diesel(sql_type = Double)]
    hit: f64,
    #[diesel(sql_type = Double)]
    read: f64,
    #[diesel(sql_type = Double)]
    dirtied: f64,
    #[diesel(sql_type = Double)]
    wal: f64,
}

/// Log records of one kind in a batch.
#[derive(QueryableByName)]
struct RecordKind {
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Double)]
    records: f64,
    #[diesel(sql_type = Double)]
    bytes: f64,
    #[diesel(sql_type = Double)]
    fpi_bytes: f64,
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = Text)]
    value: String,
}

/// The schema extension `name` is installed in, creating it in the bench's
/// schema (dropped with it) where the database has none.
fn extension_schema(conn: &mut PgConnection, name: &str) -> QueryResult<String> {
    let find = || {
        diesel::sql_query(
            "SELECT n.nspname AS value FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace \
             WHERE e.extname = $1",
        )
        .bind::<Text, _>(name.to_owned())
    };
    if let Some(found) = find().get_result::<One>(conn).optional()? {
        return Ok(found.value);
    }
    let schema = current_schema(conn)?;
    conn.batch_execute(&format!("CREATE EXTENSION {name} SCHEMA {schema}"))?;
    Ok(find().get_result::<One>(conn)?.value)
}

fn current_schema(conn: &mut PgConnection) -> QueryResult<String> {
    Ok(diesel::sql_query("SELECT current_schema() AS value")
        .get_result::<One>(conn)?
        .value)
}

/// The bench schema's relations whose blocks the log names: tables, their
/// indexes and their TOAST tables.
const OWN_FILENODES: &str = "SELECT pg_relation_filenode(c.oid)::text FROM pg_class c \
     WHERE c.relnamespace = current_schema()::regnamespace AND pg_relation_filenode(c.oid) IS NOT NULL \
     UNION SELECT pg_relation_filenode(c.reltoastrelid)::text FROM pg_class c \
     WHERE c.relnamespace = current_schema()::regnamespace AND c.reltoastrelid <> 0";

impl PgProbe {
    fn new(conn: &mut PgConnection) -> PgProbe {
        let mut notes = Vec::new();
        let flush = diesel::sql_query("SELECT pg_stat_force_next_flush()")
            .execute(conn)
            .is_ok();
        if !flush {
            notes.push(
                "rows, HOT share and buffers: not measured (the session's statistics are flushed on demand \
                 from PostgreSQL 15 on)"
                    .to_owned(),
            );
        }
        let walinspect = extension_schema(conn, "pg_walinspect")
            .and_then(|schema| {
                let allowed = diesel::sql_query(format!(
                    "SELECT has_function_privilege('{schema}.pg_get_wal_records_info(pg_lsn, pg_lsn)', 'EXECUTE')::text \
                     AS value"
                ))
                .get_result::<One>(conn)?;
                Ok((allowed.value == "true").then_some(schema))
            })
            .map_err(|error| error.to_string())
            .and_then(|schema| schema.ok_or_else(|| String::from("its functions are for superusers")))
            .map_err(|error| notes.push(format!("log records by kind: not measured (pg_walinspect: {error})")))
            .ok();
        let preloaded = diesel::sql_query("SELECT current_setting('shared_preload_libraries') AS value")
            .get_result::<One>(conn)
            .map(|libraries| libraries.value.contains("pg_stat_statements"))
            .unwrap_or(false);
        let statements = if preloaded {
            extension_schema(conn, "pg_stat_statements")
                .and_then(|schema| {
                    diesel::sql_query(format!("SELECT count(*) FROM {schema}.pg_stat_statements"))
                        .execute(conn)
                        .map(|_| schema)
                })
                .map_err(|error| notes.push(format!("statements by pg_stat_statements: not measured ({error})")))
                .ok()
                .inspect(|_| {
                    // Planning times as well, where the session may say so
                    // (a superuser's).
                    let _ = conn.batch_execute("SET pg_stat_statements.track_planning = on");
                })
        } else {
            notes.push(
                "statements by pg_stat_statements (server time, buffers and log per statement): not measured \
                 (not in shared_preload_libraries, which takes a server restart)"
                    .to_owned(),
            );
            None
        };
        let backend = diesel::sql_query("SELECT pg_backend_pid()::text AS value")
            .get_result::<One>(conn)
            .map_err(|error| error.to_string())
            .and_then(|pid| pid.value.parse::<u64>().map_err(|error| error.to_string()))
            .and_then(|pid| Task::server(pid, &["postgres"]))
            .map_err(|reason| notes.push(format!("server CPU: not measured ({reason})")))
            .ok();
        PgProbe {
            flush,
            walinspect,
            statements,
            backend,
            notes,
        }
    }

    fn counters(&self, conn: &mut PgConnection) -> QueryResult<Counters> {
        if self.flush {
            diesel::sql_query("SELECT pg_stat_force_next_flush()").execute(conn)?;
        }
        diesel::sql_query(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8 AS wal, \
                    coalesce(sum(t.n_tup_ins), 0)::float8 AS inserted, \
                    coalesce(sum(t.n_tup_upd), 0)::float8 AS updated, \
                    coalesce(sum(t.n_tup_hot_upd), 0)::float8 AS hot_updated, \
                    coalesce(sum(io.heap_blks_hit + coalesce(io.idx_blks_hit, 0) \
                        + coalesce(io.toast_blks_hit, 0) + coalesce(io.tidx_blks_hit, 0)), 0)::float8 AS hit, \
                    coalesce(sum(io.heap_blks_read + coalesce(io.idx_blks_read, 0) \
                        + coalesce(io.toast_blks_read, 0) + coalesce(io.tidx_blks_read, 0)), 0)::float8 AS read \
             FROM pg_stat_user_tables t JOIN pg_statio_user_tables io USING (relid) \
             WHERE t.schemaname = current_schema()",
        )
        .get_result(conn)
    }

    fn statement_rows(&self, conn: &mut PgConnection) -> QueryResult<Vec<StatementRow>> {
        let Some(schema) = &self.statements else {
            return Ok(Vec::new());
        };
        diesel::sql_query(format!(
            "SELECT queryid, toplevel, query, calls::float8 AS calls, total_exec_time AS exec_ms, \
                    total_plan_time AS plan_ms, shared_blks_hit::float8 AS hit, shared_blks_read::float8 AS read, \
                    shared_blks_dirtied::float8 AS dirtied, wal_bytes::float8 AS wal \
             FROM {schema}.pg_stat_statements \
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND userid = current_user::regrole AND queryid IS NOT NULL"
        ))
        .load(conn)
    }

    /// The log records of the transactions that touched the bench schema
    /// between `from` and `to`, and the records without a transaction on
    /// its relations (pruning, hint bits), by kind; other sessions' records
    /// are left out.
    fn records(&self, conn: &mut PgConnection, from: &str, to: &str) -> QueryResult<Vec<RecordKind>> {
        let Some(schema) = &self.walinspect else {
            return Ok(Vec::new());
        };
        // The log's records can be read up to where it is flushed; a batch
        // that wrote nothing may start beyond that.
        let span =
            diesel::sql_query("SELECT (least($2::pg_lsn, pg_current_wal_flush_lsn()) > $1::pg_lsn)::text AS value")
                .bind::<Text, _>(from)
                .bind::<Text, _>(to)
                .get_result::<One>(conn)?;
        if span.value != "true" {
            return Ok(Vec::new());
        }
        diesel::sql_query(format!(
            "WITH own AS ({OWN_FILENODES}), \
             records AS ( \
                 SELECT r.resource_manager || '/' || r.record_type AS kind, r.xid::text AS xid, \
                        r.record_length, r.fpi_length, \
                        ARRAY(SELECT m[1] FROM regexp_matches(coalesce(r.block_ref, ''), 'rel \\d+/\\d+/(\\d+)', 'g') AS m) \
                            && ARRAY(SELECT * FROM own) AS touches \
                 FROM {schema}.pg_get_wal_records_info($1::pg_lsn, least($2::pg_lsn, pg_current_wal_flush_lsn())) r), \
             transactions AS (SELECT DISTINCT xid FROM records WHERE touches AND xid <> '0') \
             SELECT kind, count(*)::float8 AS records, sum(record_length)::float8 AS bytes, \
                    sum(fpi_length)::float8 AS fpi_bytes \
             FROM records WHERE touches OR xid IN (SELECT xid FROM transactions) \
             GROUP BY kind ORDER BY kind"
        ))
        .bind::<Text, _>(from)
        .bind::<Text, _>(to)
        .load(conn)
    }
}

impl Probe<PgConnection> for PgProbe {
    type Reading = PgReading;

    fn read(&mut self, conn: &mut PgConnection) -> Option<PgReading> {
        let reading = (|| {
            let statements = self.statement_rows(conn)?;
            let counters = self.counters(conn)?;
            let lsn = diesel::sql_query("SELECT pg_current_wal_insert_lsn()::text AS lsn").get_result::<Lsn>(conn)?;
            Ok::<_, diesel::result::Error>(PgReading {
                lsn: lsn.lsn,
                counters,
                statements,
            })
        })();
        reading
            .map_err(|error| {
                self.notes
                    .push(format!("a reading of the server's counters failed: {error}"))
            })
            .ok()
    }

    fn figures(
        &mut self,
        conn: &mut PgConnection,
        before: &PgReading,
        after: &PgReading,
        calls: usize,
    ) -> (Vec<Figure>, Value) {
        let (b, a) = (before.counters, after.counters);
        let per = |from: f64, to: f64| (to - from) / calls as f64;
        let updated = a.updated - b.updated;
        let mut figures = vec![Figure::new("wal_bytes", "WAL bytes", per(b.wal, a.wal))];
        if self.flush {
            figures.extend([
                Figure::new("inserted", "rows inserted", per(b.inserted, a.inserted)),
                Figure::new("updated", "rows updated", per(b.updated, a.updated)),
                Figure::new(
                    "hot_share",
                    "HOT share of updates",
                    if updated > 0.0 {
                        (a.hot_updated - b.hot_updated) / updated
                    } else {
                        f64::NAN
                    },
                ),
                Figure::new("buffers_hit", "buffers hit", per(b.hit, a.hit)),
                Figure::new("buffers_read", "buffers read", per(b.read, a.read)),
            ]);
        }
        let mut detail = serde_json::Map::new();
        if self.walinspect.is_some() {
            match self.records(conn, &before.lsn, &after.lsn) {
                Ok(kinds) => {
                    // Folded from zero: the sum of no records is 0, not -0.
                    let records = kinds.iter().fold(0.0, |sum, kind| sum + kind.records);
                    let bytes = kinds.iter().fold(0.0, |sum, kind| sum + kind.bytes);
                    figures.push(Figure::new("wal_records", "WAL records", records / calls as f64));
                    figures.push(Figure::new("own_wal_bytes", "their bytes", bytes / calls as f64));
                    let kinds: Vec<Value> = kinds
                        .iter()
                        .map(|kind| {
                            json!({
                                "kind": kind.kind,
                                "per_call": round3(kind.records / calls as f64),
                                "bytes_each": round3(kind.bytes / kind.records),
                                "fpi_bytes_per_call": round3(kind.fpi_bytes / calls as f64),
                            })
                        })
                        .collect();
                    detail.insert("wal_records".into(), kinds.into());
                }
                Err(error) => self.notes.push(format!("log records by kind: not measured ({error})")),
            }
        }
        if self.statements.is_some() {
            detail.insert(
                "pg_stat_statements".into(),
                statement_deltas(before, after, calls).into(),
            );
        }
        (figures, Value::Object(detail))
    }

    fn server_task(&self) -> Option<&Task> {
        self.backend.as_ref()
    }

    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }
}

/// Per statement of the batch between `before` and `after`, per call: its
/// count, server time (execution and planning), buffers and log, as
/// `pg_stat_statements` counts them. The probe's own statements are left
/// out; the same statement sent by another session meanwhile (a `BEGIN`,
/// a `COMMIT`) is not.
fn statement_deltas(before: &PgReading, after: &PgReading, calls: usize) -> Vec<Value> {
    let calls = calls as f64;
    let mut rows: Vec<Value> = after
        .statements
        .iter()
        .filter(|row| {
            // The probe's readings: pg_stat_statements, the statistics
            // views and their flush, the log's position.
            !["pg_stat_", "pg_current_wal_"]
                .iter()
                .any(|own| row.query.contains(own))
        })
        .filter_map(|row| {
            let old = before
                .statements
                .iter()
                .find(|old| old.queryid == row.queryid && old.toplevel == row.toplevel);
            let delta = |value: fn(&StatementRow) -> f64| value(row) - old.map_or(0.0, value);
            let count = delta(|row| row.calls);
            (count > 0.0).then(|| {
                json!({
                    "statement": row.query.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(64).collect::<String>(),
                    "toplevel": row.toplevel,
                    "per_call": round3(count / calls),
                    "exec_us_each": round3(delta(|row| row.exec_ms) * 1e3 / count),
                    "plan_us_each": round3(delta(|row| row.plan_ms) * 1e3 / count),
                    "buffers_hit_each": round3(delta(|row| row.hit) / count),
                    "buffers_read_each": round3(delta(|row| row.read) / count),
                    "buffers_dirtied_each": round3(delta(|row| row.dirtied) / count),
                    "wal_bytes_each": round3(delta(|row| row.wal) / count),
                })
            })
        })
        .collect();
    rows.sort_by(|a, b| a["statement"].as_str().cmp(&b["statement"].as_str()));
    rows
}
