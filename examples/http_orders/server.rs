//! The HTTP server, hardened against clients that hold connections without
//! using them: a request head must arrive within 10 s (also the idle
//! timeout between requests), a body must not stall for 10 s, and at the
//! connection limit (1,024, or fewer under a lower open-file limit) a new
//! connection takes the place of the one idle the longest. A service of
//! your own can copy this module as it is and call [`serve`] with its
//! router.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use super::problems::causes;

/// A client has this long to send a request's head, from the moment the
/// server waits for one: on a new connection, and on a kept-alive
/// connection between requests, so it is the idle timeout too. A head is a
/// few hundred bytes that a client sends at once; 10 s tolerates a stalled
/// mobile link and soon frees the slot of a socket that says nothing. A
/// client that finds its kept-alive connection closed retries on a new
/// one, which the Idempotency-Key makes safe for a POST.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A request body may stall this long between two reads; then the request
/// is answered 408. The bodies here are small JSON, sent at once.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The most connections served at once, unless the open-file limit leaves
/// room for fewer.
const MAX_CONNECTIONS: usize = 1024;

/// Open files kept free of client connections: the database pool's
/// sockets or SQLite's files (three a connection), the runtime, stdio.
#[cfg(unix)]
const RESERVED_FILES: u64 = 64;

/// How the server protects itself from clients that hold connections
/// without using them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`BODY_READ_TIMEOUT`].
    pub body_read_timeout: Duration,
    /// The most connections served at once. At the limit a new connection
    /// takes the place of the one idle the longest; when none is idle it
    /// waits in the listen queue until one is.
    pub max_connections: usize,
}

impl Limits {
    /// The constants above, with no more connections than the process's
    /// open-file limit leaves room for: a process out of descriptors cannot
    /// accept, nor open a database connection, whoever is waiting.
    pub fn of_this_process() -> Limits {
        Limits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_connections: room_for_connections(),
        }
    }
}

#[cfg(unix)]
fn room_for_connections() -> usize {
    match rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
        Some(files) => usize::try_from(files.saturating_sub(RESERVED_FILES))
            .unwrap_or(MAX_CONNECTIONS)
            .clamp(1, MAX_CONNECTIONS),
        None => MAX_CONNECTIONS,
    }
}

#[cfg(not(unix))]
fn room_for_connections() -> usize {
    MAX_CONNECTIONS
}

/// The connections being served: whether each is in a request, and since
/// when the others have been idle, so that the server can close the one
/// idle the longest when it needs room.
#[derive(Default)]
struct Connections {
    table: std::sync::Mutex<ConnectionTable>,
    /// A request ended or a connection closed.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct ConnectionTable {
    /// Counts accepts and ended requests: the order in which connections
    /// became idle.
    clock: u64,
    open: std::collections::HashMap<u64, Tracked>,
}

struct Tracked {
    requests: usize,
    idle_since: u64,
    closing: bool,
    close: Arc<tokio::sync::Notify>,
}

impl Connections {
    fn table(&self) -> std::sync::MutexGuard<'_, ConnectionTable> {
        // Every change to the table is a single step: a panic elsewhere
        // cannot leave it half done.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn len(&self) -> usize {
        self.table().open.len()
    }

    /// Registers an accepted connection, idle until its first request.
    fn open(self: &Arc<Self>) -> Tracking {
        let close = Arc::new(tokio::sync::Notify::new());
        let mut table = self.table();
        table.clock += 1;
        let id = table.clock;
        let tracked = Tracked {
            requests: 0,
            idle_since: id,
            closing: false,
            close: close.clone(),
        };
        table.open.insert(id, tracked);
        Tracking {
            connections: self.clone(),
            id,
            close,
        }
    }

    /// Asks the connection idle the longest to close, unless one is
    /// closing already. Returns whether one is closing.
    fn make_room(&self) -> bool {
        let mut table = self.table();
        if table.open.values().any(|tracked| tracked.closing) {
            return true;
        }
        let oldest = table
            .open
            .values_mut()
            .filter(|tracked| tracked.requests == 0)
            .min_by_key(|tracked| tracked.idle_since);
        match oldest {
            Some(tracked) => {
                tracked.closing = true;
                tracked.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Asks every connection to close once its request is answered.
    fn close_all(&self) {
        for tracked in self.table().open.values_mut() {
            tracked.closing = true;
            tracked.close.notify_one();
        }
    }
}

/// A connection's entry, removed when the connection's task ends.
struct Tracking {
    connections: Arc<Connections>,
    id: u64,
    close: Arc<tokio::sync::Notify>,
}

impl Tracking {
    /// Marks the connection in a request until the guard is dropped.
    fn request(self: &Arc<Self>) -> InRequest {
        if let Some(tracked) = self.connections.table().open.get_mut(&self.id) {
            tracked.requests += 1;
        }
        InRequest(self.clone())
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        self.connections.table().open.remove(&self.id);
        self.connections.changed.notify_one();
    }
}

struct InRequest(Arc<Tracking>);

impl Drop for InRequest {
    fn drop(&mut self) {
        let connections = &self.0.connections;
        let mut table = connections.table();
        table.clock += 1;
        let now = table.clock;
        if let Some(tracked) = table.open.get_mut(&self.0.id) {
            tracked.requests -= 1;
            tracked.idle_since = now;
        }
        drop(table);
        connections.changed.notify_one();
    }
}

/// How long the accept loop pauses after an error it cannot make room for.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` within `limits` until `shutdown`
/// resolves, then lets the requests in progress finish.
///
/// axum's own `serve` has no header or idle timeout, nor a limit on
/// connections: a client that opens sockets and sends nothing holds them
/// forever, and once the process is out of descriptors no one else is
/// served. Here every connection is HTTP/1.1 with hyper's header read
/// timeout, bodies have a read timeout, and at the connection limit the
/// connection idle the longest makes room for a new one.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.body_read_timeout,
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let connections = Arc::new(Connections::default());
    let mut tasks = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    'accept: loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break 'accept,
            Some(_) = tasks.join_next() => continue,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                // The new connection waits here, unserved, until there is
                // room: while it does, no other is accepted.
                while connections.len() >= limits.max_connections {
                    connections.make_room();
                    tokio::select! {
                        () = &mut shutdown => break 'accept,
                        () = connections.changed.notified() => {}
                    }
                }
                let tracking = Arc::new(connections.open());
                tasks.spawn(serve_connection(stream, router.clone(), http.clone(), tracking));
            }
            // Out of descriptors or memory: a connection closed gives some
            // back. Other errors concern one connection that never was.
            Err(error) => {
                eprintln!("accepting a connection failed: {}", causes(&error));
                if connections.make_room() {
                    let _ = tokio::time::timeout(ACCEPT_BACKOFF, connections.changed.notified()).await;
                } else {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
    drop(listener);
    connections.close_all();
    while tasks.join_next().await.is_some() {}
}

/// Serves one connection until the client closes it, a timeout does, or
/// the server asks it to close (which waits for the response in progress).
async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    http: hyper::server::conn::http1::Builder,
    tracking: Arc<Tracking>,
) {
    let close = tracking.close.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let in_request = tracking.request();
        let response = tower::ServiceExt::oneshot(router.clone(), request);
        async move {
            let response = response.await;
            drop(in_request);
            response
        }
    });
    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    // A connection's errors (a client gone, a timeout) are the client's
    // business, not the service's: they are not logged.
    tokio::select! {
        _ = connection.as_mut() => return,
        () = close.notified() => connection.as_mut().graceful_shutdown(),
    }
    let _ = connection.await;
}
