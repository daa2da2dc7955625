//! A connection lost at each moment of a call, on PostgreSQL: before the
//! commit (the transaction rolled back: `Storage`, and a retry executes) and
//! at the commit (it may or may not have committed: `OutcomeUnknown`, and a
//! retry replays or executes). The connection runs through a TCP proxy in
//! the test that cuts the client off when it sends a chosen statement,
//! before or after passing it on, and lets the server end the session;
//! everything else is checked on a direct connection.

use std::io::{Read, Write};
use std::net::{self, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;

use diesel::pg::PgConnection;
use diesel::r2d2::event::TimeoutEvent;
use diesel::r2d2::{ConnectionManager, HandleEvent, Pool};
use diesel::{Connection, RunQueryDsl};
use idempotency::batch::Runner;
use idempotency::outbox::{Message, Relay};
use idempotency::phased::Completer;
use idempotency::{Error, Outcome, Purger, Shutdown, run_idempotent};

use crate::common::TestDb;
use crate::common::pg::{Db, database_url};

/// Whether the proxy passes the statement it cuts at on to the server.
#[derive(Clone, Copy)]
enum Cut {
    /// The server receives it (and, for a COMMIT, commits); its answer never
    /// comes back.
    AfterSending,
    /// The server never receives it.
    BeforeSending,
}

/// Proxies one connection to the test server, cutting it at the first
/// client message that contains `needle`.
struct Proxy {
    addr: SocketAddr,
    pump: thread::JoinHandle<()>,
}

/// The `host:port` of the server named by `DATABASE_URL`.
fn server_address() -> String {
    let url = database_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    }
}

impl Proxy {
    fn start(needle: &'static [u8], cut: Cut) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let upstream = server_address();
        let pump = thread::spawn(move || {
            let (client, _) = listener.accept().expect("the client connects");
            let server = TcpStream::connect(&upstream).expect("the proxy reaches the server");
            let (mut from_server, mut to_client) =
                (server.try_clone().expect("clone"), client.try_clone().expect("clone"));
            // Reads the server to its end, passing on what the client can
            // still hear: the proxy finishes only once the server has closed
            // the session, after committing or rolling back what it got.
            let backwards = thread::spawn(move || {
                let mut buffer = vec![0; 64 * 1024];
                let mut client_hears = true;
                while let Ok(read @ 1..) = from_server.read(&mut buffer) {
                    client_hears = client_hears && to_client.write_all(&buffer[..read]).is_ok();
                }
            });
            let (mut from_client, mut to_server) = (client, server);
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let read = match from_client.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(read) => read,
                };
                let chunk = &buffer[..read];
                let cut_here = chunk.windows(needle.len()).any(|window| window == needle);
                let pass_on = !cut_here || matches!(cut, Cut::AfterSending);
                if pass_on && to_server.write_all(chunk).is_err() {
                    break;
                }
                if cut_here {
                    // The client hears nothing more, and the server reads the
                    // end of its session after what was passed on.
                    let _ = from_client.shutdown(net::Shutdown::Both);
                    break;
                }
            }
            let _ = to_server.shutdown(net::Shutdown::Write);
            let _ = backwards.join();
        });
        Proxy { addr, pump }
    }

    /// A url that reaches `db`'s schema through the proxy.
    fn url(&self, db: &Db) -> String {
        let server = server_address();
        let through = db.url().replacen(&server, &self.addr.to_string(), 1);
        // An encrypted session would hide the statements from the proxy.
        format!("{through}&sslmode=disable")
    }

    /// Waits until the server has closed the session.
    fn finish(self) {
        self.pump.join().expect("the proxy's threads end");
    }
}

const COMMIT: &[u8] = b"COMMIT\0";
const KEY_INSERT: &[u8] = b"INSERT INTO \"idempotency_keys\"";

/// One call through a proxy that cuts at `needle`; returns its result and
/// how often its operation ran.
fn call_through(
    db: &Db,
    needle: &'static [u8],
    cut: Cut,
) -> (Result<Outcome<i64>, Error<diesel::result::Error>>, usize) {
    let proxy = Proxy::start(needle, cut);
    let mut conn = PgConnection::establish(&proxy.url(db)).expect("connect through the proxy");
    let calls = AtomicUsize::new(0);
    let result = run_idempotent(&mut conn, "shop", "order-1", &"one book", |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        Db::place_order(tx, "book", 1)
    });
    drop(conn);
    proxy.finish();
    (result, calls.into_inner())
}

/// A retry on a direct connection, as the client's next attempt.
fn retry(db: &Db) -> Outcome<i64> {
    run_idempotent(&mut db.conn(), "shop", "order-1", &"one book", |tx| {
        Db::place_order(tx, "retry", 1)
    })
    .expect("the retry answers")
}

#[test]
fn commit_whose_answer_is_lost_is_an_unknown_outcome_and_the_retry_replays() {
    let db = Db::new();
    let (result, calls) = call_through(&db, COMMIT, Cut::AfterSending);
    assert_eq!(calls, 1);
    let Err(error) = result else {
        panic!("the call cannot know: {result:?}")
    };
    assert!(matches!(error, Error::OutcomeUnknown(_)), "{error:?}");
    assert!(error.is_retryable());
    assert_eq!(error.status_code(), 503);

    let mut conn = db.conn();
    assert_eq!(Db::key_count(&mut conn), 1, "the server committed");
    let retried = retry(&db);
    assert!(retried.is_replayed(), "the retry replays: {retried:?}");
    assert_eq!(Db::order_items(&mut conn), ["book"], "executed once");
}

#[test]
fn commit_that_never_arrived_is_an_unknown_outcome_and_the_retry_executes() {
    let db = Db::new();
    let (result, calls) = call_through(&db, COMMIT, Cut::BeforeSending);
    assert_eq!(calls, 1);
    // The crate cannot tell this case from the one above.
    assert!(matches!(result, Err(Error::OutcomeUnknown(_))), "{result:?}");

    let mut conn = db.conn();
    Db::await_order_writers(&mut conn);
    assert_eq!(Db::key_count(&mut conn), 0, "nothing committed");
    let retried = retry(&db);
    assert!(!retried.is_replayed(), "the retry executes: {retried:?}");
    assert_eq!(Db::order_items(&mut conn), ["retry"], "executed once, by the retry");
}

#[test]
fn connection_lost_before_the_commit_is_a_storage_error_and_the_retry_executes() {
    let db = Db::new();
    let (result, calls) = call_through(&db, KEY_INSERT, Cut::AfterSending);
    assert_eq!(calls, 1);
    let Err(error) = result else {
        panic!("the call fails: {result:?}")
    };
    assert!(
        matches!(error, Error::Storage(_)),
        "rolled back, not unknown: {error:?}"
    );
    assert!(error.is_retryable());

    let mut conn = db.conn();
    Db::await_order_writers(&mut conn);
    assert_eq!(Db::key_count(&mut conn), 0);
    assert!(!retry(&db).is_replayed());
    assert_eq!(Db::order_items(&mut conn), ["retry"]);
}

/// An item's connection dies under it (the operation ends its own session,
/// as a failover would): the worker takes a fresh connection from the pool
/// and runs the item once more; no item fails and each executes once.
#[test]
fn batch_worker_replaces_a_lost_connection_and_runs_the_item_again() {
    let db = Db::new();
    let attempts = AtomicUsize::new(0);
    let runner = Runner::new(db.pool(2)).workers(2);
    let report = runner
        .run("job-1", 1..=20_i64, |tx, item| {
            if *item == 7 && attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                diesel::sql_query("SELECT pg_terminate_backend(pg_backend_pid())").execute(tx)?;
            }
            Db::place_order(tx, &item.to_string(), 1)
        })
        .expect("the run");
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(report.executed, 20);
    assert_eq!(attempts.into_inner(), 2, "item 7 ran again on a fresh connection");
    assert_eq!(Db::order_count(&mut db.conn()), 20);
}

/// A worker whose pool has no connection besides the one it holds gives the
/// lost one back before it asks for a fresh one.
#[test]
fn batch_worker_with_a_pool_of_one_replaces_a_lost_connection() {
    let db = Db::new();
    let attempts = AtomicUsize::new(0);
    // Short, so that a worker waiting for a connection it holds itself fails
    // the item instead of holding the test up.
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(std::time::Duration::from_secs(3))
        .build(ConnectionManager::<PgConnection>::new(db.url()))
        .expect("a pool");
    let report = Runner::new(pool)
        .workers(1)
        .run("job-1", 1..=5_i64, |tx, item| {
            if *item == 2 && attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                diesel::sql_query("SELECT pg_terminate_backend(pg_backend_pid())").execute(tx)?;
            }
            Db::place_order(tx, &item.to_string(), 1)
        })
        .expect("the run");
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(report.executed, 5);
    assert_eq!(attempts.into_inner(), 2, "item 2 ran again on a fresh connection");
    assert_eq!(Db::order_count(&mut db.conn()), 5);
}

/// Triggers the shutdown when a checkout from its pool times out: the
/// service is waiting for a connection right then, so the stop reaches it
/// mid-wait, without a guess of when it got there.
#[derive(Debug)]
struct TriggerOnTimeout(Shutdown);

impl HandleEvent for TriggerOnTimeout {
    fn handle_timeout(&self, _: TimeoutEvent) {
        self.0.trigger();
    }
}

/// A database that cannot be reached holds up no stop: the services wait
/// for a pooled connection in short slices and look at the signal between
/// them, where r2d2's own wait (a minute here) cannot be cut short.
#[test]
fn services_stop_at_once_while_the_database_is_unreachable() {
    let (stopped, stops) = mpsc::channel();
    let services = [
        spawn_service("relay", &stopped, |pool, shutdown| {
            let relay = Relay::default().poll_interval(std::time::Duration::from_secs(60));
            relay.run(&pool, |_: &Message| Ok::<_, String>(()), shutdown);
        }),
        spawn_service("purger", &stopped, |pool, shutdown| {
            Purger::default().run(&pool, shutdown);
        }),
        spawn_service("completer", &stopped, |pool, shutdown| {
            Completer::<PgConnection>::new().run(&pool, shutdown);
        }),
    ];
    let mut stopped_services: Vec<&str> = (0..services.len())
        .map_while(|_| stops.recv_timeout(std::time::Duration::from_secs(20)).ok())
        .collect();
    stopped_services.sort_unstable();
    assert_eq!(stopped_services, ["completer", "purger", "relay"]);
    for service in services {
        service.join().expect("the service does not panic");
    }
}

/// Runs `service` on a thread of its own, with a pool that reaches no
/// database (and waits a minute for a connection) and a shutdown that its
/// first timed-out checkout triggers; the thread reports the service's
/// name when the service returns.
fn spawn_service(
    name: &'static str,
    stopped: &mpsc::Sender<&'static str>,
    service: impl FnOnce(Pool<ConnectionManager<PgConnection>>, &Shutdown) + Send + 'static,
) -> thread::JoinHandle<()> {
    let shutdown = Shutdown::new();
    let pool = Pool::builder()
        .max_size(2)
        .connection_timeout(std::time::Duration::from_secs(60))
        .event_handler(Box::new(TriggerOnTimeout(shutdown.clone())))
        .build_unchecked(ConnectionManager::<PgConnection>::new(
            "postgres://postgres@127.0.0.1:1/test?connect_timeout=1",
        ));
    let stopped = stopped.clone();
    thread::spawn(move || {
        service(pool, &shutdown);
        let _ = stopped.send(name);
    })
}
