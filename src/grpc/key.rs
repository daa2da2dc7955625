//! The key of one gRPC call and what it is bound to.

use tonic::Status;
use tonic::metadata::MetadataMap;

use super::status::{self, Reason};
use crate::outcome::Origin;

/// `idempotency-key`, the metadata entry [`GrpcKey::from_metadata`] reads.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// `idempotent-replayed`, the response metadata entry that marks a replay
/// (`true`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// `x-request-id`, the metadata entry [`GrpcKey::from_metadata`] reads the
/// request's id from, which the record of the call that executes keeps.
pub const X_REQUEST_ID: &str = "x-request-id";

/// `original-request`, the response metadata entry of a replay that names
/// the request that executed, by its id, where its record keeps one.
pub const ORIGINAL_REQUEST: &str = "original-request";

/// The idempotency key of one gRPC call, with what it is bound to: the
/// full method name (`/package.Service/Method`), the scope of the
/// authenticated caller whose keys these are, and, where several
/// principals share a scope, the principal.
///
/// Authenticate the caller before reading the key (an interceptor or the
/// handler's first lines): a replay runs no code of the operation, so a
/// check inside it guards the first call only. The scope is a stable id
/// of the caller, never its credential.
///
/// The key rules of the [`Config`](crate::Config) (length, visible ASCII,
/// no card numbers) are checked by the call, which answers a key breaking
/// them with `INVALID_ARGUMENT`.
///
/// ```
/// # fn main() -> Result<(), tonic::Status> {
/// use idempotency::grpc::GrpcKey;
/// use tonic::metadata::MetadataMap;
///
/// let mut metadata = MetadataMap::new();
/// metadata.insert("idempotency-key", tonic::metadata::MetadataValue::from_static("o-1"));
/// let key = GrpcKey::from_metadata(&metadata, "/shop.Orders/Place", "acct-1")?.with_principal("user-7");
/// assert_eq!((key.key(), key.method(), key.principal()), ("o-1", "/shop.Orders/Place", Some("user-7")));
///
/// // AIP-155: the key is the message's `request_id`.
/// let key = GrpcKey::from_field("9f0c3a52-6c1e-4f1b-9d1a-2a4b1c9e7d31", "/shop.Orders/Place", "acct-1")?;
/// assert_eq!(key.key(), "9f0c3a52-6c1e-4f1b-9d1a-2a4b1c9e7d31");
///
/// let missing = GrpcKey::from_metadata(&MetadataMap::new(), "/shop.Orders/Place", "acct-1");
/// assert!(matches!(missing, Err(status) if status.code() == tonic::Code::InvalidArgument));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcKey {
    key: String,
    method: String,
    scope: String,
    principal: Option<String>,
    request_id: Option<String>,
}

impl GrpcKey {
    /// The key in the `idempotency-key` entry of `metadata`, sent to
    /// `method` (the full name, `/package.Service/Method`) by a caller of
    /// `scope`. The value is taken as it is, a bare token. The request's id
    /// is read from its `x-request-id` entry, where it has one it can keep
    /// (see [`with_request_id`](GrpcKey::with_request_id)).
    ///
    /// # Errors
    ///
    /// `INVALID_ARGUMENT` with the `ErrorInfo` reason
    /// `IDEMPOTENCY_KEY_MISSING` without the entry, and
    /// `IDEMPOTENCY_KEY_INVALID` for two entries or a value that is not
    /// visible ASCII.
    pub fn from_metadata(
        metadata: &MetadataMap,
        method: impl Into<String>,
        scope: impl Into<String>,
    ) -> Result<Self, Status> {
        let mut values = metadata.get_all(IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Err(status::refused(
                Reason::KeyMissing,
                "the call needs an idempotency-key metadata entry",
            ));
        };
        if values.next().is_some() {
            return Err(status::refused(
                Reason::KeyInvalid,
                "the call has more than one idempotency-key metadata entry",
            ));
        }
        let key = value
            .to_str()
            .map_err(|_| status::refused(Reason::KeyInvalid, "the idempotency key is not visible ASCII"))?;
        let mut ids = metadata.get_all(X_REQUEST_ID).iter();
        let request_id = match (ids.next(), ids.next()) {
            (Some(id), None) => id.to_str().ok(),
            _ => None,
        };
        let key = GrpcKey::bound(key.to_owned(), method.into(), scope.into());
        Ok(match request_id {
            Some(id) => key.with_request_id(id),
            None => key,
        })
    }

    /// The key the application read from a field of the request message,
    /// such as AIP-155's `request_id`, sent to `method` by a caller of
    /// `scope`.
    ///
    /// # Errors
    ///
    /// `INVALID_ARGUMENT` with the `ErrorInfo` reason
    /// `IDEMPOTENCY_KEY_MISSING` when `key` is empty, as proto3 reads a
    /// field the client left out.
    pub fn from_field(key: &str, method: impl Into<String>, scope: impl Into<String>) -> Result<Self, Status> {
        if key.is_empty() {
            return Err(status::refused(Reason::KeyMissing, "the call needs a request id"));
        }
        Ok(GrpcKey::bound(key.to_owned(), method.into(), scope.into()))
    }

    fn bound(key: String, method: String, scope: String) -> Self {
        GrpcKey {
            key,
            method,
            scope,
            principal: None,
            request_id: None,
        }
    }

    /// Gives the call's request id, which the record of the call that
    /// executes keeps and a replay sends back in its `original-request`
    /// metadata entry: 1 to 128 visible ASCII characters; any other is not
    /// kept, and the call goes on without it.
    pub fn with_request_id(mut self, id: impl Into<String>) -> Self {
        let id = id.into();
        self.request_id = Origin::keeps_request_id(&id).then_some(id);
        self
    }

    /// The request's id, where one was given that a record keeps.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// Binds the key to `principal` as well: another principal of the
    /// scope sending the same key is refused as a mismatch, never given
    /// this one's response.
    pub fn with_principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The full method name the key is bound to.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The scope the key is looked up in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The principal the key is bound to, where one was given.
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }
}
