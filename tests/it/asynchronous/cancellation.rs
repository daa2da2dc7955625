//! A call's future dropped at any of its `await`s (a timeout, a server
//! whose client hung up) changes nothing by halves: what the database holds
//! afterwards is the whole call or nothing of it, the pool never lends the
//! connection again inside a transaction, holding the key's lock (MySQL's
//! named lock outlives the transaction) or with the session's idle bound
//! still lowered for the call (MySQL's `wait_timeout`), and a retry of the
//! key is served within the in-flight wait. Proven by cutting one call at
//! each of its waits in turn, from its first statement to its commit, and
//! checking each cut against the database.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use diesel::result::Error as DieselError;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, PoolableConnection};
use idempotency::{Config, Error, InFlight, KeyStatus, Outcome};

use crate::common::TestDb;
use crate::common::asynchronous::{AsyncDb, AsyncServerDb, async_backend_tests, lent_outside_a_transaction};
use crate::common::own::unique_name;
use crate::common::wait::{PATIENCE, wait_for};

async_backend_tests!(
    server: a_dropped_async_call_leaves_all_of_it_or_nothing_and_a_retry_is_served,
    a_dropped_async_call_that_reads_first_leaves_all_of_it_or_nothing_and_a_retry_is_served,
    an_async_call_dropped_while_it_waits_for_its_key_leaves_its_connection_to_be_discarded,
);

/// Every backend, SQLite's wrapper among them.
mod every_backend {
    use super::*;

    async_backend_tests!(
        a_connection_whose_call_was_dropped_inside_its_transaction_refuses_every_later_call,
        a_pool_never_lends_again_a_connection_whose_call_was_dropped_inside_its_transaction,
    );
}

/// The output of `future` if it is ready before it has waited `waits`
/// times; otherwise `None`, and the future dropped at its wait after
/// those, as a timeout or a server whose client hung up drops it. A
/// future can be dropped only while it waits, so the cuts after 0, 1, 2,
/// ... waits are every moment a call can be cut at, whatever the timer's
/// resolution.
pub(super) async fn cut_after<F: Future>(waits: usize, future: F) -> Option<F::Output> {
    let mut future = pin!(future);
    let mut left = waits;
    poll_fn(|cx| match future.as_mut().poll(cx) {
        Poll::Ready(output) => Poll::Ready(Some(output)),
        Poll::Pending if left == 0 => Poll::Ready(None),
        Poll::Pending => {
            left -= 1;
            Poll::Pending
        }
    })
    .await
}

async fn a_dropped_async_call_leaves_all_of_it_or_nothing_and_a_retry_is_served<D: AsyncServerDb>() {
    cut_at_every_wait::<D>(false).await
}

async fn a_dropped_async_call_that_reads_first_leaves_all_of_it_or_nothing_and_a_retry_is_served<D: AsyncServerDb>() {
    cut_at_every_wait::<D>(true).await
}

/// Cuts a call after each of its waits in turn, the call reading its key's
/// record before its transaction or not (`reads_first`): each cut leaves
/// all of the call or nothing, and the retry is served.
async fn cut_at_every_wait<D: AsyncServerDb>(reads_first: bool) {
    let db = D::new();
    let (pool, own_bound) = pool_of_one(&db).await;
    let config = Config::default()
        .in_flight(InFlight::Wait(chrono::Duration::seconds(5)))
        .read_before_transaction(reads_first);
    let mut admin = db.conn();
    let (mut dropped_inside, mut dropped_outside) = (0, 0);
    let (mut waits, mut sweeps) = (0, 0);
    // Keys of this test's own: PostgreSQL's key locks span every schema of
    // the database, where the other tests run at once.
    let prefix = unique_name("order");
    for attempt in 0.. {
        assert!(waits < 2_000, "a call never finished within {waits} waits");
        let key = format!("{prefix}-{attempt}");
        let mut conn = pool.get().await.expect("a connection from the pool");
        let session = D::session_of(&mut conn).await;
        let call = config.run_async(&mut *conn, "shop", &key, &key, async |tx: &mut D::Async| {
            D::insert_order(tx, &key).await?;
            Ok::<_, diesel::result::Error>(1)
        });
        let finished = cut_after(waits, call).await;
        let broken = conn.is_broken();
        match (&finished, broken) {
            (Some(outcome), _) => assert_eq!(outcome.as_ref().expect("the whole call"), &Outcome::Executed(1)),
            (None, true) => dropped_inside += 1,
            (None, false) => dropped_outside += 1,
        }
        // Back to the pool, which drops a connection left in a transaction
        // (or, on MySQL, holding the key's named lock or its idle bound).
        drop(conn);
        if broken {
            tokio::task::block_in_place(|| {
                wait_for("the dropped connection's session to end", || {
                    !D::session_exists(&mut admin, session)
                });
                // PostgreSQL lists a session that ends no more a moment
                // before it lets go of its locks.
                wait_for("the ended session's locks to be free", || {
                    db.key_lock_holder(&mut admin, "shop", &key).is_none()
                });
            });
        }

        assert_eq!(
            db.key_lock_holder(&mut admin, "shop", &key),
            None,
            "cut at wait {waits}: no session holds the key's lock"
        );

        let mut conn = lent_outside_a_transaction::<D>(&pool, &mut admin).await;
        assert_eq!(
            D::idle_bound(&mut conn).await,
            own_bound,
            "cut at wait {waits}: the lent session has its own idle bound"
        );
        let orders = orders_of::<D>(&mut admin, &key);
        let status = config
            .status::<_, i32>(&mut admin, "shop", &key, &key)
            .expect("the key's status");
        match (orders, &status) {
            (0, KeyStatus::NoRecord) | (1, KeyStatus::Completed { response: 1, .. }) => {}
            other => panic!("cut at wait {waits}: orders and record {other:?} are not one whole call"),
        }
        let retried = config
            .run_async(&mut *conn, "shop", &key, &key, async |tx: &mut D::Async| {
                D::insert_order(tx, &key).await?;
                Ok::<_, diesel::result::Error>(1)
            })
            .await
            .expect("the retry is served");
        let expected = if orders == 0 {
            Outcome::Executed(1)
        } else {
            Outcome::Replayed(1)
        };
        assert_eq!(retried, expected, "cut at wait {waits}");
        assert_eq!(
            orders_of::<D>(&mut admin, &key),
            1,
            "one order for the key after its retry"
        );
        if finished.is_some() {
            // A loaded machine can answer a whole round trip between two
            // polls, so a sweep may end with no cut inside the transaction:
            // it is swept again from the first wait until one falls there.
            if dropped_inside > 0 || sweeps >= 20 {
                break;
            }
            sweeps += 1;
            waits = 1;
            continue;
        }
        // Only the read comes before the call takes its key, where the call
        // reads first, and a server that answers it before the call first
        // waits leaves no cut there: the first cut is made again until one
        // falls there.
        if waits > 0 || dropped_outside > 0 || !reads_first || attempt >= 50 {
            waits += 1;
        }
    }
    assert!(
        dropped_inside > 0 && (dropped_outside > 0 || !reads_first || D::CUT_STATEMENT_DISCARDS_THE_CONNECTION),
        "the cuts fell where they leave the connection to be discarded ({dropped_inside}) and where they leave it \
         as it was ({dropped_outside})"
    );
}

/// The orders placed for `key`, whose item is the key itself.
fn orders_of<D: TestDb>(conn: &mut D::Conn, key: &str) -> usize {
    D::orders(conn).iter().filter(|(_, item)| item == key).count()
}

/// A pool of one async connection to `db`, and the bound its session puts
/// on an idle client before any call lowers it, which every session the
/// pool lends afterwards must have again.
async fn pool_of_one<D: AsyncServerDb>(db: &D) -> (bb8::Pool<D::Manager>, String) {
    let pool = db.async_pool(1).await;
    let own_bound = {
        let mut conn = pool.get().await.expect("a connection from the pool");
        D::idle_bound(&mut conn).await
    };
    (pool, own_bound)
}

/// The one moment the cuts above may miss, made certain: a call dropped
/// while the server shows it waiting for the lock of a key another call
/// holds. On MySQL the session then holds the call's lowered idle bound and
/// may get the named lock once the holder lets go, with no transaction
/// open: only the connection marked broken keeps the pool from lending it.
async fn an_async_call_dropped_while_it_waits_for_its_key_leaves_its_connection_to_be_discarded<D: AsyncServerDb>() {
    let db = D::new();
    let (pool, own_bound) = pool_of_one(&db).await;
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(30)));
    let mut admin = db.conn();
    let key = &unique_name("order");
    let (inside_tx, inside) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let mut holding = db.connect().await;
    let holder = config.run_async(&mut holding, "shop", key, &"book", async |tx: &mut D::Async| {
        D::insert_order(tx, "book").await?;
        inside_tx.send(()).expect("the test waits");
        released.await.expect("the test releases the holder");
        Ok::<_, diesel::result::Error>(1)
    });
    let waiter = async {
        inside.await.expect("the holder runs its operation");
        let mut conn = pool.get().await.expect("a connection from the pool");
        let session = D::session_of(&mut conn).await;
        {
            let call = config.run_async(&mut *conn, "shop", key, &"book", async |_: &mut D::Async| {
                Ok::<_, Infallible>(2)
            });
            let mut call = std::pin::pin!(call);
            let deadline = Instant::now() + PATIENCE;
            loop {
                tokio::select! {
                    biased;
                    outcome = &mut call => panic!("the call ended while another held its key: {outcome:?}"),
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
                if tokio::task::block_in_place(|| D::session_waits_for_a_key(&mut admin, session)) {
                    break;
                }
                assert!(Instant::now() < deadline, "the call never waited for the key");
            }
        }
        assert!(
            conn.is_broken(),
            "a call dropped in its wait for the key leaves its connection to be discarded"
        );
        drop(conn);
        release.send(()).expect("the holder waits");
        session
    };
    let (held, dropped) = tokio::join!(holder, waiter);
    assert_eq!(held.expect("the holder"), Outcome::Executed(1));
    tokio::task::block_in_place(|| {
        D::wait_until_gone(&mut admin, dropped);
        wait_for("the ended session's locks to be free", || {
            db.key_lock_holder(&mut admin, "shop", key).is_none()
        });
    });

    let mut conn = pool.get().await.expect("a connection from the pool");
    assert_ne!(
        D::session_of(&mut conn).await,
        dropped,
        "the pool dropped the connection"
    );
    assert_eq!(
        D::idle_bound(&mut conn).await,
        own_bound,
        "the lent session has its own idle bound"
    );
    let retried = config
        .run_async(&mut *conn, "shop", key, &"book", async |_: &mut D::Async| {
            Ok::<_, Infallible>(2)
        })
        .await;
    assert_eq!(retried.expect("the retry is served"), Outcome::Replayed(1));
    assert_eq!(orders_of::<D>(&mut admin, "book"), 1, "the holder's order, once");
}

/// Runs a call for `key` on `conn` whose operation places an order and
/// then waits for ever, and drops the call once the operation is waiting:
/// the call's transaction is open, with the order in it, when its future
/// goes, as under a timeout or a server whose client hung up.
async fn drop_inside_the_transaction<D: AsyncDb>(config: &Config, conn: &mut D::Async, key: &str) {
    let (inside_tx, inside) = tokio::sync::oneshot::channel();
    let call = config.run_async(conn, "shop", key, &key, async |tx: &mut D::Async| {
        D::insert_order(tx, key).await?;
        inside_tx.send(()).expect("the test waits");
        std::future::pending::<()>().await;
        Ok::<_, DieselError>(1)
    });
    tokio::select! {
        outcome = call => panic!("the call ended while its operation waited: {outcome:?}"),
        inside = inside => inside.expect("the operation runs"),
    }
}

/// Places an order for `key` on `conn` under `key`.
async fn place<D: AsyncDb>(
    config: &Config,
    conn: &mut D::Async,
    key: &str,
) -> Result<Outcome<i32>, Error<DieselError>> {
    config
        .run_async(conn, "shop", key, &key, async |tx: &mut D::Async| {
            D::insert_order(tx, key).await?;
            Ok(1)
        })
        .await
}

async fn a_connection_whose_call_was_dropped_inside_its_transaction_refuses_every_later_call<D: AsyncDb>() {
    let db = D::new();
    let config = Config::default();
    let mut check = db.conn();
    let mut conn = db.connect().await;
    let (one, two) = (&unique_name("order"), &unique_name("order"));
    drop_inside_the_transaction::<D>(&config, &mut conn, one).await;

    // Neither another key nor the same one again: each would run in the
    // transaction left open, which nothing ever commits.
    for key in [two, one, one] {
        let refused = place::<D>(&config, &mut conn, key).await;
        assert!(
            matches!(refused, Err(Error::Storage(DieselError::BrokenTransactionManager))),
            "a call for {key} on the connection is refused: {refused:?}"
        );
    }
    let seen = || (D::order_count(&mut db.conn()), D::key_count(&mut db.conn()));
    assert_eq!(seen(), (0, 0), "another connection sees no order and no record");
    drop(conn);
    assert_eq!(seen(), (0, 0), "nothing was committed");
    // The server ends the dropped connection's session, and frees its lock
    // of the key (MySQL's named lock), once it sees the connection close.
    let status = tokio::task::block_in_place(|| {
        let mut last = KeyStatus::InProgress;
        wait_for("the dropped session's lock of the key to be free", || {
            last = config
                .status::<_, i32>(&mut check, "shop", one, &one)
                .expect("the key's status");
            last != KeyStatus::InProgress
        });
        last
    });
    assert_eq!(status, KeyStatus::NoRecord);

    let mut conn = db.connect().await;
    let retried = place::<D>(&config, &mut conn, one).await;
    assert_eq!(retried.expect("the retry on another connection"), Outcome::Executed(1));
    assert_eq!(orders_of::<D>(&mut check, one), 1, "one order for the key, the retry's");
}

async fn a_pool_never_lends_again_a_connection_whose_call_was_dropped_inside_its_transaction<D>()
where
    D: AsyncDb<Async: PoolableConnection>,
    AsyncDieselConnectionManager<D::Async>: bb8::ManageConnection<Connection = D::Async>,
{
    let db = D::new();
    let config = Config::default();
    let pool = bb8::Pool::builder()
        .max_size(1)
        .build(AsyncDieselConnectionManager::<D::Async>::new(db.url()))
        .await
        .expect("a pool of one async connection");
    let mut check = db.conn();
    let key = &unique_name("order");
    {
        let mut conn = pool.get().await.expect("a connection from the pool");
        drop_inside_the_transaction::<D>(&config, &mut conn, key).await;
        assert!(conn.is_broken(), "the pool is told to drop the connection");
    }

    let mut conn = pool.get().await.expect("a connection from the pool");
    assert!(!conn.is_broken(), "the pool lends no connection inside a transaction");
    let retried = place::<D>(&config, &mut conn, key).await;
    assert_eq!(retried.expect("the retry on the lent connection"), Outcome::Executed(1));
    assert_eq!(orders_of::<D>(&mut check, key), 1, "one order for the key, the retry's");
}

/// On a current-thread runtime, where diesel-async's SQLite wrapper would
/// panic waiting for a statement whose future was dropped, every call on it
/// is refused before its first statement, with a typed error. The call is
/// dropped by a timeout while another connection holds the write lock, so
/// that a call let through would be waiting for the lock in a statement.
#[test]
fn an_async_sqlite_call_on_a_current_thread_runtime_is_refused_instead_of_panicking() {
    use diesel::connection::SimpleConnection;

    let db = crate::common::sqlite::Db::new();
    let mut holder = db.conn();
    holder.batch_execute("BEGIN IMMEDIATE").expect("hold the write lock");
    let config = Config::default().in_flight(InFlight::Wait(chrono::Duration::seconds(30)));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    let (called, refused_outside) = runtime.block_on(async {
        let mut conn = db.connect().await;
        let called = tokio::time::timeout(
            Duration::from_millis(200),
            config.run_async(&mut conn, "shop", "order-1", &"book", async |_: &mut _| {
                Ok::<_, Infallible>(1)
            }),
        )
        .await;
        let enqueued = idempotency::outbox::enqueue_async(&mut conn, "receipts", &"book").await;
        (called, enqueued)
    });
    let Ok(Err(Error::Storage(DieselError::QueryBuilderError(why)))) = called else {
        panic!("the call is refused at once: {called:?}");
    };
    assert!(
        why.is::<idempotency::UnsupportedRuntime>(),
        "refused for its runtime: {why}"
    );
    assert!(
        matches!(&refused_outside, Err(idempotency::outbox::Error::Storage(DieselError::QueryBuilderError(why))) if why.is::<idempotency::UnsupportedRuntime>()),
        "a message enqueued outside a call is refused too: {refused_outside:?}"
    );
    holder.batch_execute("ROLLBACK").expect("let go of the write lock");
    assert_eq!(
        crate::common::sqlite::Db::key_count(&mut holder),
        0,
        "nothing was written"
    );
}

/// The wrapper waits, as the call's future is dropped, for a statement of
/// the operation still running on the blocking pool; only then does the
/// call look at the connection it leaves, and mark it broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_call_dropped_while_its_operation_s_statement_runs_leaves_its_connection_refusing_calls() {
    use crate::common::sqlite::Db;
    use diesel_async::RunQueryDsl;

    let db = Db::new();
    let config = Config::default();
    let mut conn = db.connect().await;
    let (inside_tx, inside) = tokio::sync::oneshot::channel();
    let call = config.run_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut <Db as AsyncDb>::Async| {
        Db::insert_order(tx, "order-1").await?;
        inside_tx.send(()).expect("the test waits");
        // Long enough to be running when the call is dropped.
        diesel::sql_query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000000) SELECT count(*) FROM c")
            .execute(tx)
            .await?;
        Ok::<_, DieselError>(1)
    });
    tokio::select! {
        biased;
        inside = inside => inside.expect("the operation runs"),
        outcome = call => panic!("the call ended before it was dropped: {outcome:?}"),
    }
    let refused = place::<Db>(&config, &mut conn, "order-2").await;
    assert!(
        matches!(refused, Err(Error::Storage(DieselError::BrokenTransactionManager))),
        "{refused:?}"
    );
    drop(conn);
    let mut check = db.conn();
    assert_eq!((Db::order_count(&mut check), Db::key_count(&mut check)), (0, 0));
}
