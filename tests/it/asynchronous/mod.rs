//! The async call (`run_idempotent_async`, `Config::run_async`) holds the
//! sync call's contract: executed once, replayed after, refused for another
//! request, a failed or panicking operation leaving nothing behind, a
//! nested call on its own key in progress, one execution among racing
//! calls, and the in-flight policy. Each outcome is checked against what
//! the database holds, read through a synchronous connection.

mod cancellation;
mod careless;
mod deadlock;
#[cfg(feature = "axum")]
mod http;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod killed_sessions;
mod outbox;
mod phased;
mod relay;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::Duration;
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent_async};

use crate::common::TestDb;
use crate::common::asynchronous::{AsyncDb, async_backend_tests};

async_backend_tests!(
    an_async_call_executes_once_and_replays_its_result,
    an_async_call_with_another_request_is_a_mismatch_and_runs_nothing,
    a_failed_async_operation_rolls_back_and_leaves_the_key_free,
    a_panicking_async_operation_rolls_back_and_leaves_its_connection_usable,
    a_nested_async_call_with_the_enclosing_key_is_in_progress,
    racing_async_calls_with_one_key_run_the_operation_once,
    an_async_call_that_rejects_in_flight_keys_is_in_progress_while_another_holds_the_key,
);

async fn an_async_call_executes_once_and_replays_its_result<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let calls = AtomicUsize::new(0);
    for expected in [Outcome::Executed(1), Outcome::Replayed(1)] {
        let outcome = order_a_book::<D>(&mut conn, ("shop", "order-1"), &calls, 1).await;
        assert_eq!(outcome.expect("the call"), expected);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_eq!(orders_and_keys(&db), (1, 1));
}

async fn an_async_call_with_another_request_is_a_mismatch_and_runs_nothing<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let place = async |conn: &mut D::Async, item: &str| {
        run_idempotent_async(conn, "shop", "order-1", &item, async |tx: &mut D::Async| {
            D::insert_order(tx, item).await?;
            Ok::<_, diesel::result::Error>(item.to_owned())
        })
        .await
    };
    assert_eq!(
        place(&mut conn, "book").await.expect("the first call"),
        Outcome::Executed("book".into())
    );
    assert!(matches!(place(&mut conn, "lamp").await, Err(Error::Mismatch)));
    let mut check = db.conn();
    assert_eq!(D::order_items(&mut check), ["book"]);
}

async fn a_failed_async_operation_rolls_back_and_leaves_the_key_free<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let failed = run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
        D::insert_order(tx, "book").await?;
        Err::<i32, _>(diesel::result::Error::RollbackTransaction)
    })
    .await;
    assert!(
        matches!(
            failed,
            Err(Error::Operation(diesel::result::Error::RollbackTransaction))
        ),
        "{failed:?}"
    );
    assert_eq!(orders_and_keys(&db), (0, 0), "nothing of it stays");

    let runs = AtomicUsize::new(0);
    let retried = order_a_book::<D>(&mut conn, ("shop", "order-1"), &runs, 2).await;
    assert_eq!(
        (retried.expect("the retry"), runs.load(Ordering::SeqCst)),
        (Outcome::Executed(2), 1),
        "the key was not spent"
    );
}

async fn a_panicking_async_operation_rolls_back_and_leaves_its_connection_usable<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let call = run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
        D::insert_order(tx, "book").await?;
        if std::hint::black_box(true) {
            panic!("the operation panics after its insert");
        }
        Ok::<_, diesel::result::Error>(1)
    });
    let panicked = catch_unwind(call).await.is_err();
    assert!(panicked, "the panic went on to the caller");
    assert_eq!(orders_and_keys(&db), (0, 0), "rolled back");
    let runs = AtomicUsize::new(0);
    let retried = order_a_book::<D>(&mut conn, ("shop", "order-1"), &runs, 2).await;
    assert_eq!(
        (
            retried.expect("the same connection serves the retry"),
            runs.load(Ordering::SeqCst)
        ),
        (Outcome::Executed(2), 1)
    );
}

async fn a_nested_async_call_with_the_enclosing_key_is_in_progress<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let outcome = run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
        let nested = run_idempotent_async(tx, "shop", "order-1", &"book", async |_: &mut D::Async| {
            Ok::<_, Infallible>(2)
        })
        .await;
        assert!(matches!(nested, Err(Error::InProgress)), "{nested:?}");
        let other = run_idempotent_async(tx, "shop", "order-2", &"lamp", async |_: &mut D::Async| {
            Ok::<_, Infallible>(3)
        })
        .await;
        assert_eq!(other.expect("another key nests"), Outcome::Executed(3));
        Ok::<_, Infallible>(1)
    })
    .await;
    assert_eq!(outcome.expect("the enclosing call"), Outcome::Executed(1));
    let mut check = db.conn();
    assert_eq!(D::key_count(&mut check), 2);
}

async fn racing_async_calls_with_one_key_run_the_operation_once<D: AsyncDb>() {
    const CALLS: usize = 8;
    let db = D::new();
    let executions = AtomicUsize::new(0);
    let start = tokio::sync::Barrier::new(CALLS);
    // Polled side by side on this task, each on a connection of its own.
    let calls = (0..CALLS).map(|_| {
        let (db, executions, start) = (&db, &executions, &start);
        async move {
            let mut conn = db.connect().await;
            start.wait().await;
            order_a_book::<D>(&mut conn, ("shop", "order-1"), executions, 7).await
        }
    });
    let mut executed = 0;
    for outcome in futures_util::future::join_all(calls).await {
        match outcome.expect("every call is answered") {
            Outcome::Executed(7) => executed += 1,
            Outcome::Replayed(7) => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!((executed, executions.load(Ordering::SeqCst)), (1, 1));
    let mut check = db.conn();
    assert_eq!(D::order_count(&mut check), 1);
}

async fn an_async_call_that_rejects_in_flight_keys_is_in_progress_while_another_holds_the_key<D: AsyncDb>() {
    let db = D::new();
    let (inside_tx, inside) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let mut holding = db.connect().await;
    let holder = run_idempotent_async(&mut holding, "shop", "order-1", &"book", async |tx: &mut D::Async| {
        D::insert_order(tx, "book").await?;
        inside_tx.send(()).expect("the test waits");
        released.await.expect("the test releases the holder");
        Ok::<_, diesel::result::Error>(1)
    });
    let mut conn = db.connect().await;
    let other = async {
        inside.await.expect("the holder runs its operation");
        let rejecting = Config::default().in_flight(InFlight::Reject);
        let refused = rejecting
            .run_async(&mut conn, "shop", "order-1", &"book", async |_: &mut D::Async| {
                Ok::<_, Infallible>(2)
            })
            .await;
        assert!(matches!(refused, Err(Error::InProgress)), "{refused:?}");
        release.send(()).expect("the holder waits");
    };
    let (held, ()) = tokio::join!(holder, other);
    assert_eq!(held.expect("the holder"), Outcome::Executed(1));
    let waiting = Config::default().in_flight(InFlight::Wait(Duration::seconds(5)));
    let replayed = waiting
        .run_async(&mut conn, "shop", "order-1", &"book", async |_: &mut D::Async| {
            Ok::<_, Infallible>(2)
        })
        .await;
    assert_eq!(replayed.expect("the replay"), Outcome::Replayed(1));
}

/// A test that spawns a call on a connection of `$db`'s, of type `$conn`:
/// spawning asks the call's future to be `Send`, as axum asks a handler's,
/// and on each concrete connection it is.
macro_rules! spawned_call {
    ($test:ident, $db:ty, $conn:ty) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let db = <$db as TestDb>::new();
            let mut conn = db.connect().await;
            let outcome = tokio::spawn(async move {
                run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut $conn| {
                    <$db as AsyncDb>::insert_order(tx, "book").await?;
                    Ok::<_, diesel::result::Error>(1)
                })
                .await
            })
            .await
            .expect("no panic");
            assert_eq!(outcome.expect("the call"), Outcome::Executed(1));
        }
    };
}

spawned_call!(
    an_async_call_on_sqlite_runs_on_a_spawned_task,
    crate::common::sqlite::Db,
    diesel_async::sync_connection_wrapper::SyncConnectionWrapper<diesel::SqliteConnection>
);
#[cfg(feature = "postgres")]
spawned_call!(
    an_async_call_on_postgres_runs_on_a_spawned_task,
    crate::common::pg::Db,
    diesel_async::AsyncPgConnection
);
#[cfg(feature = "mysql")]
spawned_call!(
    an_async_call_on_mysql_runs_on_a_spawned_task,
    crate::common::mysql::Db,
    diesel_async::AsyncMysqlConnection
);

/// The call most tests make: an order of one book under `(scope, key)`,
/// answering `answer`, each run of the operation counted in `runs`.
async fn order_a_book<D: AsyncDb>(
    conn: &mut D::Async,
    (scope, key): (&str, &str),
    runs: &AtomicUsize,
    answer: i32,
) -> Result<Outcome<i32>, Error<diesel::result::Error>> {
    run_idempotent_async(conn, scope, key, &"book", async |tx: &mut D::Async| {
        runs.fetch_add(1, Ordering::SeqCst);
        D::insert_order(tx, "book").await?;
        Ok::<_, diesel::result::Error>(answer)
    })
    .await
}

/// The orders and the key records the database holds, read through a
/// synchronous connection of its own.
fn orders_and_keys<D: TestDb>(db: &D) -> (i64, i64) {
    let mut check = db.conn();
    (D::order_count(&mut check), D::key_count(&mut check))
}

/// The output of `future`, or the panic raised while it was polled.
async fn catch_unwind<F: std::future::Future>(future: F) -> std::thread::Result<F::Output> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(payload) => std::task::Poll::Ready(Err(payload)),
        }
    })
    .await
}
