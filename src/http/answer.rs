//! What a call over HTTP answers: its outcome, and when the key's guarantee
//! ends, sent in a response header.

use std::ops::Deref;

use chrono::{DateTime, Utc};
use http::{HeaderName, HeaderValue, header};

use super::headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, ORIGINAL_REQUEST};
use crate::{Origin, Outcome};

/// The [`Outcome`] of [`run`](super::run), [`run_phased`](super::run_phased)
/// or [`lookup`](super::lookup), with the end of the key's retention.
///
/// As a response it is the outcome's (`R`'s response, with
/// `Idempotent-Replayed: true` on a replay, or the name
/// [`KeyHeader::replay_header`](super::KeyHeader::replay_header) gives) plus
/// the expiry header
/// ([`KeyHeader::expiry_header`](super::KeyHeader::expiry_header), by
/// default `Idempotency-Expires`) whose value is the moment the key may
/// execute again, as an HTTP-date (RFC 9110 §5.6.7, the IMF-fixdate form),
/// the same on the first response and on every replay. A replay, and a
/// lookup's answer, also carries `Original-Request` with the id of the
/// request that executed, where its record keeps one
/// ([`KeyHeader::request_id_header`](super::KeyHeader::request_id_header)).
/// A lookup's answer
/// also carries `Cache-Control: no-store`: it is one caller's. It
/// dereferences to the outcome, so `answer.is_replayed()` reads as before.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::http::HeaderName;
/// use axum::response::IntoResponse;
/// use chrono::{TimeZone, Utc};
/// use idempotency::http::Answer;
/// use idempotency::Outcome;
///
/// let expires_at = Utc.with_ymd_and_hms(2030, 6, 1, 12, 0, 0).single().ok_or("date")?;
/// let answer = Answer::new(Outcome::Replayed("charged"), expires_at, HeaderName::from_static("idempotency-expires"));
/// assert!(answer.is_replayed());
/// assert_eq!(answer.expires_at(), expires_at);
/// let response = answer.into_response();
/// assert_eq!(response.headers()["idempotency-expires"], "Sat, 01 Jun 2030 12:00:00 GMT");
/// assert_eq!(response.headers()["idempotent-replayed"], "true");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer<R> {
    outcome: Outcome<R>,
    expires_at: DateTime<Utc>,
    origin: Origin,
    marks: Marks,
    /// Answered with `Cache-Control: no-store`, as every answer of a
    /// lookup is.
    no_store: bool,
}

impl<R> Answer<R> {
    /// The outcome, whose key is kept until `expires_at`, advertised in a
    /// header named `header`.
    pub fn new(outcome: Outcome<R>, expires_at: DateTime<Utc>, header: HeaderName) -> Self {
        let marks = Marks {
            expiry: header,
            replayed: IDEMPOTENT_REPLAYED,
            echo: None,
        };
        Answer::marked((outcome, expires_at, Origin::default()), marks)
    }

    /// The outcome of a key whose [`KeyHeader`](super::KeyHeader) chose
    /// the headers its answers carry, with its expiry and its origin.
    pub(super) fn marked((outcome, expires_at, origin): (Outcome<R>, DateTime<Utc>, Origin), marks: Marks) -> Self {
        Answer {
            outcome,
            expires_at,
            origin,
            marks,
            no_store: false,
        }
    }

    /// The same answer, with `Cache-Control: no-store`.
    pub(super) fn not_to_be_stored(mut self) -> Self {
        self.no_store = true;
        self
    }

    /// When the key's retention ends (UTC): from then on the same key
    /// executes again.
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }

    /// Where the result came from: the execution that produced it, this
    /// request's or, on a replay and a lookup, the first request's.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The outcome alone.
    pub fn into_outcome(self) -> Outcome<R> {
        self.outcome
    }

    /// The response, and the headers an adapter adds to it: the replay
    /// header on a replay (and with `false` on a first response where the
    /// key marks them), the key where it is echoed, the expiry header and,
    /// for a lookup, `Cache-Control: no-store`.
    pub(super) fn into_parts(self) -> (R, Vec<(HeaderName, HeaderValue)>) {
        let Marks { expiry, replayed, echo } = self.marks;
        // An HTTP-date has whole seconds: the second the retention ends in,
        // rounded down, so that the header never promises more than is kept.
        let date = self.expires_at.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
        let value = HeaderValue::try_from(date).expect("an HTTP-date is visible ASCII");
        let mut headers = vec![(expiry, value)];
        let response = match self.outcome {
            Outcome::Replayed(response) => {
                headers.push((replayed, HeaderValue::from_static("true")));
                let original = self.origin.request_id.as_deref().map(HeaderValue::try_from);
                if let Some(Ok(original)) = original {
                    headers.push((ORIGINAL_REQUEST, original));
                }
                response
            }
            Outcome::Executed(response) => {
                if echo.is_some() {
                    headers.push((replayed, HeaderValue::from_static("false")));
                }
                response
            }
        };
        if let Some(key) = echo {
            headers.push((IDEMPOTENCY_KEY, key));
        }
        if self.no_store {
            headers.push((header::CACHE_CONTROL, HeaderValue::from_static("no-store")));
        }
        (response, headers)
    }
}

/// The headers besides its own that a key's answer carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Marks {
    /// The header that tells when the key expires.
    pub(super) expiry: HeaderName,
    /// The header that marks a replay.
    pub(super) replayed: HeaderName,
    /// The key as an sf-string, where every response echoes it and marks
    /// a first response as well.
    pub(super) echo: Option<HeaderValue>,
}

impl<R> Deref for Answer<R> {
    type Target = Outcome<R>;

    fn deref(&self) -> &Outcome<R> {
        &self.outcome
    }
}
