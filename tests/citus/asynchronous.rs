//! The async call on Citus: diesel-async's `AsyncPgConnection` to the
//! coordinator holds the contract, writes on the tenant's worker alone with
//! no two-phase commit, claims a key found with a record before its
//! operation runs as the database's `idempotency.claim_first` says, and
//! runs the operation once among racing calls; a phased operation with
//! async steps runs each step once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use diesel::{ExpressionMethods, QueryDsl, QueryResult};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use idempotency::phased::{AsyncSteps, Phased};
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent_async};

use super::{
    Db, PlaceOrder, executed_on_each, executed_since, idempotency_keys, orders, orders_and_key_records, placement_of,
    race, recorded_2pc, reset_statements, workers,
};

async fn connect(db: &Db) -> AsyncPgConnection {
    AsyncPgConnection::establish(&db.url)
        .await
        .expect("an async connection to the test schema")
}

async fn place_order_async(tx: &mut AsyncPgConnection, account: &str, item: &str) -> QueryResult<i64> {
    use diesel_async::RunQueryDsl;
    diesel::insert_into(orders::table)
        .values((orders::account.eq(account), orders::item.eq(item)))
        .returning(orders::id)
        .get_result(tx)
        .await
}

/// The status of the key record of `(account, key)` as `tx` sees it.
async fn status_seen(tx: &mut AsyncPgConnection, account: &str, key: &str) -> QueryResult<String> {
    use diesel_async::RunQueryDsl;
    idempotency_keys::table
        .find((account, key))
        .select(idempotency_keys::status)
        .get_result(tx)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
async fn an_async_call_is_one_single_shard_transaction() {
    let (db, mut check) = Db::with_session();
    let mut admin = db.coordinator();
    let mut workers = workers(&mut admin);
    let account = "acct-async";
    let home = placement_of(&mut check, account);
    let mut conn = connect(&db).await;
    let calls = AtomicUsize::new(0);

    reset_statements(&mut workers);
    let before = executed_on_each(&mut workers, &db.schema);
    let recorded_before = recorded_2pc(&mut admin);
    let place = async |conn: &mut AsyncPgConnection, item: &str| {
        run_idempotent_async(
            conn,
            account,
            "order-1",
            &PlaceOrder { item },
            async |tx: &mut AsyncPgConnection| {
                calls.fetch_add(1, Ordering::SeqCst);
                // A fresh key is claimed in the round trip that takes its lock.
                assert_eq!(status_seen(tx, account, "order-1").await?, "processing");
                place_order_async(tx, account, item).await
            },
        )
        .await
    };
    let first = place(&mut conn, "book").await.expect("the first call");
    let deltas = executed_since(&mut workers, &db.schema, &before);
    let Outcome::Executed(id) = first else {
        panic!("the first call executes: {first:?}")
    };
    for (worker, delta) in workers.iter().zip(&deltas) {
        assert_eq!(
            (delta.prepares, delta.commit_prepared),
            (0, 0),
            "no two-phase commit: {deltas:?}"
        );
        if worker.name == home {
            assert_eq!(
                (delta.begins, delta.commits, delta.order_inserts, delta.key_inserts),
                (1, 1, 1, 1),
                "one transaction with the order and the key record on {}: {deltas:?}",
                worker.name
            );
        } else {
            assert_eq!(delta.shard_statements, 0, "nothing on {}: {deltas:?}", worker.name);
        }
    }
    assert!(recorded_2pc(&mut admin).difference(&recorded_before).next().is_none());

    assert_eq!(
        place(&mut conn, "book").await.expect("the retry"),
        Outcome::Replayed(id)
    );
    let other = place(&mut conn, "lamp").await;
    assert!(matches!(other, Err(Error::Mismatch)), "another request: {other:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_eq!(orders_and_key_records(&mut check, account), (1, 1));
}

/// Where the database claims every key first (`citus::distribute` sets
/// `idempotency.claim_first`), a key found with a record, here one whose
/// retention ended, is claimed before the operation runs, as the sync call
/// claims it: elsewhere the record would be read and replaced after the
/// operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
async fn an_async_call_claims_a_key_found_with_a_record_before_its_operation_runs() {
    let (db, mut check) = Db::with_session();
    let mut conn = connect(&db).await;
    let clock = idempotency::testing::ManualClock::new();
    let config = Config::default()
        .clock(clock.source())
        .retention(chrono::Duration::hours(1));
    let account = "acct-expired";
    let first = config
        .run_async(
            &mut conn,
            account,
            "order-1",
            &PlaceOrder { item: "book" },
            async |tx: &mut AsyncPgConnection| place_order_async(tx, account, "book").await,
        )
        .await
        .expect("the first call");
    assert!(!first.is_replayed());
    clock.advance(chrono::Duration::hours(2));
    let again = config
        .run_async(
            &mut conn,
            account,
            "order-1",
            &PlaceOrder { item: "lamp" },
            async |tx: &mut AsyncPgConnection| {
                assert_eq!(
                    status_seen(tx, account, "order-1").await?,
                    "processing",
                    "the expired record was taken over by a claim before the operation"
                );
                place_order_async(tx, account, "lamp").await
            },
        )
        .await
        .expect("the key executes again after its retention");
    assert!(!again.is_replayed());
    assert_eq!(orders_and_key_records(&mut check, account), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
async fn racing_async_calls_execute_once() {
    const TASKS: usize = 8;
    let db = Db::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let calls = Arc::new(AtomicUsize::new(0));
    let config = Arc::new(Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(60))));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (barrier, calls, config) = (barrier.clone(), calls.clone(), config.clone());
        let mut conn = connect(&db).await;
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            config
                .run_async(
                    &mut conn,
                    "acct-race",
                    "one-key",
                    &PlaceOrder { item: "book" },
                    async |tx: &mut AsyncPgConnection| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        // Work that keeps the key held while the others arrive.
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        place_order_async(tx, "acct-race", "book").await
                    },
                )
                .await
                .expect("every request succeeds")
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("a racing task"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    race::assert_one_executed_and_all_saw_it(outcomes);
    assert_eq!(orders_and_key_records(&mut db.conn(), "acct-race"), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Citus cluster (.ci/citus); run with --include-ignored"]
async fn an_async_phased_operation_runs_each_step_once() {
    let (db, mut check) = Db::with_session();
    let mut conn = connect(&db).await;
    let (phases, calls) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let phased = Phased::new("place-order");
    let account = "acct-phased";
    let run = async |conn: &mut AsyncPgConnection| {
        phased
            .run_async(
                conn,
                account,
                "order-1",
                &"book",
                async |s: &mut AsyncSteps<'_, AsyncPgConnection>| {
                    let order = s
                        .phase("ordered", async |tx: &mut AsyncPgConnection| {
                            phases.fetch_add(1, Ordering::SeqCst);
                            place_order_async(tx, account, "book").await
                        })
                        .await?;
                    let charge = s
                        .call("charged", async |provider_key: &str| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, diesel::result::Error>(format!("ch-{}", &provider_key[..8]))
                        })
                        .await?;
                    s.finish(async |_: &mut AsyncPgConnection| Ok((order, charge))).await
                },
            )
            .await
    };
    let first = run(&mut conn).await.expect("the first attempt");
    let retry = run(&mut conn).await.expect("the retry");
    assert!(!first.is_replayed() && retry.is_replayed(), "{first:?}, {retry:?}");
    assert_eq!(first.into_inner(), retry.into_inner());
    assert_eq!((phases.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)), (1, 1));
    assert_eq!(orders_and_key_records(&mut check, account).0, 1);
}
