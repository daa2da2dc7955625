//! What PostgreSQL does in its own way (what every server does alike is in
//! `server`): the `lock_timeout` the claim borrows, keys as long as the
//! index holds, takeovers and purges, callers' transactions at `REPEATABLE
//! READ` and `SERIALIZABLE`, the claim-first setting, advisory locks,
//! durable replays, and the completion statement prepared once per session.
//!
//! Threads are ordered by channels, barriers and the server's own view of
//! who waits for a lock (`pg_locks`), never by sleeping for a guessed time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::result::Error as DieselError;
use idempotency::{Config, Error, InFlight, Outcome, run_idempotent};

use crate::common::kept_an_hour;
use crate::common::pg::{Db, show_lock_timeout};
use crate::common::server::*;
use crate::common::wait;
use crate::common::{Isolation, ServerDb, TestDb};

/// Runs `f` in a transaction of the caller's at `isolation`.
fn in_caller_transaction<T, E>(
    conn: &mut PgConnection,
    isolation: Isolation,
    f: impl FnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<DieselError>,
{
    match isolation {
        Isolation::ReadCommitted => conn.build_transaction().read_committed().run(f),
        Isolation::RepeatableRead => conn.build_transaction().repeatable_read().run(f),
        Isolation::Serializable => conn.build_transaction().serializable().run(f),
    }
}

/// A request in a transaction of the caller's at `isolation`.
fn in_isolation(isolation: Isolation) -> Call<PgConnection> {
    match isolation {
        Isolation::ReadCommitted => |conn, config, key, op| {
            in_caller_transaction(conn, Isolation::ReadCommitted, |tx| {
                config.run(tx, SCOPE, key, REQUEST, op)
            })
        },
        Isolation::RepeatableRead => |conn, config, key, op| {
            in_caller_transaction(conn, Isolation::RepeatableRead, |tx| {
                config.run(tx, SCOPE, key, REQUEST, op)
            })
        },
        Isolation::Serializable => |conn, config, key, op| {
            in_caller_transaction(conn, Isolation::Serializable, |tx| {
                config.run(tx, SCOPE, key, REQUEST, op)
            })
        },
    }
}

/// Visible ASCII that does not compress, as a random client key would not.
fn incompressible(len: usize, seed: u64) -> String {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'!' + u8::try_from((state >> 33) % 94).expect("below 94"))
        })
        .collect()
}

/// A B-tree entry holds 2704 bytes: a longer configured limit is lowered to
/// what the primary key can index, so a long key is refused before the
/// operation runs instead of failing at its insert.
#[test]
fn key_too_long_for_the_index_is_refused_before_the_operation_runs() {
    let db = Db::new();
    let config = Config::default().max_key_len(10_000);
    assert_the_longest_fits_and_longer_is_refused::<Db>(&mut db.conn(), &config, 1300, incompressible);
}

/// A wait for the key's lock that runs out is `InProgress` whatever
/// language the server answers in: the crate knows its own lock statement,
/// not the server's messages. (`.ci/run` makes the German locale the test
/// asks for.)
#[test]
fn lock_wait_that_runs_out_is_in_progress_in_any_language_of_the_server() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-lc-messages");
    let mut conn = db.conn();
    conn.batch_execute("SET lc_messages = 'de_DE.utf8'")
        .expect("the server knows the locale de_DE.utf8 (locale-gen, then a restart of the server)");
    let Err(DieselError::DatabaseError(_, info)) = conn.batch_execute("SELECT 1 / 0") else {
        panic!("a division by zero fails");
    };
    assert_eq!(info.message(), "Division durch Null", "the session speaks German");

    let short_wait = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(100)));
    let calls = AtomicUsize::new(0);
    for (call, name) in [
        (top_level::<Db> as Call<PgConnection>, "top level"),
        (nested::<Db>, "nested"),
    ] {
        let waited = call(&mut conn, &short_wait, "k-lc-messages", counted::<Db>(&calls, "waiter"));
        let Err(error) = waited else {
            panic!("the {name} waiter gives up, got {waited:?}")
        };
        assert!(matches!(error, Error::InProgress), "{name}: {error:?}");
        assert!(!Db::in_transaction(&mut conn), "{name}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    holder.finish(Release::Commit).expect("the holder commits");
    let retry = top_level::<Db>(&mut conn, &short_wait, "k-lc-messages", counted::<Db>(&calls, "retry"));
    assert!(retry.expect("the retry replays").is_replayed());
}

/// A caller's `statement_timeout` shorter than the in-flight wait ends the
/// wait for the key first; the answer is the same: the key is held.
#[test]
fn statement_timeout_shorter_than_the_wait_is_in_progress_too() {
    let db = Db::new();
    let holder = Holder::claim(&db, "k-short-statements");
    let mut conn = db.conn();
    conn.batch_execute("SET statement_timeout = '200ms'")
        .expect("the caller's own setting");
    let calls = AtomicUsize::new(0);

    let call = |conn: &mut PgConnection, item| {
        top_level::<Db>(conn, &long_wait(), "k-short-statements", counted::<Db>(&calls, item))
    };
    let waited = call(&mut conn, "waiter");
    let Err(error) = waited else {
        panic!("the waiter gives up, got {waited:?}")
    };
    assert!(matches!(error, Error::InProgress), "{error:?}");
    assert!(error.is_retryable());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!Db::in_transaction(&mut conn));
    holder.finish(Release::Commit).expect("the holder commits");
    assert!(call(&mut conn, "retry").expect("the retry replays").is_replayed());
}

#[test]
fn purge_between_the_read_and_the_store_of_a_takeover_does_not_fail_the_call() {
    let db = Db::new();
    let (clock, config) = kept_an_hour();
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);
    config
        .run(&mut conn, SCOPE, "k-expiring", REQUEST, counted::<Db>(&calls, "first"))
        .expect("first call");
    clock.advance(Duration::hours(2));

    let (entered, operation_running) = mpsc::channel();
    let takeover = thread::scope(|s| {
        // Owned here, so that a failed assertion drops it and frees the
        // waiting thread before the scope joins it.
        let (resume, resumed) = mpsc::channel::<()>();
        let (db, config, calls) = (&db, &config, &calls);
        let taker = s.spawn(move || {
            config.run(&mut db.conn(), SCOPE, "k-expiring", REQUEST, |tx| {
                entered.send(()).expect("the test waits");
                wait::recv(&resumed, "the test resumes the operation");
                counted::<Db>(calls, "takeover")(tx)
            })
        });
        wait::recv(&operation_running, "the takeover to run its operation");
        // The takeover read the expired record and holds the key's lock,
        // which the purger does not take: the record goes under it.
        assert_eq!(config.purge_expired(&mut conn, 100).expect("purge"), 1);
        resume.send(()).expect("the operation waits");
        taker.join().expect("the taker does not panic")
    });

    assert!(!takeover.expect("the takeover executes").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(Db::key_count(&mut conn), 1, "the takeover's record is stored");
    let retry = config.run(&mut conn, SCOPE, "k-expiring", REQUEST, counted::<Db>(&calls, "retry"));
    assert!(retry.expect("retry").is_replayed());
}

/// Two requests with one key, each inside a caller's transaction at
/// `isolation`: the first claims the key and holds it; the second takes its
/// snapshot, then waits for the key; the first commits.
///
/// What happens: the second request's claim finds a conflicting row that
/// its snapshot cannot see, and PostgreSQL refuses to act on it ("could not
/// serialize access due to concurrent update"). The call fails with
/// `Error::Storage` of kind `SerializationFailure` without running its
/// operation, and the caller's transaction rolls back. Retrying the whole
/// transaction, as serialization failures ask, replays the first result.
fn nested_race_executes_once(isolation: Isolation) {
    let db = Db::new();
    let (holder, waiter) = holder_and_waiter(&db, "k-isolated", in_isolation(isolation), in_isolation(isolation));

    let held = holder.finish(Release::Commit).expect("the first caller commits");
    let (mut conn, waited, calls) = waiter.join();

    let Outcome::Executed(order_id) = held else {
        panic!("the first request executes, got {held:?}")
    };
    assert!(is_serialization_failure(&waited), "{isolation:?}: {waited:?}");
    assert_eq!(calls, 0, "the second request's operation did not run");
    assert!(!Db::in_transaction(&mut conn), "the caller's transaction rolled back");

    let retry_calls = AtomicUsize::new(0);
    let retried = in_caller_transaction(&mut conn, isolation, |tx| {
        run_idempotent(tx, SCOPE, "k-isolated", REQUEST, counted::<Db>(&retry_calls, "retry"))
    });
    assert_eq!(
        retried.expect("the caller retries its transaction"),
        Outcome::Replayed(order_id)
    );
    assert_eq!(retry_calls.load(Ordering::SeqCst), 0);
    assert_eq!(Db::order_count(&mut conn), 1);
    assert_eq!(Db::key_count(&mut conn), 1);
}

#[test]
fn racing_calls_nested_in_repeatable_read_execute_once() {
    nested_race_executes_once(Isolation::RepeatableRead);
}

#[test]
fn racing_calls_nested_in_serializable_execute_once() {
    nested_race_executes_once(Isolation::Serializable);
}

/// Races two callers round after round (see [`race_in_rounds`]) at
/// `REPEATABLE READ` and then at `SERIALIZABLE`: each racer on a connection
/// that `connect` makes for the level, each call of key
/// `{prefix}-{level}-{round}` as `call` makes it at that level. Returns how
/// many calls were retried at each level.
fn race_at_the_isolated_levels(
    prefix: &str,
    connect: impl Fn(Isolation) -> PgConnection + Sync,
    call: impl Fn(&mut PgConnection, Isolation, &str, Op<'_, PgConnection>) -> CallResult + Sync,
    retry_replays: bool,
) -> Vec<(Isolation, usize)> {
    [Isolation::RepeatableRead, Isolation::Serializable]
        .into_iter()
        .map(|isolation| {
            let call = |conn: &mut PgConnection, round: usize, calls: &AtomicUsize| {
                let key = format!("{prefix}-{isolation:?}-{round}");
                call(conn, isolation, &key, counted::<Db>(calls, "racer"))
            };
            let retried = race_in_rounds(&format!("{isolation:?}"), || connect(isolation), call, retry_replays);
            (isolation, retried)
        })
        .collect()
}

/// The same race left to the scheduler: two callers released together,
/// round after round. Depending on when the loser takes its snapshot it
/// replays at once (the winner had committed), fails with a serialization
/// failure (the winner committed after the snapshot), or waits and then
/// fails. A failed caller retries its whole transaction and replays.
#[test]
fn callers_racing_in_isolated_transactions_execute_each_key_once() {
    let db = Db::new();
    let in_their_transactions = |conn: &mut PgConnection, isolation, key: &str, op: Op<'_, PgConnection>| {
        in_caller_transaction(conn, isolation, |tx| run_idempotent(tx, SCOPE, key, REQUEST, op))
    };
    for (isolation, failures) in race_at_the_isolated_levels("k-nested", |_| db.conn(), in_their_transactions, true) {
        println!("{isolation:?}: {failures} of {ROUNDS} races ended in a serialization failure");
    }
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2 * ROUNDS as i64);
    assert_eq!(Db::key_count(&mut conn), 2 * ROUNDS as i64);
}

/// The operation's own view of `lock_timeout`.
fn current_lock_timeout(conn: &mut PgConnection) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    Ok(diesel::sql_query("SELECT current_setting('lock_timeout') AS value")
        .get_result::<Setting>(conn)?
        .value)
}

#[test]
fn lock_timeout_of_the_claim_does_not_leak_into_the_operation_or_the_session() {
    let db = Db::new();
    let mut conn = db.conn();
    // A wait unlike any value the caller sets, so a leak cannot hide.
    let config = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(750)));
    let seen_by_op = |conn: &mut PgConnection, key: &str| {
        config
            .run(conn, SCOPE, key, REQUEST, current_lock_timeout)
            .expect("claimed call")
            .into_inner()
    };

    let server_default = show_lock_timeout(&mut conn);
    assert_eq!(seen_by_op(&mut conn, "k-default"), server_default);
    assert_eq!(show_lock_timeout(&mut conn), server_default);

    conn.batch_execute("SET lock_timeout = '3s'")
        .expect("set a session lock_timeout");
    assert_eq!(seen_by_op(&mut conn, "k-session"), "3s");
    assert_eq!(show_lock_timeout(&mut conn), "3s");

    let failed = config.run(&mut conn, SCOPE, "k-failed", REQUEST, |_| {
        Err::<String, _>(DomainError::Refused)
    });
    assert!(
        matches!(failed, Err(Error::Operation(DomainError::Refused))),
        "{failed:?}"
    );
    assert_eq!(show_lock_timeout(&mut conn), "3s", "also after a rolled-back call");

    // Nested in a caller's transaction, the call restores the caller's
    // transaction-local value, which ends with the caller's transaction.
    conn.transaction(|tx| {
        tx.batch_execute("SET LOCAL lock_timeout = '7s'")?;
        assert_eq!(seen_by_op(tx, "k-nested"), "7s");
        assert_eq!(show_lock_timeout(tx), "7s");
        QueryResult::Ok(())
    })
    .expect("caller's transaction");
    assert_eq!(show_lock_timeout(&mut conn), "3s");
}

/// Runs `f` in a transaction of the caller's that has set its own
/// `lock_timeout`, 3 s, and returns what `f` says.
fn in_a_transaction_with_its_lock_timeout_at_3s(
    conn: &mut PgConnection,
    f: impl FnOnce(&mut PgConnection) -> String,
) -> String {
    conn.transaction(|tx| {
        tx.batch_execute("SET LOCAL lock_timeout = '3s'")?;
        Ok::<_, DieselError>(f(tx))
    })
    .expect("caller's transaction")
}

#[test]
fn nested_call_that_claims_nothing_leaves_the_callers_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().in_flight(InFlight::Wait(Duration::milliseconds(250)));
    let after_inner = in_a_transaction_with_its_lock_timeout_at_3s(&mut conn, |conn| {
        let outcome = config.run(conn, "settings", "k-1", &1, |tx| {
            // The same key, claimed by the enclosing call on this
            // connection: the inner call claims nothing.
            let inner = config.run(tx, "settings", "k-1", &1, |_| Ok::<_, Error>(String::new()));
            assert!(matches!(inner, Err(Error::InProgress)), "got {inner:?}");
            Ok::<_, Error>(show_lock_timeout(tx))
        });
        outcome.expect("outer call").into_inner()
    });
    assert_eq!(after_inner, "3s");
}

#[test]
fn relay_inside_a_callers_transaction_leaves_its_lock_timeout() {
    let db = Db::new();
    let mut conn = db.conn();
    let after = in_a_transaction_with_its_lock_timeout_at_3s(&mut conn, |tx| {
        idempotency::outbox::enqueue(tx, "receipts", &1).expect("enqueue");
        let batch = idempotency::outbox::Relay::default()
            .run_once(tx, |_| Ok::<_, std::convert::Infallible>(()))
            .expect("relay");
        assert_eq!(batch.delivered, 1);
        show_lock_timeout(tx)
    });
    assert_eq!(after, "3s");
}

#[test]
fn longest_in_flight_wait_is_accepted() {
    let db = Db::new();
    let mut conn = db.conn();
    // Longer than PostgreSQL's largest lock_timeout; shortened to it.
    let config = Config::default().in_flight(InFlight::Wait(Duration::days(30)));
    let first = config.run(&mut conn, SCOPE, "k-long-wait", REQUEST, |tx| {
        Db::place_order(tx, "long", 1)
    });
    assert!(!first.expect("the call executes").is_replayed());
    assert!(!Db::in_transaction(&mut conn));
    let again = config.run(&mut conn, SCOPE, "k-long-wait", REQUEST, |tx| {
        Db::place_order(tx, "long", 1)
    });
    assert!(again.expect("the connection is still usable").is_replayed());
}

/// Two top-level calls with one key from sessions at `REPEATABLE READ` or
/// `SERIALIZABLE`, released together round after round. Their reads cannot
/// see a concurrent commit, so they claim the key before the operation: the
/// loser replays, or fails with a serialization failure before its
/// operation runs and replays on its retry. The operation runs once.
#[test]
fn racing_calls_from_isolated_sessions_execute_each_key_once() {
    let db = Db::new();
    let at_the_top_level =
        |conn: &mut PgConnection, _, key: &str, op: Op<'_, PgConnection>| run_idempotent(conn, SCOPE, key, REQUEST, op);
    let session = |isolation| db.session_at(isolation);
    race_at_the_isolated_levels("k", session, at_the_top_level, false);
    let mut conn = db.conn();
    assert_eq!(Db::order_count(&mut conn), 2 * ROUNDS as i64);
}

#[test]
fn nested_holder_and_top_level_waiter_serialize_on_one_lock() {
    the_waiter_replays_the_holders_commit::<Db>(
        "k-mixed-nested-holder",
        in_isolation(Isolation::ReadCommitted),
        top_level::<Db>,
    );
}

/// The crate locks keys in PostgreSQL's two-integer advisory key space;
/// an application's `bigint` advisory locks, even on the very same 64 bits,
/// never hold a call up.
#[test]
fn applications_bigint_advisory_locks_never_meet_the_crates() {
    let db = Db::new();
    let mut application = db.conn();
    let digest = crate::common::key_hash(SCOPE, "k-locked");
    let same_bits = i64::from_be_bytes(digest[..8].try_into().expect("eight bytes"));
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<diesel::sql_types::BigInt, _>(same_bits)
        .execute(&mut application)
        .expect("the application's lock");

    let mut conn = db.conn();
    let reject = Config::default().in_flight(InFlight::Reject);
    let calls = AtomicUsize::new(0);
    let outcome = reject.run(&mut conn, SCOPE, "k-locked", REQUEST, counted::<Db>(&calls, "call"));
    assert!(!outcome.expect("not held up").is_replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A durable replay answers only after a commit of its own, which waits for
/// the synchronous standbys where there are any (the failover suite shows
/// the effect; here, the commit is there and the answers are the same).
#[test]
fn durable_replays_commit_before_they_answer() {
    use diesel::connection::{Connection as _, InstrumentationEvent};

    let db = Db::new();
    let mut conn = db.conn();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = Arc::clone(&sent);
    conn.set_instrumentation(move |event: InstrumentationEvent<'_>| {
        if let InstrumentationEvent::StartQuery { query, .. } = event {
            recorder.lock().expect("no panic while locked").push(query.to_string());
        }
    });
    let durable = Config::default().durable_replays(true);
    let calls = AtomicUsize::new(0);
    let first = durable
        .run(&mut conn, SCOPE, "k-durable", REQUEST, counted::<Db>(&calls, "first"))
        .expect("executes");
    let confirmations = |sent: &Mutex<Vec<String>>| {
        sent.lock()
            .expect("no panic while locked")
            .iter()
            .filter(|sql| sql.contains("pg_logical_emit_message"))
            .count()
    };
    assert_eq!(confirmations(&sent), 0, "an execution commits its own record");

    let replay = durable
        .run(&mut conn, SCOPE, "k-durable", REQUEST, counted::<Db>(&calls, "replay"))
        .expect("replays");
    assert_eq!(replay, Outcome::Replayed(first.into_inner()));
    assert_eq!(confirmations(&sent), 1, "the replay waited for a commit of its own");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(!Db::in_transaction(&mut conn));
}

/// The status of the record of `key`, read in `conn`'s transaction.
fn record_status(conn: &mut PgConnection, key: &str) -> QueryResult<Option<String>> {
    #[derive(QueryableByName)]
    struct Status {
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
    }
    diesel::sql_query("SELECT status FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2")
        .bind::<diesel::sql_types::Text, _>(SCOPE)
        .bind::<diesel::sql_types::Text, _>(key)
        .get_result::<Status>(conn)
        .optional()
        .map(|status| status.map(|s| s.status))
}

#[test]
fn a_fresh_key_is_claimed_in_the_round_trip_that_takes_its_lock() {
    let db = Db::new();
    let mut conn = db.conn();
    let seen = run_idempotent(&mut conn, SCOPE, "claimed-at-once", REQUEST, |tx| {
        record_status(tx, "claimed-at-once")
    })
    .expect("the call")
    .into_inner();
    assert_eq!(seen.as_deref(), Some("processing"), "the claim, seen by the operation");
    assert_eq!(
        record_status(&mut conn, "claimed-at-once").expect("read").as_deref(),
        Some("completed")
    );
}

#[test]
fn the_claim_first_setting_claims_an_expired_key_before_the_operation_runs() {
    let db = Db::new();
    let clock = idempotency::testing::ManualClock::new();
    let config = Config::default().clock(clock.source()).retention(Duration::hours(1));
    for (setting, inside) in [
        ("off", "completed"),
        ("on", "processing"),
        ("TRUE", "processing"),
        ("maybe", "completed"),
    ] {
        let mut conn = db.conn();
        conn.batch_execute(&format!("SET idempotency.claim_first = '{setting}'"))
            .expect("set the setting");
        let key = format!("claim-first-{setting}");
        config
            .run(&mut conn, SCOPE, &key, REQUEST, |_| {
                Ok::<_, DieselError>(None::<String>)
            })
            .expect("the first call");
        clock.advance(Duration::hours(2));
        // An expired record: read under the lock and replaced once, or
        // claimed over before the operation runs.
        let seen = config
            .run(&mut conn, SCOPE, &key, REQUEST, |tx| record_status(tx, &key))
            .expect("the call after the retention")
            .into_inner();
        assert_eq!(
            seen.as_deref(),
            Some(inside),
            "the record inside the operation, claim_first = {setting}"
        );
        assert_eq!(
            record_status(&mut conn, &key).expect("read").as_deref(),
            Some("completed")
        );
        let replayed = config
            .run(&mut conn, SCOPE, &key, REQUEST, |tx| record_status(tx, &key))
            .expect("the retry");
        assert!(replayed.is_replayed(), "claim_first = {setting}");
    }
}

#[test]
fn distribute_without_citus_is_refused_and_changes_nothing() {
    let db = Db::new();
    let mut conn = db.conn();
    let triggers = |conn: &mut PgConnection| -> i64 {
        diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'idempotency_outbox'::regclass AND NOT tgisinternal",
        )
        .get_result(conn)
        .expect("count the outbox's triggers")
    };
    assert_eq!(triggers(&mut conn), 2);
    let refused = idempotency::citus::distribute(&mut conn, "orders");
    assert!(matches!(refused, Err(Error::Storage(_))), "{refused:?}");
    assert_eq!(triggers(&mut conn), 2, "the triggers are still there");
    let primary_key: String = diesel::dsl::sql::<diesel::sql_types::Text>(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = 'idempotency_outbox'::regclass AND contype = 'p'",
    )
    .get_result(&mut conn)
    .expect("the outbox's primary key");
    assert_eq!(primary_key, "PRIMARY KEY (id)");
    let setting: Option<String> = diesel::dsl::sql::<diesel::sql_types::Nullable<diesel::sql_types::Text>>(
        "SELECT current_setting('idempotency.claim_first', true)",
    )
    .get_result(&mut db.conn())
    .expect("read the setting in a new session");
    assert_ne!(setting.as_deref(), Some("on"), "the database's setting is unchanged");
}

/// The server's clock now, in UTC, as the crate stores times: not `now()`,
/// which is the transaction's start.
fn clock_timestamp(conn: &mut PgConnection) -> chrono::NaiveDateTime {
    diesel::select(diesel::dsl::sql::<diesel::sql_types::Timestamp>(
        "timezone('UTC', clock_timestamp())",
    ))
    .get_result(conn)
    .expect("the server's clock")
}

/// Two times of a row.
#[derive(QueryableByName)]
struct Times {
    #[diesel(sql_type = diesel::sql_types::Timestamp)]
    at: chrono::NaiveDateTime,
    #[diesel(sql_type = diesel::sql_types::Timestamp)]
    until: chrono::NaiveDateTime,
}

/// A caller's transaction that began 1.5 s before `f` runs in it.
fn in_a_transaction_begun_long_ago<T>(conn: &mut PgConnection, f: impl FnOnce(&mut PgConnection) -> T) -> T {
    conn.transaction(|tx| {
        tx.batch_execute("SELECT pg_sleep(1.5)")?;
        Ok::<_, DieselError>(f(tx))
    })
    .expect("the caller's transaction")
}

#[test]
fn call_nested_in_a_long_transaction_dates_its_record_by_the_statement_not_the_transaction() {
    let db = Db::new();
    let mut conn = db.conn();
    let key = crate::common::unique_name("k-long-transaction");
    let (before, (created_at, expires_at)) = in_a_transaction_begun_long_ago(&mut conn, |tx| {
        let before = clock_timestamp(tx);
        run_idempotent(tx, SCOPE, &key, REQUEST, |_| Ok::<_, Error>(1)).expect("the nested call");
        let times: Times = diesel::sql_query(
            "SELECT created_at AS at, expires_at AS until FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2",
        )
        .bind::<diesel::sql_types::Text, _>(SCOPE)
        .bind::<diesel::sql_types::Text, _>(&key)
        .get_result(tx)
        .expect("the record");
        (before, (times.at, times.until))
    });
    assert!(
        created_at >= before,
        "created at {created_at}, before the call {before}"
    );
    assert!(
        expires_at >= before + Duration::hours(24),
        "a full retention from the call: expires at {expires_at}, called at {before}"
    );
}

#[test]
fn relay_pass_in_a_long_transaction_writes_times_in_the_future() {
    let db = Db::new();
    let mut conn = db.conn();
    // Shorter than the transaction is old: from the transaction's start,
    // the message would be due again before the pass ends.
    let relay = idempotency::outbox::Relay::default()
        .lease(Duration::seconds(1))
        .backoff(Duration::seconds(1), Duration::seconds(1));
    let (id, before, message, now) = in_a_transaction_begun_long_ago(&mut conn, |tx| {
        let before = clock_timestamp(tx);
        let id = idempotency::outbox::enqueue(tx, "receipts", &1).expect("enqueue");
        let pass = relay.run_once(tx, |_| Err("receiver unavailable")).expect("a pass");
        assert_eq!((pass.claimed, pass.retried), (1, 1));
        let message: Times =
            diesel::sql_query("SELECT created_at AS at, available_at AS until FROM idempotency_outbox WHERE id = $1")
                .bind::<diesel::sql_types::Text, _>(&id)
                .get_result(tx)
                .expect("the message");
        (id, before, message, clock_timestamp(tx))
    });
    assert!(message.at >= before, "enqueued at {}, after {before}", message.at);
    let due = message.until;
    assert!(due > now, "message {id} due again at {due}, already past at {now}");
}

/// By default a first call sends as many statements as its transaction
/// with one insert of the record: the claim rides with the lock in the
/// `BEGIN` round trip, stamped with the database's time, and no read comes
/// before. A retry finds its claim refused, rolls it back and reads. With
/// the read before the transaction, a first call sends one statement more
/// and a replay is that one read.
#[test]
fn a_first_call_sends_as_many_statements_as_its_transaction_with_one_insert() {
    let db = Db::new();
    let mut conn = db.conn();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = Arc::clone(&sent);
    conn.set_instrumentation(move |event: diesel::connection::InstrumentationEvent<'_>| {
        if let diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
            recorder.lock().expect("not poisoned").push(query.to_string());
        }
    });
    let take = |sent: &Mutex<Vec<String>>| std::mem::take(&mut *sent.lock().expect("not poisoned"));

    // The floor: the operation's transaction with one insert of a record.
    conn.transaction(|tx| {
        Db::place_order(tx, "book", 1)?;
        diesel::sql_query("INSERT INTO orders (item, quantity) VALUES ('record', 0)").execute(tx)
    })
    .expect("the floor");
    let floor = take(&sent).len();
    let claims_with_the_lock = |statements: &[String]| {
        statements.first().is_some_and(|sql| {
            sql.starts_with("BEGIN")
                && sql.contains("pg_advisory_xact_lock")
                && sql.contains("INSERT INTO idempotency_keys")
        })
    };

    for (config, extra, replay) in [
        (Config::default(), 0, 3),
        (Config::default().read_before_transaction(true), 1, 1),
    ] {
        let key = format!("counted-{extra}");
        let first = config.run(&mut conn, SCOPE, &key, REQUEST, |tx| Db::place_order(tx, "book", 1));
        assert!(!first.expect("executes").is_replayed());
        let statements = take(&sent);
        assert_eq!(statements.len(), floor + extra, "{config:?}: {statements:#?}");
        assert!(
            claims_with_the_lock(&statements[extra..]),
            "{config:?}: the lock and the claim share the round trip of BEGIN: {statements:#?}"
        );

        let again = config.run(&mut conn, SCOPE, &key, REQUEST, |tx| Db::place_order(tx, "book", 1));
        assert!(again.expect("replays").is_replayed());
        let statements = take(&sent);
        assert_eq!(statements.len(), replay, "{config:?}: {statements:#?}");
        assert!(
            statements.last().is_some_and(|sql| sql.starts_with("SELECT")),
            "{config:?}: a replay ends with the read: {statements:#?}"
        );
    }
}

/// A record whose retention is over when a call's claim meets it is read
/// as the read before the transaction would have read it, and taken over:
/// the call executes once more, and its record has the new retention.
#[test]
fn a_claim_that_meets_an_expired_record_takes_it_over() {
    let db = Db::new();
    let mut conn = db.conn();
    let config = Config::default().retention(Duration::microseconds(1));
    let calls = AtomicUsize::new(0);
    let call = |conn: &mut PgConnection| {
        config.run(conn, SCOPE, "expires-at-once", REQUEST, |tx| {
            calls.fetch_add(1, Ordering::SeqCst);
            Db::place_order(tx, "book", 1)
        })
    };
    let first = call(&mut conn).expect("the first call");
    let second = call(&mut conn).expect("the call after the retention");
    assert!(!first.is_replayed() && !second.is_replayed(), "{first:?}, {second:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        record_status(&mut conn, "expires-at-once").expect("read").as_deref(),
        Some("completed")
    );
}

#[test]
fn keys_and_scopes_with_quotes_and_backslashes_are_claimed_as_they_are() {
    let db = Db::new();
    for conforming in ["on", "off"] {
        let mut conn = db.conn();
        // Off, a plain literal would read backslashes as escapes; the claim's
        // escape strings mean the same either way.
        conn.batch_execute(&format!(
            "SET escape_string_warning = off; SET standard_conforming_strings = {conforming}"
        ))
        .expect("set the session");
        let scope = format!("t'e\\n;ant-{conforming}");
        let key = r#"o'k\'';DROP_TABLE_orders;--$$\\"#;
        let calls = AtomicUsize::new(0);
        let call = |conn: &mut PgConnection| {
            run_idempotent(conn, &scope, key, REQUEST, |tx| {
                calls.fetch_add(1, Ordering::SeqCst);
                Db::place_order(tx, "book", 1)
            })
        };
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&sent);
        conn.set_instrumentation(move |event: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        let first = call(&mut conn).expect("the first call");
        assert!(!first.is_replayed());
        // The claim with the lock, the order, the completion, the commit:
        // no claim refused and taken again.
        assert_eq!(sent.load(Ordering::SeqCst), 4, "claimed with the lock");
        assert_eq!(
            call(&mut conn).expect("the retry"),
            Outcome::Replayed(first.into_inner())
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "standard_conforming_strings = {conforming}"
        );
        let stored: Vec<(String, String)> =
            diesel::sql_query("SELECT scope, idempotency_key FROM idempotency_keys WHERE scope = $1")
                .bind::<diesel::sql_types::Text, _>(&scope)
                .load::<StoredKey>(&mut conn)
                .expect("read the records")
                .into_iter()
                .map(|row| (row.scope, row.idempotency_key))
                .collect();
        assert_eq!(stored, [(scope.clone(), key.to_owned())], "stored as given");
    }
    assert_eq!(
        Db::order_count(&mut db.conn()),
        2,
        "the orders table is still there, one order per scope"
    );
}

#[derive(QueryableByName)]
struct StoredKey {
    #[diesel(sql_type = diesel::sql_types::Text)]
    scope: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    idempotency_key: String,
}

/// How many statements the session keeps prepared that complete a claimed
/// key record.
const COMPLETIONS_PREPARED: &str =
    "(SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'UPDATE idempotency_keys SET status%')";

/// [`COMPLETIONS_PREPARED`] of `conn`'s session.
fn completions_prepared(conn: &mut PgConnection) -> i64 {
    diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(COMPLETIONS_PREPARED))
        .get_result(conn)
        .expect("the session's prepared statements")
}

/// A first call completes its claimed record with a statement the session
/// prepares once and keeps: diesel's own `UPDATE` would be prepared anew,
/// a round trip of its own, on every call.
#[test]
fn the_completion_of_a_claimed_record_is_prepared_once_per_session() {
    let db = Db::new();
    let mut conn = db.conn();
    for n in 0..3 {
        let outcome = run_idempotent(&mut conn, "shop", &format!("order-{n}"), &n, |_| {
            Ok::<_, std::convert::Infallible>(n)
        })
        .expect("the call");
        assert_eq!(outcome, Outcome::Executed(n));
    }
    assert_eq!(completions_prepared(&mut conn), 1);
}

/// [`the_completion_of_a_claimed_record_is_prepared_once_per_session`] on
/// diesel-async's connection.
#[cfg(feature = "diesel-async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_completion_of_a_claimed_record_is_prepared_once_per_session() {
    use crate::common::asynchronous::AsyncDb;

    let db = Db::new();
    let mut conn = db.connect().await;
    for n in 0..3 {
        let outcome = idempotency::run_idempotent_async(
            &mut conn,
            "shop",
            &format!("order-{n}"),
            &n,
            async |_: &mut diesel_async::AsyncPgConnection| Ok::<_, std::convert::Infallible>(n),
        )
        .await
        .expect("the call");
        assert_eq!(outcome, Outcome::Executed(n));
    }
    let prepared = diesel_async::RunQueryDsl::get_result::<i64>(
        diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(COMPLETIONS_PREPARED)),
        &mut conn,
    )
    .await
    .expect("the session's prepared statements");
    assert_eq!(prepared, 1);
}
