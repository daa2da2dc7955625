//! The error type: thread-safe, HTTP mapping, messages and sources.

use std::convert::Infallible;
use std::error::Error as _;

use diesel::SqliteConnection;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::batch::Runner;
use idempotency::outbox;
use idempotency::{Error, KeyError};

fn assert_send_sync_static<T: Send + Sync + 'static>() {}

#[test]
fn error_is_send_sync_and_static() {
    assert_send_sync_static::<Error>();
    assert_send_sync_static::<Error<std::io::Error>>();
    assert_send_sync_static::<Error<anyhow::Error>>();
    assert_send_sync_static::<KeyError>();
    assert_send_sync_static::<outbox::Error>();
    assert_send_sync_static::<idempotency::batch::RunError>();
}

#[test]
fn status_codes_follow_the_idempotency_key_draft() {
    let cases: [(Error<std::io::Error>, u16); 9] = [
        (Error::InvalidKey(KeyError::Empty), 400),
        (Error::InvalidScope(KeyError::Empty), 400),
        (Error::Mismatch, 422),
        (Error::InProgress, 409),
        (Error::Operation(std::io::Error::other("x")), 500),
        (Error::Storage(diesel::result::Error::NotFound), 500),
        (
            Error::Codec(serde_json::from_str::<u8>("x").expect_err("not json")),
            500,
        ),
        (Error::Parked, 500),
        (
            Error::PhaseRenamed {
                position: 1,
                recorded: "charged".into(),
                found: "paid".into(),
            },
            500,
        ),
    ];
    for (error, status) in cases {
        assert_eq!(error.status_code(), status, "{error:?}");
    }
}

#[test]
fn messages_are_lowercase_without_trailing_punctuation() {
    let errors: Vec<Error<std::io::Error>> = vec![
        Error::InvalidKey(KeyError::TooLong { len: 300, max: 255 }),
        Error::InvalidScope(KeyError::InvalidCharacter { position: 2 }),
        Error::Mismatch,
        Error::InProgress,
        Error::Storage(diesel::result::Error::NotFound),
        Error::Codec(serde_json::from_str::<u8>("x").expect_err("not json")),
        Error::Parked,
        Error::PhaseRenamed {
            position: 0,
            recorded: "ride_created".into(),
            found: "ride_booked".into(),
        },
    ];
    for error in errors {
        let message = error.to_string();
        let first = message.chars().next().expect("a message");
        assert!(first.is_lowercase(), "{message}");
        assert!(!message.ends_with(['.', '!', '?']), "{message}");
    }
}

#[test]
fn wrapped_errors_are_sources() {
    let storage: Error = Error::Storage(diesel::result::Error::NotFound);
    assert_eq!(
        storage.source().expect("a source").to_string(),
        diesel::result::Error::NotFound.to_string()
    );

    let codec: Error = Error::Codec(serde_json::from_str::<u8>("x").expect_err("not json"));
    assert!(codec.source().is_some());

    // The operation's error is shown as the error itself, its chain going on
    // from its own source.
    let inner = std::io::Error::other("disk full");
    let operation: Error<std::io::Error> = Error::Operation(inner);
    assert_eq!(operation.to_string(), "disk full");

    assert!(Error::<std::io::Error>::Mismatch.source().is_none());
}

#[test]
fn an_anyhow_operation_error_is_kept() {
    let error: Error<anyhow::Error> = Error::Operation(anyhow::anyhow!("payment gateway timed out"));
    assert_eq!(error.to_string(), "payment gateway timed out");
    match error {
        Error::Operation(inner) => assert_eq!(inner.to_string(), "payment gateway timed out"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_error_converts_into_anyhow() {
    fn handler() -> anyhow::Result<()> {
        Err(Error::<std::io::Error>::InProgress)?;
        Ok(())
    }
    let error = handler().expect_err("the handler fails");
    assert_eq!(error.to_string(), "a request with this idempotency key is in progress");
    assert!(matches!(
        error.downcast_ref::<Error<std::io::Error>>(),
        Some(Error::InProgress)
    ));
}

/// Every error the crate returns, with a cause where it has one.
fn every_error() -> Vec<Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = idempotency::testing::sqlite_memory();
    let not_json = || serde_json::from_str::<u8>("x").expect_err("not json");
    let mut errors: Vec<Box<dyn std::error::Error + Send + Sync>> = vec![
        Box::new(Error::<std::io::Error>::InvalidKey(KeyError::Empty)),
        Box::new(Error::<std::io::Error>::InvalidScope(KeyError::TooLong {
            len: 9,
            max: 8,
        })),
        Box::new(Error::<std::io::Error>::Storage(diesel::result::Error::NotFound)),
        Box::new(Error::<std::io::Error>::Codec(not_json())),
        Box::new(Error::Operation(std::io::Error::other("disk full"))),
        Box::new(KeyError::LooksLikeCardNumber),
        Box::new(outbox::Error::Codec(not_json())),
        Box::new(outbox::Error::Storage(diesel::result::Error::NotFound)),
    ];
    errors.push(Box::new(
        outbox::enqueue(&mut conn, "", &1).expect_err("an empty topic is refused"),
    ));
    let db = idempotency::testing::SqliteFile::new();
    let url = db.path().to_str().expect("utf-8 path").to_owned();
    let pool = Pool::builder()
        .max_size(1)
        .build(ConnectionManager::<SqliteConnection>::new(url))
        .expect("a pool");
    let run = Runner::new(pool)
        .scope("")
        .run("job", [1_i64], |_, _| Ok::<_, std::io::Error>(()));
    errors.push(Box::new(run.expect_err("an empty scope is refused")));
    errors
}

#[test]
fn no_error_states_its_cause_twice() {
    for error in every_error() {
        let message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            let cause_message = cause.to_string();
            assert!(
                !message.contains(&cause_message),
                "{message:?} repeats its cause {cause_message:?}"
            );
            source = cause.source();
        }
    }
}

#[test]
fn an_invalid_topic_says_why_once() {
    let mut conn = idempotency::testing::sqlite_memory();
    let error = outbox::enqueue(&mut conn, "", &1).expect_err("an empty topic is refused");
    assert_eq!(error.to_string(), "invalid outbox topic: must not be empty");
    assert!(error.source().is_none());
}

/// A storage error with `message`, as diesel reports a MySQL client error:
/// with no kind, only the client library's text.
fn unknown_database_error(message: &str) -> Error {
    Error::Storage(diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::Unknown,
        Box::new(message.to_owned()),
    ))
}

#[test]
fn a_deadlock_is_retryable_as_every_client_library_reports_it() {
    let deadlock = || {
        Box::new(String::from(
            "Deadlock found when trying to get lock; try restarting transaction",
        ))
    };
    // diesel's MySQL connection (and PostgreSQL's serialization failures):
    // the kind.
    let kind =
        diesel::result::Error::DatabaseError(diesel::result::DatabaseErrorKind::SerializationFailure, deadlock());
    assert!(Error::<()>::Storage(kind).is_retryable());
    // diesel-async's MySQL client: the server's text alone.
    assert!(
        unknown_database_error("Deadlock found when trying to get lock; try restarting transaction").is_retryable()
    );
    // PostgreSQL's deadlock (40P01) on either client: the server's text.
    assert!(unknown_database_error("deadlock detected").is_retryable());
}

#[test]
fn a_lost_connection_is_retryable_in_every_client_librarys_spelling() {
    for message in [
        // libmysqlclient
        "MySQL server has gone away",
        "Lost connection to MySQL server during query",
        "Lost connection to MySQL server at 'reading initial communication packet', system error: 104",
        // libmariadb
        "Server has gone away",
        "Lost connection to server during query",
        "Lost connection to server at 'handshake: reading initial communication packet', system error: 104",
        // the server, ending the session
        "Connection was killed",
        "Server shutdown in progress",
        "The client was disconnected by the server because of inactivity.",
        // mysql_async, diesel-async's client: a socket that failed or closed,
        // and a connection it knows closed
        "Input/output error: Input/output error: connection closed",
        "Input/output error: Input/output error: Connection reset by peer (os error 104)",
        "Input/output error: Input/output error: Broken pipe (os error 32)",
        "Driver error: `Connection to the server is closed.'",
    ] {
        assert!(unknown_database_error(message).is_retryable(), "{message}");
    }
    for message in [
        "Duplicate entry 'a' for key 'PRIMARY'",
        "Unknown column 'b' in 'field list'",
    ] {
        assert!(!unknown_database_error(message).is_retryable(), "{message}");
    }
}

#[test]
fn a_connection_that_can_run_no_more_transactions_is_retryable() {
    assert!(Error::<Infallible>::Storage(diesel::result::Error::BrokenTransactionManager).is_retryable());
}
