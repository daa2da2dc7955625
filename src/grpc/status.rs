//! The failures of a call as gRPC statuses, with a `google.rpc.ErrorInfo`
//! naming the reason and a `google.rpc.RetryInfo` where a retry helps.

use std::collections::HashMap;
use std::fmt::Display;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::Error;
use crate::telemetry::TARGET;

/// `idempotency`, the domain of the `google.rpc.ErrorInfo` in the details
/// of every status this module sends.
pub const ERROR_DOMAIN: &str = "idempotency";

/// How long a client is told to wait before it retries, as the HTTP layer
/// tells it with `Retry-After`.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// The `ErrorInfo` reasons.
#[derive(Debug, Clone, Copy)]
pub(super) enum Reason {
    KeyMissing,
    KeyInvalid,
    KeyReused,
    InProgress,
    KeyCompleted,
    KeyExpired,
    OutcomeUnknown,
    Unavailable,
    ResponseTooLarge,
    Internal,
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Reason::KeyMissing => "IDEMPOTENCY_KEY_MISSING",
            Reason::KeyInvalid => "IDEMPOTENCY_KEY_INVALID",
            Reason::KeyReused => "IDEMPOTENCY_KEY_REUSED",
            Reason::InProgress => "IDEMPOTENCY_KEY_IN_PROGRESS",
            Reason::KeyCompleted => "IDEMPOTENCY_KEY_COMPLETED",
            Reason::KeyExpired => "IDEMPOTENCY_KEY_EXPIRED",
            Reason::OutcomeUnknown => "OUTCOME_UNKNOWN",
            Reason::Unavailable => "UNAVAILABLE",
            Reason::ResponseTooLarge => "RESPONSE_TOO_LARGE",
            Reason::Internal => "INTERNAL",
        }
    }

    /// The code a status of this reason has, and whether the client is
    /// told to retry after [`RETRY_DELAY`].
    fn code(self) -> (Code, bool) {
        match self {
            Reason::KeyMissing | Reason::KeyInvalid => (Code::InvalidArgument, false),
            Reason::KeyReused => (Code::FailedPrecondition, false),
            Reason::InProgress => (Code::Aborted, true),
            Reason::KeyCompleted | Reason::KeyExpired => (Code::AlreadyExists, false),
            Reason::OutcomeUnknown | Reason::Unavailable => (Code::Unavailable, true),
            Reason::ResponseTooLarge | Reason::Internal => (Code::Internal, false),
        }
    }
}

/// The status of `reason`, with `message` for people.
pub(super) fn refused(reason: Reason, message: impl Into<String>) -> Status {
    let (code, retry) = reason.code();
    let mut details = ErrorDetails::with_error_info(reason.as_str(), ERROR_DOMAIN, HashMap::new());
    if retry {
        details.set_retry_info(Some(RETRY_DELAY));
    }
    Status::with_error_details(code, message, details)
}

/// No connection from the pool in time; nothing was done.
pub(super) fn unavailable(cause: &dyn Display) -> Status {
    tracing::warn!(target: TARGET, %cause, "no database connection for a gRPC call");
    refused(Reason::Unavailable, "the server is busy; nothing was done, retry later")
}

/// The server could not complete the call; `cause` goes to the log only.
pub(super) fn internal(cause: &dyn Display) -> Status {
    tracing::error!(target: TARGET, %cause, "a gRPC call failed");
    refused(Reason::Internal, "the server could not complete the request")
}

/// The status of `error`: the operation's own converted, every other as
/// the module's table says.
pub(super) fn of<E: Into<Status>>(error: Error<E>) -> Status {
    let error = match error.into_operation() {
        Ok(error) => return error.into(),
        Err(error) => error,
    };
    match error {
        Error::InvalidKey(reason) => refused(Reason::KeyInvalid, format!("the idempotency key {reason}")),
        Error::Mismatch => refused(
            Reason::KeyReused,
            "this idempotency key was first used with a different request",
        ),
        Error::InProgress => refused(
            Reason::InProgress,
            "a call with this idempotency key is still being processed; retry later",
        ),
        Error::AlreadyCompleted => refused(
            Reason::KeyCompleted,
            "the call with this idempotency key has already completed; a new call takes a new key",
        ),
        Error::Expired => refused(
            Reason::KeyExpired,
            "the call with this idempotency key was carried out, but its result is no longer kept; \
             a new call takes a new key",
        ),
        Error::OutcomeUnknown(cause) => {
            tracing::warn!(target: TARGET, %cause, "a gRPC call's commit has an unknown outcome");
            refused(
                Reason::OutcomeUnknown,
                "the call may or may not have been carried out; retry it with the same idempotency key to learn which",
            )
        }
        Error::ResponseTooLarge { max, .. } => refused(
            Reason::ResponseTooLarge,
            format!("the response is larger than the {max} bytes the server stores for a key; nothing was done"),
        ),
        // A failure of the moment (a lost connection, a deadlock) may pass
        // when the same call is sent again; the client is told so.
        other if other.is_retryable() => {
            tracing::warn!(target: TARGET, cause = %other, "a gRPC call failed for the moment");
            refused(
                Reason::Unavailable,
                "the server could not complete the request; retry later",
            )
        }
        // The scope comes from the server's own authentication, so an
        // invalid one is the server's mistake, as a storage or codec
        // failure is.
        other => internal(&other),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use diesel::result::{DatabaseErrorKind, Error as DieselError};
    use tonic::{Code, Status};
    use tonic_types::StatusExt;

    use super::ERROR_DOMAIN;
    use crate::Error;

    /// The code, the `ErrorInfo` reason and the `RetryInfo` delay of `error`'s status.
    fn mapped(error: Error<Status>) -> (Code, String, Option<Duration>) {
        let status = Status::from(error);
        let info = status.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(info.domain, ERROR_DOMAIN);
        let delay = status.get_details_retry_info().and_then(|retry| retry.retry_delay);
        (status.code(), info.reason, delay)
    }

    fn lost() -> DieselError {
        DieselError::DatabaseError(
            DatabaseErrorKind::ClosedConnection,
            Box::new(String::from("server closed the connection unexpectedly")),
        )
    }

    #[test]
    fn every_failure_is_its_status_with_its_reason_and_a_delay_where_a_retry_helps() {
        let second = Some(Duration::from_secs(1));
        let cases = [
            (
                Error::Mismatch,
                Code::FailedPrecondition,
                "IDEMPOTENCY_KEY_REUSED",
                None,
            ),
            (Error::InProgress, Code::Aborted, "IDEMPOTENCY_KEY_IN_PROGRESS", second),
            (
                Error::AlreadyCompleted,
                Code::AlreadyExists,
                "IDEMPOTENCY_KEY_COMPLETED",
                None,
            ),
            (
                Error::OutcomeUnknown(lost()),
                Code::Unavailable,
                "OUTCOME_UNKNOWN",
                second,
            ),
            (Error::Storage(lost()), Code::Unavailable, "UNAVAILABLE", second),
            (Error::Storage(DieselError::NotFound), Code::Internal, "INTERNAL", None),
            (
                Error::ResponseTooLarge { len: 2048, max: 1024 },
                Code::Internal,
                "RESPONSE_TOO_LARGE",
                None,
            ),
            (Error::Parked, Code::Internal, "INTERNAL", None),
        ];
        for (error, code, reason, delay) in cases {
            let described = format!("{error:?}");
            assert_eq!(mapped(error), (code, reason.to_owned(), delay), "{described}");
        }
    }

    #[test]
    fn the_operations_own_status_goes_out_as_it_is() {
        let declined = Status::failed_precondition("card declined");
        let status = Status::from(Error::Operation(declined));
        assert_eq!(
            (status.code(), status.message()),
            (Code::FailedPrecondition, "card declined")
        );
        assert!(status.get_details_error_info().is_none());
    }
}
