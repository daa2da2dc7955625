//! What the HTTP tests stand on, beside the databases of [`TestDb`]: the
//! test order service served on 127.0.0.1, a client, a proxy that loses
//! responses, the compiled example binary, and a gate that holds an order's
//! transaction open.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use diesel::connection::SimpleConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use super::TestDb;
use super::orders_service;
pub use super::orders_service::{Account, Limits, MAX_ITEM_CHARS, Settings};

pub use super::wait::PATIENCE;

/// Anyone is one caller, the `public` scope: for the parts of
/// `idempotency::http` that the service leaves out.
pub struct Anyone;

impl<S: Sync> axum::extract::FromRequestParts<S> for Anyone {
    type Rejection = axum::http::StatusCode;

    async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Anyone)
    }
}

impl idempotency::http::Caller for Anyone {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed("public")
    }
}

/// A pool of SQLite connections, as the routers of the tests that need no
/// backend of their own use.
pub type SqlitePool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<diesel::SqliteConnection>>;

/// The token of the request's `Authorization: Bearer` header, where it
/// has one.
pub fn bearer_token(parts: &axum::http::request::Parts) -> Option<&str> {
    parts
        .headers
        .get("authorization")
        .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
}

/// The `type` of the crate's problem `name`, under the default base.
pub fn problem_type(name: &str) -> String {
    format!("{}{name}", idempotency::http::Problems::DEFAULT_BASE)
}

/// A caller who must show a bearer token, 401 without one; the token is
/// its scope.
pub struct Bearer(pub String);

impl<S: Sync> axum::extract::FromRequestParts<S> for Bearer {
    type Rejection = axum::http::StatusCode;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        bearer_token(parts)
            .map(|token| Bearer(token.to_owned()))
            .ok_or(axum::http::StatusCode::UNAUTHORIZED)
    }
}

impl idempotency::http::Caller for Bearer {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed(&self.0)
    }
}

/// The state of a router of notes: the pool its calls run on, and their
/// policy.
#[derive(Clone)]
pub struct Notes {
    pub pool: SqlitePool,
    pub config: idempotency::Config,
}

impl Notes {
    /// Notes in `db`, over a [`notes_pool`] of `pool_size` connections,
    /// under `config`.
    pub fn new(db: &idempotency::testing::SqliteFile, pool_size: u32, config: idempotency::Config) -> Self {
        Notes {
            pool: notes_pool(db, pool_size),
            config,
        }
    }
}

/// A response of a router in the test's process as a client sees it:
/// every byte of it.
#[derive(Debug, PartialEq)]
pub struct Seen {
    pub status: axum::http::StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Seen {
    /// The body, which is JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// The value of the header field `name`, if the response has one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|value| value.to_str().expect("visible ASCII"))
    }
}

/// What `app` answers `request`.
pub async fn seen(app: &Router, request: axum::http::Request<axum::body::Body>) -> Seen {
    use tower::ServiceExt;
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("a body")
        .to_vec();
    Seen { status, headers, body }
}

/// A pool of `size` connections to `db`, with a `notes` table, which a
/// request waits 200 ms for at most.
pub fn notes_pool(db: &idempotency::testing::SqliteFile, size: u32) -> SqlitePool {
    db.conn()
        .batch_execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY)")
        .expect("create notes");
    diesel::r2d2::Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_millis(200))
        .build(diesel::r2d2::ConnectionManager::new(
            db.path().to_str().expect("utf-8 path"),
        ))
        .expect("a pool")
}

/// A database of the test's own on backend `D`, empty: the service sets it
/// up.
pub async fn database<D: TestDb>() -> D {
    tokio::task::spawn_blocking(D::empty)
        .await
        .expect("create the test database")
}

/// How many orders `db` holds, all accounts together.
pub async fn order_count<D: TestDb>(db: &D) -> i64 {
    tokio::task::block_in_place(|| D::order_count(&mut db.conn()))
}

/// How many key records `db` holds, all accounts together.
pub async fn key_count<D: TestDb>(db: &D) -> i64 {
    tokio::task::block_in_place(|| D::key_count(&mut db.conn()))
}

/// Drops `table` from `db`, under the running service.
pub async fn drop_table<D: TestDb>(db: &D, table: &str) {
    tokio::task::block_in_place(|| {
        db.conn()
            .batch_execute(&format!("DROP TABLE {table}"))
            .expect("drop the table")
    });
}

/// The order service of [`orders_service`], served in this process on
/// 127.0.0.1 on a free port.
pub struct Server {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl Server {
    pub async fn start<D: TestDb>(db: &D, settings: Settings) -> Server {
        Server::start_with(db, settings, |router| router).await
    }

    /// Serves the service's routes as `wrap` changes them.
    pub async fn start_with<D: TestDb>(db: &D, settings: Settings, wrap: impl FnOnce(Router) -> Router) -> Server {
        let pool = orders_service::pool(db, &settings);
        let router = tokio::task::spawn_blocking(move || orders_service::router::<D>(pool, settings))
            .await
            .expect("start the service");
        Server::serve(wrap(router), Limits::default()).await
    }

    /// The service with every connection of its pool checked out and held
    /// by the second value, until it is dropped.
    pub async fn start_exhausted<D: TestDb>(db: &D, settings: Settings) -> (Server, HeldPool) {
        let pool = orders_service::pool(db, &settings);
        let (router, held) = tokio::task::spawn_blocking(move || {
            let router = orders_service::router::<D>(pool.clone(), settings);
            let connections: Vec<_> = (0..pool.max_size())
                .map(|_| pool.get().expect("check out a connection of the pool"))
                .collect();
            assert_eq!(pool.state().idle_connections, 0, "every connection of the pool is held");
            let held = HeldPool {
                _connections: Box::new(connections),
            };
            (router, held)
        })
        .await
        .expect("start the service");
        (Server::serve(router, Limits::default()).await, held)
    }

    /// Serves `router` within `limits` on a free port, until dropped.
    pub async fn serve(router: Router, limits: Limits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen on a free port");
        let addr = listener.local_addr().expect("the listening address");
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(orders_service::serve(listener, router, limits, async {
            let _ = stopped.await;
        }));
        Server { addr, _stop: stop }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The service on `db` with the default settings, served within
    /// `limits`.
    pub async fn start_limited<D: TestDb>(db: &D, limits: Limits) -> Server {
        let settings = Settings::default();
        let pool = orders_service::pool(db, &settings);
        let router = tokio::task::spawn_blocking(move || orders_service::router::<D>(pool, settings))
            .await
            .expect("start the service");
        Server::serve(router, limits).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Connections of a service's pool, checked out and held.
pub struct HeldPool {
    _connections: Box<dyn std::any::Any + Send>,
}

/// A client over keep-alive connections, without proxies from the
/// environment.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(PATIENCE)
        .build()
        .expect("build a client")
}

/// `POST /orders` as `account` with the given `Idempotency-Key` fields and
/// a JSON body.
pub fn post_order(
    client: &reqwest::Client,
    base: &str,
    account: &str,
    keys: &[&str],
    body: &str,
) -> reqwest::RequestBuilder {
    let mut request = client
        .post(format!("{base}/orders"))
        .bearer_auth(account)
        .header("content-type", "application/json")
        .body(body.to_owned());
    for key in keys {
        request = request.header("idempotency-key", *key);
    }
    request
}

/// A response as the tests compare them.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub location: Option<String>,
    pub content_type: Option<String>,
    pub replayed: Option<String>,
    pub retry_after: Option<String>,
    pub body: serde_json::Value,
}

impl Answer {
    pub async fn of(response: reqwest::Response) -> Answer {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|value| value.to_str().expect("an ascii header").to_owned())
        };
        let (location, content_type) = (header("location"), header("content-type"));
        let (replayed, retry_after) = (header("idempotent-replayed"), header("retry-after"));
        let status = response.status().as_u16();
        let text = response.text().await.expect("read the body");
        let body = if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|error| panic!("a JSON body, got {text:?}: {error}"))
        };
        Answer {
            status,
            location,
            content_type,
            replayed,
            retry_after,
            body,
        }
    }

    /// Asserts a problem+json answer of `status` whose type is the example
    /// service's problem `name`, and returns it.
    pub fn assert_problem_of(self, status: u16, name: &str) -> Answer {
        let answer = self.assert_problem(status);
        assert_eq!(
            answer.body["type"],
            format!("https://orders.example/problems/{name}"),
            "{answer:?}"
        );
        answer
    }

    /// Asserts a problem+json answer of `status` and returns it.
    pub fn assert_problem(self, status: u16) -> Answer {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/problem+json"),
            "{self:?}"
        );
        assert_eq!(self.body["status"], status, "{self:?}");
        assert!(
            self.body["type"].is_string() && self.body["title"].is_string(),
            "{self:?}"
        );
        self
    }
}

/// Sends `request` and reads the answer.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    Answer::of(request.send().await.expect("send the request")).await
}

/// A response as a proxy saw it on the wire.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The response of a message head and body as read off the wire.
    fn parse(head: &str, body: Vec<u8>) -> RawResponse {
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|line| line.split(' ').nth(1))
            .and_then(|code| code.parse().ok())
            .expect("a status line");
        let headers = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(n, v)| (n.to_owned(), v.trim().to_owned()))
            .collect();
        RawResponse { status, headers, body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one HTTP/1.1 message with a `Content-Length` body from `stream`:
/// its head and its body.
async fn read_message<R: tokio::io::AsyncRead + Unpin>(stream: &mut R) -> (String, Vec<u8>) {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).await.expect("read a message");
        assert!(n > 0, "the peer closed before the end of the message head");
        buffer.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(buffer[..head_end].to_vec()).expect("an ascii head");
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().expect("a content length"))
        })
        .unwrap_or(0);
    let mut body = buffer[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await.expect("read a body");
        assert!(n > 0, "the peer closed before the end of the body");
        body.extend_from_slice(&chunk[..n]);
    }
    (head, body)
}

/// Reads one response from `stream`.
pub async fn read_response<R: tokio::io::AsyncRead + Unpin>(stream: &mut R) -> RawResponse {
    let (head, body) = read_message(stream).await;
    RawResponse::parse(&head, body)
}

/// Sends a POST with `body` over a connection of its own and reads the
/// answer, whether or not the server reads the whole body first: a server
/// that refuses a body by its length answers and closes while the body is
/// still on its way, which a client library reports as a failed send.
pub async fn post_raw(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: String) -> RawResponse {
    let stream = TcpStream::connect(addr).await.expect("connect to the service");
    let (mut reader, mut writer) = stream.into_split();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let sending = tokio::spawn(async move {
        // The server may close before it has all of it; that is its answer.
        let _ = writer.write_all(head.as_bytes()).await;
        let _ = writer.write_all(body.as_bytes()).await;
    });
    let (head, body) = tokio::time::timeout(PATIENCE, read_message(&mut reader))
        .await
        .unwrap_or_else(|_| panic!("no answer to the POST within {PATIENCE:?}"));
    sending.abort();
    RawResponse::parse(&head, body)
}

/// A proxy on 127.0.0.1 for one request: it forwards the request to
/// `upstream`, reads the whole response, and closes the client's connection
/// without sending any of it. The task returns the lost response.
pub async fn losing_proxy(upstream: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<RawResponse>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen for the proxy");
    let addr = listener.local_addr().expect("the proxy's address");
    let exchange = async move {
        let (mut client, _) = listener.accept().await.expect("accept the client");
        let (head, body) = read_message(&mut client).await;
        let mut server = TcpStream::connect(upstream).await.expect("connect to the service");
        server.write_all(head.as_bytes()).await.expect("forward the head");
        server.write_all(&body).await.expect("forward the body");
        let (head, body) = read_message(&mut server).await;
        drop(client);
        RawResponse::parse(&head, body)
    };
    let task = tokio::spawn(async move {
        tokio::time::timeout(PATIENCE, exchange)
            .await
            .unwrap_or_else(|_| panic!("the proxy at {addr} saw no whole request and response within {PATIENCE:?}"))
    });
    (addr, task)
}

/// A `before_commit` hook that holds the first order's transaction open:
/// it reports that the order is written, then waits until released. Later
/// orders pass.
pub struct Gate {
    pub entered: mpsc::UnboundedReceiver<()>,
    release: mpsc::UnboundedSender<()>,
}

impl Gate {
    pub fn new() -> (Gate, Arc<dyn Fn() + Send + Sync>) {
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let (release, release_rx) = mpsc::unbounded_channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let calls = AtomicUsize::new(0);
        let hook = move || {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                entered_tx.send(()).expect("the test waits for the order");
                // A blocking-pool thread: waiting here blocks no async worker.
                release_rx.lock().expect("one holder").blocking_recv();
            }
        };
        (Gate { entered, release }, Arc::new(hook))
    }

    /// Waits until the first order is written and its transaction held.
    pub async fn wait_entered(&mut self) {
        tokio::time::timeout(PATIENCE, self.entered.recv())
            .await
            .expect("the order's operation started")
            .expect("the hook is alive");
    }

    /// Lets the held transaction go on to commit.
    pub fn release(&self) {
        let _ = self.release.send(());
    }
}

/// The binary of the example `name` that `cargo test` built next to this
/// test binary (`target/<profile>/examples/`), with the same features.
fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps");
    let binary = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.exists(),
        "{} is missing: cargo test builds it along with the tests; a run limited to this test \
         needs `cargo build --example {name}` with the test's features first",
        binary.display()
    );
    binary
}

/// How the example binary is started besides its arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct Launch {
    /// The open-file limit (`RLIMIT_NOFILE`, soft and hard) of its process.
    pub max_open_files: Option<u64>,
    /// Collect what it writes to stderr, for [`ExampleProcess::log_line`];
    /// it is passed on to the test's stderr too.
    pub capture_stderr: bool,
}

/// The example binary running as a child process; killed if the test ends
/// without stopping it.
pub struct ExampleProcess {
    child: Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    stderr: Option<mpsc::UnboundedReceiver<String>>,
    logged: Vec<String>,
    pub base: String,
}

impl ExampleProcess {
    /// Starts the binary with `args` and waits for its one line on stdout.
    pub async fn start(args: Vec<String>) -> ExampleProcess {
        ExampleProcess::start_with(args, Launch::default()).await
    }

    /// Starts the binary with `args` as `launch` says and waits for its one
    /// line on stdout.
    pub async fn start_with(args: Vec<String>, launch: Launch) -> ExampleProcess {
        ExampleProcess::start_example("http_orders", args, launch).await
    }

    /// Starts the binary of the example `name` with `args` as `launch` says
    /// and waits for its one line on stdout, which announces its address.
    pub async fn start_example(name: &'static str, args: Vec<String>, launch: Launch) -> ExampleProcess {
        tokio::task::spawn_blocking(move || {
            use std::io::BufRead;
            let mut command = Command::new(example_binary(name));
            command.args(&args).stdin(Stdio::null()).stdout(Stdio::piped());
            command.stderr(if launch.capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
            if let Some(files) = launch.max_open_files {
                limit_open_files(&mut command, files);
            }
            let mut child = command.spawn().expect("start the example");
            let stderr = child.stderr.take().map(|stderr| {
                let (lines, received) = mpsc::unbounded_channel();
                std::thread::spawn(move || {
                    for line in std::io::BufReader::new(stderr).lines() {
                        let Ok(line) = line else { break };
                        eprintln!("{line}");
                        if lines.send(line).is_err() {
                            break;
                        }
                    }
                });
                received
            });
            // Read on a thread of its own, so that an example that never
            // announces itself fails the test instead of holding it.
            let stdout = child.stdout.take().expect("piped stdout");
            let (first_line, announced) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut stdout = std::io::BufReader::new(stdout);
                let mut line = String::new();
                let read = stdout.read_line(&mut line).map(|_| line);
                let _ = first_line.send((read, stdout));
            });
            let kill = |child: &mut Child| {
                let _ = child.kill();
                let _ = child.wait();
            };
            let Ok((read, stdout)) = announced.recv_timeout(PATIENCE) else {
                kill(&mut child);
                panic!("the example did not announce its address on stdout within {PATIENCE:?}");
            };
            let line = read.expect("read the first line");
            let Some(base) = line
                .strip_prefix("listening on ")
                .and_then(|rest| rest.strip_suffix('\n'))
                .map(str::to_owned)
            else {
                kill(&mut child);
                panic!("the first line announces the address, got {line:?}");
            };
            ExampleProcess {
                child,
                stdout,
                stderr,
                logged: Vec::new(),
                base,
            }
        })
        .await
        .expect("start the example")
    }

    /// Waits for a line on stderr that contains `text` and returns it.
    pub async fn log_line(&mut self, text: &str) -> String {
        if let Some(line) = self.logged.iter().find(|line| line.contains(text)) {
            return line.clone();
        }
        let stderr = self
            .stderr
            .as_mut()
            .expect("stderr is captured: start the example with Launch { capture_stderr: true, .. }");
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let line = tokio::time::timeout_at(deadline, stderr.recv())
                .await
                .unwrap_or_else(|_| panic!("no line containing {text:?} on the example's stderr within {PATIENCE:?}"))
                .unwrap_or_else(|| panic!("the example closed stderr before a line containing {text:?}"));
            self.logged.push(line.clone());
            if line.contains(text) {
                return line;
            }
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.base
            .strip_prefix("http://")
            .and_then(|addr| addr.parse().ok())
            .expect("http://HOST:PORT")
    }

    /// Sends SIGTERM and waits for the process to end; returns whether it
    /// exited with success, and what it printed to stdout after the first
    /// line.
    pub async fn terminate(mut self) -> (bool, String) {
        let pid = self.child.id().to_string();
        tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
            assert!(sent.success(), "kill -TERM {pid}");
            let deadline = std::time::Instant::now() + PATIENCE;
            let status = loop {
                if let Some(status) = self.child.try_wait().expect("poll the example") {
                    break status;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the example did not stop on SIGTERM"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut rest = String::new();
            self.stdout.read_to_string(&mut rest).expect("read stdout to the end");
            (status.success(), rest)
        })
        .await
        .expect("stop the example")
    }
}

/// Sets the open-file limit of the process `command` starts.
#[cfg(unix)]
fn limit_open_files(command: &mut Command, files: u64) {
    use std::os::unix::process::CommandExt;
    let limit = rustix::process::Rlimit {
        current: Some(files),
        maximum: Some(files),
    };
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed; setrlimit is one, and the
    // closure allocates nothing.
    unsafe {
        command.pre_exec(move || {
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).map_err(std::io::Error::from)
        });
    }
}

#[cfg(not(unix))]
fn limit_open_files(_: &mut Command, _: u64) {
    panic!("the open-file limit is set on Unix only");
}

impl ExampleProcess {
    /// [`terminate`](ExampleProcess::terminate), then every line it wrote
    /// to stderr, from the first.
    pub async fn terminate_and_read_log(mut self) -> (bool, Vec<String>) {
        let mut logged = std::mem::take(&mut self.logged);
        let mut stderr = self
            .stderr
            .take()
            .expect("stderr is captured: start the example with Launch { capture_stderr: true, .. }");
        let (success, _) = self.terminate().await;
        // The reader ends at the end of the stream, which the exit brings.
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while let Some(line) = tokio::time::timeout_at(deadline, stderr.recv())
            .await
            .unwrap_or_else(|_| panic!("the example's stderr did not end within {PATIENCE:?} of its exit"))
        {
            logged.push(line);
        }
        (success, logged)
    }
}

impl Drop for ExampleProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The requests that waited for a request with the same key in this
/// process before checking out a connection, by scope, as the crate
/// reports them (its debug event): what tells a test that duplicates are
/// queued; and the requests whose client hung up before they checked out
/// a connection, which then never do. Counted by a layer of this test binary's global subscriber, so
/// events from the server's worker threads are seen; a test's own
/// thread-local subscriber is not disturbed.
pub mod turn_waits {
    use std::collections::HashMap;
    use std::fmt;
    use std::sync::{LazyLock, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::subscriber::Interest;
    use tracing::{Event, Metadata, Subscriber};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    use super::PATIENCE;

    const WAITING: &str = "waiting for a request with the same key in this process";

    static WAITS: LazyLock<Mutex<HashMap<String, usize>>> = LazyLock::new(Mutex::default);

    /// The crate's debug event for a request whose client hung up before it
    /// got a connection, which then runs nothing.
    const GONE: &str = "the client is gone before its request got a connection: it runs nothing";

    static GONES: LazyLock<Mutex<HashMap<String, usize>>> = LazyLock::new(Mutex::default);

    /// The layer of the global subscriber that counts the waits.
    pub struct Counter;

    #[derive(Default)]
    struct Fields {
        message: String,
        scope: String,
    }

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "scope" {
                self.scope = value.to_owned();
            }
        }

        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            match field.name() {
                "message" => self.message = format!("{value:?}"),
                "scope" => self.scope = format!("{value:?}"),
                _ => {}
            }
        }
    }

    impl<S: Subscriber> Layer<S> for Counter {
        fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
            // Spans too: a layer's `never` would veto the global
            // subscriber's interest in them (see `global_subscriber`).
            crate::common::global_subscriber::crate_interest(metadata)
        }

        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut fields = Fields::default();
            event.record(&mut fields);
            let counts = match fields.message.as_str() {
                WAITING => &WAITS,
                GONE => &GONES,
                _ => return,
            };
            *counts
                .lock()
                .expect("no panic while counting")
                .entry(fields.scope)
                .or_default() += 1;
        }
    }

    /// Starts counting; call before the requests are sent.
    pub fn count() {
        crate::common::global_subscriber::install();
    }

    /// Waits until `n` requests of `scope` have waited for their turn.
    pub async fn wait_for(scope: &str, n: usize) {
        wait_for_count(&WAITS, scope, n, "waited for their turn").await;
    }

    /// Waits until `n` requests of `scope` whose client hung up have given
    /// up their wait for a connection.
    pub async fn wait_for_gone(scope: &str, n: usize) {
        wait_for_count(&GONES, scope, n, "gave up their wait for a connection").await;
    }

    async fn wait_for_count(counts: &Mutex<HashMap<String, usize>>, scope: &str, n: usize, what: &str) {
        let waited = || {
            counts
                .lock()
                .expect("no panic while counting")
                .get(scope)
                .copied()
                .unwrap_or(0)
        };
        let counted = async {
            while waited() < n {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(PATIENCE, counted).await.is_err() {
            panic!("{} of {n} requests of {scope} {what} within {PATIENCE:?}", waited());
        }
    }
}
