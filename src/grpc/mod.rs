//! Idempotency keys on gRPC through tonic (feature `tonic`).
//!
//! A client that lost a unary call's response sends it again with the same
//! key and gets the first response back, its operation run once. The key
//! comes from the `idempotency-key` metadata entry, or from a field of the
//! request message the application names (Google AIP-155's `request_id`);
//! it is bound to the full method name (`/package.Service/Method`), to the
//! principal where the application gives one, and to the request message.
//! The call runs [`Config::run`] on tokio's blocking pool with a
//! connection from an r2d2 pool, as the HTTP layer's `http::run` does, and
//! its failures become statuses with a `google.rpc.ErrorInfo` (and a
//! `google.rpc.RetryInfo` where a retry helps) in their details.
//!
//! | piece | what it does |
//! | --- | --- |
//! | [`GrpcKey`] | the key of one call: read from the metadata or given from a message field, with the method, the scope and the principal it is bound to |
//! | [`run`] | the key's call: the operation at most once, the response stored as its prost encoding and replayed with `idempotent-replayed: true` |
//! | `run_async` (feature `diesel-async`) | the same on a diesel-async connection, the operation an async closure, in the handler's own future |
//! | `From<Error<E>> for Status` | every failure as its status, for applications that call [`Config::run`] themselves |
//!
//! The statuses, by case ([`ERROR_DOMAIN`] is the `ErrorInfo` domain):
//!
//! | case | code | `ErrorInfo` reason | `RetryInfo` |
//! | --- | --- | --- | --- |
//! | no key | `INVALID_ARGUMENT` | `IDEMPOTENCY_KEY_MISSING` | |
//! | two key entries, a value that is not ASCII, a key breaking the key rules | `INVALID_ARGUMENT` | `IDEMPOTENCY_KEY_INVALID` | |
//! | same key, another request, method or principal | `FAILED_PRECONDITION` | `IDEMPOTENCY_KEY_REUSED` | |
//! | a call with the same key still in progress after the in-flight wait | `ABORTED` | `IDEMPOTENCY_KEY_IN_PROGRESS` | 1 s |
//! | the key's call completed and [`OnCompleted::Reject`](crate::OnCompleted::Reject) refuses replays | `ALREADY_EXISTS` | `IDEMPOTENCY_KEY_COMPLETED` | |
//! | the key's call was carried out, its result is gone and its tombstone kept ([`Error::Expired`]) | `ALREADY_EXISTS` | `IDEMPOTENCY_KEY_EXPIRED` | |
//! | a commit whose outcome is unknown | `UNAVAILABLE` | `OUTCOME_UNKNOWN` | 1 s |
//! | no database connection in time, a storage failure of the moment | `UNAVAILABLE` | `UNAVAILABLE` | 1 s |
//! | the response is beyond [`Config::max_response_len`] | `INTERNAL` | `RESPONSE_TOO_LARGE` | |
//! | any other storage or codec failure, an invalid scope, a panic | `INTERNAL` | `INTERNAL` | |
//! | the operation's own error | the operation's status | | |
//!
//! Why these codes: a mismatch is not wrong in itself (the same message
//! under a fresh key succeeds) but wrong for the key's state, which is
//! `FAILED_PRECONDITION` by `google.rpc.Code`'s rule ("the system is not
//! in a state required for the operation"), and must not be retried as
//! it is. A call in progress is a concurrency conflict: `ABORTED`, which
//! clients retry "at a higher level", here after `RetryInfo`'s delay with
//! the same key. An unknown outcome is `UNAVAILABLE`, the code that is
//! safe to retry: the retry with the same key replays the result if the
//! commit happened and executes it if it did not. No status carries the
//! key or the request.
//!
//! See [gRPC with tonic](crate::guide::grpc) for a whole service.

mod key;
mod status;

use std::fmt::Write as _;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use prost::Message;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};

use crate::backend::RulesOf;
use crate::run::Sender;
use crate::{Config, Error, Recorded, StoreConnection};

pub use key::{GrpcKey, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, ORIGINAL_REQUEST, X_REQUEST_ID};
pub use status::ERROR_DOMAIN;

/// Runs `op` at most once for `key`, as [`Config::run`] does, from a tonic
/// handler: a connection is checked out of `pool` and the call made on
/// tokio's blocking pool. The first call's response message is stored as
/// its prost encoding; a retry gets it back decoded, with the metadata
/// entry `idempotent-replayed: true`, and `op` is not called.
///
/// `op` gets the connection, inside the transaction that also holds the
/// key record, and the request. An `Err` rolls everything back and leaves
/// the key free; it goes to the client as the status it converts into.
///
/// The key is bound to its [method](GrpcKey::method), its principal where
/// it has one, and `request` by the SHA-256 of its prost encoding. prost
/// encodes a message's fields in tag order, so the encoding is a function
/// of the message, with one exception: a `map` field decoded into a
/// `HashMap` encodes its entries in the map's iteration order, which
/// differs between two decodings of the same bytes. A request with map
/// fields must use `BTreeMap` (prost-build's `btree_map(["."])`), or two
/// identical retries may be told apart as a mismatch.
///
/// The response is stored as the hex of its prost encoding, in the
/// record's JSON text: twice its encoded length counts against
/// [`Config::max_response_len`].
///
/// A client that goes away changes nothing: the blocking task is not
/// cancelled with the handler's future, the transaction commits or rolls
/// back as a whole, and the client's retry replays the result (or, while
/// the first call still runs, waits for it as [`Config::in_flight`]
/// allows).
///
/// # Errors
///
/// A [`Status`], as the [module](self) lists them: `op`'s own error
/// converted, a mismatch, a call in progress, an invalid key (refused
/// before a connection is checked out, so at once even while the pool is
/// exhausted), an unknown
/// outcome, no connection from `pool` within its connection timeout
/// (`UNAVAILABLE`), a storage failure, a stored response that no longer
/// decodes as `R` (`INTERNAL`; the key stays spent), or a panic in `op`
/// (`INTERNAL`, nothing committed).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # tokio::runtime::Runtime::new()?.block_on(async {
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use diesel::SqliteConnection;
/// use idempotency::grpc::{self, GrpcKey};
/// use idempotency::Config;
/// use tonic::metadata::MetadataMap;
///
/// #[derive(Clone, PartialEq, prost::Message)]
/// struct Charge {
///     #[prost(uint32, tag = "1")]
///     cents: u32,
/// }
///
/// let db = idempotency::testing::SqliteFile::new();
/// let pool = Pool::new(ConnectionManager::<SqliteConnection>::new(db.path().to_str().ok_or("utf-8 path")?))?;
/// let config = Config::default();
/// let mut metadata = MetadataMap::new();
/// metadata.insert("idempotency-key", "c-1".parse()?);
/// let key = GrpcKey::from_metadata(&metadata, "/pay.Payments/Charge", "acct-1")?;
///
/// let charge = |cents: u32| {
///     grpc::run(&pool, &config, &key, Charge { cents }, |_conn, charge| {
///         Ok::<_, tonic::Status>(charge.clone())
///     })
/// };
/// let first = charge(500).await?;
/// assert!(first.metadata().get("idempotent-replayed").is_none());
/// let retry = charge(500).await?;
/// assert_eq!(retry.metadata().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
/// assert_eq!(retry.into_inner(), Charge { cents: 500 });
///
/// // The same key with another request.
/// let refused = charge(900).await.err().ok_or("a mismatch")?;
/// assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
/// # Ok(())
/// # })
/// # }
/// ```
pub async fn run<C, Q, R, E, F>(
    pool: &Pool<ConnectionManager<C>>,
    config: &Config,
    key: &GrpcKey,
    request: Q,
    op: F,
) -> Result<Response<R>, Status>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
    Q: Message + Send + 'static,
    R: Message + Default + Send + 'static,
    E: Into<Status> + Send + 'static,
    F: FnOnce(&mut C, &Q) -> Result<R, E> + Send + 'static,
{
    // A key that can never succeed is refused before the checkout: it
    // must not wait for a busy pool and then be told to retry.
    check_key::<C>(config, key)?;
    let bound = BoundCall::of(key, &request);
    let (pool, config, key) = (pool.clone(), config.clone(), key.clone());
    let task = tokio::task::spawn_blocking(move || {
        let mut conn = pool.get().map_err(|error| status::unavailable(&error))?;
        config
            .run_recorded_by(&mut conn, key.scope(), key.key(), &bound, sender(&key), |tx| {
                op(tx, &request).map(|response| StoredMessage::of(&response))
            })
            .map_err(Status::from)
    });
    let recorded = match task.await {
        Ok(recorded) => recorded?,
        // A panic in the operation, or a runtime shutting down before the
        // task ran: either way nothing was committed.
        Err(error) => return Err(status::internal(&error)),
    };
    answer(recorded)
}

/// [`run`] on a diesel-async connection (feature `diesel-async`), checked
/// out by the application from its bb8 or deadpool pool: `op` is an async
/// closure, run on `conn` inside the transaction that also holds the key
/// record, in the handler's own future; nothing runs on the blocking
/// pool. What the key is bound to, the stored response, the replay marker
/// and the statuses are [`run`]'s.
///
/// One thing differs, by design: tonic drops the handler's future when
/// the client goes away (a cancelled call, a deadline, a closed
/// connection), and a call dropped before its commit rolls back as a
/// whole: the key stays free, and the client's retry executes. (The
/// blocking call of [`run`] goes on and commits, and the retry replays.)
/// Either way nothing is left by halves; see the
/// [async guide](crate::guide::asynchronous) for what a dropped call does
/// to its connection.
///
/// # Errors
///
/// As [`run`], without the pool's: `op`'s own error converted, a mismatch,
/// a call in progress, an invalid key, an unknown outcome, a storage
/// failure, a stored response that no longer decodes as `R`.
///
/// ```
/// # #[cfg(not(feature = "sqlite-async"))] fn main() {}
/// # #[cfg(feature = "sqlite-async")]
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::grpc::{self, GrpcKey};
/// use idempotency::Config;
///
/// #[derive(Clone, PartialEq, prost::Message)]
/// struct Charge {
///     #[prost(uint32, tag = "1")]
///     cents: u32,
/// }
///
/// // From your pool; an in-memory database here.
/// let mut conn = idempotency::testing::sqlite_memory_async();
/// let config = Config::default();
/// let key = GrpcKey::from_field("c-1", "/pay.Payments/Charge", "acct-1")?;
/// for _ in 0..2 {
///     let charged = grpc::run_async(&mut conn, &config, &key, Charge { cents: 500 }, async |_: &mut _, charge: &Charge| {
///         Ok::<_, tonic::Status>(charge.clone())
///     })
///     .await?;
///     assert_eq!(charged.into_inner(), Charge { cents: 500 });
/// }
/// let refused = grpc::run_async(&mut conn, &config, &key, Charge { cents: 900 }, async |_: &mut _, charge: &Charge| {
///     Ok::<_, tonic::Status>(charge.clone())
/// })
/// .await;
/// assert!(matches!(refused, Err(status) if status.code() == tonic::Code::FailedPrecondition));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "diesel-async")]
pub async fn run_async<C, Q, R, E, F>(
    conn: &mut C,
    config: &Config,
    key: &GrpcKey,
    request: Q,
    op: F,
) -> Result<Response<R>, Status>
where
    C: crate::AsyncStoreConnection,
    Q: Message,
    R: Message + Default,
    E: Into<Status>,
    F: AsyncFnOnce(&mut C, &Q) -> Result<R, E>,
{
    config
        .check_rules::<RulesOf<C>, Status>(key.scope(), key.key(), None)
        .map_err(Status::from)?;
    let bound = BoundCall::of(key, &request);
    let recorded = config
        .run_recorded_by_async(conn, key.scope(), key.key(), &bound, sender(key), async |tx: &mut C| {
            op(tx, &request).await.map(|response| StoredMessage::of(&response))
        })
        .await
        .map_err(Status::from)?;
    answer(recorded)
}

/// Who sent the call of `key`: its request id, where it has one.
fn sender(key: &GrpcKey) -> Sender<'_> {
    Sender {
        caller_hash: None,
        request_id: key.request_id(),
    }
}

/// The response of `recorded`, decoded, a replay marked and naming the
/// request that executed where its record keeps its id.
///
/// # Errors
///
/// `INTERNAL` for a stored response that does not decode as `R`.
fn answer<R: Message + Default>(recorded: Recorded<StoredMessage>) -> Result<Response<R>, Status> {
    let replayed = recorded.outcome.is_replayed();
    let message = recorded.outcome.into_inner().decode::<R>()?;
    let mut response = Response::new(message);
    if replayed {
        let metadata = response.metadata_mut();
        metadata.insert(IDEMPOTENT_REPLAYED, MetadataValue::from_static("true"));
        let original = recorded.origin.request_id.as_deref().map(MetadataValue::try_from);
        if let Some(Ok(original)) = original {
            metadata.insert(ORIGINAL_REQUEST, original);
        }
    }
    Ok(response)
}

/// Refuses a scope or key that breaks the key rules of `config` on the
/// backend of `C`. (Generic over `C` alone: with `C` its own `Raw`, as
/// [`run`] has it, the compiler no longer sees that `Raw` stores keys.)
fn check_key<C: StoreConnection>(config: &Config, key: &GrpcKey) -> Result<(), Status> {
    config
        .check_rules::<RulesOf<C::Raw>, Status>(key.scope(), key.key(), None)
        .map_err(Status::from)
}

/// What a key is fingerprinted with: the method, the principal beside the
/// scope, and the request message by the hash of its encoding (the record
/// keeps only the fingerprint either way).
#[derive(Serialize)]
struct BoundCall {
    method: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    principal: Option<String>,
    message: String,
}

impl BoundCall {
    fn of(key: &GrpcKey, request: &impl Message) -> Self {
        BoundCall {
            method: key.method().to_owned(),
            principal: key.principal().map(str::to_owned),
            message: sha256_hex(&request.encode_to_vec()),
        }
    }
}

/// A response message as it is stored: its prost encoding in hex, a JSON
/// string the record's text column holds as it is.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
struct StoredMessage(String);

impl StoredMessage {
    fn of(message: &impl Message) -> Self {
        StoredMessage(hex(&message.encode_to_vec()))
    }

    /// The stored message decoded as `R`.
    ///
    /// # Errors
    ///
    /// `INTERNAL` when it is not the hex of an `R`: the key stays spent,
    /// and the call is never run again for it.
    fn decode<R: Message + Default>(&self) -> Result<R, Status> {
        let bytes = unhex(&self.0).ok_or_else(|| status::internal(&"a stored response is not hex"))?;
        R::decode(bytes.as_slice()).map_err(|error| status::internal(&error))
    }
}

/// The lowercase hex of SHA-256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        write!(text, "{byte:02x}").expect("writing to a String does not fail");
    }
    text
}

/// The bytes of an even number of hex digits; `None` for anything else.
fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).ok())
        .collect()
}

/// Every failure of [`Config::run`] as the status a gRPC client is given,
/// as the [module](self) lists them; the operation's own error converted
/// as it is.
impl<E: Into<Status>> From<Error<E>> for Status {
    fn from(error: Error<E>) -> Self {
        status::of(error)
    }
}

#[cfg(test)]
mod tests {
    use super::{hex, unhex};

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let bytes = [0x00, 0x7f, 0xff, 0x10];
        assert_eq!(hex(&bytes), "007fff10");
        assert_eq!(unhex("007fff10").as_deref(), Some(&bytes[..]));
        assert_eq!(unhex("007FFF10").as_deref(), Some(&bytes[..]));
        for not_hex in ["0", "zz", "+1", "0g"] {
            assert_eq!(unhex(not_hex), None, "{not_hex}");
        }
    }
}
