//! Phased operations with async steps (`Phased::run_async`) hold the
//! contract of the sync steps: each step runs once and the response is
//! replayed, a failed call resumes from the last recovery point with the
//! same provider key, a panicking step rolls back and frees the lease,
//! another request is a mismatch, an operation begun with async steps is
//! finished by the sync ones (one protocol, one record), an attempt
//! dropped at any of its waits leaves whole steps and is resumed once its
//! lease runs out, and one gone silent mid-step loses its key within the
//! idle bound. Each outcome is checked against what the database
//! holds, and the provider's charges against the provider's own book.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chrono::Duration;
use diesel_async::AsyncConnection;
use diesel_async::pooled_connection::PoolableConnection;
use idempotency::phased::{AsyncSteps, Completer, Finished, Phased};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, Outcome};

use super::cancellation::cut_after;
use crate::common::asynchronous::{AsyncDb, AsyncServerDb, async_backend_tests, lent_outside_a_transaction};
use crate::common::wait::wait_for;
use crate::phased::rides::RideDb;
use crate::phased::{SCOPE, recovery_points};

async_backend_tests!(
    an_async_phased_operation_runs_each_step_once_and_replays_its_response,
    an_async_phased_operation_resumes_after_a_failed_call_without_running_its_phase_again,
    a_panicking_async_step_rolls_back_frees_the_lease_and_the_retry_finishes,
    an_async_phased_operation_with_another_request_is_a_mismatch_and_runs_nothing,
    an_operation_begun_with_async_steps_is_finished_by_the_sync_steps,
    an_operation_begun_with_sync_steps_is_finished_by_the_async_steps,
    an_abandoned_async_operation_is_finished_by_a_completer_on_a_thread,
    an_async_call_result_beyond_the_response_bound_is_recorded_and_the_call_is_never_made_again,
);

/// The backends with a server, whose sessions show what a cut left open.
mod server {
    use super::*;

    async_backend_tests!(
        server: an_async_attempt_cut_at_any_wait_keeps_whole_steps_and_is_resumed_after_its_lease,
        an_async_attempt_gone_silent_mid_step_loses_its_key_within_the_idle_bound,
    );
}

/// A payment provider reached over the network: it deduplicates charges
/// by provider key in its own book, and counts every request.
#[derive(Default)]
struct Provider {
    book: Mutex<HashMap<String, String>>,
    requests: AtomicUsize,
    /// Requests still to be refused before charging.
    refusals: AtomicUsize,
}

#[derive(Debug, PartialEq)]
enum ChargeError {
    Unavailable,
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for ChargeError {
    fn from(error: diesel::result::Error) -> Self {
        ChargeError::Database(error)
    }
}

impl Provider {
    async fn charge(&self, provider_key: &str) -> Result<String, ChargeError> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        // A request over the network: the attempt waits for its answer.
        tokio::task::yield_now().await;
        let refused = self
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .is_ok();
        if refused {
            return Err(ChargeError::Unavailable);
        }
        let mut book = self.book.lock().expect("the provider's book");
        let charges = book.len();
        Ok(book
            .entry(provider_key.to_owned())
            .or_insert_with(|| format!("ch-{charges}"))
            .clone())
    }

    fn charges(&self) -> usize {
        self.book.lock().expect("the provider's book").len()
    }
}

/// The order operation: the order is written in a phase, charged at the
/// provider, and answered with its charge in the finish. `phases` counts
/// the runs of the phase's closure.
async fn place<D: AsyncDb>(
    phased: &Phased,
    conn: &mut D::Async,
    key: &str,
    item: &str,
    provider: &Provider,
    phases: &AtomicUsize,
) -> Result<Outcome<String>, Error<ChargeError>> {
    phased
        .run_async(conn, SCOPE, key, &item, async |s: &mut AsyncSteps<'_, D::Async>| {
            s.phase("ordered", async |tx: &mut D::Async| {
                phases.fetch_add(1, Ordering::SeqCst);
                D::insert_order(tx, item).await.map_err(ChargeError::from)
            })
            .await?;
            let charge = s
                .call("charged", async |provider_key: &str| {
                    provider.charge(provider_key).await
                })
                .await?;
            s.finish(async |_: &mut D::Async| Ok::<_, ChargeError>(charge)).await
        })
        .await
}

async fn an_async_phased_operation_runs_each_step_once_and_replays_its_response<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    let phased = Phased::new("place-order");
    let first = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the first attempt");
    let retry = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the retry");
    assert!(!first.is_replayed() && retry.is_replayed(), "{first:?}, {retry:?}");
    assert_eq!(first.into_inner(), retry.into_inner());
    assert_eq!(
        (phases.load(Ordering::SeqCst), provider.requests.load(Ordering::SeqCst)),
        (1, 1),
        "each step ran once"
    );
    let mut check = db.conn();
    assert_eq!(D::order_items(&mut check), ["book"]);
    assert_eq!(provider.charges(), 1);
    assert_completed::<D>(&mut check, "order-1");
}

async fn an_async_phased_operation_resumes_after_a_failed_call_without_running_its_phase_again<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    provider.refusals.store(1, Ordering::SeqCst);
    let phased = Phased::new("place-order");
    let failed = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases).await;
    assert!(
        matches!(failed, Err(Error::Operation(ChargeError::Unavailable))),
        "{failed:?}"
    );
    let mut check = db.conn();
    assert_eq!(D::order_items(&mut check), ["book"], "the phase committed");
    assert_eq!(
        recovery_points::<D>(&mut check, "order-1"),
        Some(vec!["ordered".to_owned(), "charged (started)".to_owned()]),
        "the call is recorded as started"
    );

    // The failed attempt freed its lease: the retry resumes at once.
    let resumed = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the retry resumes");
    assert!(!resumed.is_replayed());
    assert_eq!(
        phases.load(Ordering::SeqCst),
        1,
        "the committed phase did not run again"
    );
    assert_eq!(provider.requests.load(Ordering::SeqCst), 2);
    assert_eq!(provider.charges(), 1, "both requests carried one provider key");
    assert_eq!(D::order_items(&mut check), ["book"]);
    assert_completed::<D>(&mut check, "order-1");
}

async fn a_panicking_async_step_rolls_back_frees_the_lease_and_the_retry_finishes<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    let phased = Phased::new("place-order");
    let attempt = phased.run_async(
        &mut conn,
        SCOPE,
        "order-1",
        &"book",
        async |s: &mut AsyncSteps<'_, D::Async>| {
            s.phase("ordered", async |tx: &mut D::Async| {
                D::insert_order(tx, "book").await.map_err(ChargeError::from)
            })
            .await?;
            let charge = s
                .call("charged", async |provider_key: &str| {
                    provider.charge(provider_key).await
                })
                .await?;
            s.finish(async |tx: &mut D::Async| {
                D::insert_order(tx, "receipt").await?;
                if std::hint::black_box(true) {
                    panic!("the finish panics after its insert");
                }
                Ok::<_, ChargeError>(charge)
            })
            .await
        },
    );
    let panicked = super::catch_unwind(attempt).await.is_err();
    assert!(panicked, "the panic went on to the caller");
    let mut check = db.conn();
    assert_eq!(D::order_items(&mut check), ["book"], "the finish's insert rolled back");
    assert_eq!(
        recovery_points::<D>(&mut check, "order-1"),
        Some(vec!["ordered".to_owned(), "charged".to_owned()])
    );

    // The same connection serves the retry, which finds the lease free.
    let finished = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the retry finishes");
    assert!(!finished.is_replayed());
    assert_eq!(phases.load(Ordering::SeqCst), 0, "the phase was not run again");
    assert_eq!(
        provider.requests.load(Ordering::SeqCst),
        1,
        "the call was not made again"
    );
    assert_completed::<D>(&mut check, "order-1");
}

async fn an_async_phased_operation_with_another_request_is_a_mismatch_and_runs_nothing<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    let phased = Phased::new("place-order");
    place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the first attempt");
    let other = place::<D>(&phased, &mut conn, "order-1", "lamp", &provider, &phases).await;
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    let renamed = place::<D>(
        &Phased::new("place-gift"),
        &mut conn,
        "order-1",
        "book",
        &provider,
        &phases,
    )
    .await;
    assert!(
        matches!(renamed, Err(Error::Mismatch)),
        "another operation: {renamed:?}"
    );
    assert_eq!(
        (phases.load(Ordering::SeqCst), provider.requests.load(Ordering::SeqCst)),
        (1, 1)
    );
    assert_eq!(D::order_items(&mut db.conn()), ["book"]);
}

/// The steps are one protocol for both kinds of connection: an operation
/// whose async attempt stopped after its call is finished by an attempt
/// with the sync steps on the same database, which neither runs the phase
/// nor makes the call again.
async fn an_operation_begun_with_async_steps_is_finished_by_the_sync_steps<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let provider = Provider::default();
    let phased = Phased::new("place-order");
    let stopped = phased
        .run_async(
            &mut conn,
            SCOPE,
            "order-1",
            &"book",
            async |s: &mut AsyncSteps<'_, D::Async>| {
                s.phase("ordered", async |tx: &mut D::Async| {
                    D::insert_order(tx, "book").await.map_err(ChargeError::from)
                })
                .await?;
                s.call("charged", async |provider_key: &str| {
                    provider.charge(provider_key).await
                })
                .await?;
                Err::<Finished<String>, _>(Error::Operation(ChargeError::Unavailable))
            },
        )
        .await;
    assert!(matches!(stopped, Err(Error::Operation(ChargeError::Unavailable))));

    let mut sync = db.conn();
    let finished = tokio::task::block_in_place(|| {
        phased.run(&mut sync, SCOPE, "order-1", &"book", |s| {
            s.phase("ordered", |_| -> Result<(), ChargeError> {
                panic!("the committed phase runs again")
            })?;
            let charge: String = s.call("charged", |_| -> Result<String, ChargeError> {
                panic!("the committed call is made again")
            })?;
            s.finish(|_| Ok::<_, ChargeError>(charge))
        })
    });
    assert_eq!(
        finished.expect("the sync steps finish it"),
        Outcome::Executed("ch-0".to_owned())
    );
    assert_eq!(provider.requests.load(Ordering::SeqCst), 1);
    assert_eq!(D::order_items(&mut sync), ["book"]);
}

/// The other way round: an operation whose sync attempt stopped after its
/// call is finished by the async steps, which neither run the phase nor make
/// the call again, and answer with the call's stored result.
async fn an_operation_begun_with_sync_steps_is_finished_by_the_async_steps<D: AsyncDb + RideDb>() {
    let db = D::new();
    let phased = Phased::new("place-order");
    let mut sync = db.conn();
    let stopped = tokio::task::block_in_place(|| {
        phased.run(&mut sync, SCOPE, "order-1", &"book", |s| {
            s.phase("ordered", |tx| {
                D::place_order(tx, "book", 1).map(drop).map_err(ChargeError::from)
            })?;
            s.call("charged", |_| Ok::<_, ChargeError>(String::from("ch-sync")))?;
            Err::<Finished<String>, _>(Error::Operation(ChargeError::Unavailable))
        })
    });
    assert!(
        matches!(stopped, Err(Error::Operation(ChargeError::Unavailable))),
        "{stopped:?}"
    );

    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    let finished = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the async steps finish it");
    assert_eq!(finished, Outcome::Executed("ch-sync".to_owned()));
    assert_eq!(
        (phases.load(Ordering::SeqCst), provider.requests.load(Ordering::SeqCst)),
        (0, 0),
        "neither the phase nor the call ran again"
    );
    assert_eq!(D::order_items(&mut sync), ["book"]);
}

/// The completer stays a thread over a synchronous connection beside an
/// async application: the function it runs for an operation with async
/// steps drives the attempt on the application's runtime, on an async
/// connection of its own, and finishes what the client left.
async fn an_abandoned_async_operation_is_finished_by_a_completer_on_a_thread<D: AsyncDb + RideDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let (provider, phases) = (Arc::new(Provider::default()), Arc::new(AtomicUsize::new(0)));
    provider.refusals.store(1, Ordering::SeqCst);
    let clock = ManualClock::new();
    let phased = Phased::new("place-order")
        .store_requests(true)
        .config(Config::default().clock(clock.source()));
    let failed = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases).await;
    assert!(
        matches!(failed, Err(Error::Operation(ChargeError::Unavailable))),
        "{failed:?}"
    );

    let runtime = tokio::runtime::Handle::current();
    let url = db.url().to_owned();
    let (resumed_provider, resumed_phases, resumed) = (Arc::clone(&provider), Arc::clone(&phases), phased.clone());
    let completer = Completer::<D::Conn>::new().clock(clock.source()).operation(
        "place-order",
        move |_: &mut D::Conn, _scope: &str, key: &str, item: String| {
            runtime.block_on(async {
                let mut conn = D::Async::establish(&url).await.expect("an async connection");
                place::<D>(&resumed, &mut conn, key, &item, &resumed_provider, &resumed_phases).await
            })
        },
    );
    clock.advance(Duration::minutes(5));
    let mut sync = db.conn();
    let (report, mut sync) = tokio::task::spawn_blocking(move || (completer.run_once(&mut sync), sync))
        .await
        .expect("the completer's thread");
    let report = report.expect("a pass");
    assert_eq!((report.picked, report.completed), (1, 1), "{report:?}");
    assert_completed::<D>(&mut sync, "order-1");
    assert_eq!(phases.load(Ordering::SeqCst), 1, "the phase ran once");
    assert_eq!(
        (provider.requests.load(Ordering::SeqCst), provider.charges()),
        (2, 1),
        "the call was made again with its provider key"
    );
    let replay = place::<D>(&phased, &mut conn, "order-1", "book", &provider, &phases)
        .await
        .expect("the client's retry");
    assert!(replay.is_replayed(), "{replay:?}");
    assert_eq!(D::order_items(&mut sync), ["book"]);
}

/// An attempt cut at each of its waits in turn (a timeout, a server whose
/// client hung up), from its first read to its last commit: afterwards
/// every step is whole or absent (the order exists exactly when its phase
/// is recorded), the pool lends no connection inside a transaction, and
/// once the cut attempt's lease has run out the retry finishes the
/// operation with one order and one charge, resuming from what committed.
async fn an_async_attempt_cut_at_any_wait_keeps_whole_steps_and_is_resumed_after_its_lease<
    D: AsyncServerDb + RideDb,
>() {
    let db = D::new();
    let pool = db.async_pool(1).await;
    let clock = ManualClock::new();
    let phased = Phased::new("place-order")
        .lease(Duration::seconds(30))
        .config(Config::default().clock(clock.source()).in_flight(InFlight::Reject));
    let mut admin = db.conn();
    let (mut cut_inside, mut cut_between) = (0, 0);
    // Keys no other test uses: PostgreSQL's advisory locks are the
    // database's, not the schema's, so a test in another schema holding
    // the same scope and key (`order-1`) would hold this retry off.
    let keys = crate::common::unique_name("cut-order");
    let mut waits = 0;
    loop {
        assert!(waits < 2_000, "an attempt never finished within {waits} waits");
        let key = format!("{keys}-{waits}");
        let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
        let mut conn = pool.get().await.expect("a connection from the pool");
        let session = D::session_of(&mut conn).await;
        let attempt = place::<D>(&phased, &mut conn, &key, &key, &provider, &phases);
        let finished = cut_after(waits, attempt).await;
        let broken = conn.is_broken();
        drop(conn);
        if finished.is_none() {
            if broken {
                cut_inside += 1;
                tokio::task::block_in_place(|| {
                    wait_for("the dropped connection's session to end", || {
                        !D::session_exists(&mut admin, session)
                    });
                });
            } else {
                cut_between += 1;
            }
        }

        let points = recovery_points::<D>(&mut admin, &key);
        let orders = D::order_items(&mut admin).iter().filter(|item| **item == key).count();
        let ordered = points
            .as_ref()
            .is_some_and(|points| matches!(points.first().map(String::as_str), Some("ordered" | "completed")));
        assert_eq!(
            orders,
            usize::from(ordered),
            "cut at wait {waits}: the order exists exactly when its phase committed ({points:?})"
        );
        assert!(provider.charges() <= 1, "cut at wait {waits}");

        let mut conn = lent_outside_a_transaction::<D>(&pool, &mut admin).await;
        let completed = points.as_deref() == Some(&["completed".to_owned()][..]);
        if points.is_some() && !completed && finished.is_none() {
            // The cut attempt's lease holds the operation until it runs out.
            let held = place::<D>(&phased, &mut conn, &key, &key, &provider, &phases).await;
            assert!(matches!(held, Err(Error::InProgress)), "cut at wait {waits}: {held:?}");
            clock.advance(Duration::seconds(31));
        }
        let retried = place::<D>(&phased, &mut conn, &key, &key, &provider, &phases)
            .await
            .expect("the retry finishes the operation");
        assert_eq!(
            retried.is_replayed(),
            finished.is_some() || completed,
            "cut at wait {waits}: {retried:?}"
        );
        assert_eq!(provider.charges(), 1, "cut at wait {waits}: one charge");
        assert_eq!(
            D::order_items(&mut admin).iter().filter(|item| **item == key).count(),
            1,
            "cut at wait {waits}: one order"
        );
        if finished.is_some() {
            break;
        }
        waits += 1;
    }
    assert!(
        cut_inside > 0 && (cut_between > 0 || D::CUT_STATEMENT_DISCARDS_THE_CONNECTION),
        "the cuts fell inside a step's transaction ({cut_inside}) and between steps ({cut_between})"
    );
}

/// An attempt whose step writes and then goes silent, its connection open,
/// as a host cut off from the network leaves it: the server ends the
/// session within the idle bound, which frees the key, and an attempt
/// waiting for it executes the operation; nothing of the silent step stays.
async fn an_async_attempt_gone_silent_mid_step_loses_its_key_within_the_idle_bound<D: AsyncServerDb + RideDb>() {
    let db = D::new();
    let (inside_tx, inside) = tokio::sync::oneshot::channel();
    let silent_phased = Phased::new("place-order").config(Config::default().idle_timeout(Duration::seconds(1)));
    let mut silent_conn = db.connect().await;
    let silent = silent_phased.run_async(
        &mut silent_conn,
        SCOPE,
        "order-1",
        &"book",
        async |s: &mut AsyncSteps<'_, D::Async>| {
            s.phase("ordered", async |tx: &mut D::Async| {
                D::insert_order(tx, "silent").await?;
                inside_tx.send(()).expect("the test waits");
                std::future::pending::<()>().await;
                Ok::<_, ChargeError>(())
            })
            .await?;
            s.finish(async |_: &mut D::Async| Ok::<_, ChargeError>(String::new()))
                .await
        },
    );
    let mut conn = db.connect().await;
    let (provider, phases) = (Provider::default(), AtomicUsize::new(0));
    let waiting = Phased::new("place-order").config(Config::default().in_flight(InFlight::Wait(Duration::seconds(20))));
    let waiter = async {
        inside.await.expect("the silent step holds the key");
        place::<D>(&waiting, &mut conn, "order-1", "book", &provider, &phases).await
    };
    // The silent attempt is polled until the waiter is answered, and never
    // ends: only the server can free its key.
    let answered = tokio::select! {
        _ = silent => panic!("the silent attempt never ends by itself"),
        answered = waiter => answered,
    };
    assert!(!answered.expect("the waiter is served").is_replayed());
    let mut check = db.conn();
    assert_eq!(D::order_items(&mut check), ["book"], "nothing of the silent step stays");
    assert_completed::<D>(&mut check, "order-1");
}

/// As with the sync steps (`phased::call_results`): the call was made, so
/// its result is recorded whatever the response bound says.
async fn an_async_call_result_beyond_the_response_bound_is_recorded_and_the_call_is_never_made_again<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let phased = Phased::new("fetch-document").config(Config::default().max_response_len(64));
    for at_most_once in [false, true] {
        let key = format!("document-{at_most_once}");
        let calls = AtomicUsize::new(0);
        let fetch = async |conn: &mut D::Async, whole: bool| {
            phased
                .run_async(
                    conn,
                    SCOPE,
                    &key,
                    &"report",
                    async |s: &mut AsyncSteps<'_, D::Async>| {
                        let provider = async |_: &str| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            Ok::<_, std::convert::Infallible>("x".repeat(100))
                        };
                        let document = if at_most_once {
                            s.call_at_most_once("fetched", provider).await?
                        } else {
                            s.call("fetched", provider).await?
                        };
                        s.finish(async |_: &mut D::Async| Ok(if whole { document } else { document.len().to_string() }))
                            .await
                    },
                )
                .await
        };
        let refused = fetch(&mut conn, true).await;
        assert!(
            matches!(refused, Err(Error::ResponseTooLarge { len: 102, max: 64 })),
            "the response is bounded: {refused:?}"
        );
        let fetched = fetch(&mut conn, false).await;
        assert_eq!(
            fetched.expect("the retry finishes"),
            Outcome::Executed(String::from("100"))
        );
        let replayed = fetch(&mut conn, false).await;
        assert_eq!(replayed.expect("a replay"), Outcome::Replayed(String::from("100")));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the call was made once (at most once: {at_most_once})"
        );
    }
}

/// Asserts that the operation of `key` is completed: its only recovery
/// point says so.
#[track_caller]
fn assert_completed<D: RideDb>(conn: &mut D::Conn, key: &str) {
    assert_eq!(recovery_points::<D>(conn, key), Some(vec!["completed".to_owned()]));
}
