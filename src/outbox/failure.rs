//! What a handler's error tells the relay: try the message again later, or
//! never, because it can never be delivered.

use std::fmt;

/// The error a relay's handler returns, as the relay reads it: the text it
/// records on the message, and whether the failure is permanent.
///
/// Every [`Display`](fmt::Display) type is a handler error that is worth a
/// retry, so handlers returning `&str`, `String`, `anyhow::Error` or an error
/// type of the application's own work as they are. A handler says that a
/// message can never be delivered (a receiver answering 410 Gone, a payload
/// the broker refuses as malformed) by returning [`Permanent`], or a
/// [`Failure`] when it decides per message: the message is then parked as
/// dead at once with the reason, without the attempts left.
pub trait HandlerError {
    /// The text stored on the message as its last error.
    fn text(&self) -> String;

    /// Whether the message can never be delivered, so that it is parked as
    /// dead at once instead of retried.
    fn is_permanent(&self) -> bool;
}

impl<E: fmt::Display> HandlerError for E {
    fn text(&self) -> String {
        self.to_string()
    }

    fn is_permanent(&self) -> bool {
        false
    }
}

/// A handler's error that parks its message as dead at once, with `reason`
/// as its last error.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::outbox::{self, Permanent, Relay};
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let id = outbox::enqueue(&mut conn, "webhooks", &"order shipped")?;
/// let report = Relay::default().run_once(&mut conn, |_| Err(Permanent("410 gone: the endpoint was removed")))?;
/// assert_eq!((report.dead, report.retried), (1, 0));
/// let dead = Relay::default().dead_letters(&mut conn, 10)?;
/// assert_eq!((dead[0].id.as_str(), dead[0].attempts), (id.as_str(), 1));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permanent<R>(pub R);

impl<R: fmt::Display> HandlerError for Permanent<R> {
    fn text(&self) -> String {
        self.0.to_string()
    }

    fn is_permanent(&self) -> bool {
        true
    }
}

/// A handler's error when it decides per message whether to retry: `?`
/// turns any [`Display`](fmt::Display) error into [`Failure::Retry`], and a
/// [`Permanent`] into [`Failure::Permanent`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotency::outbox::{self, Failure, Message, Permanent, Relay};
///
/// fn deliver(message: &Message) -> Result<(), Failure> {
///     let status: u16 = message.payload()?; // a JSON error: retried
///     match status {
///         200..=299 => Ok(()),
///         400..=499 => Err(Permanent(format!("refused with {status}")))?,
///         _ => Err(Failure::Retry(format!("answered {status}"))),
///     }
/// }
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// outbox::enqueue(&mut conn, "webhooks", &422)?;
/// outbox::enqueue(&mut conn, "webhooks", &503)?;
/// let report = Relay::default().run_once(&mut conn, deliver)?;
/// assert_eq!((report.dead, report.retried), (1, 1));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Worth another attempt after the backoff.
    Retry(String),
    /// The message can never be delivered: parked as dead at once.
    Permanent(String),
}

impl<E: fmt::Display> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Retry(error.to_string())
    }
}

impl<R: fmt::Display> From<Permanent<R>> for Failure {
    fn from(Permanent(reason): Permanent<R>) -> Self {
        Failure::Permanent(reason.to_string())
    }
}

impl HandlerError for Failure {
    fn text(&self) -> String {
        match self {
            Failure::Retry(text) | Failure::Permanent(text) => text.clone(),
        }
    }

    fn is_permanent(&self) -> bool {
        matches!(self, Failure::Permanent(_))
    }
}
