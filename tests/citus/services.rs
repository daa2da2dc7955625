//! The outbox, the relay service, the purges, the completer, the batch
//! runner and calls from a worker node, all on distributed tables.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration as StdDuration;

use chrono::{Duration, Utc};
use diesel::pg::PgConnection;
use diesel::prelude::*;
use idempotency::batch::Runner;
use idempotency::outbox::{self, Message, Relay};
use idempotency::phased::{Completer, Phased};
use idempotency::{Config, Error, InFlight, Outcome, Shutdown, run_idempotent};

use crate::{Db, PlaceOrder, idempotency_keys, orders, place_order, race, wait};

/// Tenants enough that both workers hold some.
fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("tenant-{i}")).collect()
}

/// A schema of the test's own, a session in it, and `n` tenants.
fn with_tenants(n: usize) -> (Db, PgConnection, Vec<String>) {
    let db = Db::new();
    let conn = db.conn();
    (db, conn, tenants(n))
}

/// A call that places an order and enqueues its receipt.
fn order_with_receipt(
    conn: &mut PgConnection,
    tenant: &str,
    key: &str,
) -> Result<Outcome<i64>, Error<diesel::result::Error>> {
    run_idempotent(conn, tenant, key, &PlaceOrder { item: key }, |tx| {
        let id = place_order(tx, tenant, key)?;
        outbox::enqueue(tx, "receipts", &id).map_err(|e| match e {
            outbox::Error::Storage(e) => e,
            other => panic!("enqueue: {other}"),
        })?;
        Ok(id)
    })
}

diesel::table! {
    idempotency_outbox (scope, id) {
        scope -> Text,
        id -> Text,
        status -> Text,
    }
}

fn messages_by_status(conn: &mut PgConnection) -> BTreeMap<String, i64> {
    idempotency_outbox::table
        .group_by(idempotency_outbox::status)
        .select((idempotency_outbox::status, diesel::dsl::count_star()))
        .load::<(String, i64)>(conn)
        .expect("count messages")
        .into_iter()
        .collect()
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn the_relay_service_delivers_every_tenants_messages_once_without_notify() {
    const BEFORE: usize = 24;
    const DURING: usize = 24;
    let (db, mut conn, tenants) = with_tenants(8);
    let mut enqueued = BTreeMap::new();
    for i in 0..BEFORE {
        let tenant = &tenants[i % tenants.len()];
        let key = format!("before-{i}");
        order_with_receipt(&mut conn, tenant, &key).expect("an order");
        enqueued.insert(key, tenant.clone());
    }

    let pool = db.pool(3);
    let relay = Relay::default()
        .workers(2)
        .batch_size(5)
        .poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let delivered = Mutex::new(BTreeMap::new());
    let duplicates = AtomicUsize::new(0);
    let (done, deliveries) = mpsc::channel();
    let handler = |message: &Message| {
        let order: i64 = message.payload().map_err(|e| e.to_string())?;
        if delivered
            .lock()
            .expect("delivered")
            .insert(message.id.clone(), (message.scope.clone(), order))
            .is_some()
        {
            duplicates.fetch_add(1, Ordering::SeqCst);
        }
        done.send(()).map_err(|e| e.to_string())
    };
    let stopped = thread::scope(|scope| {
        let _stop = wait::StopOnDrop(&shutdown);
        let service = scope.spawn(|| relay.serve(&pool, handler, &shutdown));
        for i in 0..DURING {
            let tenant = &tenants[i % tenants.len()];
            let key = format!("during-{i}");
            order_with_receipt(&mut conn, tenant, &key).expect("an order");
            enqueued.insert(key, tenant.clone());
        }
        for _ in 0..BEFORE + DURING {
            wait::recv(&deliveries, "every message delivered by polling");
        }
        shutdown.trigger();
        service.join().expect("the relay service does not panic")
    });

    assert_eq!(duplicates.load(Ordering::SeqCst), 0, "no message was delivered twice");
    assert_eq!(stopped.errors, 0, "{stopped:?}");
    assert_eq!(stopped.work.delivered, BEFORE + DURING, "{stopped:?}");
    // Each message carries the scope of the call that enqueued it: its
    // order's tenant.
    let delivered = delivered.into_inner().expect("delivered");
    for (scope, order) in delivered.values() {
        let tenant: String = orders::table
            .filter(orders::id.eq(order))
            .select(orders::account)
            .get_result(&mut conn)
            .expect("the order of a receipt");
        assert_eq!(scope, &tenant, "the message lives with its tenant's rows");
    }
    let scopes: BTreeSet<&String> = delivered.values().map(|(scope, _)| scope).collect();
    assert_eq!(scopes.len(), tenants.len(), "every tenant's messages");
    assert_eq!(
        messages_by_status(&mut conn),
        BTreeMap::from([("delivered".to_owned(), (BEFORE + DURING) as i64)])
    );
    let stats = relay.stats(&mut conn).expect("stats");
    assert_eq!((stats.pending, stats.due_now, stats.dead), (0, 0, 0));
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn dead_messages_are_listed_requeued_delivered_and_purged() {
    let (_db, mut conn, tenants) = with_tenants(6);
    for tenant in &tenants {
        order_with_receipt(&mut conn, tenant, "order-1").expect("an order");
    }
    let relay = Relay::default().max_attempts(1);

    let failed = relay.run_once(&mut conn, |_| Err("410 gone")).expect("a pass");
    assert_eq!((failed.claimed, failed.dead), (6, 6), "{failed:?}");
    let dead = relay.dead_letters(&mut conn, 100).expect("dead letters");
    assert_eq!(dead.len(), 6);
    assert!(
        dead.iter().all(|d| d.last_error.as_deref() == Some("410 gone")),
        "{dead:?}"
    );
    for letter in &dead {
        assert!(relay.requeue(&mut conn, &letter.id).expect("requeue"), "requeued");
    }
    assert_eq!(relay.stats(&mut conn).expect("stats").pending, 6);

    let delivered = relay.run_once(&mut conn, |_| Ok::<_, String>(())).expect("a pass");
    assert_eq!(delivered.delivered, 6, "{delivered:?}");
    // A day later, with an hour's retention.
    let later = Relay::default()
        .retention(Duration::hours(1))
        .clock(|| Utc::now() + Duration::days(1));
    assert_eq!(
        later.purge_delivered(&mut conn, 4).expect("purge"),
        6,
        "in batches of 4"
    );
    assert!(
        messages_by_status(&mut conn).is_empty(),
        "every delivered message purged"
    );
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn purges_remove_every_tenants_expired_records_beside_live_calls() {
    const LIVE_THREADS: usize = 4;
    const LIVE_CALLS: usize = 20;
    let (db, mut conn, tenants) = with_tenants(12);
    // Records written two days ago with a one-hour retention: expired now.
    let past = Config::default()
        .retention(Duration::hours(1))
        .clock(|| Utc::now() - Duration::days(2));
    for tenant in &tenants {
        for k in 0..5 {
            past.run(
                &mut conn,
                tenant.as_str(),
                &format!("old-{k}"),
                &PlaceOrder { item: "old" },
                |tx| place_order(tx, tenant, "old"),
            )
            .expect("an old call");
        }
        Phased::new("old-operation")
            .config(past.clone())
            .run(&mut conn, tenant.as_str(), "old-op", &1, |s| {
                s.finish(|tx| place_order(tx, tenant, "old-phased"))
            })
            .expect("an old operation");
    }

    let pool = db.pool(LIVE_THREADS as u32);
    let barrier = Arc::new(wait::Barrier::new(LIVE_THREADS + 1));
    let live: Vec<_> = (0..LIVE_THREADS)
        .map(|t| {
            let (pool, barrier, tenants) = (pool.clone(), barrier.clone(), tenants.clone());
            thread::spawn(move || {
                let mut conn = pool.get().expect("pooled connection");
                barrier.wait();
                (0..LIVE_CALLS)
                    .map(|i| {
                        let tenant = &tenants[(t + i) % tenants.len()];
                        let key = format!("live-{t}-{i}");
                        run_idempotent(&mut conn, tenant.as_str(), &key, &PlaceOrder { item: "live" }, |tx| {
                            place_order(tx, tenant, "live")
                        })
                        .expect("a live call");
                        (tenant.clone(), key)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    barrier.wait();
    let purged = Config::default()
        .purge_expired(&mut conn, 7)
        .expect("purge beside traffic");
    let live: Vec<(String, String)> = live.into_iter().flat_map(|h| wait::join(h, "a live caller")).collect();

    assert_eq!(purged, tenants.len() * 6, "every expired key record and operation");
    let left: Vec<(String, String)> = idempotency_keys::table
        .select((idempotency_keys::scope, idempotency_keys::idempotency_key))
        .load(&mut conn)
        .expect("the key records left");
    let left: BTreeSet<(String, String)> = left.into_iter().collect();
    let live: BTreeSet<(String, String)> = live.into_iter().collect();
    assert_eq!(left, live, "the live records, all of them and only them");
    let orders: i64 = orders::table.count().get_result(&mut conn).expect("count orders");
    assert_eq!(
        orders as usize,
        tenants.len() * 6 + LIVE_THREADS * LIVE_CALLS,
        "purging touches no domain row"
    );
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn the_completer_finishes_every_tenants_abandoned_operation_once() {
    const OPERATION: &str = "place-order";
    let (db, mut conn, tenants) = with_tenants(8);
    let finishes = Arc::new(AtomicUsize::new(0));
    let phased = Phased::new(OPERATION).store_requests(true);
    let place = {
        let (phased, finishes) = (phased.clone(), finishes.clone());
        move |conn: &mut PgConnection, tenant: &str, key: &str, item: &str, crash: bool| {
            phased.run(conn, tenant, key, &PlaceOrder { item }, |s| {
                let id: i64 = s.phase("placed", |tx| place_order(tx, tenant, item))?;
                if crash {
                    // The process dies between the phases: the operation
                    // stays running with its first phase committed.
                    return Err(Error::Operation(diesel::result::Error::RollbackTransaction));
                }
                s.finish(|_| {
                    finishes.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, diesel::result::Error>(id)
                })
            })
        }
    };
    for tenant in &tenants {
        let crashed = place(&mut conn, tenant, "order-1", "book", true);
        assert!(matches!(crashed, Err(Error::Operation(_))), "{crashed:?}");
    }

    #[derive(serde::Deserialize)]
    struct Request {
        item: String,
    }
    let completer = {
        let place = place.clone();
        // Two minutes ahead: past the grace period of the crashed attempts.
        Completer::new()
            .grace(Duration::minutes(1))
            .clock(|| Utc::now() + Duration::minutes(2))
            .operation(
                OPERATION,
                move |conn: &mut PgConnection, scope, key, request: Request| {
                    place(conn, scope, key, &request.item, false)
                },
            )
    };
    // Two completers on the same tenants: each operation finishes once.
    let pool = db.pool(2);
    let barrier = wait::Barrier::new(2);
    let runs: Vec<_> = thread::scope(|scope| {
        let passes: Vec<_> = (0..2)
            .map(|_| {
                let mut conn = pool.get().expect("pooled connection");
                let (barrier, completer) = (&barrier, &completer);
                scope.spawn(move || {
                    barrier.wait();
                    completer.run_once(&mut conn).expect("a completer pass")
                })
            })
            .collect();
        passes
            .into_iter()
            .map(|pass| pass.join().expect("a completer does not panic"))
            .collect()
    });
    let completed: usize = runs.iter().map(|r| r.completed).sum();
    assert_eq!(completed, tenants.len(), "{runs:?}");
    assert_eq!(finishes.load(Ordering::SeqCst), tenants.len(), "each finished once");
    for tenant in &tenants {
        let replay = place(&mut conn, tenant, "order-1", "book", false).expect("the client's retry");
        assert!(replay.is_replayed(), "the retry replays what the completer finished");
        let count: i64 = orders::table
            .filter(orders::account.eq(tenant))
            .count()
            .get_result(&mut conn)
            .expect("count orders");
        assert_eq!(count, 1, "one order for {tenant}");
    }
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn calls_through_a_worker_and_the_coordinator_execute_one_key_once() {
    const THREADS: usize = 16;
    let db = Db::new();
    let mut admin = db.coordinator();
    let worker_url = crate::workers(&mut admin)
        .into_iter()
        .next()
        .map(|w| w.url_with_search_path(&db.schema))
        .expect("a worker");
    let urls = [db.url.clone(), worker_url];
    let barrier = Arc::new(wait::Barrier::new(THREADS));
    let calls = Arc::new(AtomicUsize::new(0));
    let config = Arc::new(Config::default().in_flight(InFlight::Wait(Duration::seconds(60))));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let url = urls[t % 2].clone();
            let (barrier, calls, config) = (barrier.clone(), calls.clone(), config.clone());
            thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("connect to a node");
                barrier.wait();
                config
                    .run(&mut conn, "acct-nodes", "one-key", &PlaceOrder { item: "book" }, |tx| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        // Work that keeps the key claimed while the others arrive.
                        thread::sleep(StdDuration::from_millis(20));
                        place_order(tx, "acct-nodes", "book")
                    })
                    .expect("every request succeeds")
            })
        })
        .collect();
    let outcomes: Vec<Outcome<i64>> = handles.into_iter().map(|h| wait::join(h, "a racing thread")).collect();

    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the operation ran once across the nodes"
    );
    race::assert_one_executed_and_all_saw_it(outcomes);
    let mut conn = db.conn();
    assert_eq!(crate::orders_and_key_records(&mut conn, "acct-nodes"), (1, 1));
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn a_tenants_batch_job_reruns_replaying_what_finished() {
    let db = Db::new();
    let tenants = tenants(4);
    let place = |tenant: &str| {
        let tenant = tenant.to_owned();
        move |tx: &mut PgConnection, item: &i64| place_order(tx, &tenant, &format!("item-{item}"))
    };
    for tenant in &tenants {
        // One job per tenant, under the tenant's scope: every item is a call
        // on the tenant's shard.
        let runner = Runner::new(db.pool(2)).workers(2).scope(tenant.as_str());
        let first = runner.run("restock", 1..=10_i64, place(tenant)).expect("the first run");
        assert_eq!((first.executed, first.replayed), (10, 0), "{first:?}");
        let rerun = runner.run("restock", 1..=20_i64, place(tenant)).expect("the rerun");
        assert_eq!((rerun.executed, rerun.replayed), (10, 10), "{rerun:?}");
        assert!(rerun.failed.is_empty(), "{rerun:?}");
    }
    let mut conn = db.conn();
    for tenant in &tenants {
        assert_eq!(crate::orders_and_key_records(&mut conn, tenant), (20, 20), "{tenant}");
    }
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn tombstones_refuse_late_retries_and_purges_keep_them_bounded_on_every_shard() {
    let (_db, mut conn, tenants) = with_tenants(6);
    let clock = idempotency::testing::ManualClock::new();
    let config = Config::default()
        .retention(Duration::hours(1))
        .tombstones(Duration::days(1))
        .clock(clock.source());
    let operation = Phased::new("operation").config(config.clone());
    let call = |conn: &mut PgConnection, tenant: &str| {
        config.run(conn, tenant, "k", &PlaceOrder { item: "book" }, |tx| {
            place_order(tx, tenant, "book")
        })
    };
    let phased = |conn: &mut PgConnection, tenant: &str| {
        operation.run(conn, tenant, "op", &1, |s| {
            s.finish(|tx| place_order(tx, tenant, "phased"))
        })
    };
    let responses_kept = |conn: &mut PgConnection| -> i64 {
        #[derive(QueryableByName)]
        struct Kept {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        diesel::sql_query(
            "SELECT (SELECT count(*) FROM idempotency_keys WHERE response IS NOT NULL) \
                  + (SELECT count(*) FROM idempotency_phases WHERE response IS NOT NULL) AS n",
        )
        .get_result::<Kept>(conn)
        .expect("count the responses kept")
        .n
    };
    for tenant in &tenants {
        call(&mut conn, tenant).expect("a call");
        phased(&mut conn, tenant).expect("an operation");
    }
    clock.advance(Duration::hours(1));
    for tenant in &tenants {
        assert!(matches!(call(&mut conn, tenant), Err(Error::Expired)), "{tenant}");
        assert!(matches!(phased(&mut conn, tenant), Err(Error::Expired)), "{tenant}");
    }

    // Batches of four across the shards: every record and operation a
    // tombstone, its response gone, still refusing its retry.
    assert_eq!(config.purge_expired(&mut conn, 4).expect("purge"), tenants.len() * 2);
    assert_eq!(responses_kept(&mut conn), 0);
    assert!(matches!(call(&mut conn, &tenants[0]), Err(Error::Expired)));

    clock.advance(Duration::days(1));
    assert_eq!(config.purge_expired(&mut conn, 4).expect("purge"), tenants.len() * 2);
    let keys: i64 = idempotency_keys::table
        .count()
        .get_result(&mut conn)
        .expect("count key records");
    assert_eq!(keys, 0, "deleted after the grace period");
    assert!(!call(&mut conn, &tenants[0]).expect("executes again").is_replayed());
}

#[test]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
fn the_async_relay_delivers_every_tenants_messages_once_one_and_eight_at_a_time() {
    use diesel_async::AsyncPgConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;

    const EACH_ROUND: usize = 24;
    let (db, mut conn, tenants) = with_tenants(8);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let pool = runtime
        .block_on(
            bb8::Pool::builder()
                .max_size(2)
                .build(AsyncDieselConnectionManager::<AsyncPgConnection>::new(&db.url)),
        )
        .expect("a pool of async connections");
    // One at a time (the claim by scope and each mark of its own), then
    // eight at once (marked together, across the tenants' shards).
    for (round, in_flight) in [1, 8].into_iter().enumerate() {
        for i in 0..EACH_ROUND {
            let tenant = &tenants[i % tenants.len()];
            order_with_receipt(&mut conn, tenant, &format!("async-{round}-{i}")).expect("an order");
        }
        let relay = Relay::default()
            .batch_size(10)
            .in_flight(in_flight)
            .poll_interval(Duration::milliseconds(20));
        let shutdown = Shutdown::new();
        let delivered: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
        let duplicates = Arc::new(AtomicUsize::new(0));
        let handler = {
            let (delivered, duplicates, shutdown) = (Arc::clone(&delivered), Arc::clone(&duplicates), shutdown.clone());
            move |message: Message| {
                let mut delivered = delivered.lock().expect("delivered");
                if delivered.insert(message.id, message.scope).is_some() {
                    duplicates.fetch_add(1, Ordering::SeqCst);
                }
                if delivered.len() == EACH_ROUND {
                    shutdown.trigger();
                }
                std::future::ready(Ok::<_, String>(()))
            }
        };
        let stopped = runtime.block_on(async {
            tokio::time::timeout(StdDuration::from_secs(60), relay.serve_async(&pool, handler, &shutdown))
                .await
                .expect("every message delivered within a minute")
        });
        assert_eq!(duplicates.load(Ordering::SeqCst), 0, "no message was delivered twice");
        assert_eq!((stopped.work.delivered, stopped.errors), (EACH_ROUND, 0), "{stopped:?}");
        let scopes: BTreeSet<String> = delivered.lock().expect("delivered").values().cloned().collect();
        assert_eq!(scopes.len(), tenants.len(), "every tenant's messages");
        assert_eq!(
            messages_by_status(&mut conn),
            BTreeMap::from([("delivered".to_owned(), ((round + 1) * EACH_ROUND) as i64)])
        );
    }
}
