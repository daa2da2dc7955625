//! What a successful idempotent call returns.

use chrono::{DateTime, NaiveDateTime, Utc};

/// The result of an idempotent call: either the operation ran now, or an
/// earlier call with the same key and request ran it and this is its stored
/// result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// The operation ran in this call and its result was stored.
    Executed(R),
    /// The operation did not run; this is the result stored by the call that
    /// did.
    Replayed(R),
}

impl<R> Outcome<R> {
    /// The result, however it was obtained.
    ///
    /// ```
    /// use idempotency::Outcome;
    ///
    /// assert_eq!(Outcome::Replayed(7).into_inner(), 7);
    /// ```
    pub fn into_inner(self) -> R {
        match self {
            Outcome::Executed(value) | Outcome::Replayed(value) => value,
        }
    }

    /// Whether the result came from an earlier call. Handlers often report
    /// it, for example in an `Idempotent-Replayed: true` response header.
    ///
    /// ```
    /// use idempotency::Outcome;
    ///
    /// assert!(Outcome::Replayed(()).is_replayed());
    /// assert!(!Outcome::Executed(()).is_replayed());
    /// ```
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }
}

/// An [`Outcome`] with the times of the key record behind it, as
/// [`Config::run_recorded`](crate::Config::run_recorded) returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recorded<R> {
    /// Whether the operation ran now, and its result.
    pub outcome: Outcome<R>,
    /// When the call that executed the operation began (UTC).
    pub created_at: DateTime<Utc>,
    /// When the retention of the record ends (UTC): from then on the key may
    /// execute again.
    pub expires_at: DateTime<Utc>,
    /// Where the result came from: the execution that produced it, this
    /// call's on [`Outcome::Executed`], the first call's on a replay.
    pub origin: Origin,
}

impl<R> Recorded<R> {
    pub(crate) fn new(
        outcome: Outcome<R>,
        created_at: NaiveDateTime,
        expires_at: NaiveDateTime,
        origin: Origin,
    ) -> Self {
        Recorded {
            outcome,
            created_at: created_at.and_utc(),
            expires_at: expires_at.and_utc(),
            origin,
        }
    }
}

/// What a call answers where no record times but the expiry matter (the
/// HTTP layer's and a phased operation's): its outcome, when its key's
/// retention ends, and where its result came from.
pub(crate) type Answered<R> = (Outcome<R>, DateTime<Utc>, Origin);

/// Where a stored result came from: what the key record keeps of the call
/// that executed the operation (of an operation in phases, of the attempt
/// that began it), so that a replay and a lookup can be correlated with
/// that execution ([`Recorded::origin`],
/// [`KeyStatus::Completed`](crate::KeyStatus::Completed)).
///
/// - `traceparent`: the W3C trace context of the span the operation ran in,
///   kept with the `opentelemetry` feature where the application's
///   `tracing` subscriber has an OpenTelemetry layer. A replay's span links
///   to that span.
/// - `request_id`: the id the application gave the request that executed;
///   over HTTP, the request header
///   [`KeyHeader::request_id_header`](crate::guide::http#where-a-replay-came-from)
///   names (`X-Request-Id` by default), over gRPC the `x-request-id`
///   metadata entry, kept when it is 1 to 128 visible ASCII characters.
///
/// Either is `None` where there was none, and on every record written before
/// the columns existed (migration `2026-12-07-000000_idempotency_origin`).
/// A lookup or a replay tells them only to the reader it would answer the
/// stored result, as it does the result.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::Config;
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let config = Config::default();
/// let first = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(1))?;
/// let retry = config.run_recorded(&mut conn, "shop", "order-1", &"book", |_| Ok::<_, std::convert::Infallible>(2))?;
/// assert!(retry.outcome.is_replayed());
/// assert_eq!(retry.origin, first.origin, "a replay names the execution it replays");
/// // Without an OpenTelemetry layer, or outside the HTTP layer, neither is known.
/// assert_eq!((first.origin.trace_id(), first.origin.request_id.as_deref()), (None, None));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Origin {
    /// The W3C `traceparent` (version `00`) of the span the operation ran
    /// in: `00-{trace id}-{span id}-{flags}`.
    pub traceparent: Option<String>,
    /// The id the application gave the request that executed.
    pub request_id: Option<String>,
}

impl Origin {
    /// The trace id (32 lowercase hex digits) of the span the operation ran
    /// in, as tracing backends search for it.
    pub fn trace_id(&self) -> Option<&str> {
        self.traceparent
            .as_deref()
            .and_then(|traceparent| traceparent.get(3..35))
    }

    /// The origin a record keeps in its columns `traceparent` and
    /// `request_id`.
    pub(crate) fn kept(traceparent: Option<&str>, request_id: Option<&str>) -> Origin {
        Origin {
            traceparent: traceparent.map(str::to_owned),
            request_id: request_id.map(str::to_owned),
        }
    }

    /// Whether a record keeps `id` as its request id: 1 to 128 visible
    /// ASCII characters (the width of its column), as request ids are
    /// (UUIDs, `req_…`, a proxy's hex). Any other is not kept, and the call
    /// goes on without it: an id is for correlation, not a reason to refuse
    /// a request. The HTTP layer and gRPC, which read request ids, check
    /// them so.
    #[cfg_attr(
        not(any(feature = "axum", feature = "actix", feature = "tonic")),
        expect(dead_code, reason = "only the HTTP layer and gRPC read request ids")
    )]
    pub(crate) fn keeps_request_id(id: &str) -> bool {
        const LONGEST: usize = 128;
        (1..=LONGEST).contains(&id.len()) && id.bytes().all(|byte| byte.is_ascii_graphic())
    }
}
