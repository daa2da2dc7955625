//! The crate on Citus: its tables distributed by `scope` and co-located with
//! a tenant's domain rows, calls through the coordinator and a worker.
//!
//! Each test gets a schema of its own on the cluster named by
//! `CITUS_DATABASE_URL` (the coordinator), reached through `search_path`,
//! with the crate's migrations, a domain table `orders` distributed by
//! `account`, and the crate's tables distributed by `scope` and co-located
//! with it by `idempotency::citus::distribute`. Citus names every shard with its schema in the statements it
//! sends to the workers, so the schema reaches the shards without a
//! `search_path` on the workers.
//!
//! The tests take turns: one of them counts the statements that reached each
//! worker, which another test's traffic would disturb. They need
//! `CITUS_DATABASE_URL` and fail without it; `.ci/citus` starts a cluster and
//! `.ci/run` runs them. With `diesel-async`, the async call and phased
//! operations with async steps are tested through the coordinator as well.
//! They are ignored unless asked for (`-- --include-ignored`), so that
//! `cargo test --features postgres` runs without a cluster.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Integer, Text};
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent};
use serde::Serialize;

#[cfg(feature = "diesel-async")]
mod asynchronous;
mod services;
mod setup;

// The parts of the main suite's harness that stand on nothing else of it;
// this suite uses some of each.
#[allow(dead_code)]
#[path = "../it/common/own.rs"]
mod own;
#[allow(dead_code)]
#[path = "../it/common/race.rs"]
mod race;
#[allow(dead_code)]
#[path = "../it/common/wait.rs"]
mod wait;

mod faults;

diesel::table! {
    orders (account, id) {
        account -> Text,
        id -> BigInt,
        item -> Text,
    }
}

diesel::table! {
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        status -> Text,
    }
}

#[derive(Serialize)]
struct PlaceOrder<'a> {
    item: &'a str,
}

fn citus_url() -> String {
    std::env::var("CITUS_DATABASE_URL").expect(
        "the Citus tests need CITUS_DATABASE_URL, the coordinator of a running cluster: \
         .ci/citus start DIR && CITUS_DATABASE_URL=$(.ci/citus url DIR) \
         cargo test --features postgres --test citus -- --include-ignored",
    )
}

/// One test at a time on the cluster: one of them counts the statements
/// that reached each worker, which another test's traffic would disturb,
/// and another restarts a worker.
fn take_turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A schema of its own on the cluster, dropped (with its shards) at the
/// end, and the test's turn on the cluster, given back after that.
struct Db {
    base_url: String,
    url: String,
    schema: String,
    _schema: own::OnServer,
    _turn: MutexGuard<'static, ()>,
}

impl Db {
    /// The schema with the crate's tables distributed beside `orders`.
    fn new() -> Db {
        let db = Db::undistributed();
        let mut conn = db.conn();
        idempotency::citus::distribute(&mut conn, "orders").expect("distribute the crate's tables");
        assert_distributed(&mut conn, &db.schema);
        db
    }

    /// The schema with the crate's migrations and `orders` distributed by
    /// `account`; the crate's tables still local.
    fn undistributed() -> Db {
        let turn = take_turn();
        let base_url = citus_url();
        let schema = own::unique_name("idem_citus");
        let url = own::url_with_search_path(&base_url, &schema);
        let create = format!("CREATE SCHEMA {schema}");
        let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
        let own = own::OnServer::create::<PgConnection>(&base_url, &create, drop);
        let db = Db {
            base_url,
            url,
            schema,
            _schema: own,
            _turn: turn,
        };
        let mut conn = db.conn();
        idempotency::run_migrations(&mut conn).expect("migrate");
        for statement in [
            "CREATE TABLE orders (account TEXT NOT NULL, id BIGSERIAL, item TEXT NOT NULL, PRIMARY KEY (account, id))",
            "SELECT create_distributed_table('orders', 'account')",
        ] {
            conn.batch_execute(statement)
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
        db
    }

    /// [`Db::new`], and a session in its schema.
    fn with_session() -> (Db, PgConnection) {
        let db = Db::new();
        let conn = db.conn();
        (db, conn)
    }

    fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).expect("connect to the test schema")
    }

    /// A session on the coordinator outside the test's schema.
    fn coordinator(&self) -> PgConnection {
        PgConnection::establish(&self.base_url).expect("connect to CITUS_DATABASE_URL")
    }

    fn pool(&self, size: u32) -> Pool<ConnectionManager<PgConnection>> {
        Pool::builder()
            .max_size(size)
            .build(ConnectionManager::new(&self.url))
            .expect("build a pool")
    }
}

fn place_order(tx: &mut PgConnection, account: &str, item: &str) -> QueryResult<i64> {
    diesel::insert_into(orders::table)
        .values((orders::account.eq(account), orders::item.eq(item)))
        .returning(orders::id)
        .get_result(tx)
}

/// How many orders the tenant `account` has, and how many key records its
/// scope of the same name.
fn orders_and_key_records(conn: &mut PgConnection, account: &str) -> (i64, i64) {
    let orders = orders::table
        .filter(orders::account.eq(account))
        .count()
        .get_result(conn)
        .expect("count orders");
    let keys = idempotency_keys::table
        .filter(idempotency_keys::scope.eq(account))
        .count()
        .get_result(conn)
        .expect("count key records");
    (orders, keys)
}

#[derive(QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    line: String,
}

fn lines(conn: &mut PgConnection, query: &str) -> Vec<String> {
    diesel::sql_query(query)
        .load::<Line>(conn)
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .into_iter()
        .map(|l| l.line)
        .collect()
}

/// The three tables are hash-distributed in the test's schema, co-located,
/// and spread over both workers: the setup itself is under test.
fn assert_distributed(conn: &mut PgConnection, schema: &str) {
    let tables = lines(
        conn,
        "SELECT c.relnamespace::regnamespace::text || '.' || c.relname
                || ' ' || p.partmethod::text || ' ' || p.colocationid AS line
         FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
         WHERE p.logicalrelid IN ('orders'::regclass, 'idempotency_keys'::regclass, 'idempotency_phases'::regclass,
                                  'idempotency_outbox'::regclass)
         ORDER BY 1",
    );
    assert!(
        tables.iter().all(|t| t.starts_with(&format!("{schema}."))),
        "the tables of the test schema: {tables:?}"
    );
    assert_eq!(tables.len(), 4, "four distributed tables in {schema}: {tables:?}");
    let colocations: BTreeSet<&str> = tables.iter().filter_map(|t| t.rsplit(' ').next()).collect();
    assert_eq!(colocations.len(), 1, "co-located: {tables:?}");
    assert!(tables.iter().all(|t| t.contains(" h ")), "hash-distributed: {tables:?}");
    let nodes = lines(
        conn,
        "SELECT DISTINCT nodename || ':' || nodeport AS line FROM citus_shards WHERE table_name = 'orders'::regclass",
    );
    assert_eq!(
        nodes.len(),
        2,
        "the shards of orders spread over both workers: {nodes:?}"
    );
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn a_retry_replays_and_another_request_mismatches() {
    let (_db, mut conn) = Db::with_session();
    let calls = AtomicUsize::new(0);
    let place = |conn: &mut PgConnection, item: &str| {
        run_idempotent(conn, "acct-1", "order-1", &PlaceOrder { item }, |tx| {
            calls.fetch_add(1, Ordering::SeqCst);
            place_order(tx, "acct-1", item)
        })
    };

    let first = place(&mut conn, "book").expect("the first call");
    let Outcome::Executed(id) = first else {
        panic!("the first call executes: {first:?}")
    };
    assert_eq!(
        place(&mut conn, "book").expect("the retry"),
        Outcome::Replayed(id),
        "the retry replays"
    );
    let other = place(&mut conn, "lamp");
    assert!(matches!(other, Err(Error::Mismatch)), "another request: {other:?}");

    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_eq!(orders_and_key_records(&mut conn, "acct-1"), (1, 1));
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn racing_retries_execute_once() {
    const THREADS: usize = 32;
    let db = Db::new();
    let pool = db.pool(u32::try_from(THREADS).expect("small"));
    let barrier = Arc::new(wait::Barrier::new(THREADS));
    let calls = Arc::new(AtomicUsize::new(0));
    // Every waiter queues on the key's lock behind the holder and the
    // replays before it; far beyond what they need.
    let config = Arc::new(Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(60))));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (pool, barrier, calls, config) = (pool.clone(), barrier.clone(), calls.clone(), config.clone());
            thread::spawn(move || {
                let mut conn = pool.get().expect("pooled connection");
                barrier.wait();
                config
                    .run(&mut conn, "acct-race", "one-key", &PlaceOrder { item: "book" }, |tx| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        // Work that keeps the key held while the others arrive.
                        thread::sleep(std::time::Duration::from_millis(20));
                        place_order(tx, "acct-race", "book")
                    })
                    .expect("every request succeeds")
            })
        })
        .collect();
    let outcomes: Vec<Outcome<i64>> = handles.into_iter().map(|h| wait::join(h, "a racing thread")).collect();

    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    race::assert_one_executed_and_all_saw_it(outcomes);
    let mut conn = db.conn();
    assert_eq!(orders_and_key_records(&mut conn, "acct-race"), (1, 1));
}

/// A worker as the coordinator lists it, reached directly with the
/// coordinator's user and database.
struct Worker {
    name: String,
    url: String,
    conn: PgConnection,
}

impl Worker {
    /// The worker's URL, its sessions in `schema`.
    fn url_with_search_path(&self, schema: &str) -> String {
        own::url_with_search_path(&self.url, schema)
    }
}

fn workers(coordinator: &mut PgConnection) -> Vec<Worker> {
    #[derive(QueryableByName)]
    struct Node {
        #[diesel(sql_type = Text)]
        nodename: String,
        #[diesel(sql_type = Integer)]
        nodeport: i32,
        #[diesel(sql_type = Text)]
        usr: String,
        #[diesel(sql_type = Text)]
        db: String,
    }
    diesel::sql_query(
        "SELECT nodename, nodeport, current_user::text AS usr, current_database()::text AS db
         FROM pg_dist_node WHERE groupid <> 0 AND noderole = 'primary' AND isactive ORDER BY nodeport",
    )
    .load::<Node>(coordinator)
    .expect("list the workers")
    .into_iter()
    .map(|n| {
        let name = format!("{}:{}", n.nodename, n.nodeport);
        let url = format!("postgres://{}@{name}/{}", n.usr, n.db);
        let conn = PgConnection::establish(&url).unwrap_or_else(|e| panic!("connect to the worker {url}: {e}"));
        Worker { name, url, conn }
    })
    .collect()
}

/// What one worker executed in the test database, from pg_stat_statements
/// (loaded on every node by `.ci/citus`): transactions begun, committed,
/// prepared (two-phase commit) and committed prepared, and the statements on
/// this test's shards. Citus names the shards with their schema in what it
/// sends to the workers.
#[derive(QueryableByName, Debug, Clone, Copy, PartialEq, Eq)]
struct Executed {
    #[diesel(sql_type = BigInt)]
    begins: i64,
    #[diesel(sql_type = BigInt)]
    commits: i64,
    #[diesel(sql_type = BigInt)]
    prepares: i64,
    #[diesel(sql_type = BigInt)]
    commit_prepared: i64,
    #[diesel(sql_type = BigInt)]
    shard_statements: i64,
    #[diesel(sql_type = BigInt)]
    order_inserts: i64,
    #[diesel(sql_type = BigInt)]
    key_inserts: i64,
    #[diesel(sql_type = BigInt)]
    outbox_inserts: i64,
}

impl std::ops::Sub for Executed {
    type Output = Executed;
    fn sub(self, before: Executed) -> Executed {
        Executed {
            begins: self.begins - before.begins,
            commits: self.commits - before.commits,
            prepares: self.prepares - before.prepares,
            commit_prepared: self.commit_prepared - before.commit_prepared,
            shard_statements: self.shard_statements - before.shard_statements,
            order_inserts: self.order_inserts - before.order_inserts,
            key_inserts: self.key_inserts - before.key_inserts,
            outbox_inserts: self.outbox_inserts - before.outbox_inserts,
        }
    }
}

fn executed(worker: &mut Worker, schema: &str) -> Executed {
    diesel::sql_query(
        "SELECT
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'BEGIN%'), 0)::bigint AS begins,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'COMMIT' OR query ILIKE 'COMMIT;'), 0)::bigint AS commits,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'PREPARE TRANSACTION%'), 0)::bigint AS prepares,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'COMMIT PREPARED%'), 0)::bigint AS commit_prepared,
           coalesce(sum(calls) FILTER (WHERE strpos(query, $1 || '.') > 0), 0)::bigint AS shard_statements,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'INSERT INTO ' || $1 || '.orders%'), 0)::bigint
             AS order_inserts,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'INSERT INTO ' || $1 || '.idempotency_keys%'), 0)::bigint
             AS key_inserts,
           coalesce(sum(calls) FILTER (WHERE query ILIKE 'INSERT INTO ' || $1 || '.idempotency_outbox%'), 0)::bigint
             AS outbox_inserts
         FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind::<Text, _>(schema)
    .get_result(&mut worker.conn)
    .unwrap_or_else(|e| panic!("read pg_stat_statements on {}: {e}", worker.name))
}

/// Empties pg_stat_statements on every worker, so that no entry the test
/// reads is evicted to make room (a cluster keeps 5000 statements).
fn reset_statements(workers: &mut [Worker]) {
    for worker in workers {
        diesel::sql_query("SELECT pg_stat_statements_reset()")
            .execute(&mut worker.conn)
            .unwrap_or_else(|e| panic!("reset pg_stat_statements on {}: {e}", worker.name));
    }
}

fn executed_on_each(workers: &mut [Worker], schema: &str) -> Vec<Executed> {
    workers.iter_mut().map(|w| executed(w, schema)).collect()
}

fn executed_since(workers: &mut [Worker], schema: &str, before: &[Executed]) -> Vec<Executed> {
    executed_on_each(workers, schema)
        .into_iter()
        .zip(before)
        .map(|(after, before)| after - *before)
        .collect()
}

/// The two-phase commits the coordinator has recorded and not yet
/// recovered.
fn recorded_2pc(coordinator: &mut PgConnection) -> BTreeSet<String> {
    lines(coordinator, "SELECT gid::text AS line FROM pg_dist_transaction")
        .into_iter()
        .collect()
}

/// The worker holding the shard of `account` in `orders`.
fn placement_of(coordinator: &mut PgConnection, account: &str) -> String {
    #[derive(QueryableByName)]
    struct Placement {
        #[diesel(sql_type = Text)]
        node: String,
    }
    diesel::sql_query(
        "SELECT nodename || ':' || nodeport AS node FROM citus_shards
         WHERE table_name = 'orders'::regclass AND shardid = get_shard_id_for_distribution_column('orders', $1)",
    )
    .bind::<Text, _>(account)
    .get_result::<Placement>(coordinator)
    .expect("find the shard placement")
    .node
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn a_first_call_that_enqueues_is_one_single_shard_transaction() {
    let (db, mut conn) = Db::with_session();
    let mut admin = db.coordinator();
    let mut workers = workers(&mut admin);
    assert_eq!(workers.len(), 2, "a cluster of two workers");
    let account = "acct-single";
    let home = placement_of(&mut conn, account);

    // The planner's view of the key lookup: one task, on one shard.
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let plan: Vec<String> = diesel::sql_query(format!(
        "EXPLAIN (COSTS OFF) SELECT * FROM idempotency_keys WHERE scope = '{account}' AND idempotency_key = 'order-1'"
    ))
    .load::<PlanLine>(&mut conn)
    .expect("explain the key lookup")
    .into_iter()
    .map(|l| l.line)
    .collect();
    assert!(
        plan.iter().any(|l| l.trim() == "Task Count: 1"),
        "the key lookup is one task: {plan:#?}"
    );

    reset_statements(&mut workers);
    let before = executed_on_each(&mut workers, &db.schema);
    let recorded_before = recorded_2pc(&mut admin);
    let outcome = run_idempotent(&mut conn, account, "order-1", &PlaceOrder { item: "book" }, |tx| {
        let order = place_order(tx, account, "book").map_err(idempotency::outbox::Error::Storage)?;
        idempotency::outbox::enqueue(tx, "receipts", &order)?;
        Ok::<_, idempotency::outbox::Error>(order)
    })
    .expect("the first call");
    assert!(!outcome.is_replayed(), "the first call executes");
    let deltas = executed_since(&mut workers, &db.schema, &before);
    let report: Vec<String> = workers
        .iter()
        .zip(&deltas)
        .map(|(w, d)| format!("{}: {d:?}", w.name))
        .collect();
    println!("the first call, as the workers executed it: {report:?} (the shard of {account} on {home})");

    for (worker, delta) in workers.iter().zip(&deltas) {
        assert_eq!(
            (delta.prepares, delta.commit_prepared),
            (0, 0),
            "no two-phase commit on {}: {report:?}",
            worker.name
        );
        if worker.name == home {
            assert_eq!(
                (
                    delta.begins,
                    delta.commits,
                    delta.order_inserts,
                    delta.key_inserts,
                    delta.outbox_inserts
                ),
                (1, 1, 1, 1, 1),
                "one transaction with the order, the key record and the message on {}: {report:?}",
                worker.name
            );
        } else {
            assert_eq!(
                (delta.begins, delta.commits, delta.shard_statements),
                (0, 0, 0),
                "nothing on {}: {report:?}",
                worker.name
            );
        }
    }
    let new_2pc: Vec<String> = recorded_2pc(&mut admin).difference(&recorded_before).cloned().collect();
    assert!(
        new_2pc.is_empty(),
        "the coordinator recorded no two-phase commit: {new_2pc:?}"
    );

    // The counters do see a transaction that writes on both workers: two
    // accounts whose shards are on different workers, in one transaction.
    let other = (0..1000)
        .map(|i| format!("acct-{i}"))
        .find(|a| placement_of(&mut conn, a) != home)
        .expect("an account on the other worker");
    let before = executed_on_each(&mut workers, &db.schema);
    conn.transaction(|tx| {
        place_order(tx, account, "lamp")?;
        place_order(tx, &other, "lamp")
    })
    .expect("a transaction on both workers");
    let deltas = executed_since(&mut workers, &db.schema, &before);
    println!("a transaction on both workers: {deltas:?}");
    assert!(
        deltas.iter().all(|d| d.prepares == 1 && d.commit_prepared == 1),
        "two-phase commit on both workers: {deltas:?}"
    );
}
