//! The names of the headers the layer reads and writes.

use http::HeaderName;

/// `Idempotency-Key`, the request header of the IETF draft.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotency-Expires`, the default name of the response header that
/// tells when a key's guarantee ends ([`Answer`](super::Answer)).
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// `Idempotent-Replayed`, the response header that marks a replay (`true`),
/// as Stripe's API sends it.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
