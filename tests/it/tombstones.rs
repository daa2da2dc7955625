//! Fail-closed expiry (`Config::tombstones`): once a key's retention has
//! ended, its tombstone refuses the same request with `Error::Expired` for
//! a grace period, another request with `Error::Mismatch`, and runs
//! nothing; after the grace period the key executes again. The purge turns
//! expired records into tombstones and deletes them after the grace
//! period; a lookup tells a tombstone only to the request a replay would
//! have answered.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

use chrono::{Duration, TimeZone, Utc};
use idempotency::phased::Phased;
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, KeyStatus, Outcome, Purger, Shutdown};

use crate::common::TestDb;
use crate::common::wait::{self, Barrier, StopOnDrop, wait_for};

crate::common::backend_tests!(
    a_retry_inside_the_grace_period_is_refused_as_expired_and_runs_nothing,
    a_retry_after_the_grace_period_executes_again,
    another_request_inside_the_grace_period_is_a_mismatch,
    the_purge_turns_expired_records_into_tombstones_and_deletes_them_after_the_grace_period,
    a_purge_without_the_policy_deletes_expired_records_as_before,
    the_purger_keeps_tombstones_bounded,
    a_lookup_tells_a_tombstone_only_to_the_request_that_could_have_been_replayed,
    racing_retries_of_a_tombstoned_key_are_all_refused_and_run_nothing,
    racing_retries_after_the_grace_period_execute_once,
    retries_beside_purges_that_make_and_delete_tombstones_never_run_an_expired_key,
    a_phased_operation_past_its_retention_is_expired_until_the_grace_period_ends,
);

/// A retention of an hour, tombstones kept a day after it, by a manual
/// clock in 2030.
fn policy() -> (ManualClock, Config) {
    let clock = ManualClock::at(Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).single().expect("a date"));
    let config = Config::default()
        .retention(Duration::hours(1))
        .tombstones(Duration::days(1))
        .clock(clock.source());
    (clock, config)
}

/// Places an order of `item` under `key` in the scope `shop`, counting
/// the operation's runs.
fn place<D: TestDb>(config: &Config, conn: &mut D::Conn, key: &str, item: &str, runs: &AtomicUsize) -> Placed {
    config.run(conn, "shop", key, &item, |tx| {
        runs.fetch_add(1, Ordering::SeqCst);
        D::place_order(tx, item, 1)
    })
}

fn a_retry_inside_the_grace_period_is_refused_as_expired_and_runs_nothing<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);

    place::<D>(&config, &mut conn, "k", "book", &runs).expect("the first call");
    clock.advance(Duration::minutes(59));
    let within = place::<D>(&config, &mut conn, "k", "book", &runs).expect("a replay");
    assert!(within.is_replayed(), "the retention is as without the policy");

    // The retention ends at the hour: from then on the tombstone answers,
    // up to the last moment of the grace period.
    for after in [Duration::minutes(1), Duration::hours(23), Duration::minutes(59)] {
        clock.advance(after);
        let late = place::<D>(&config, &mut conn, "k", "book", &runs);
        let error = late.expect_err("refused");
        assert!(matches!(error, Error::Expired), "{error:?}");
        assert_eq!(error.status_code(), 410);
        assert!(
            !error.is_retryable(),
            "the same request cannot succeed until the grace period ends"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
    assert_eq!(D::order_count(&mut conn), 1);
    assert_eq!(D::key_count(&mut conn), 1, "the record is kept as it was");

    // The same table under the default policy: the key executes again,
    // as it always did.
    let default = Config::default().retention(Duration::hours(1)).clock(clock.source());
    let again = place::<D>(&default, &mut conn, "k", "book", &runs).expect("executes");
    assert!(!again.is_replayed());
}

fn a_retry_after_the_grace_period_executes_again<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);

    place::<D>(&config, &mut conn, "k", "book", &runs).expect("the first call");
    clock.advance(Duration::hours(1) + Duration::days(1));
    let again = place::<D>(&config, &mut conn, "k", "book", &runs).expect("the key is free again");
    assert!(!again.is_replayed(), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!((D::order_count(&mut conn), D::key_count(&mut conn)), (2, 1));

    // The new record has a retention of its own, and a tombstone after it.
    let retry = place::<D>(&config, &mut conn, "k", "book", &runs).expect("a replay");
    assert_eq!(retry, Outcome::Replayed(again.into_inner()));
    clock.advance(Duration::hours(1));
    assert!(matches!(
        place::<D>(&config, &mut conn, "k", "book", &runs),
        Err(Error::Expired)
    ));
}

fn another_request_inside_the_grace_period_is_a_mismatch<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);

    place::<D>(&config, &mut conn, "k", "book", &runs).expect("the first call");
    clock.advance(Duration::hours(2));
    // Compared as during the retention: only the request that could have
    // been replayed learns that its result expired.
    let other = place::<D>(&config, &mut conn, "k", "pen", &runs);
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    // A purged response changes nothing of it.
    config.purge_expired(&mut conn, 10).expect("purge");
    let other = place::<D>(&config, &mut conn, "k", "pen", &runs);
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    clock.advance(Duration::days(1));
    let after = place::<D>(&config, &mut conn, "k", "pen", &runs).expect("after the grace period");
    assert!(!after.is_replayed());
    assert_eq!(D::order_items(&mut conn), ["book", "pen"]);
}

fn the_purge_turns_expired_records_into_tombstones_and_deletes_them_after_the_grace_period<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);

    for key in ["a", "b", "c"] {
        place::<D>(&config, &mut conn, key, "book", &runs).expect("the first call");
    }
    clock.advance(Duration::days(1));
    // `a` to `c` expired 23 hours ago; `d` and `e` are live.
    for key in ["d", "e"] {
        place::<D>(&config, &mut conn, key, "book", &runs).expect("the first call");
    }
    clock.advance(Duration::minutes(30));
    let stored = |conn: &mut D::Conn| {
        D::responses_in_scope(conn, "shop")
            .into_iter()
            .map(|(key, response)| (key, response.is_some()))
            .collect::<Vec<_>>()
    };
    let key = |key: &str, kept: bool| (key.to_owned(), kept);

    // Batches of two: the three expired records take two of them.
    assert_eq!(
        config.purge_expired(&mut conn, 2).expect("purge"),
        3,
        "three tombstones"
    );
    assert_eq!(
        stored(&mut conn),
        [
            key("a", false),
            key("b", false),
            key("c", false),
            key("d", true),
            key("e", true)
        ],
        "the responses of the expired records are gone, the live ones kept"
    );
    assert_eq!(
        config.purge_expired(&mut conn, 2).expect("purge again"),
        0,
        "nothing left to do"
    );

    // A tombstone refuses its retry as the expired record did.
    assert!(matches!(
        place::<D>(&config, &mut conn, "a", "book", &runs),
        Err(Error::Expired)
    ));
    assert!(
        place::<D>(&config, &mut conn, "d", "book", &runs)
            .expect("a replay")
            .is_replayed()
    );

    // `a` to `c` leave their grace period now; `d` and `e` become tombstones.
    clock.advance(Duration::minutes(30));
    assert_eq!(
        config.purge_expired(&mut conn, 2).expect("purge"),
        5,
        "three deleted, two tombstones"
    );
    assert_eq!(stored(&mut conn), [key("d", false), key("e", false)]);
    let again = place::<D>(&config, &mut conn, "a", "book", &runs).expect("executes again");
    assert!(!again.is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}

fn a_purge_without_the_policy_deletes_expired_records_as_before<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);
    place::<D>(&config, &mut conn, "a", "book", &runs).expect("the first call");
    clock.advance(Duration::hours(2));
    let default = Config::default().clock(clock.source());
    assert_eq!(default.purge_expired(&mut conn, 10).expect("purge"), 1);
    assert_eq!(D::key_count(&mut conn), 0);
}

fn the_purger_keeps_tombstones_bounded<D: TestDb>() {
    let db = D::new();
    let pool = db.pool(1);
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);
    for key in ["a", "b"] {
        place::<D>(&config, &mut conn, key, "book", &runs).expect("the first call");
    }
    clock.advance(Duration::hours(1));

    // An hour between rounds: the first round runs at once, and the
    // trigger ends the wait for the second.
    let purger = Purger::default()
        .interval(Duration::hours(1))
        .batch_size(1)
        .config(config.clone());
    let serve_until = |conn: &mut D::Conn, what: &str, done: &dyn Fn(&mut D::Conn) -> bool| {
        let shutdown = Shutdown::new();
        thread::scope(|scope| {
            let _stop = StopOnDrop(&shutdown);
            let service = scope.spawn(|| purger.serve(&pool, &shutdown));
            wait_for(what, || done(conn));
            shutdown.trigger();
            service.join().expect("the purger does not panic")
        })
    };

    let tombstoned = serve_until(&mut conn, "the tombstones", &|conn| {
        D::responses_in_scope(conn, "shop")
            .iter()
            .all(|(_, response)| response.is_none())
    });
    assert_eq!(
        (tombstoned.work.tombstoned, tombstoned.work.keys, tombstoned.errors),
        (2, 0, 0)
    );
    assert_eq!(D::key_count(&mut conn), 2);

    clock.advance(Duration::days(1));
    let deleted = serve_until(&mut conn, "the tombstones deleted", &|conn| D::key_count(conn) == 0);
    assert_eq!((deleted.work.tombstoned, deleted.work.keys, deleted.errors), (0, 2, 0));
}

fn a_lookup_tells_a_tombstone_only_to_the_request_that_could_have_been_replayed<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);
    // A key of its own: a lookup holds the key without waiting, and
    // PostgreSQL's key locks span every schema of the database, where
    // other tests may hold the same key at that moment.
    let key = &crate::common::unique_name("k");
    let first = config
        .run_recorded(&mut conn, "shop", key, &"book", |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            D::place_order(tx, "book", 1)
        })
        .expect("the first call");
    let status = |conn: &mut D::Conn, scope: &str, request: &str| -> KeyStatus<i64> {
        config.status(conn, scope, key, &request).expect("a lookup")
    };

    clock.advance(Duration::hours(2));
    let tombstone = KeyStatus::Tombstoned {
        expired_at: first.expires_at,
        reusable_at: first.expires_at + Duration::days(1),
    };
    assert_eq!(status(&mut conn, "shop", "book"), tombstone);
    // Another request, or another scope, learns nothing.
    assert_eq!(status(&mut conn, "shop", "pen"), KeyStatus::NoRecord);
    assert_eq!(status(&mut conn, "other", "book"), KeyStatus::NoRecord);
    // Nor does a purge change the answer.
    config.purge_expired(&mut conn, 10).expect("purge");
    assert_eq!(status(&mut conn, "shop", "book"), tombstone);
    assert_eq!(status(&mut conn, "shop", "pen"), KeyStatus::NoRecord);

    // Once the grace period is over, a record not yet purged is expired:
    // a call with the key executes as new.
    clock.advance(Duration::days(1));
    assert_eq!(
        status(&mut conn, "shop", "book"),
        KeyStatus::Expired {
            expired_at: first.expires_at
        }
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "a lookup runs nothing");
}

/// What a call of [`place`] answers.
type Placed = Result<Outcome<i64>, Error<diesel::result::Error>>;

/// `THREADS` retries of one key from a pool, released together by a
/// barrier; each one's result, and how often the operation ran.
fn race<D: TestDb>(db: &D, config: &Config) -> (Vec<Placed>, usize) {
    const THREADS: usize = 8;
    // Smaller than the thread count: the barrier comes before checkout.
    let pool = db.pool(4);
    let barrier = Arc::new(Barrier::new(THREADS));
    let runs = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (pool, barrier, runs, config) = (pool.clone(), barrier.clone(), runs.clone(), config.clone());
            thread::spawn(move || {
                barrier.wait();
                let mut conn = pool.get().expect("a pooled connection");
                place::<D>(&config, &mut conn, "k", "book", &runs)
            })
        })
        .collect();
    let results = handles.into_iter().map(|h| wait::join(h, "a racing retry")).collect();
    (results, runs.load(Ordering::SeqCst))
}

fn racing_retries_of_a_tombstoned_key_are_all_refused_and_run_nothing<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    place::<D>(&config, &mut conn, "k", "book", &AtomicUsize::new(0)).expect("the first call");
    clock.advance(Duration::hours(1));

    let (results, runs) = race(&db, &config);
    assert!(
        results.iter().all(|result| matches!(result, Err(Error::Expired))),
        "{results:?}"
    );
    assert_eq!(runs, 0, "no retry ran the operation");
    assert_eq!(D::order_count(&mut conn), 1);
}

fn racing_retries_after_the_grace_period_execute_once<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    place::<D>(&config, &mut conn, "k", "book", &AtomicUsize::new(0)).expect("the first call");
    clock.advance(Duration::hours(1) + Duration::days(1));

    let (results, runs) = race(&db, &config);
    let outcomes: Vec<Outcome<i64>> = results
        .into_iter()
        .map(|result| result.expect("every retry succeeds"))
        .collect();
    crate::common::race::assert_one_executed_and_all_saw_it(outcomes);
    assert_eq!(runs, 1, "the operation ran once among the racers");
    assert_eq!((D::order_count(&mut conn), D::key_count(&mut conn)), (2, 1));
}

fn retries_beside_purges_that_make_and_delete_tombstones_never_run_an_expired_key<D: TestDb>() {
    const THREADS: usize = 3;
    const KEYS: usize = 12;
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let runs = AtomicUsize::new(0);
    let key = |i: usize| format!("k-{i}");
    for i in 0..KEYS {
        place::<D>(&config, &mut conn, &key(i), "book", &runs).expect("the first call");
    }
    // Every record expired: each round of retries meets records a purge
    // is turning into tombstones at the same time.
    clock.advance(Duration::hours(1));
    let pool = db.pool(THREADS as u32 + 1);
    let barrier = Barrier::new(THREADS + 1);
    let purged = thread::scope(|scope| {
        for _ in 0..THREADS {
            let (pool, barrier, config, runs) = (&pool, &barrier, &config, &runs);
            scope.spawn(move || {
                let mut conn = pool.get().expect("a pooled connection");
                barrier.wait();
                for i in 0..KEYS {
                    let late = place::<D>(config, &mut conn, &key(i), "book", runs);
                    assert!(matches!(late, Err(Error::Expired)), "{late:?}");
                }
            });
        }
        let mut conn = pool.get().expect("a pooled connection");
        barrier.wait();
        config.purge_expired(&mut conn, 2).expect("a purge beside the retries")
    });
    // A purge skips the records a retry holds locked (MySQL's retries
    // read them FOR UPDATE), and a purge after the retries clears those:
    // it counts only records still holding a response.
    let purged = purged + config.purge_expired(&mut conn, 2).expect("a purge after the retries");
    assert_eq!(purged, KEYS, "every record a tombstone, once");
    assert_eq!(runs.load(Ordering::SeqCst), KEYS, "no retry ran the operation");

    // Once the grace period is over the purge deletes the tombstones while
    // retries race it: each key runs once more, whoever came first.
    clock.advance(Duration::days(1));
    let barrier = Barrier::new(THREADS + 1);
    thread::scope(|scope| {
        for _ in 0..THREADS {
            let (pool, barrier, config, runs) = (&pool, &barrier, &config, &runs);
            scope.spawn(move || {
                let mut conn = pool.get().expect("a pooled connection");
                barrier.wait();
                for i in 0..KEYS {
                    place::<D>(config, &mut conn, &key(i), "book", runs).expect("executes or replays");
                }
            });
        }
        let mut conn = pool.get().expect("a pooled connection");
        barrier.wait();
        config.purge_expired(&mut conn, 2).expect("a purge beside the retries");
    });
    assert_eq!(runs.load(Ordering::SeqCst), 2 * KEYS, "each key ran once more");
    assert_eq!(D::order_count(&mut conn), 2 * KEYS as i64);
    assert_eq!(D::key_count(&mut conn), KEYS as i64);
}

/// A phased operation follows the policy as a single call does: refused
/// inside the grace period, its tombstone cleared by the purge, run anew
/// after it.
fn a_phased_operation_past_its_retention_is_expired_until_the_grace_period_ends<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let (clock, config) = policy();
    let order = Phased::new("place_order").config(config.clone());
    let phases = AtomicUsize::new(0);
    let run = |conn: &mut D::Conn, item: &str| {
        order.run(conn, "shop", "k", &item, |s| {
            let id = s.phase("placed", |tx| {
                phases.fetch_add(1, Ordering::SeqCst);
                D::place_order(tx, item, 1)
            })?;
            s.finish(|_| Ok::<_, diesel::result::Error>(id))
        })
    };
    let status = |conn: &mut D::Conn, item: &str| -> KeyStatus<i64> {
        order.status(conn, "shop", "k", &item).expect("a lookup")
    };
    let first = run(&mut conn, "book").expect("the first run");
    assert!(!first.is_replayed());
    clock.advance(Duration::hours(1));

    let late = run(&mut conn, "book");
    assert!(matches!(late, Err(Error::Expired)), "{late:?}");
    assert!(matches!(run(&mut conn, "pen"), Err(Error::Mismatch)));
    assert!(matches!(status(&mut conn, "book"), KeyStatus::Tombstoned { .. }));
    assert_eq!(status(&mut conn, "pen"), KeyStatus::NoRecord);
    assert_eq!(config.purge_expired(&mut conn, 10).expect("purge"), 1, "one tombstone");
    let late = run(&mut conn, "book");
    assert!(matches!(late, Err(Error::Expired)), "{late:?}");
    assert_eq!(phases.load(Ordering::SeqCst), 1, "no phase ran again");

    clock.advance(Duration::days(1));
    assert!(matches!(status(&mut conn, "book"), KeyStatus::Expired { .. }));
    assert!(!run(&mut conn, "book").expect("runs anew").is_replayed());
    assert_eq!(phases.load(Ordering::SeqCst), 2);
    clock.advance(Duration::hours(1) + Duration::days(1));
    assert_eq!(
        config.purge_expired(&mut conn, 10).expect("purge"),
        1,
        "deleted after its grace period"
    );
}

#[test]
#[should_panic(expected = "tombstone grace period must be positive")]
fn a_grace_period_of_zero_is_refused() {
    let _ = Config::default().tombstones(Duration::zero());
}

#[test]
fn the_default_policy_keeps_no_tombstones() {
    assert_eq!(Config::default().tombstone_grace(), None);
    assert_eq!(
        Config::default().tombstones(Duration::days(7)).tombstone_grace(),
        Some(Duration::days(7))
    );
}

/// The async calls share the single call's path: the policy holds there on
/// every backend's async connection.
#[cfg(feature = "diesel-async")]
mod asynchronous {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use chrono::Duration;
    use idempotency::{Error, Outcome};

    use crate::common::asynchronous::{AsyncDb, async_backend_tests};

    async_backend_tests!(an_async_retry_inside_the_grace_period_is_expired_and_after_it_executes);

    async fn an_async_retry_inside_the_grace_period_is_expired_and_after_it_executes<D: AsyncDb>() {
        let db = D::new();
        let mut conn = db.connect().await;
        let (clock, config) = super::policy();
        let runs = AtomicUsize::new(0);
        let charge = async |conn: &mut D::Async| {
            config
                .run_async(conn, "payments", "charge-1", &500, async |_: &mut D::Async| {
                    Ok::<_, Infallible>(runs.fetch_add(1, Ordering::SeqCst) + 1)
                })
                .await
        };
        assert_eq!(charge(&mut conn).await.expect("the first call"), Outcome::Executed(1));
        clock.advance(Duration::hours(1));
        let late = charge(&mut conn).await;
        assert!(matches!(late, Err(Error::Expired)), "{late:?}");
        clock.advance(Duration::days(1));
        assert_eq!(
            charge(&mut conn).await.expect("after the grace period"),
            Outcome::Executed(2)
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }
}

/// Over HTTP: a retry inside the grace period is a 410 problem of its own
/// type, and so is the lookup of its caller; after the grace period the
/// request is carried out again.
#[cfg(feature = "axum")]
mod http {
    use std::borrow::Cow;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::{FromRequestParts, State};
    use axum::http::{Method, Request, StatusCode, request::Parts};
    use axum::response::{IntoResponse, Response};
    use axum::routing::{get, post};
    use chrono::Duration;
    use diesel::r2d2::{ConnectionManager, Pool};
    use idempotency::Config;
    use idempotency::http::{self, Answer, Caller, Failure, IdempotencyKey, Problem, StoredResponse};
    use serde_json::{Value, json};

    use crate::common::TestDb;
    use crate::common::http::{bearer_token, problem_type, seen};

    crate::common::backend_tests!(async: a_retry_inside_the_grace_period_is_410_gone_and_after_it_is_carried_out);

    /// The user `Authorization: Bearer <user>` names, whose keys are in a
    /// scope of its own.
    struct User(String);

    impl<S: Sync> FromRequestParts<S> for User {
        type Rejection = StatusCode;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
            bearer_token(parts)
                .map(|token| User(token.to_owned()))
                .ok_or(StatusCode::UNAUTHORIZED)
        }
    }

    impl Caller for User {
        fn scope(&self) -> Cow<'_, str> {
            Cow::Borrowed("refunds")
        }

        fn principal(&self) -> Cow<'_, str> {
            Cow::Borrowed(&self.0)
        }
    }

    struct App<D: TestDb> {
        pool: Pool<ConnectionManager<D::Conn>>,
        config: Config,
    }

    impl<D: TestDb> Clone for App<D> {
        fn clone(&self) -> Self {
            App {
                pool: self.pool.clone(),
                config: self.config.clone(),
            }
        }
    }

    async fn refund<D: TestDb>(State(app): State<App<D>>, key: IdempotencyKey<User>) -> Response {
        let outcome: Result<Answer<StoredResponse<Value>>, Failure<Problem>> =
            http::run(&app.pool, &app.config, &key, (), move |_, ()| {
                Ok(StoredResponse::new(StatusCode::CREATED, json!({ "refund": "re_1" })))
            })
            .await;
        outcome.into_response()
    }

    async fn refund_status<D: TestDb>(
        State(app): State<App<D>>,
        key: IdempotencyKey<User>,
    ) -> Result<Answer<StoredResponse<Value>>, Failure<std::convert::Infallible>> {
        http::lookup(&app.pool, &app.config, &key, &[(Method::POST, "/refunds")]).await
    }

    /// The status, the replay header and the body of a request.
    async fn send(app: &Router, method: Method, path: &str, user: &str) -> (StatusCode, Option<String>, String, Value) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {user}"))
            .header("idempotency-key", "refund-1")
            .body(Body::empty())
            .expect("a request");
        let seen = seen(app, request).await;
        (
            seen.status,
            seen.header("idempotent-replayed").map(str::to_owned),
            seen.header("content-type").unwrap_or_default().to_owned(),
            seen.json(),
        )
    }

    async fn a_retry_inside_the_grace_period_is_410_gone_and_after_it_is_carried_out<D: TestDb>() {
        let db = tokio::task::block_in_place(D::new);
        let (clock, config) = super::policy();
        let pool = tokio::task::block_in_place(|| db.pool(2));
        let app = Router::new()
            .route("/refunds", post(refund::<D>))
            .route("/refunds/status", get(refund_status::<D>))
            .with_state(App::<D> { pool, config });

        let (status, replayed, _, _) = send(&app, Method::POST, "/refunds", "ann").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, None));
        clock.advance(Duration::hours(1));

        let expired = problem_type("idempotency-key-expired");
        for path in ["/refunds", "/refunds/status"] {
            let method = if path == "/refunds" { Method::POST } else { Method::GET };
            let (status, _, content_type, body) = send(&app, method, path, "ann").await;
            assert_eq!(status, StatusCode::GONE, "{path}: {body}");
            assert_eq!(content_type, "application/problem+json");
            assert_eq!(
                (&body["type"], &body["status"]),
                (&json!(expired), &json!(410)),
                "{path}"
            );
        }
        // Another caller's lookup learns nothing of it; its call is a
        // mismatch, as during the retention.
        let (status, _, _, body) = send(&app, Method::GET, "/refunds/status", "bob").await;
        assert_eq!(
            (status, &body["type"]),
            (StatusCode::NOT_FOUND, &json!(problem_type("idempotency-key-unknown")))
        );
        let (status, _, _, _) = send(&app, Method::POST, "/refunds", "bob").await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(crate::common::http::key_count(&db).await, 1, "nothing written");

        clock.advance(Duration::days(1));
        let (status, replayed, _, body) = send(&app, Method::POST, "/refunds", "ann").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::CREATED, None),
            "carried out again: {body}"
        );
    }
}
