//! A connection lost at each moment of a call, on PostgreSQL: before the
//! commit (the transaction rolled back: `Storage`, and a retry executes) and
//! at the commit (it may or may not have committed: `OutcomeUnknown`, and a
//! retry replays or executes). The connection runs through a proxy in the
//! test, on 127.0.0.1, that reaches the server as `DATABASE_URL` does (over
//! TCP or the server's Unix socket), cuts the client off when it sends a
//! chosen statement, before or after passing it on, and lets the server end
//! the session; everything else is checked on a direct connection.

use std::io::{ErrorKind, Read, Write};
use std::net::{self, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use diesel::pg::PgConnection;
use diesel::r2d2::event::TimeoutEvent;
use diesel::r2d2::{ConnectionManager, HandleEvent, Pool};
use diesel::{Connection, RunQueryDsl};
use idempotency::batch::Runner;
use idempotency::outbox::{Message, Relay};
use idempotency::phased::Completer;
use idempotency::{Error, Outcome, Purger, Shutdown, run_idempotent};

use crate::common::pg::{Db, database_url};
use crate::common::wait::{self, PATIENCE};
use crate::common::{TestDb, percent_decode};

/// Whether the proxy passes the statement it cuts at on to the server.
#[derive(Clone, Copy)]
enum Cut {
    /// The server receives it (and, for a COMMIT, commits); its answer never
    /// comes back.
    AfterSending,
    /// The server never receives it.
    BeforeSending,
}

/// Where the server named by `DATABASE_URL` listens, as libpq finds it: a
/// TCP address, or the Unix socket of a directory (a host that is a path,
/// in the url or in its `host` parameter; no host at all: `PGHOST`, or the
/// socket directory of Debian's and most builds of libpq).
#[derive(Debug)]
enum Server {
    Tcp(String),
    Unix(PathBuf),
}

impl Server {
    fn of_database_url() -> Server {
        let url = database_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
        let (address, query) = rest.split_once('?').unwrap_or((rest, ""));
        let authority = address.split('/').next().unwrap_or(address);
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
        let parameter = |name: &str| {
            query
                .split('&')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .map(percent_decoded)
        };
        let (host, port) = match host_port.strip_prefix('[') {
            Some(bracketed) => {
                let (host, after) = bracketed.split_once(']').unwrap_or((bracketed, ""));
                (format!("[{host}]"), after.strip_prefix(':').map(str::to_owned))
            }
            None => match host_port.rsplit_once(':') {
                Some((host, port)) => (percent_decoded(host), Some(port.to_owned())),
                None => (percent_decoded(host_port), None),
            },
        };
        let host = parameter("host")
            .or((!host.is_empty()).then_some(host))
            .or_else(|| std::env::var("PGHOST").ok());
        let port = parameter("port")
            .or(port)
            .or_else(|| std::env::var("PGPORT").ok())
            .unwrap_or_else(|| "5432".to_owned());
        assert!(
            !host.as_deref().unwrap_or_default().contains(','),
            "the connection-loss tests proxy one server; DATABASE_URL names several: {url}"
        );
        match host {
            Some(directory) if directory.starts_with('/') => Server::socket_in(&[&directory], &port, &url),
            Some(host) if host.contains(':') && !host.starts_with('[') => Server::Tcp(format!("[{host}]:{port}")),
            Some(host) => Server::Tcp(format!("{host}:{port}")),
            None => Server::socket_in(&["/var/run/postgresql", "/tmp"], &port, &url),
        }
    }

    /// The server's socket for `port` in the first of `directories` that
    /// has one.
    fn socket_in(directories: &[&str], port: &str, url: &str) -> Server {
        directories
            .iter()
            .map(|directory| Path::new(directory).join(format!(".s.PGSQL.{port}")))
            .find(|socket| socket.exists())
            .map(Server::Unix)
            .unwrap_or_else(|| {
                panic!("DATABASE_URL ({url}) reaches the server over a Unix socket, and no socket for port {port} is in {directories:?}")
            })
    }

    fn connect(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Server::Tcp(address) => {
                let address = address
                    .to_socket_addrs()?
                    .next()
                    .ok_or_else(|| std::io::Error::other(format!("{address} resolves to nothing")))?;
                Stream::Tcp(TcpStream::connect_timeout(&address, PATIENCE)?)
            }
            Server::Unix(socket) => Stream::Unix(UnixStream::connect(socket)?),
        })
    }
}

/// `text` with its `%XX` escapes decoded.
fn percent_decoded(text: &str) -> String {
    String::from_utf8(percent_decode(text)).expect("a url in UTF-8")
}

/// One end of a proxied session: the client's, or the server's over TCP or
/// a Unix socket.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(stream) => Stream::Tcp(stream.try_clone()?),
            Stream::Unix(stream) => Stream::Unix(stream.try_clone()?),
        })
    }

    fn shutdown(&self, how: net::Shutdown) {
        let _ = match self {
            Stream::Tcp(stream) => stream.shutdown(how),
            Stream::Unix(stream) => stream.shutdown(how),
        };
    }

    /// Bounds every read: a session that goes quiet for [`PATIENCE`] ends
    /// the proxy with an error instead of holding the test.
    fn bound_reads(&self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_read_timeout(Some(PATIENCE)),
            Stream::Unix(stream) => stream.set_read_timeout(Some(PATIENCE)),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buffer),
            Stream::Unix(stream) => stream.read(buffer),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buffer),
            Stream::Unix(stream) => stream.write(buffer),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.flush(),
            Stream::Unix(stream) => stream.flush(),
        }
    }
}

/// Whether a read ended because the peer said nothing for too long.
fn timed_out(error: &std::io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Proxies one connection on 127.0.0.1 to the test server, over TCP or the
/// server's Unix socket, cutting it at the first client message that
/// contains `needle`. Every wait of the proxy is bounded: it waits
/// [`PATIENCE`] for its client and for each read, and then fails the test
/// saying what it waited for.
struct Proxy {
    addr: SocketAddr,
    pump: thread::JoinHandle<Result<(), String>>,
}

impl Proxy {
    fn start(needle: &'static [u8], cut: Cut) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let server = Server::of_database_url();
        let pump = thread::spawn(move || {
            let client = accept_within(&listener, PATIENCE)
                .map_err(|error| format!("no client connected to the proxy at {addr}: {error}"))?;
            let server = server
                .connect()
                .map_err(|error| format!("the proxy could not reach the server at {server:?}: {error}"))?;
            let client = Stream::Tcp(client);
            for end in [&client, &server] {
                end.bound_reads()
                    .map_err(|error| format!("bound the proxy's reads: {error}"))?;
            }
            let (mut from_server, mut to_client) = (
                server.try_clone().map_err(|e| e.to_string())?,
                client.try_clone().map_err(|e| e.to_string())?,
            );
            // Reads the server to its end, passing on what the client can
            // still hear: the proxy finishes only once the server has closed
            // the session, after committing or rolling back what it got.
            let backwards = thread::spawn(move || {
                let mut buffer = vec![0; 64 * 1024];
                let mut client_hears = true;
                loop {
                    match from_server.read(&mut buffer) {
                        Ok(0) => return Ok(()),
                        Ok(read) => client_hears = client_hears && to_client.write_all(&buffer[..read]).is_ok(),
                        Err(error) if timed_out(&error) => {
                            return Err(format!("the server did not end the session within {PATIENCE:?}"));
                        }
                        Err(_) => return Ok(()),
                    }
                }
            });
            let (mut from_client, mut to_server) = (client, server);
            let mut buffer = vec![0; 64 * 1024];
            let mut outcome = Ok(());
            loop {
                let read = match from_client.read(&mut buffer) {
                    Ok(0) => break,
                    Err(error) if timed_out(&error) => {
                        outcome = Err(format!("the client sent nothing for {PATIENCE:?}"));
                        break;
                    }
                    Err(_) => break,
                    Ok(read) => read,
                };
                let chunk = &buffer[..read];
                let cut_here = chunk.windows(needle.len()).any(|window| window == needle);
                if cut_here {
                    // The client hears nothing more, from before the server
                    // can answer what is passed on: the server's answer
                    // would otherwise race the cut back to the client.
                    // The server reads the end of its session after it.
                    from_client.shutdown(net::Shutdown::Both);
                    if matches!(cut, Cut::AfterSending) {
                        let _ = to_server.write_all(chunk);
                    }
                    break;
                }
                if to_server.write_all(chunk).is_err() {
                    break;
                }
            }
            to_server.shutdown(net::Shutdown::Write);
            let backwards = wait::join(backwards, "the proxy's thread from the server");
            outcome.and(backwards)
        });
        Proxy { addr, pump }
    }

    /// A url that reaches `db`'s schema through the proxy: `db`'s url with
    /// the proxy for its host and port, whatever the server's were.
    fn url(&self, db: &Db) -> String {
        let url = db.url();
        let (scheme, rest) = url.split_once("://").expect("a url with a scheme");
        let (address, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, database) = address.split_once('/').unwrap_or((address, ""));
        let user = authority.rsplit_once('@').map_or("", |(user, _)| user);
        let user = if user.is_empty() {
            String::new()
        } else {
            format!("{user}@")
        };
        let query: Vec<&str> = query
            .split('&')
            .filter(|pair| !pair.is_empty())
            .filter(|pair| {
                !["host=", "hostaddr=", "port=", "sslmode="]
                    .iter()
                    .any(|name| pair.starts_with(name))
            })
            .collect();
        // An encrypted session would hide the statements from the proxy.
        format!(
            "{scheme}://{user}{}/{database}?{}&sslmode=disable&connect_timeout={}",
            self.addr,
            query.join("&"),
            PATIENCE.as_secs()
        )
    }

    /// Waits until the server has closed the session.
    fn finish(self) {
        if let Err(error) = wait::join(self.pump, "the proxy") {
            panic!("{error}");
        }
    }
}

/// The first client of `listener`, if one connects within `patience`.
fn accept_within(listener: &TcpListener, patience: Duration) -> std::io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + patience;
    loop {
        match listener.accept() {
            Ok((client, _)) => {
                client.set_nonblocking(false)?;
                return Ok(client);
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    format!("none within {patience:?}"),
                ));
            }
            Err(error) => return Err(error),
        }
    }
}

const COMMIT: &[u8] = b"COMMIT\0";
/// The statement that stores a fresh key's result, after the operation: the
/// claim that rides with the lock is completed.
const KEY_STORE: &[u8] = b"UPDATE idempotency_keys SET status";

/// One call through a proxy that cuts at `needle`; asserts that its
/// operation ran once, and returns its result.
fn call_through(db: &Db, needle: &'static [u8], cut: Cut) -> Result<Outcome<i64>, CallError> {
    let proxy = Proxy::start(needle, cut);
    let mut conn = PgConnection::establish(&proxy.url(db)).expect("connect through the proxy");
    let calls = AtomicUsize::new(0);
    let result = run_idempotent(&mut conn, "shop", "order-1", &"one book", |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        Db::place_order(tx, "book", 1)
    });
    drop(conn);
    proxy.finish();
    assert_eq!(calls.into_inner(), 1, "the operation ran once");
    result
}

type CallError = Error<diesel::result::Error>;

/// On a database of its own, one call through a proxy that cuts at
/// `needle`, which must fail with an error that `expected` accepts and that
/// says a retry may succeed; then the checks of [`assert_the_retry_finds`],
/// for a call that `committed` or not. Returns the call's error.
fn lose_the_connection(
    needle: &'static [u8],
    cut: Cut,
    expected: fn(&CallError) -> bool,
    committed: bool,
) -> CallError {
    let db = Db::new();
    let result = call_through(&db, needle, cut);
    let Err(error) = result else {
        panic!("the call fails: {result:?}")
    };
    assert!(expected(&error), "{error:?}");
    assert!(error.is_retryable(), "{error:?}");
    assert_the_retry_finds(&db, committed);
    error
}

/// The call cannot know whether its commit happened.
fn unknown(error: &CallError) -> bool {
    matches!(error, Error::OutcomeUnknown(_))
}

/// The call knows that it was rolled back: not unknown.
fn rolled_back(error: &CallError) -> bool {
    matches!(error, Error::Storage(_))
}

/// Asserts that the call through the proxy committed, or that nothing
/// did, as `committed` says; then that a retry with its key on a direct
/// connection, as the client's next attempt, replays or executes it
/// accordingly, so that the order exists once.
fn assert_the_retry_finds(db: &Db, committed: bool) {
    let mut conn = db.conn();
    Db::await_order_writers(&mut conn);
    let what = if committed {
        "the server committed"
    } else {
        "nothing committed"
    };
    assert_eq!(Db::key_count(&mut conn), i64::from(committed), "{what}");
    let retried = run_idempotent(&mut db.conn(), "shop", "order-1", &"one book", |tx| {
        Db::place_order(tx, "retry", 1)
    })
    .expect("the retry answers");
    assert_eq!(
        retried.is_replayed(),
        committed,
        "the retry replays what committed: {retried:?}"
    );
    let once = if committed { "book" } else { "retry" };
    assert_eq!(Db::order_items(&mut conn), [once], "executed once");
}

#[test]
fn commit_whose_answer_is_lost_is_an_unknown_outcome_and_the_retry_replays() {
    let error = lose_the_connection(COMMIT, Cut::AfterSending, unknown, true);
    assert_eq!(error.status_code(), 503);
}

/// The crate cannot tell this case from the one above.
#[test]
fn commit_that_never_arrived_is_an_unknown_outcome_and_the_retry_executes() {
    lose_the_connection(COMMIT, Cut::BeforeSending, unknown, false);
}

#[test]
fn connection_lost_before_the_commit_is_a_storage_error_and_the_retry_executes() {
    lose_the_connection(KEY_STORE, Cut::AfterSending, rolled_back, false);
}

/// Runs a job of `items` items with `workers` workers on `pool`, whose
/// item `lost` ends its own session the first time it runs, as a failover
/// would; asserts that no item failed, each executed once, and `lost` ran
/// again on a fresh connection.
fn run_a_job_losing_a_connection(
    db: &Db,
    pool: Pool<ConnectionManager<PgConnection>>,
    workers: usize,
    items: i64,
    lost: i64,
) {
    let attempts = AtomicUsize::new(0);
    let report = Runner::new(pool)
        .workers(workers)
        .run("job-1", 1..=items, |tx, item| {
            if *item == lost && attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                diesel::sql_query("SELECT pg_terminate_backend(pg_backend_pid())").execute(tx)?;
            }
            Db::place_order(tx, &item.to_string(), 1)
        })
        .expect("the run");
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(report.executed, usize::try_from(items).expect("a count"));
    assert_eq!(attempts.into_inner(), 2, "item {lost} ran again on a fresh connection");
    assert_eq!(Db::order_count(&mut db.conn()), items);
}

/// An item's connection dies under it (the operation ends its own session,
/// as a failover would): the worker takes a fresh connection from the pool
/// and runs the item once more; no item fails and each executes once.
#[test]
fn batch_worker_replaces_a_lost_connection_and_runs_the_item_again() {
    let db = Db::new();
    run_a_job_losing_a_connection(&db, db.pool(2), 2, 20, 7);
}

/// A worker whose pool has no connection besides the one it holds gives the
/// lost one back before it asks for a fresh one.
#[test]
fn batch_worker_with_a_pool_of_one_replaces_a_lost_connection() {
    let db = Db::new();
    // Short, so that a worker waiting for a connection it holds itself fails
    // the item instead of holding the test up.
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(std::time::Duration::from_secs(3))
        .build(ConnectionManager::<PgConnection>::new(db.url()))
        .expect("a pool");
    run_a_job_losing_a_connection(&db, pool, 1, 5, 2);
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
            let relay = Relay::default().poll_interval(chrono::Duration::seconds(60));
            relay.serve(&pool, |_: &Message| Ok::<_, String>(()), shutdown);
        }),
        spawn_service("purger", &stopped, |pool, shutdown| {
            Purger::default().serve(&pool, shutdown);
        }),
        spawn_service("completer", &stopped, |pool, shutdown| {
            Completer::<PgConnection>::new().serve(&pool, shutdown);
        }),
    ];
    let mut stopped_services: Vec<&str> = (0..services.len())
        .map_while(|_| stops.recv_timeout(std::time::Duration::from_secs(20)).ok())
        .collect();
    stopped_services.sort_unstable();
    assert_eq!(stopped_services, ["completer", "purger", "relay"]);
    for service in services {
        wait::join(service, "a service thread");
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
