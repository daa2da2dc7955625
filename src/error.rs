//! The error type of every fallible call in this crate.

use std::convert::Infallible;
use std::fmt;

/// Why an idempotent call did not produce an [`Outcome`](crate::Outcome).
///
/// `E` is the error type of the caller's operation; calls without an
/// operation (such as [`Config::purge_expired`](crate::Config::purge_expired))
/// use the default, [`Infallible`].
///
/// Which errors spend the key: none of them, with two exceptions. Every
/// other variant means that the transaction holding the key record was
/// rolled back (or never opened), so a retry with the same key and the same
/// request is answered as if this call had not happened. The exceptions:
/// [`Error::OutcomeUnknown`], where the commit itself failed without the
/// database refusing it, so it may have committed (retry with the same key:
/// the retry replays if it did); and [`Error::Codec`] on a replay, where an
/// earlier call spent the key and its stored response no longer decodes.
/// Nor do the errors that answer a key an earlier call spent:
/// [`Error::Mismatch`], [`Error::AlreadyCompleted`] and [`Error::Expired`]
/// leave it as it was (spent, or for `Expired`, spent and expired until its
/// tombstone's grace period ends).
/// [`is_retryable`](Error::is_retryable) tells which errors call for a retry
/// with the same key. A [phased operation](crate::phased) keeps its key spent
/// after its first commit; see there.
///
/// [`status_code`](Error::status_code) maps each variant to the HTTP status
/// that the IETF `Idempotency-Key` header draft prescribes. A handler maps
/// its own operation errors and lets the rest follow the draft:
///
/// ```
/// use idempotency::{run_idempotent, Error};
///
/// #[derive(Debug)]
/// enum OrderError { OutOfStock }
///
/// impl std::fmt::Display for OrderError {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("out of stock")
///     }
/// }
///
/// /// The status and body a handler answers with.
/// fn respond(result: Result<idempotency::Outcome<u64>, Error<OrderError>>) -> (u16, String) {
///     match result {
///         Ok(outcome) => (201, format!("order {}", outcome.into_inner())),
///         Err(Error::Operation(error @ OrderError::OutOfStock)) => (409, error.to_string()),
///         // Storage and codec failures are logged, not shown to the client.
///         Err(error @ (Error::Storage(_) | Error::Codec(_))) => (error.status_code(), "internal error".into()),
///         Err(error) => (error.status_code(), error.to_string()),
///     }
/// }
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let mut place = |conn: &mut _, quantity: u64| {
///     respond(run_idempotent(conn, "shop", "order-1", &quantity, |_| {
///         if quantity > 10 { Err(OrderError::OutOfStock) } else { Ok(1) }
///     }))
/// };
/// assert_eq!(place(&mut conn, 50), (409, "out of stock".into()));
/// assert_eq!(place(&mut conn, 2), (201, "order 1".into()));
/// assert_eq!(place(&mut conn, 3).0, 422, "the key was used for another request");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E = Infallible> {
    /// The idempotency key breaks the key rules; nothing was written. HTTP 400.
    InvalidKey(KeyError),
    /// The scope breaks the key rules; nothing was written. HTTP 400.
    InvalidScope(KeyError),
    /// The key was first used with a different request (its fingerprint
    /// differs); nothing was written and the first result stays replayable.
    /// HTTP 422.
    Mismatch,
    /// Another transaction holds the key and the [`InFlight`](crate::InFlight)
    /// policy ran out (or rejects at once); nothing was written. HTTP 409.
    InProgress,
    /// The same request with this key has already completed, and the
    /// [`Config`](crate::Config) answers that with an error rather than the
    /// stored result ([`OnCompleted::Reject`](crate::OnCompleted::Reject));
    /// nothing was run or written. HTTP 409.
    AlreadyCompleted,
    /// The same request with this key was carried out, its retention has
    /// ended, and the [`Config`](crate::Config) keeps the key's tombstone
    /// for a grace period ([`Config::tombstones`](crate::Config::tombstones)):
    /// the stored result is gone, and the key is not executed again until
    /// the grace period ends. Nothing was run or written. Not retryable: the
    /// same request with the same key gets this until the grace period ends;
    /// a new request takes a new key. HTTP 410.
    Expired,
    /// The operation returned this error; its writes and the key record were
    /// rolled back and the key is not spent. HTTP 500 unless the application
    /// maps its own errors.
    Operation(E),
    /// The database failed before the transaction committed; everything was
    /// rolled back. HTTP 500.
    ///
    /// On PostgreSQL and MySQL this includes serialization failures and
    /// deadlocks (`DatabaseErrorKind::SerializationFailure`, or a deadlock
    /// a client reports as `Unknown` with the server's English text), and
    /// a connection lost before the commit (`ClosedConnection`,
    /// `UnableToSendCommand`, as during a failover): the transaction did not
    /// commit, the operation's effects are gone and retrying the whole call
    /// is safe. (A MySQL deadlock rolls back a caller's whole transaction,
    /// not only the call's savepoint.) The crate never retries by itself.
    Storage(diesel::result::Error),
    /// The commit of the transaction that stores the result failed, and the
    /// database did not say that it refused it: it may have committed or
    /// not, and nothing on this side can tell. Almost always the connection
    /// was lost on the way (a crash, a failover, a killed session); every
    /// other failure of a commit that is not the database's own refusal
    /// counts too, whatever its wording. The operation ran. Retry with the
    /// same key and the same request: the retry replays the stored result
    /// if the commit went through, and executes if it did not; never both.
    /// HTTP 503.
    OutcomeUnknown(diesel::result::Error),
    /// A value could not be converted to or from JSON: the request while
    /// fingerprinting it, or the operation's result while storing it (both
    /// rolled back, key not spent), or a stored response that no longer
    /// decodes into the caller's type on a replay (the operation is never run
    /// again for it). HTTP 500.
    Codec(serde_json::Error),
    /// The result's stored JSON is `len` bytes long, beyond the bound of
    /// [`Config::max_response_len`](crate::Config::max_response_len), `max`:
    /// it was refused before the commit, so everything was rolled back and
    /// the key is not spent. The same request fails the same way; return a
    /// smaller result (a link to the resource) or raise the bound. HTTP 500.
    ResponseTooLarge {
        /// The length of the result's JSON, in bytes.
        len: usize,
        /// The configured bound, in bytes.
        max: usize,
    },
    /// A [phased operation](crate::phased) was given up and waits for a
    /// person: a foreign call past its provider horizon, an interrupted call
    /// that may not be repeated, or too many attempts. Retries keep getting
    /// this until someone requeues it
    /// ([`Completer::requeue`](crate::phased::Completer::requeue)). HTTP 500.
    Parked,
    /// A step of a [phased operation](crate::phased) has another name than
    /// the one recorded at its position by an earlier attempt: the
    /// operation's code changed while it was in flight. Nothing was run or
    /// written. HTTP 500.
    PhaseRenamed {
        /// The step's position, from 0.
        position: usize,
        /// The name recorded at that position.
        recorded: String,
        /// The name the code gave the step now.
        found: String,
    },
}

impl<E> Error<E> {
    /// The HTTP status for this error: 400 for an invalid key or scope, 422
    /// for a mismatched request, 409 for a key in progress, 410 for an
    /// expired key that keeps its tombstone, 503 for an
    /// unknown outcome (retry later, with the same key), 500 otherwise.
    ///
    /// This is the generic mapping, where the scope may come from the
    /// client. [`http::run`](crate::http::run) takes the scope from the
    /// server's own authentication, so it answers an invalid scope with a
    /// 500, the server's mistake, and not this 400.
    ///
    /// ```
    /// use idempotency::Error;
    ///
    /// assert_eq!(Error::<()>::Mismatch.status_code(), 422);
    /// assert_eq!(Error::<()>::InProgress.status_code(), 409);
    /// ```
    pub fn status_code(&self) -> u16 {
        match self {
            Error::InvalidKey(_) | Error::InvalidScope(_) => 400,
            Error::Mismatch => 422,
            Error::InProgress | Error::AlreadyCompleted => 409,
            Error::Expired => 410,
            Error::OutcomeUnknown(_) => 503,
            Error::Operation(_)
            | Error::Storage(_)
            | Error::Codec(_)
            | Error::ResponseTooLarge { .. }
            | Error::Parked
            | Error::PhaseRenamed { .. } => 500,
        }
    }

    /// Whether the right next step is to send the same request again with
    /// the same key, after a pause: another request holds the key
    /// ([`InProgress`](Error::InProgress)), the outcome is unknown
    /// ([`OutcomeUnknown`](Error::OutcomeUnknown)), or the database failed
    /// for a reason of the moment ([`Storage`](Error::Storage) with a lost
    /// connection, a serialization failure or a deadlock, or a connection
    /// that an earlier failure left unable to run transactions, which a pool
    /// discards: the retry takes another). The retry replays
    /// or executes, never both. Other errors need another request (an
    /// invalid key, a mismatch), a fix (the operation's own error, a codec
    /// failure) or a person.
    ///
    /// ```
    /// use diesel::result::{DatabaseErrorKind, Error as DieselError};
    /// use idempotency::Error;
    ///
    /// let lost = DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, Box::new(String::from("server closed the connection unexpectedly")));
    /// assert!(Error::<()>::OutcomeUnknown(lost).is_retryable());
    /// let ended = DieselError::DatabaseError(DatabaseErrorKind::Unknown, Box::new(String::from("terminating connection due to administrator command")));
    /// assert!(Error::<()>::Storage(ended).is_retryable());
    /// assert!(Error::<()>::InProgress.is_retryable());
    /// assert!(!Error::<()>::Mismatch.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::InProgress | Error::OutcomeUnknown(_) => true,
            Error::Storage(error) => {
                is_connection_lost(error)
                    || is_serialization_failure(error)
                    || matches!(error, diesel::result::Error::BrokenTransactionManager)
            }
            _ => false,
        }
    }
}

impl<E> Error<E> {
    /// The same error with the operation's own error mapped by `f`, as
    /// [`Result::map_err`] does; every other variant stays as it is. With
    /// `E = Infallible` it turns an error of a call without an operation
    /// into an error of any operation type, so that `?` composes:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use idempotency::{Config, Error};
    ///
    /// #[derive(Debug)]
    /// struct Rejected;
    ///
    /// fn tidy(conn: &mut diesel::SqliteConnection) -> Result<usize, Error<Rejected>> {
    ///     Config::default().purge_expired(conn, 500).map_err(|error| error.map_operation(|never: Infallible| match never {}))
    /// }
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// assert_eq!(tidy(&mut conn).map_err(|e| e.status_code()), Ok(0));
    /// assert!(matches!(Error::Operation(1).map_operation(|n| n + 1), Error::Operation(2)));
    /// ```
    pub fn map_operation<F>(self, f: impl FnOnce(E) -> F) -> Error<F> {
        match self.into_operation_or::<F>() {
            Ok(error) => Error::Operation(f(error)),
            Err(other) => other,
        }
    }

    /// The operation's own error as `Ok`, or the error, which is then of
    /// any other variant, typed for an operation error `F`.
    fn into_operation_or<F>(self) -> Result<E, Error<F>> {
        Err(match self {
            Error::Operation(error) => return Ok(error),
            Error::InvalidKey(reason) => Error::InvalidKey(reason),
            Error::InvalidScope(reason) => Error::InvalidScope(reason),
            Error::Mismatch => Error::Mismatch,
            Error::InProgress => Error::InProgress,
            Error::AlreadyCompleted => Error::AlreadyCompleted,
            Error::Expired => Error::Expired,
            Error::Storage(error) => Error::Storage(error),
            Error::OutcomeUnknown(error) => Error::OutcomeUnknown(error),
            Error::Codec(error) => Error::Codec(error),
            Error::ResponseTooLarge { len, max } => Error::ResponseTooLarge { len, max },
            Error::Parked => Error::Parked,
            Error::PhaseRenamed {
                position,
                recorded,
                found,
            } => Error::PhaseRenamed {
                position,
                recorded,
                found,
            },
        })
    }

    /// The operation's own error as `Ok`, or every other error as `Err`,
    /// typed without an operation: a handler maps its own errors and passes
    /// the crate's on (an `Error` is a `std::error::Error` whatever the
    /// operation's type).
    ///
    /// ```
    /// use idempotency::Error;
    ///
    /// assert_eq!(Error::Operation("declined").into_operation().ok(), Some("declined"));
    /// assert_eq!(Error::<&str>::Mismatch.into_operation().map_err(|e| e.status_code()), Err(422));
    /// ```
    ///
    /// # Errors
    ///
    /// Every error other than [`Error::Operation`], as `Error<Infallible>`.
    pub fn into_operation(self) -> Result<E, Error> {
        self.into_operation_or()
    }
}

/// Whether `error` says that the connection to the server was lost (or
/// could not carry the statement): a crash, a failover, a killed session.
///
/// diesel reports PostgreSQL's as `ClosedConnection` or
/// `UnableToSendCommand`, decided by libpq's connection status. MySQL's
/// arrive as `Unknown` with nothing but the client library's text (diesel
/// keeps no error number), and the two client libraries spell them
/// differently: libmysqlclient says "MySQL server has gone away" (2006) and
/// "Lost connection to MySQL server during query" (2013, and 2055 "... at
/// '%s', system error"), libmariadb "Server has gone away" and "Lost
/// connection to server during query"; a server that ends a session says
/// "Connection was killed" (MariaDB, 1927), "Server shutdown in progress"
/// (1053) or "The client was disconnected by the server because of
/// inactivity" (MySQL, 4031). PostgreSQL's own word that it ends a session,
/// the FATAL "terminating connection due to administrator command" (57P01;
/// also "... due to idle-session timeout" and others), arrives as `Unknown`
/// when diesel reads it before libpq has seen the connection close, and a
/// Citus coordinator passes a worker's on to its client as an error over a
/// connection that stays up. diesel-async's MySQL client (mysql_async)
/// passes on the server's own errors by their message, and its own in its
/// words: a socket that failed or closed is an "Input/output error: ..."
/// (a reset, a broken pipe, an end of file), a connection it already knows
/// closed "Driver error: `Connection to the server is closed.'". They are
/// matched without regard to case, as fragments the spellings share. No
/// decision about what committed rests on this: a failed commit is read by
/// each backend's `BlockingStore::commit_rolled_back`.
pub(crate) fn is_connection_lost(error: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error};
    const LOST: [&str; 8] = [
        "server has gone away",
        "lost connection to",
        "connection was killed",
        "server shutdown in progress",
        "disconnected by the server",
        "terminating connection due to",
        "input/output error",
        "connection to the server is closed",
    ];
    match error {
        Error::DatabaseError(DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand, _) => true,
        Error::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            let message = info.message().to_ascii_lowercase();
            LOST.iter().any(|lost| message.contains(lost))
        }
        Error::RollbackErrorOnCommit { commit_error, .. } => is_connection_lost(commit_error),
        _ => false,
    }
}

/// Whether `error` is a serialization failure or a deadlock, which rolled
/// the transaction back: diesel's own kind (PostgreSQL's 40001, MySQL's
/// 1213 through libmysqlclient), or a deadlock the client reports as
/// `Unknown` with the server's text alone: PostgreSQL's 40P01 on either
/// client, MySQL's 1213 through diesel-async's client. The texts are the
/// servers' English ones; a server set to report in another language
/// (`lc_messages`) words them otherwise, and such a deadlock is then not
/// told retryable.
fn is_serialization_failure(error: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error};
    match error {
        Error::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        Error::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            let message = info.message().to_ascii_lowercase();
            message.contains("deadlock found when trying to get lock") || message.contains("deadlock detected")
        }
        _ => false,
    }
}

impl<E> From<diesel::result::Error> for Error<E> {
    fn from(error: diesel::result::Error) -> Self {
        Error::Storage(error)
    }
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey(reason) => write!(f, "invalid idempotency key: {reason}"),
            Error::InvalidScope(reason) => write!(f, "invalid idempotency scope: {reason}"),
            Error::Mismatch => f.write_str("idempotency key was already used with a different request"),
            Error::InProgress => f.write_str("a request with this idempotency key is in progress"),
            Error::AlreadyCompleted => f.write_str("the request with this idempotency key has already completed"),
            Error::Expired => {
                f.write_str("the request with this idempotency key was carried out and its result is no longer kept")
            }
            Error::Operation(error) => error.fmt(f),
            Error::Storage(_) => f.write_str("idempotency storage failed"),
            Error::OutcomeUnknown(_) => f.write_str(
                "the commit of the result failed and may have succeeded; retry with the same key to learn the outcome",
            ),
            Error::Codec(_) => f.write_str("json encoding or decoding failed"),
            Error::ResponseTooLarge { len, max } => {
                write!(
                    f,
                    "the result is {len} bytes as stored, beyond the bound of {max} bytes"
                )
            }
            Error::Parked => f.write_str("the operation was parked and waits for a person"),
            Error::PhaseRenamed {
                position,
                recorded,
                found,
            } => write!(
                f,
                "step {position} of the operation is named {found} but was recorded as {recorded}"
            ),
        }
    }
}

impl<E> std::error::Error for Error<E>
where
    E: std::error::Error + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // The operation's error is shown as this error itself, so its
            // chain continues with its own source.
            Error::Operation(error) => error.source(),
            Error::Storage(error) | Error::OutcomeUnknown(error) => Some(error),
            Error::Codec(error) => Some(error),
            Error::InvalidKey(_)
            | Error::InvalidScope(_)
            | Error::Mismatch
            | Error::InProgress
            | Error::AlreadyCompleted
            | Error::Expired
            | Error::ResponseTooLarge { .. }
            | Error::Parked
            | Error::PhaseRenamed { .. } => None,
        }
    }
}

/// Why a key or scope was refused. The message never repeats the value,
/// which may be sensitive.
///
/// ```
/// use idempotency::{run_idempotent, Error, KeyError};
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// let refused = run_idempotent(&mut conn, "shop", "order 1", &1, |_| Ok::<_, std::convert::Infallible>(1));
/// let Err(Error::InvalidKey(reason)) = refused else { panic!("a key with a space is refused") };
/// assert_eq!(reason, KeyError::InvalidCharacter { position: 5 });
/// assert_eq!(reason.to_string(), "byte 5 is not visible ascii");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty.
    Empty,
    /// The value is longer than [`Config::max_key_len`](crate::Config::max_key_len) bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// The byte at `position` is not visible ASCII (`!` to `~`): white space,
    /// a control byte, NUL or part of a non-ASCII character.
    InvalidCharacter {
        /// Byte offset of the first offending byte.
        position: usize,
    },
    /// The key or scope holds what looks like a payment card number (see
    /// [Keys and scopes](crate::guide::contract#keys-and-scopes) for the
    /// rule). Keys and scopes are technical identifiers and must not carry
    /// personal data.
    LooksLikeCardNumber,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("must not be empty"),
            KeyError::TooLong { len, max } => write!(f, "is {len} bytes long, the limit is {max}"),
            KeyError::InvalidCharacter { position } => {
                write!(f, "byte {position} is not visible ascii")
            }
            KeyError::LooksLikeCardNumber => f.write_str("looks like a payment card number"),
        }
    }
}

impl std::error::Error for KeyError {}

/// A call on SQLite through diesel-async's `SyncConnectionWrapper` was made
/// on a tokio runtime where a blocking section is not allowed: a
/// current-thread runtime (`#[tokio::main(flavor = "current_thread")]`,
/// `#[tokio::test]`'s default). The wrapper runs each statement on tokio's
/// blocking pool and, when a future is dropped while a statement runs,
/// waits for it with `tokio::task::block_in_place`, which panics there. So
/// the crate refuses such a runtime before it sends a statement: the call
/// fails with [`Error::Storage`] holding
/// `diesel::result::Error::QueryBuilderError` with this error inside,
/// nothing written. Run SQLite's async calls on the multi-threaded runtime
/// (one worker is enough) or use the synchronous `SqliteConnection`.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::result::Error as DieselError;
/// use idempotency::{run_idempotent_async, Error, UnsupportedRuntime};
///
/// let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// let refused = runtime.block_on(async {
///     let mut conn = idempotency::testing::sqlite_memory_async();
///     run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |_: &mut _| Ok::<_, std::convert::Infallible>(1)).await
/// });
/// let Err(Error::Storage(DieselError::QueryBuilderError(why))) = refused else { panic!("refused") };
/// assert!(why.is::<UnsupportedRuntime>());
///
/// let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
/// let placed = runtime.block_on(async {
///     let mut conn = idempotency::testing::sqlite_memory_async();
///     run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |_: &mut _| Ok::<_, std::convert::Infallible>(1)).await
/// });
/// assert_eq!(placed?.into_inner(), 1);
/// # Ok(())
/// # }
/// ```
#[cfg(all(feature = "sqlite", feature = "diesel-async"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnsupportedRuntime;

#[cfg(all(feature = "sqlite", feature = "diesel-async"))]
impl fmt::Display for UnsupportedRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "SQLite through SyncConnectionWrapper needs tokio's multi-threaded runtime: \
             a call dropped on a current-thread runtime would panic",
        )
    }
}

#[cfg(all(feature = "sqlite", feature = "diesel-async"))]
impl std::error::Error for UnsupportedRuntime {}
