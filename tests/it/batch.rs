//! Batch jobs: reruns replay what finished, failures are collected, and a job
//! killed midway is finished by its rerun with every item done exactly once.

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use diesel::prelude::*;
use idempotency::batch::{Item, Progress, RunError, Runner};
use idempotency::{Error, KeyError};
use serde::Serialize;

use crate::common::TestDb;
use crate::common::child::{Child, parent_database};

#[derive(Debug, PartialEq)]
struct OutOfStock;

#[derive(Serialize)]
struct Line {
    sku: u64,
    quantity: i32,
}

impl Item for Line {
    fn id(&self) -> String {
        self.sku.to_string()
    }
}

crate::common::backend_tests!(
    rerun_replays_finished_items_and_executes_the_rest,
    another_job_id_executes_its_items_anew,
    failed_item_is_reported_and_does_not_stop_the_others,
    changed_item_is_a_mismatch_not_a_second_execution,
    progress_is_reported_once_per_item_in_order,
    workers_never_exceed_the_setting_or_the_pool,
    invalid_scope_is_refused_before_any_item_runs,
    panicking_item_stops_the_job_and_the_rerun_finishes_it,
    killed_job_rerun_executes_every_item_exactly_once,
);

/// The domain effect of one item: an order named after it.
fn invoice<D: TestDb>(tx: &mut D::Conn, item: &i64) -> QueryResult<i64> {
    D::place_order(tx, &format!("item-{item}"), 1)
}

fn distinct_items<D: TestDb>(conn: &mut D::Conn) -> i64 {
    let items: HashSet<String> = D::order_items(conn).into_iter().collect();
    i64::try_from(items.len()).expect("small")
}

fn rerun_replays_finished_items_and_executes_the_rest<D: TestDb>() {
    let db = D::new();
    let runner = Runner::new(db.pool(4)).scope("jobs");
    let first = runner.run("job-1", 1..=30_i64, invoice::<D>).expect("first run");
    assert_eq!((first.executed, first.replayed, first.failed.len()), (30, 0, 0));

    let rerun = runner.run("job-1", 1..=100_i64, invoice::<D>).expect("rerun");
    assert_eq!((rerun.executed, rerun.replayed, rerun.failed.len()), (70, 30, 0));
    let mut conn = db.conn();
    assert_eq!(D::order_count(&mut conn), 100);
    assert_eq!(distinct_items::<D>(&mut conn), 100);
    assert_eq!(D::key_count(&mut conn), 100);
}

fn another_job_id_executes_its_items_anew<D: TestDb>() {
    let db = D::new();
    let runner = Runner::new(db.pool(2));
    runner.run("monday", 1..=10_i64, invoice::<D>).expect("monday");
    let tuesday = runner.run("tuesday", 1..=10_i64, invoice::<D>).expect("tuesday");
    assert_eq!((tuesday.executed, tuesday.replayed), (10, 0));
    assert_eq!(D::order_count(&mut db.conn()), 20);
}

fn failed_item_is_reported_and_does_not_stop_the_others<D: TestDb>() {
    let db = D::new();
    let runner = Runner::new(db.pool(4));
    let report = runner
        .run("job-1", 1..=50_i64, |tx, item| {
            let order = invoice::<D>(tx, item).map_err(|_| None)?;
            if item % 7 == 0 {
                Err(Some(OutOfStock))
            } else {
                Ok(order)
            }
        })
        .expect("run");
    let failed: Vec<&str> = report.failed.iter().map(|failure| failure.id.as_str()).collect();
    assert_eq!(
        failed,
        ["7", "14", "21", "28", "35", "42", "49"],
        "in the order of the items"
    );
    assert!(
        report
            .failed
            .iter()
            .all(|failure| matches!(failure.error, Error::Operation(Some(OutOfStock))))
    );
    assert_eq!((report.executed, report.replayed, report.total()), (43, 0, 50));
    let mut conn = db.conn();
    assert_eq!(
        D::order_count(&mut conn),
        43,
        "the failed items' writes were rolled back"
    );
    assert_eq!(D::key_count(&mut conn), 43, "the failed items' keys stay free");

    let rerun = runner.run("job-1", 1..=50_i64, invoice::<D>).expect("rerun");
    assert_eq!((rerun.executed, rerun.replayed, rerun.failed.len()), (7, 43, 0));
    assert_eq!(distinct_items::<D>(&mut conn), 50);
    assert_eq!(D::order_count(&mut conn), 50);
}

fn changed_item_is_a_mismatch_not_a_second_execution<D: TestDb>() {
    let db = D::new();
    let runner = Runner::new(db.pool(2));
    let place = |tx: &mut D::Conn, line: &Line| D::place_order(tx, &line.sku.to_string(), line.quantity);
    let lines = |second: i32| {
        vec![
            Line { sku: 1, quantity: 1 },
            Line {
                sku: 2,
                quantity: second,
            },
        ]
    };
    runner.run("job-1", lines(1), place).expect("first run");

    let rerun = runner.run("job-1", lines(5), place).expect("rerun with a changed item");
    assert_eq!((rerun.executed, rerun.replayed), (0, 1));
    assert_eq!(rerun.failed.len(), 1);
    assert_eq!(rerun.failed[0].id, "2");
    assert!(
        matches!(rerun.failed[0].error, Error::Mismatch),
        "{:?}",
        rerun.failed[0].error
    );
    assert_eq!(D::order_count(&mut db.conn()), 2);
}

fn progress_is_reported_once_per_item_in_order<D: TestDb>() {
    let db = D::new();
    let seen = std::sync::Arc::new(Mutex::new(Vec::<Progress>::new()));
    let record = std::sync::Arc::clone(&seen);
    let runner = Runner::new(db.pool(4)).on_progress(move |progress| record.lock().expect("lock").push(*progress));
    runner.run("job-1", 1..=20_i64, invoice::<D>).expect("first run");
    runner.run("job-1", 1..=40_i64, invoice::<D>).expect("rerun");

    let seen = seen.lock().expect("lock");
    let processed: Vec<usize> = seen.iter().map(|progress| progress.processed).collect();
    let expected: Vec<usize> = (1..=20).chain(1..=40).collect();
    assert_eq!(processed, expected);
    let last = seen.last().expect("progress was reported");
    assert_eq!(
        (last.executed, last.replayed, last.failed, last.total),
        (20, 20, 0, Some(40))
    );
    assert!(seen.iter().all(|p| p.executed + p.replayed + p.failed == p.processed));
}

fn workers_never_exceed_the_setting_or_the_pool<D: TestDb>() {
    let db = D::new();
    for (pool_size, workers, bound) in [(8, 3, 3), (2, 4, 2), (4, 1, 1)] {
        let pool = db.pool(pool_size);
        let threads = Mutex::new(HashSet::new());
        let busiest = Mutex::new(0);
        let runner = Runner::new(pool.clone()).workers(workers);
        let report = runner
            .run(&format!("job-{pool_size}-{workers}"), 1..=60_i64, |tx, item| {
                threads.lock().expect("lock").insert(std::thread::current().id());
                let state = pool.state();
                let in_use = state.connections - state.idle_connections;
                let mut busiest = busiest.lock().expect("lock");
                *busiest = (*busiest).max(in_use);
                invoice::<D>(tx, item)
            })
            .expect("run");
        assert_eq!(report.executed, 60);
        let threads = threads.lock().expect("lock").len();
        assert!(
            (1..=bound).contains(&threads),
            "{threads} worker threads for bound {bound}"
        );
        let busiest = *busiest.lock().expect("lock");
        assert!(
            busiest <= bound as u32,
            "{busiest} connections in use for bound {bound}"
        );
    }
}

fn invalid_scope_is_refused_before_any_item_runs<D: TestDb>() {
    let db = D::new();
    let runner = Runner::new(db.pool(2)).scope("night jobs");
    let result = runner.run("job-1", 1..=5_i64, invoice::<D>);
    assert!(
        matches!(
            result,
            Err(RunError::InvalidScope(KeyError::InvalidCharacter { position: 5 }))
        ),
        "{result:?}"
    );
    assert_eq!(D::order_count(&mut db.conn()), 0);
}

fn panicking_item_stops_the_job_and_the_rerun_finishes_it<D: TestDb>() {
    let db = D::new();
    // One worker, so that exactly the items before the panic ran.
    let runner = Runner::new(db.pool(2)).workers(1);
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runner.run("job-1", 1..=20_i64, |tx, item| {
            let order = invoice::<D>(tx, item)?;
            assert_ne!(*item, 5, "item 5 crashes the worker");
            Ok::<_, diesel::result::Error>(order)
        })
    }));
    assert!(crashed.is_err(), "the panic reaches the caller");
    let mut conn = db.conn();
    assert_eq!(
        D::order_count(&mut conn),
        4,
        "items 1 to 4 committed, item 5 rolled back, none after it ran"
    );

    let rerun = runner.run("job-1", 1..=20_i64, invoice::<D>).expect("rerun");
    assert_eq!((rerun.executed, rerun.replayed, rerun.failed.len()), (16, 4, 0));
    assert_eq!(distinct_items::<D>(&mut conn), 20);
}

fn killed_job_rerun_executes_every_item_exactly_once<D: TestDb>() {
    const ITEMS: i64 = 5_000;
    const KILL_AFTER: usize = 1_500;
    let job = |pool| Runner::new(pool).workers(8).scope("jobs");

    if let Some(url) = parent_database() {
        // The child: the job as a real process would run it, printing
        // its progress until the parent kills it.
        let runner = job(D::pool_at(&url, 8)).on_progress(|progress| println!("progress {}", progress.processed));
        runner
            .run("job-kill", 1..=ITEMS, invoice::<D>)
            .expect("the child's run");
        return;
    }

    let db = D::new();
    let name = crate::common::test_name::<D>(module_path!(), "killed_job_rerun_executes_every_item_exactly_once");
    let mut child = Child::start(&name, db.url());
    child.wait_for(&format!("processing {KILL_AFTER} items"), |line| {
        line.strip_prefix("progress ")
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|n| *n >= KILL_AFTER)
    });
    let status = child.kill();
    assert_eq!(status.signal(), Some(9), "the child was killed, not finished: {status}");

    let mut conn = db.conn();
    // A COMMIT the child sent just before it died may still be in the
    // server's hands.
    D::await_order_writers(&mut conn);
    let committed = D::order_count(&mut conn);
    assert!(
        (KILL_AFTER as i64..ITEMS).contains(&committed),
        "{committed} items committed before the kill"
    );
    assert_eq!(
        D::key_count(&mut conn),
        committed,
        "every committed item has its key and no other key exists"
    );
    assert_eq!(distinct_items::<D>(&mut conn), committed);

    let rerun = job(db.pool(8)).run("job-kill", 1..=ITEMS, invoice::<D>).expect("rerun");
    assert!(rerun.failed.is_empty(), "{:?}", rerun.failed.first());
    assert_eq!(
        rerun.replayed as i64, committed,
        "the rerun replays exactly what the killed run committed"
    );
    assert_eq!(rerun.executed as i64, ITEMS - committed);
    assert_eq!(D::order_count(&mut conn), ITEMS);
    assert_eq!(
        distinct_items::<D>(&mut conn),
        ITEMS,
        "every item's effect exists exactly once"
    );
}

#[test]
fn unreachable_database_is_a_run_error() {
    use diesel::r2d2::{ConnectionManager, Pool};
    let dir = tempfile::tempdir().expect("temporary directory");
    let missing = dir.path().join("no-such-directory").join("jobs.db");
    let pool = Pool::builder()
        .max_size(2)
        .connection_timeout(std::time::Duration::from_millis(200))
        .build_unchecked(ConnectionManager::<SqliteConnection>::new(
            missing.to_str().expect("utf-8 path"),
        ));
    let runs = AtomicUsize::new(0);
    let result = Runner::new(pool).run("job-1", 1..=3_i64, |_, _| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, OutOfStock>(())
    });
    assert!(matches!(result, Err(RunError::Pool(_))), "{result:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
