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

/// `X-Request-Id`, the request header whose value a key record keeps as
/// the id of the request that executed, by default
/// ([`KeyHeader::request_id_header`](super::KeyHeader::request_id_header)):
/// the name tower-http's `SetRequestIdLayer`, nginx, Heroku's router and
/// most load balancers give it.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `Original-Request`, the response header of a replay and of a lookup that
/// names the request that executed, by its id, as Stripe's API sends it.
pub const ORIGINAL_REQUEST: HeaderName = HeaderName::from_static("original-request");
