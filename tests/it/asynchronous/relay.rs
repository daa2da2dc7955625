//! The relay on diesel-async connections: `Relay::run_once_async` and the
//! service `Relay::serve_async` on bb8 and deadpool pools, with async
//! handlers. The same promises as the thread relay's: each message once
//! while nothing fails, backoff and dead letters, a panic or a hang as a
//! failed attempt, each ordering key in order across workers, and a stop
//! that lets the running handler finish and gives the rest back.
//!
//! Handlers report to the test over channels, and the test waits on those,
//! never on a guessed sleep; the tables, the truth, are read through the
//! backend's synchronous connection.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration as StdDuration;

use chrono::Duration;
use idempotency::outbox::{self, Envelope, Failure, Message, Relay};
use idempotency::testing::ManualClock;
use idempotency::{AsyncConnectionPool, Shutdown, run_idempotent_async};
use tokio::sync::{Notify, mpsc};

use crate::common::TestDb;
use crate::common::asynchronous::{AsyncDb, async_backend_tests};
use crate::common::wait::PATIENCE;

async_backend_tests!(
    served_messages_enqueued_before_and_during_the_run_are_each_delivered_once_on_bb8_and_deadpool,
    a_failure_is_retried_after_its_backoff_and_parked_dead_after_its_last_attempt_or_at_once_when_permanent,
    a_panicking_handler_fails_its_message_while_the_others_are_delivered,
    a_hanging_handler_is_given_up_at_three_quarters_of_its_lease_while_the_others_are_delivered,
    stopping_lets_the_running_handler_finish_and_gives_the_rest_of_the_batch_back,
    workers_keep_each_ordering_key_in_order_through_failures,
    messages_handed_over_eight_at_once_keep_each_ordering_key_in_order_through_failures,
);

/// The statuses of every outbox message, as the synchronous connection
/// reads them: (status, attempts, last error), by message id.
fn statuses<D: TestDb>(db: &D) -> BTreeMap<String, (String, i32, Option<String>)> {
    tokio::task::block_in_place(|| D::outbox_messages(&mut db.conn()))
        .into_iter()
        .map(|(id, _topic, status, attempts, error)| (id, (status, attempts, error)))
        .collect()
}

/// The next report of a handler, or a failed test after [`PATIENCE`].
async fn next<T>(reports: &mut mpsc::UnboundedReceiver<T>, what: &str) -> T {
    tokio::time::timeout(PATIENCE, reports.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {PATIENCE:?}"))
        .unwrap_or_else(|| panic!("{what}: the handler is gone"))
}

/// A handler that reports each message's key and payload and succeeds.
fn reporting(
    reports: mpsc::UnboundedSender<(String, String)>,
) -> impl Fn(Message) -> std::future::Ready<Result<(), String>> + Send + Sync + 'static {
    move |message: Message| {
        let sent = reports.send((message.key, message.payload_json));
        std::future::ready(sent.map_err(|_| String::from("the test stopped listening")))
    }
}

async fn served_messages_enqueued_before_and_during_the_run_are_each_delivered_once_on_bb8_and_deadpool<D: AsyncDb>() {
    let db = D::new();
    served_each_once(&db, db.bb8(3).await, "bb8").await;
    served_each_once(&db, db.deadpool(3).await, "deadpool").await;
}

/// Three workers on `pool` deliver 30 messages enqueued before the service
/// starts and 30 enqueued while it runs, by calls in scope `calls`, each
/// once.
async fn served_each_once<D, P>(db: &D, pool: P, calls: &str)
where
    D: AsyncDb,
    P: AsyncConnectionPool<Connection = D::Async> + 'static,
{
    const EACH: usize = 30;
    let mut conn = db.connect().await;
    let mut enqueued = HashSet::new();
    for i in 0..EACH {
        enqueued.insert(outbox::enqueue_async(&mut conn, "receipts", &i).await.expect("enqueue"));
    }
    let shutdown = Shutdown::new();
    let (sender, mut reports) = mpsc::unbounded_channel();
    let relay = Relay::default()
        .workers(3)
        .batch_size(4)
        .poll_interval(Duration::milliseconds(20));
    let service = D::spawn_relay(pool, relay, reporting(sender), shutdown.clone());
    // Enqueued by calls, as an application enqueues: each call's
    // transaction waits for a relay's claim, SQLite's write lock included.
    for i in EACH..2 * EACH {
        let key = format!("order-{i}");
        let id = run_idempotent_async(&mut conn, calls, &key, &i, async |tx: &mut D::Async| {
            outbox::enqueue_async(tx, "receipts", &i).await
        })
        .await
        .expect("a call that enqueues");
        enqueued.insert(id.into_inner());
    }
    let mut delivered = HashSet::new();
    while delivered.len() < enqueued.len() {
        let (key, _) = next(&mut reports, "a delivery").await;
        assert!(delivered.insert(key.clone()), "{key} delivered twice");
    }
    shutdown.trigger();
    let stopped = tokio::time::timeout(PATIENCE, service)
        .await
        .expect("the service stops")
        .expect("the service does not panic");
    assert_eq!(delivered, enqueued);
    assert_eq!((stopped.work.delivered, stopped.errors), (2 * EACH, 0), "{stopped:?}");
    assert!(reports.try_recv().is_err(), "nothing was delivered twice");
    let statuses = statuses(db);
    assert!(
        statuses
            .values()
            .all(|(status, attempts, _)| status == "delivered" && *attempts == 1)
    );
    // The next pool starts from an empty outbox.
    tokio::task::block_in_place(|| {
        use diesel::connection::SimpleConnection;
        db.conn()
            .batch_execute("DELETE FROM idempotency_outbox")
            .expect("empty the outbox")
    });
}

async fn a_failure_is_retried_after_its_backoff_and_parked_dead_after_its_last_attempt_or_at_once_when_permanent<
    D: AsyncDb,
>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let clock = ManualClock::new();
    let relay = Relay::default()
        .clock(clock.source())
        .max_attempts(2)
        .backoff(Duration::seconds(10), Duration::minutes(1));
    let flaky = outbox::enqueue_async(&mut conn, "payments", &"flaky")
        .await
        .expect("enqueue");
    let refused = outbox::enqueue_async(&mut conn, "payments", &"refused")
        .await
        .expect("enqueue");
    let handler = |message: Message| async move {
        match message.payload::<String>().as_deref() {
            Ok("refused") => Err(Failure::Permanent(String::from("400 the gateway refuses it"))),
            _ => Err(Failure::Retry(String::from("gateway unavailable"))),
        }
    };

    let first = relay.run_once_async(&mut conn, handler).await.expect("a pass");
    assert_eq!((first.claimed, first.retried, first.dead), (2, 1, 1), "{first:?}");
    let after_first = statuses(&db);
    assert_eq!(after_first[&flaky].0, "pending");
    assert_eq!(
        after_first[&refused],
        ("dead".to_owned(), 1, Some("400 the gateway refuses it".to_owned())),
        "a permanent failure is parked at its first attempt"
    );

    let early = relay.run_once_async(&mut conn, handler).await.expect("a pass");
    assert_eq!(early.claimed, 0, "not due before its backoff");
    clock.advance(Duration::seconds(10));
    let second = relay.run_once_async(&mut conn, handler).await.expect("a pass");
    assert_eq!((second.claimed, second.dead), (1, 1), "{second:?}");
    assert_eq!(
        statuses(&db)[&flaky],
        ("dead".to_owned(), 2, Some("gateway unavailable".to_owned())),
        "parked after its last attempt"
    );
}

async fn a_panicking_handler_fails_its_message_while_the_others_are_delivered<D: AsyncDb>() {
    let db = D::new();
    let pool = db.bb8(2).await;
    let mut conn = db.connect().await;
    let poison = outbox::enqueue_async(&mut conn, "webhooks", &"poison")
        .await
        .expect("enqueue");
    let fine = outbox::enqueue_async(&mut conn, "webhooks", &"fine")
        .await
        .expect("enqueue");
    let relay = Relay::default()
        .max_attempts(1)
        .poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let (sender, mut reports) = mpsc::unbounded_channel();
    let handler = move |message: Message| {
        let sender = sender.clone();
        async move {
            tokio::task::yield_now().await;
            if message.payload::<String>().is_ok_and(|payload| payload == "poison") {
                panic!("the payload breaks the mapper");
            }
            sender.send(message.key).map_err(|_| "the test stopped listening")
        }
    };
    let stopped = {
        let serving = relay.serve_async(&pool, handler, &shutdown);
        let watching = async {
            assert_eq!(next(&mut reports, "the other message").await, fine);
            while statuses(&db)[&poison].0 != "dead" {
                tokio::time::sleep(StdDuration::from_millis(5)).await;
            }
            shutdown.trigger();
        };
        tokio::time::timeout(PATIENCE, async { tokio::join!(serving, watching).0 })
            .await
            .expect("the service stops")
    };
    assert_eq!((stopped.work.delivered, stopped.work.dead), (1, 1), "{stopped:?}");
    assert_eq!(
        statuses(&db)[&poison].2.as_deref(),
        Some("the handler panicked: the payload breaks the mapper")
    );
}

async fn a_hanging_handler_is_given_up_at_three_quarters_of_its_lease_while_the_others_are_delivered<D: AsyncDb>() {
    let db = D::new();
    let pool = db.bb8(2).await;
    let mut conn = db.connect().await;
    let hangs = outbox::enqueue_async(&mut conn, "webhooks", &"hangs")
        .await
        .expect("enqueue");
    let after = outbox::enqueue_async(&mut conn, "webhooks", &"after")
        .await
        .expect("enqueue");
    let relay = Relay::default()
        .lease(Duration::milliseconds(400))
        .max_attempts(1)
        .poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let (sender, mut reports) = mpsc::unbounded_channel();
    let dropped = Arc::new(AtomicUsize::new(0));
    let handler = {
        let dropped = Arc::clone(&dropped);
        move |message: Message| {
            let (sender, dropped) = (sender.clone(), Arc::clone(&dropped));
            async move {
                if message.payload::<String>().is_ok_and(|payload| payload == "hangs") {
                    // Counts itself when the relay drops it.
                    let _counted = CountOnDrop(dropped);
                    std::future::pending::<()>().await;
                }
                sender.send(message.key).map_err(|_| "the test stopped listening")
            }
        }
    };
    let stopped = {
        let serving = relay.serve_async(&pool, handler, &shutdown);
        let watching = async {
            assert_eq!(next(&mut reports, "the message after it").await, after);
            shutdown.trigger();
        };
        tokio::time::timeout(PATIENCE, async { tokio::join!(serving, watching).0 })
            .await
            .expect("the service stops")
    };
    assert_eq!((stopped.work.delivered, stopped.work.dead), (1, 1), "{stopped:?}");
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the hanging handler was dropped");
    assert_eq!(
        statuses(&db)[&hangs],
        (
            "dead".to_owned(),
            1,
            Some("the handler did not return within three quarters of the lease; the attempt was given up".to_owned())
        )
    );
}

/// Adds one to its counter when dropped.
struct CountOnDrop(Arc<AtomicUsize>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

async fn stopping_lets_the_running_handler_finish_and_gives_the_rest_of_the_batch_back<D: AsyncDb>() {
    let db = D::new();
    let pool = db.bb8(2).await;
    let mut conn = db.connect().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(outbox::enqueue_async(&mut conn, "receipts", &i).await.expect("enqueue"));
    }
    let relay = Relay::default().batch_size(3).poll_interval(Duration::milliseconds(20));
    let shutdown = Shutdown::new();
    let (sender, mut reports) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let handler = {
        let release = Arc::clone(&release);
        move |message: Message| {
            let (sender, release) = (sender.clone(), Arc::clone(&release));
            async move {
                sender.send(message.key).map_err(|_| "the test stopped listening")?;
                // Runs on until the test, having triggered the stop, lets it.
                release.notified().await;
                Ok::<_, &str>(())
            }
        }
    };
    let stopped = {
        let serving = relay.serve_async(&pool, handler, &shutdown);
        let watching = async {
            assert_eq!(next(&mut reports, "the first handler").await, ids[0]);
            shutdown.trigger();
            release.notify_one();
        };
        tokio::time::timeout(PATIENCE, async { tokio::join!(serving, watching).0 })
            .await
            .expect("the service stops")
    };
    assert!(reports.try_recv().is_err(), "no handler started after the stop");
    assert_eq!(
        (stopped.work.claimed, stopped.work.delivered, stopped.work.released),
        (3, 1, 2),
        "{stopped:?}"
    );
    let statuses = statuses(&db);
    assert_eq!(statuses[&ids[0]].0, "delivered", "the running handler finished");
    for id in &ids[1..] {
        assert_eq!(statuses[id], ("pending".to_owned(), 0, None), "given back unattempted");
    }
}

async fn workers_keep_each_ordering_key_in_order_through_failures<D: AsyncDb>() {
    let relay = Relay::default().workers(3).batch_size(5);
    let most_at_once = each_key_in_order_through_failures::<D>(relay).await;
    assert!(
        most_at_once <= 3,
        "one handler at a time per worker: {most_at_once} at once"
    );
}

async fn messages_handed_over_eight_at_once_keep_each_ordering_key_in_order_through_failures<D: AsyncDb>() {
    let relay = Relay::default().in_flight(8).batch_size(8);
    let most_at_once = each_key_in_order_through_failures::<D>(relay).await;
    assert_eq!(most_at_once, 8, "a worker's handlers awaited together");
}

/// `relay` delivers 8 messages of each of 8 ordering keys, a third of them
/// failing their first attempt, each key in enqueue order and each message
/// once; returns how many handlers ran at once at most.
async fn each_key_in_order_through_failures<D: AsyncDb>(relay: Relay) -> usize {
    const KEYS: usize = 8;
    const PER_KEY: usize = 8;
    let db = D::new();
    let pool = db.bb8(4).await;
    let mut conn = db.connect().await;
    let mut expected: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for n in 0..PER_KEY {
        for k in 0..KEYS {
            let key = format!("customer-{k}");
            Envelope::new("events", &n)
                .ordering_key(&key)
                .enqueue_async(&mut conn)
                .await
                .expect("enqueue");
            expected.entry(key).or_default().push(n);
        }
    }
    let relay = relay
        .backoff(Duration::milliseconds(5), Duration::milliseconds(20))
        .poll_interval(Duration::milliseconds(10));
    let shutdown = Shutdown::new();
    let seen: Arc<Mutex<BTreeMap<String, Vec<usize>>>> = Arc::default();
    let (running, most_at_once) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (sender, mut reports) = mpsc::unbounded_channel();
    let handler = {
        let (seen, running, most_at_once) = (Arc::clone(&seen), Arc::clone(&running), Arc::clone(&most_at_once));
        move |message: Message| {
            let (seen, sender) = (Arc::clone(&seen), sender.clone());
            let (running, most_at_once) = (Arc::clone(&running), Arc::clone(&most_at_once));
            async move {
                let now_running = running.fetch_add(1, Ordering::SeqCst) + 1;
                most_at_once.fetch_max(now_running, Ordering::SeqCst);
                // Gives the others of its window or worker their turn.
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
                running.fetch_sub(1, Ordering::SeqCst);
                let n: usize = message.payload().map_err(|error| error.to_string())?;
                // Every third message fails its first attempt, which holds
                // back the rest of its key until it is delivered.
                if n % 3 == 1 && message.attempt == 1 {
                    return Err(String::from("the consumer is busy"));
                }
                let key = message.ordering_key().ok_or("an ordering key")?.to_owned();
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(key)
                    .or_default()
                    .push(n);
                sender.send(()).map_err(|_| String::from("the test stopped listening"))
            }
        }
    };
    let stopped = {
        let serving = relay.serve_async(&pool, handler, &shutdown);
        let watching = async {
            for _ in 0..KEYS * PER_KEY {
                next(&mut reports, "a delivery").await;
            }
            shutdown.trigger();
        };
        tokio::time::timeout(PATIENCE, async { tokio::join!(serving, watching).0 })
            .await
            .expect("the service stops")
    };
    assert_eq!(stopped.work.delivered, KEYS * PER_KEY, "{stopped:?}");
    assert!(stopped.work.retried > 0, "failures were retried: {stopped:?}");
    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    assert_eq!(*seen, expected, "each key in enqueue order, each message once");
    most_at_once.load(Ordering::SeqCst)
}

/// What only PostgreSQL shows: the enqueue's notification wakes a
/// sleeping async relay at once, and its sessions can be killed by the
/// server.
#[cfg(feature = "postgres")]
mod on_postgres {
    use std::time::Duration as StdDuration;

    use chrono::Duration;
    use diesel::RunQueryDsl;
    use idempotency::Shutdown;
    use idempotency::outbox::{self, Message, Relay};
    use tokio::sync::mpsc;

    use super::reporting;
    use crate::common::TestDb;
    use crate::common::asynchronous::AsyncDb;
    use crate::common::pg::Db;

    /// Far longer than the test waits: a message that arrives came through
    /// a notification.
    const POLL_INTERVAL: Duration = Duration::seconds(120);

    /// How long a woken relay may take to deliver: wide, for a loaded
    /// machine, and still a sixtieth of the poll interval.
    const WAKE_BOUND: StdDuration = StdDuration::from_secs(2);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_commit_wakes_the_async_relay_long_before_its_poll_interval_on_a_pool_of_one() {
        let db = Db::new();
        // The pool's one connection is the worker's: the listener keeps a
        // connection of its own, outside the pool.
        let pool = db.bb8(1).await;
        let mut conn = db.connect().await;
        let relay = Relay::default().poll_interval(POLL_INTERVAL);
        let shutdown = Shutdown::new();
        let (sender, mut reports) = mpsc::unbounded_channel();
        let serving = relay.serve_async(&pool, reporting(sender), &shutdown);
        let enqueuing = async {
            // The relay's first look may find the first message without a
            // notification; every later one only a notification brings in
            // time.
            for round in 0..4 {
                let id = outbox::enqueue_async(&mut conn, "receipts", &round)
                    .await
                    .expect("enqueue");
                let (delivered, _) = tokio::time::timeout(WAKE_BOUND, reports.recv())
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: not delivered within {WAKE_BOUND:?}"))
                    .expect("the handler is alive");
                assert_eq!(delivered, id, "round {round}");
            }
            shutdown.trigger();
        };
        let (stopped, ()) = tokio::join!(serving, enqueuing);
        assert_eq!((stopped.work.delivered, stopped.errors), (4, 0), "{stopped:?}");
        let statuses = tokio::task::block_in_place(|| Db::outbox_messages(&mut db.conn()));
        assert!(statuses.iter().all(|message| message.2 == "delivered"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_async_relay_rides_out_its_sessions_killed_mid_batch_and_delivers_every_message() {
        const MESSAGES: usize = 20;
        const KILLED_AT: usize = 5;
        let db = Db::new();
        // Its own name, by which the test finds the relay's sessions on the
        // shared server.
        let name = crate::common::unique_name("relay");
        let url = format!("{}&application_name={name}", db.url());
        let pool = crate::common::asynchronous::bb8_pool(
            diesel_async::pooled_connection::AsyncDieselConnectionManager::<diesel_async::AsyncPgConnection>::new(url),
            2,
        )
        .await;
        let mut conn = db.connect().await;
        let mut enqueued = std::collections::BTreeSet::new();
        for i in 0..MESSAGES {
            enqueued.insert(outbox::enqueue_async(&mut conn, "receipts", &i).await.expect("enqueue"));
        }
        // Short, so that the message whose mark the kill lost comes again
        // soon.
        let relay = Relay::default()
            .lease(Duration::seconds(2))
            .poll_interval(Duration::milliseconds(20));
        let shutdown = Shutdown::new();
        let (sender, mut reports) = mpsc::unbounded_channel();
        let killed = std::sync::Arc::new(tokio::sync::Notify::new());
        let handler = {
            let killed = std::sync::Arc::clone(&killed);
            move |message: Message| {
                let (sender, killed) = (sender.clone(), std::sync::Arc::clone(&killed));
                async move {
                    let first_time = sender.send(message.key.clone()).is_ok();
                    // The fifth delivery waits until the test has killed the
                    // relay's sessions: its mark then meets a dead one.
                    if first_time && message.attempt == 1 && message.payload::<usize>().is_ok_and(|n| n == KILLED_AT) {
                        killed.notified().await;
                    }
                    Ok::<_, String>(())
                }
            }
        };
        let serving = relay.serve_async(&pool, handler, &shutdown);
        let killing = async {
            let mut delivered = std::collections::BTreeSet::new();
            while delivered.len() < KILLED_AT + 1 {
                let key = tokio::time::timeout(super::PATIENCE, reports.recv())
                    .await
                    .expect("deliveries")
                    .expect("the handler is alive");
                delivered.insert(key);
            }
            let terminated: Vec<bool> = tokio::task::block_in_place(|| {
                diesel::sql_query(
                    "SELECT pg_terminate_backend(pid) AS terminated FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind::<diesel::sql_types::Text, _>(&name)
                .load::<Terminated>(&mut db.conn())
                .expect("terminate the relay's sessions")
                .into_iter()
                .map(|row| row.terminated)
                .collect()
            });
            assert!(terminated.contains(&true), "the relay's sessions were terminated");
            killed.notify_one();
            while delivered != enqueued {
                let key = tokio::time::timeout(super::PATIENCE, reports.recv())
                    .await
                    .expect("every message delivered after the kill")
                    .expect("the handler is alive");
                delivered.insert(key);
            }
            shutdown.trigger();
        };
        let (stopped, ()) = tokio::join!(serving, killing);
        assert!(stopped.errors >= 1, "the killed sessions were met: {stopped:?}");
        let statuses = tokio::task::block_in_place(|| Db::outbox_messages(&mut db.conn()));
        assert_eq!(statuses.len(), MESSAGES);
        assert!(statuses.iter().all(|message| message.2 == "delivered"), "{statuses:?}");
    }

    #[derive(diesel::QueryableByName)]
    struct Terminated {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        terminated: bool,
    }
}
