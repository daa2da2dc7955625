//! Real HTTP clients with their own retry logic, curl and Python's urllib3,
//! against the example's service through a proxy that loses the first
//! response: the retry they send by themselves, with the same
//! `Idempotency-Key`, gets the first answer back, and one order exists.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::common::TestDb;
use crate::common::http::*;

const BODY: &str = r#"{"item": "book", "quantity": 2}"#;

/// A urllib3 client that retries any method on a read error, as a client
/// sending an `Idempotency-Key` may; it prints the status, the replay
/// marker and the body, a line each.
const URLLIB3_CLIENT: &str = r#"
import sys, urllib3
retries = urllib3.Retry(total=3, allowed_methods=None, backoff_factor=0.1, raise_on_status=False)
http = urllib3.PoolManager(retries=retries, timeout=30)
answer = http.request("POST", sys.argv[1], body=sys.argv[2].encode(), headers={
    "Authorization": "Bearer acct-1",
    "Idempotency-Key": '"urllib3-1"',
    "Content-Type": "application/json",
})
print(answer.status)
print(answer.headers.get("Idempotent-Replayed"))
print(answer.data.decode())
"#;

crate::common::backend_tests!(
    async:
    curl_retrying_a_lost_response_gets_the_first_answer_and_one_order,
    urllib3_retrying_a_lost_response_gets_the_first_answer_and_one_order,
);

/// A proxy to `upstream` whose first connection loses its response (read
/// whole from the service, then the client's socket is closed), while
/// every later connection is forwarded as it is. The first response comes
/// out of the receiver; the counter tells how many connections came.
async fn proxy_losing_the_first_response(
    upstream: SocketAddr,
) -> (SocketAddr, mpsc::UnboundedReceiver<RawResponse>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen for the proxy");
    let addr = listener.local_addr().expect("the proxy's address");
    let (lost_tx, lost) = mpsc::unbounded_channel();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            let lost_tx = lost_tx.clone();
            tokio::spawn(async move {
                if first {
                    let (losing, response) = losing_proxy(upstream).await;
                    let mut hop = TcpStream::connect(losing).await.expect("connect to the losing hop");
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut hop).await;
                    let _ = lost_tx.send(response.await.expect("the losing hop saw the response"));
                } else {
                    let mut service = TcpStream::connect(upstream).await.expect("connect to the service");
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut service).await;
                }
            });
        }
    });
    (addr, lost, connections)
}

/// Runs `command` on a blocking thread and returns what it printed, once
/// it has exited with success.
async fn output_of(mut command: Command) -> String {
    let output: Output = tokio::task::spawn_blocking(move || command.output().expect("start the client"))
        .await
        .expect("the client's thread");
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    printed
}

/// Checks that the client's retry got the replay of the lost first
/// response, and that the service placed one order.
async fn assert_the_retry_replays_the_lost_answer<D: TestDb>(
    db: &D,
    lost: &mut mpsc::UnboundedReceiver<RawResponse>,
    connections: &AtomicUsize,
    (status, replayed, body): (u16, Option<String>, Value),
) {
    let first = lost.recv().await.expect("the first response was read by the proxy");
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert!(connections.load(Ordering::SeqCst) >= 2, "the client retried");
    assert_eq!(status, 201);
    assert_eq!(replayed.as_deref(), Some("true"));
    let first_body: Value = serde_json::from_slice(&first.body).expect("a JSON body");
    assert_eq!(body, first_body);
    assert_eq!(order_count(db).await, 1);
}

async fn curl_retrying_a_lost_response_gets_the_first_answer_and_one_order<D: TestDb>() {
    let db = database::<D>().await;
    let server = Server::start(&db, Settings::default()).await;
    curl_retries_a_lost_response(&db, server.addr()).await;
}

/// curl, through a proxy that loses the first response of `service` (which
/// places orders in `db`), retries by itself and gets the first answer.
pub(crate) async fn curl_retries_a_lost_response<D: TestDb>(db: &D, service: SocketAddr) {
    let (proxy, mut lost, connections) = proxy_losing_the_first_response(service).await;

    let mut curl = Command::new("curl");
    curl.args(["-sS", "-i", "--retry", "3", "--retry-all-errors", "--retry-delay", "1"])
        .args(["--max-time", "30", "-X", "POST"])
        .args([
            "-H",
            "Authorization: Bearer acct-1",
            "-H",
            "Idempotency-Key: \"curl-1\"",
        ])
        .args(["-H", "Content-Type: application/json", "--data-binary", BODY])
        .arg(format!("http://{proxy}/orders"));
    let printed = output_of(curl).await;
    let (head, body) = printed.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let replayed = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("idempotent-replayed")
            .then(|| value.trim().to_owned())
    });
    let body = serde_json::from_str(body).expect("a JSON body");
    assert_the_retry_replays_the_lost_answer(db, &mut lost, &connections, (status, replayed, body)).await;
}

async fn urllib3_retrying_a_lost_response_gets_the_first_answer_and_one_order<D: TestDb>() {
    let db = database::<D>().await;
    let server = Server::start(&db, Settings::default()).await;
    urllib3_retries_a_lost_response(&db, server.addr()).await;
}

/// urllib3, as [`curl_retries_a_lost_response`].
pub(crate) async fn urllib3_retries_a_lost_response<D: TestDb>(db: &D, service: SocketAddr) {
    let (proxy, mut lost, connections) = proxy_losing_the_first_response(service).await;

    let mut python = Command::new("python3");
    python.args(["-c", URLLIB3_CLIENT, &format!("http://{proxy}/orders"), BODY]);
    let printed = output_of(python).await;
    let mut lines = printed.lines();
    let status = lines.next().and_then(|s| s.parse().ok()).expect("the status");
    let replayed = lines.next().filter(|marker| *marker != "None").map(str::to_owned);
    let body = serde_json::from_str(lines.next().expect("the body")).expect("a JSON body");
    assert_the_retry_replays_the_lost_answer(db, &mut lost, &connections, (status, replayed, body)).await;
}
