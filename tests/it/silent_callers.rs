//! A caller cut off mid-call by the network, not killed: its host goes
//! silent and closes nothing, so the server sees neither a FIN nor a reset,
//! only silence. The call's connection runs through a proxy in the test
//! process that freezes: it stops passing bytes either way and keeps every
//! socket open. The server then ends the silent session once the call's
//! idle bound (`Config::idle_timeout`) has passed, which frees the key, and
//! a retry on a direct connection executes. Without the bound the key stays
//! held until the socket closes.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::{self, JoinHandle};
use std::time::Instant;

use chrono::Duration;
use diesel::Connection;
use idempotency::phased::Phased;
use idempotency::{Config, Error, InFlight, Outcome};

use crate::common::server::{Call, CallResult, DomainError, Op, REQUEST, SCOPE, counted, nested, top_level};
use crate::common::{ServerDb, TestDb, wait};

crate::common::server_backend_tests!(
    a_caller_cut_off_mid_call_frees_its_key_within_the_idle_timeout,
    a_caller_cut_off_in_a_callers_transaction_frees_its_key_within_the_idle_timeout,
    a_caller_cut_off_mid_step_frees_its_phased_operation_within_the_idle_timeout,
    without_an_idle_timeout_a_silent_caller_keeps_its_key_until_its_socket_closes,
    a_call_bounds_its_idle_time_and_puts_the_sessions_own_setting_back,
);

/// The bound of the tests: short, so that the suite stays fast.
const BOUND: std::time::Duration = std::time::Duration::from_secs(1);
/// Each retry waits this long for the key, which paces the retries.
const IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_millis(200);
/// What the server may take beyond the bound to notice the silence and end
/// the session (MySQL counts its timeout in whole seconds).
const SLACK: std::time::Duration = std::time::Duration::from_secs(4);

fn bounded() -> Config {
    Config::default()
        .idle_timeout(Duration::from_std(BOUND).expect("a bound"))
        .in_flight(InFlight::Wait(Duration::from_std(IN_FLIGHT_WAIT).expect("a wait")))
}

/// Whether the proxy passes bytes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Open,
    Frozen,
    Closed,
}

/// What the proxy's threads share: the flow, and every socket, so that
/// closing the proxy ends every read its threads are blocked in.
struct Shared {
    flow: Mutex<Flow>,
    changed: Condvar,
    sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn set(&self, flow: Flow) {
        *self.flow.lock().expect("the proxy's flow") = flow;
        self.changed.notify_all();
    }

    /// Waits while the proxy is frozen; whether it passes bytes on.
    fn wait_open(&self) -> bool {
        let mut flow = self.flow.lock().expect("the proxy's flow");
        while *flow == Flow::Frozen {
            flow = self.changed.wait(flow).expect("the proxy's flow");
        }
        *flow == Flow::Open
    }
}

/// A TCP proxy on 127.0.0.1 to a server, for the connections a test makes
/// through it. Frozen, it holds what it reads and passes nothing on, every
/// socket left open: the server hears silence, as from a host that lost its
/// network. Closed (or dropped), it shuts every socket, and the server and
/// the client each see their connection end.
struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared {
            flow: Mutex::new(Flow::Open),
            changed: Condvar::new(),
            sockets: Mutex::new(Vec::new()),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                let mut pumps = Vec::new();
                for client in listener.incoming() {
                    if *shared.flow.lock().expect("the proxy's flow") == Flow::Closed {
                        break;
                    }
                    let Ok(client) = client else { break };
                    let server = TcpStream::connect(&upstream)
                        .unwrap_or_else(|error| panic!("the proxy reaches the server at {upstream}: {error}"));
                    let clone = |socket: &TcpStream| socket.try_clone().expect("a socket's clone");
                    shared
                        .sockets
                        .lock()
                        .expect("the proxy's sockets")
                        .extend([clone(&client), clone(&server)]);
                    for (from, to) in [(clone(&client), clone(&server)), (server, client)] {
                        let shared = Arc::clone(&shared);
                        pumps.push(thread::spawn(move || pump(from, to, &shared)));
                    }
                }
                for pump in pumps {
                    wait::join(pump, "a thread of the proxy");
                }
            })
        };
        Proxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// The proxy for the server of `url`, and `url` with the proxy in its
    /// place.
    fn for_url(url: &str) -> (Proxy, String) {
        let (scheme, rest) = url.split_once("://").expect("a url with a scheme");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (user, host) = match authority.rsplit_once('@') {
            Some((user, host)) => (format!("{user}@"), host),
            None => (String::new(), authority),
        };
        assert!(
            !host.is_empty() && !host.contains(',') && !host.starts_with('['),
            "the partition tests proxy one server named by host and port: {url}"
        );
        let upstream = match (host.contains(':'), scheme) {
            (true, _) => host.to_owned(),
            (false, "mysql") => format!("{host}:3306"),
            (false, _) => format!("{host}:5432"),
        };
        let proxy = Proxy::start(upstream);
        let url = format!("{scheme}://{user}{}/{path}", proxy.addr);
        (proxy, url)
    }

    /// Stops passing bytes on, either way, keeping every socket open.
    fn freeze(&self) {
        self.shared.set(Flow::Frozen);
    }

    /// Shuts every socket, so that whoever waits on one sees it end.
    fn shut(&mut self) {
        self.shared.set(Flow::Closed);
        for socket in self.shared.sockets.lock().expect("the proxy's sockets").iter() {
            let _ = socket.shutdown(Shutdown::Both);
        }
        // Wakes the acceptor, which then sees the proxy closed.
        let _ = TcpStream::connect(self.addr);
    }

    /// Closes the proxy and waits for its threads to end.
    fn close(mut self) {
        self.shut();
        if let Some(acceptor) = self.acceptor.take() {
            wait::join(acceptor, "the proxy's acceptor");
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // A test that fails midway leaves no thread blocked on the proxy.
        if self.acceptor.is_some() {
            self.shut();
        }
    }
}

/// Passes what `from` sends on to `to` while the proxy is open.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if !shared.wait_open() || to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A phased operation of one phase, the operation, and a finish.
fn phased<D: TestDb>(conn: &mut D::Conn, config: &Config, key: &str, op: Op<'_, D::Conn>) -> CallResult {
    Phased::new("partition")
        .config(config.clone())
        .run(conn, SCOPE, key, REQUEST, |steps| {
            let order = steps.phase("place", op)?;
            steps.finish(|_| Ok::<_, DomainError>(order))
        })
}

/// A call made as `call` makes it, through a proxy, that has placed its
/// order and is inside its transaction, holding its key, when the proxy
/// freezes; its operation then returns, and what the call sends next is
/// lost.
struct CutOff {
    /// The key, of this test alone: PostgreSQL's advisory locks span the
    /// schemas of the other tests.
    key: String,
    proxy: Proxy,
    session: i64,
    frozen_at: Instant,
    thread: JoinHandle<CallResult>,
}

impl CutOff {
    fn start<D: ServerDb>(db: &D, config: &Config, calls: &Arc<AtomicUsize>, call: Call<D::Conn>) -> CutOff {
        let (proxy, url) = Proxy::for_url(db.url());
        let (inside_tx, inside_rx) = mpsc::channel();
        let (go_on, go_on_rx) = mpsc::channel::<()>();
        let (config, calls) = (config.clone(), Arc::clone(calls));
        let key = crate::common::unique_name("cut-off");
        let thread = thread::spawn({
            let key = key.clone();
            move || {
                let mut conn = D::Conn::establish(&url).expect("connect through the proxy");
                let session = D::session_id(&mut conn);
                let op: Op<'_, D::Conn> = Box::new(move |tx| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let order = D::place_order(tx, "cut off", 1)?;
                    inside_tx.send(session).expect("the test waits for the call");
                    go_on_rx.recv().expect("the test lets the operation return");
                    Ok(order)
                });
                call(&mut conn, &config, &key, op)
            }
        });
        let Ok(session) = inside_rx.recv_timeout(wait::PATIENCE) else {
            let result = wait::join(thread, "the call through the proxy");
            panic!("the call through the proxy ended before its operation ran: {result:?}");
        };
        let mut admin = db.conn();
        assert_eq!(
            db.key_lock_holder(&mut admin, SCOPE, &key),
            Some(session),
            "the call through the proxy holds the key"
        );
        proxy.freeze();
        let frozen_at = Instant::now();
        go_on.send(()).expect("the operation waits");
        CutOff {
            key,
            proxy,
            session,
            frozen_at,
            thread,
        }
    }

    /// Closes the proxy: the cut-off call hears its connection end and
    /// fails, having committed nothing.
    fn close(self) {
        self.proxy.close();
        let result = wait::join(self.thread, "the cut-off call");
        assert!(
            matches!(result, Err(Error::Storage(_))),
            "the cut-off call fails with its connection: {result:?}"
        );
    }
}

/// Retries the key of `cut_off` on `conn` as `call` makes it, its
/// operation counted in `calls`, until the retry executes or `patience` has
/// passed since the proxy froze; the outcome and how many retries found the
/// key in progress.
fn retry_until_executed<D: ServerDb>(
    conn: &mut D::Conn,
    cut_off: &CutOff,
    config: &Config,
    calls: &AtomicUsize,
    call: Call<D::Conn>,
    patience: std::time::Duration,
) -> (Option<Outcome<i64>>, usize) {
    let mut in_progress = 0;
    loop {
        match call(conn, config, &cut_off.key, counted::<D>(calls, "retry")) {
            Ok(outcome) => return (Some(outcome), in_progress),
            Err(Error::InProgress) => in_progress += 1,
            Err(error) => panic!("a retry of a held key: {error:?}"),
        }
        if cut_off.frozen_at.elapsed() >= patience {
            return (None, in_progress);
        }
    }
}

/// A call made as `call` makes it is cut off mid-call; a retry on a direct
/// connection finds the key held, then executes once the server has ended
/// the silent session, within the bound and the in-flight wait.
fn cut_off_then_retried<D: ServerDb>(call: Call<D::Conn>) {
    let db = D::new();
    let config = bounded();
    let calls = Arc::new(AtomicUsize::new(0));
    let cut_off = CutOff::start(&db, &config, &calls, call);
    let mut direct = db.conn();
    let (outcome, in_progress) = retry_until_executed::<D>(
        &mut direct,
        &cut_off,
        &config,
        &calls,
        call,
        BOUND + IN_FLIGHT_WAIT + SLACK,
    );
    let waited = cut_off.frozen_at.elapsed();
    let Some(Outcome::Executed(order)) = outcome else {
        panic!("the retry still finds the key held {waited:?} after the caller went silent: {outcome:?}");
    };
    assert!(in_progress > 0, "the key was held when the caller went silent");
    let mut admin = db.conn();
    D::wait_until_gone(&mut admin, cut_off.session);
    // Exactly one commit: the retry's order, its record replayed.
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the cut-off call and the retry ran");
    assert_eq!(D::order_items(&mut admin), vec!["retry".to_owned()]);
    let replay = call(&mut admin, &config, &cut_off.key, counted::<D>(&calls, "replay")).expect("a replay");
    assert_eq!(replay, Outcome::Replayed(order));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "a replay runs nothing");
    cut_off.close();
}

fn a_caller_cut_off_mid_call_frees_its_key_within_the_idle_timeout<D: ServerDb>() {
    cut_off_then_retried::<D>(top_level::<D>);
}

fn a_caller_cut_off_in_a_callers_transaction_frees_its_key_within_the_idle_timeout<D: ServerDb>() {
    cut_off_then_retried::<D>(nested::<D>);
}

fn a_caller_cut_off_mid_step_frees_its_phased_operation_within_the_idle_timeout<D: ServerDb>() {
    cut_off_then_retried::<D>(phased::<D>);
}

fn without_an_idle_timeout_a_silent_caller_keeps_its_key_until_its_socket_closes<D: ServerDb>() {
    let db = D::new();
    let config = bounded().idle_timeout(None);
    let calls = Arc::new(AtomicUsize::new(0));
    let cut_off = CutOff::start(&db, &config, &calls, top_level::<D>);
    let mut direct = db.conn();
    // Three times the bound of the other tests, all of it in progress.
    let (outcome, in_progress) =
        retry_until_executed::<D>(&mut direct, &cut_off, &config, &calls, top_level::<D>, 3 * BOUND);
    assert_eq!(outcome, None, "the key was freed without a bound");
    assert!(in_progress > 0);
    let mut admin = db.conn();
    assert!(
        D::session_exists(&mut admin, cut_off.session),
        "the silent session is still there"
    );
    // The socket closes: the server ends the session, and the key is free.
    let (session, key) = (cut_off.session, cut_off.key.clone());
    cut_off.close();
    D::wait_until_gone(&mut admin, session);
    let retry = top_level::<D>(&mut direct, &config, &key, counted::<D>(&calls, "retry")).expect("the retry");
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
    assert_eq!(D::order_items(&mut admin), vec!["retry".to_owned()]);
}

/// How a backend's session shows the bound on its silence, in seconds.
trait IdleSetting: ServerDb {
    /// Whether the bound a nested call set lasts until its caller's
    /// transaction ends (PostgreSQL's transaction-local setting), rather
    /// than until the call ends (MySQL's session variable, put back).
    const OUTLIVES_A_NESTED_CALL: bool;

    fn set_idle_seconds(conn: &mut Self::Conn, seconds: i64);

    fn idle_seconds(conn: &mut Self::Conn) -> i64;
}

#[cfg(feature = "postgres")]
impl IdleSetting for crate::common::pg::Db {
    const OUTLIVES_A_NESTED_CALL: bool = true;

    fn set_idle_seconds(conn: &mut diesel::PgConnection, seconds: i64) {
        use diesel::connection::SimpleConnection;
        conn.batch_execute(&format!("SET idle_in_transaction_session_timeout = '{seconds}s'"))
            .expect("set the session's idle_in_transaction_session_timeout");
    }

    fn idle_seconds(conn: &mut diesel::PgConnection) -> i64 {
        use diesel::RunQueryDsl;
        diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "EXTRACT(EPOCH FROM current_setting('idle_in_transaction_session_timeout')::interval)::bigint",
        ))
        .get_result(conn)
        .expect("read idle_in_transaction_session_timeout")
    }
}

#[cfg(feature = "mysql")]
impl IdleSetting for crate::common::mysql::Db {
    const OUTLIVES_A_NESTED_CALL: bool = false;

    fn set_idle_seconds(conn: &mut diesel::MysqlConnection, seconds: i64) {
        use diesel::connection::SimpleConnection;
        conn.batch_execute(&format!("SET SESSION wait_timeout = {seconds}"))
            .expect("set the session's wait_timeout");
    }

    fn idle_seconds(conn: &mut diesel::MysqlConnection) -> i64 {
        use diesel::RunQueryDsl;
        diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>("@@SESSION.wait_timeout"))
            .get_result(conn)
            .expect("read wait_timeout")
    }
}

fn a_call_bounds_its_idle_time_and_puts_the_sessions_own_setting_back<D: IdleSetting>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut holder = db.conn();
    let config = Config::default().idle_timeout(Duration::seconds(30));
    // Keys of this test alone: PostgreSQL's advisory locks span the schemas.
    let unique = crate::common::unique_name("idle");
    let key = |name: &str| format!("{unique}-{name}");
    let run = |conn: &mut D::Conn, key: &str, config: &Config| {
        config.run(conn, SCOPE, key, REQUEST, |tx| {
            D::place_order(tx, key, 1)?;
            Ok::<_, DomainError>(D::idle_seconds(tx))
        })
    };
    D::set_idle_seconds(&mut conn, 600);
    assert_eq!(
        run(&mut conn, &key("top"), &config).expect("a call"),
        Outcome::Executed(30)
    );
    assert_eq!(D::idle_seconds(&mut conn), 600, "put back after the call");

    // A session whose own bound is lower keeps it.
    D::set_idle_seconds(&mut conn, 7);
    assert_eq!(
        run(&mut conn, &key("lower"), &config).expect("a call"),
        Outcome::Executed(7)
    );
    assert_eq!(D::idle_seconds(&mut conn), 7);

    // Put back when the key's wait runs out, too.
    D::set_idle_seconds(&mut conn, 600);
    let reject = config.clone().in_flight(InFlight::Reject);
    let held = crate::common::server::Holder::claim_with(&db, &key("held"), config.clone(), top_level::<D>);
    assert!(matches!(run(&mut conn, &key("held"), &reject), Err(Error::InProgress)));
    assert_eq!(D::idle_seconds(&mut conn), 600, "put back after a wait that ran out");
    held.finish(crate::common::server::Release::Fail)
        .expect_err("the holder's operation fails");

    // Nested: put back when the call ends (MySQL) or with the caller's
    // transaction (PostgreSQL).
    let after_the_call = conn
        .transaction(|tx| {
            run(tx, &key("nested"), &config)?;
            Ok::<_, Error<DomainError>>(D::idle_seconds(tx))
        })
        .expect("a nested call");
    let expected = if D::OUTLIVES_A_NESTED_CALL { 30 } else { 600 };
    assert_eq!(after_the_call, expected, "in the caller's transaction after the call");
    assert_eq!(
        D::idle_seconds(&mut conn),
        600,
        "put back after the caller's transaction"
    );
    // Without a bound nothing is touched.
    assert_eq!(
        run(&mut holder, &key("unbounded"), &config.clone().idle_timeout(None)).expect("a call"),
        Outcome::Executed(D::idle_seconds(&mut db.conn()))
    );
}
