//! Operations in phases: a ride is created, its card charged at a payment
//! provider and the charge recorded with a receipt, resumed from every point
//! a process can die at, raced by retries and completers, parked and
//! requeued.
//!
//! The provider is a fake that deduplicates charges by provider key in a
//! table of its own, so it remembers them across a killed process, and
//! counts every request it gets. Each charge it applied is a row, so "one
//! charge" is a row count.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use idempotency::outbox;
use idempotency::phased::{Completer, Completions, Phased};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, Outcome};
use serde::{Deserialize, Serialize};

use crate::common::TestDb;
use crate::common::child::{Child, parent_database, report_and_wait_for_the_kill};
use crate::common::wait::{self, Barrier, PATIENCE};

const SCOPE: &str = "riders";
const KEY: &str = "ride-7c1e";
const OPERATION: &str = "create-ride";
const RECEIPTS: &str = "ride-receipt";

/// What the child prints once it stands at the boundary it is killed at.
const CHILD_READY: &str = "phased-child-ready";

crate::common::backend_tests!(
    killed_inside_the_first_phase_leaves_the_key_free,
    killed_after_the_first_phase_resumes_once,
    killed_before_the_call_calls_the_provider_once,
    killed_after_the_provider_applied_charges_once,
    killed_inside_finish_sends_one_receipt,
    killed_after_finish_replays_the_reply,
    failure_in_the_first_phase_leaves_the_key_free,
    phase_output_that_would_not_read_back_is_refused_and_rolls_back,
    panic_in_a_step_rolls_it_back_and_frees_the_lease,
    result_kept_from_another_operation_is_refused,
    provider_failing_before_charging_is_called_again_with_the_same_key,
    provider_timing_out_after_charging_gives_the_retry_the_same_charge,
    concurrent_retries_during_a_blocked_call_charge_once,
    attempt_whose_lease_ran_out_mid_call_is_fenced_out,
    retry_taking_over_after_another_attempt_progressed_resumes_from_its_progress,
    completer_finishes_an_abandoned_operation,
    completer_leaves_operations_without_a_stored_request_to_their_clients,
    completer_racing_client_retries_finishes_each_operation_once,
    completer_skips_operations_in_their_grace_period_or_under_lease,
    completer_parks_after_max_attempts_and_requeue_brings_it_back,
    completer_retries_a_failed_operation_once_its_grace_ran_out,
    provider_horizon_parks_the_operation_for_a_person,
    requeued_operation_past_its_horizon_makes_the_call_again,
    interrupted_at_most_once_call_parks_until_requeued,
    renamed_step_is_refused_and_runs_nothing,
    calls_sharing_a_name_get_a_provider_key_each,
    another_request_under_the_same_key_is_a_mismatch,
    another_operation_under_a_spent_key_is_a_mismatch,
    another_operation_under_a_key_in_progress_is_a_mismatch_at_once,
    key_executing_again_after_retention_charges_under_a_new_provider_key,
    purge_deletes_finished_operations_only,
);

mod schema {
    diesel::table! {
        /// The domain table: one row per ride, its charge once recorded.
        rides (id) {
            id -> Text,
            rider -> Text,
            cents -> BigInt,
            charge -> Nullable<Text>,
        }
    }

    diesel::table! {
        /// The provider's own table: one row per charge it applied, and how
        /// many requests came with its key.
        provider_charges (provider_key) {
            provider_key -> Text,
            charge_id -> Text,
            cents -> BigInt,
            requests -> Integer,
        }
    }

    diesel::table! {
        /// The crate's operations, the columns the tests read.
        idempotency_phases (scope, idempotency_key) {
            scope -> Text,
            idempotency_key -> Text,
            status -> Text,
            points -> Text,
            attempts -> Integer,
        }
    }

    diesel::table! {
        /// The crate's outbox, the columns the tests read.
        idempotency_outbox (id) {
            id -> Text,
            topic -> Text,
            payload -> Text,
        }
    }
}

/// Portable SQL: the same on every backend.
const RIDE_TABLES: &str = "
    CREATE TABLE rides (id TEXT PRIMARY KEY, rider TEXT NOT NULL, cents BIGINT NOT NULL, charge TEXT);
    CREATE TABLE provider_charges (
        provider_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL, cents BIGINT NOT NULL, requests INTEGER NOT NULL
    );";

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct NewRide {
    rider: String,
    cents: i64,
}

fn ada() -> NewRide {
    NewRide {
        rider: String::from("ada"),
        cents: 20_00,
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Reply {
    ride: String,
    charge: String,
}

/// The receipt message, as enqueued in the last step.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    ride: String,
    charge: String,
    cents: i64,
}

#[derive(Debug)]
enum RideError {
    Database(diesel::result::Error),
    Outbox(outbox::Error),
    Provider(ProviderError),
    GaveUp,
}

impl std::fmt::Display for RideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RideError::Database(error) => write!(f, "the ride could not be saved: {error}"),
            RideError::Outbox(error) => write!(f, "the receipt could not be queued: {error}"),
            RideError::Provider(error) => write!(f, "the payment provider failed: {error:?}"),
            RideError::GaveUp => f.write_str("the attempt gave up"),
        }
    }
}

impl From<diesel::result::Error> for RideError {
    fn from(error: diesel::result::Error) -> Self {
        RideError::Database(error)
    }
}

impl From<outbox::Error> for RideError {
    fn from(error: outbox::Error) -> Self {
        RideError::Outbox(error)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ProviderError {
    /// Refused before it charged anything.
    Unavailable,
    /// Charged, but the answer never arrived.
    TimedOut,
    /// The key came with another amount than its first request.
    KeyReused,
}

/// A charge as the provider stores it: (provider key, charge id, cents,
/// requests with that key).
type ChargeRow = (String, String, i64, i32);

/// The queries of the ride tables, per backend.
trait RideDb: TestDb + 'static {
    /// The ride and provider tables, as the backend declares them.
    const TABLES: &'static str;

    fn insert_ride(tx: &mut Self::Conn, id: &str, request: &NewRide) -> QueryResult<usize>;

    fn set_ride_charge(tx: &mut Self::Conn, id: &str, charge: &str) -> QueryResult<usize>;

    /// Every ride as (id, charge).
    fn rides(conn: &mut Self::Conn) -> Vec<(String, Option<String>)>;

    /// Applies a charge unless one exists under `provider_key`, counting the
    /// request either way; returns the charge id and its amount.
    fn apply_charge(conn: &mut Self::Conn, provider_key: &str, cents: i64) -> QueryResult<(String, i64)>;

    fn charges(conn: &mut Self::Conn) -> Vec<ChargeRow>;

    /// The operation under `key` as (status, attempts, recovery points).
    fn operation(conn: &mut Self::Conn, key: &str) -> Option<(String, i32, String)>;

    /// The payloads of every receipt enqueued.
    fn receipts(conn: &mut Self::Conn) -> Vec<String>;
}

/// The bodies of [`RideDb`], written once and expanded per backend: diesel's
/// query types are concrete per connection.
macro_rules! ride_queries {
    () => {
        fn insert_ride(tx: &mut Self::Conn, id: &str, request: &NewRide) -> QueryResult<usize> {
            use schema::rides as r;
            diesel::insert_into(r::table)
                .values((
                    r::id.eq(id),
                    r::rider.eq(&request.rider),
                    r::cents.eq(request.cents),
                ))
                .execute(tx)
        }

        fn set_ride_charge(tx: &mut Self::Conn, id: &str, charge: &str) -> QueryResult<usize> {
            use schema::rides as r;
            diesel::update(r::table.find(id))
                .set(r::charge.eq(charge))
                .execute(tx)
        }

        fn rides(conn: &mut Self::Conn) -> Vec<(String, Option<String>)> {
            use schema::rides as r;
            r::table
                .order(r::id)
                .select((r::id, r::charge))
                .load(conn)
                .expect("read the rides")
        }

        fn charges(conn: &mut Self::Conn) -> Vec<ChargeRow> {
            use schema::provider_charges as p;
            p::table
                .order(p::provider_key)
                .select((p::provider_key, p::charge_id, p::cents, p::requests))
                .load(conn)
                .expect("read the provider's charges")
        }

        fn operation(conn: &mut Self::Conn, key: &str) -> Option<(String, i32, String)> {
            use schema::idempotency_phases as o;
            o::table
                .find((SCOPE, key))
                .select((o::status, o::attempts, o::points))
                .get_result(conn)
                .optional()
                .expect("read the operation")
        }

        fn receipts(conn: &mut Self::Conn) -> Vec<String> {
            use schema::idempotency_outbox as m;
            m::table
                .filter(m::topic.eq(RECEIPTS))
                .order(m::id)
                .select(m::payload)
                .load(conn)
                .expect("read the receipts")
        }
    };
}

/// The provider's insert-or-count, where the backend has `ON CONFLICT`.
macro_rules! apply_charge_on_conflict {
    () => {
        fn apply_charge(conn: &mut Self::Conn, provider_key: &str, cents: i64) -> QueryResult<(String, i64)> {
            use schema::provider_charges as p;
            diesel::insert_into(p::table)
                .values((
                    p::provider_key.eq(provider_key),
                    p::charge_id.eq(crate::common::unique_name("ch")),
                    p::cents.eq(cents),
                    p::requests.eq(1),
                ))
                .on_conflict(p::provider_key)
                .do_update()
                .set(p::requests.eq(p::requests + 1))
                .execute(conn)?;
            p::table
                .find(provider_key)
                .select((p::charge_id, p::cents))
                .get_result(conn)
        }
    };
}

impl RideDb for crate::common::sqlite::Db {
    const TABLES: &'static str = RIDE_TABLES;
    ride_queries!();
    apply_charge_on_conflict!();
}

#[cfg(feature = "postgres")]
impl RideDb for crate::common::pg::Db {
    const TABLES: &'static str = RIDE_TABLES;
    ride_queries!();
    apply_charge_on_conflict!();
}

#[cfg(feature = "mysql")]
impl RideDb for crate::common::mysql::Db {
    const TABLES: &'static str = "
        CREATE TABLE rides (id VARCHAR(64) PRIMARY KEY, rider TEXT NOT NULL, cents BIGINT NOT NULL, charge TEXT);
        CREATE TABLE provider_charges (
            provider_key VARCHAR(255) PRIMARY KEY, charge_id TEXT NOT NULL, cents BIGINT NOT NULL, requests INTEGER NOT NULL
        );";
    ride_queries!();

    fn apply_charge(conn: &mut Self::Conn, provider_key: &str, cents: i64) -> QueryResult<(String, i64)> {
        use diesel::dsl::DuplicatedKeys;
        use schema::provider_charges as p;
        diesel::insert_into(p::table)
            .values((
                p::provider_key.eq(provider_key),
                p::charge_id.eq(crate::common::unique_name("ch")),
                p::cents.eq(cents),
                p::requests.eq(1),
            ))
            .on_conflict(DuplicatedKeys)
            .do_update()
            .set(p::requests.eq(p::requests + 1))
            .execute(conn)?;
        p::table
            .find(provider_key)
            .select((p::charge_id, p::cents))
            .get_result(conn)
    }
}

/// A new database with the ride and provider tables.
fn ride_db<D: RideDb>() -> D {
    let db = D::new();
    db.conn().batch_execute(D::TABLES).expect("create the ride tables");
    db
}

/// What the provider does with the next request.
enum Behaviour {
    /// Charges, or returns the charge made under the key before.
    Apply,
    /// Fails before charging.
    FailBefore,
    /// Charges, then fails as a timeout would: the caller cannot tell.
    TimeOutAfter,
    /// Waits at the gate, then charges.
    Block(Gate),
}

/// Holds a provider request until the test lets it go.
struct Gate {
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
}

/// A gate, the receiver that hears a request arrive at it, and the sender
/// that lets the request go.
fn gate() -> (Gate, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (entered, arrived) = mpsc::channel();
    let (open, release) = mpsc::channel();
    (Gate { entered, release }, arrived, open)
}

/// The fake payment provider: deduplicates by provider key in its own table,
/// reached through connections of its own, and follows a script of
/// behaviours, one per request, then applies.
struct Provider<D: TestDb> {
    pool: Pool<ConnectionManager<D::Conn>>,
    script: Mutex<VecDeque<Behaviour>>,
    requests: AtomicUsize,
    db: PhantomData<fn() -> D>,
}

impl<D: RideDb> Provider<D> {
    fn new(url: &str) -> Self {
        Provider {
            pool: D::pool_at(url, 2),
            script: Mutex::new(VecDeque::new()),
            requests: AtomicUsize::new(0),
            db: PhantomData,
        }
    }

    fn then(&self, behaviour: Behaviour) -> &Self {
        self.script.lock().expect("the script").push_back(behaviour);
        self
    }

    /// Requests this process made, failed ones included.
    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn charge(&self, provider_key: &str, cents: i64) -> Result<String, ProviderError> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let behaviour = self
            .script
            .lock()
            .expect("the script")
            .pop_front()
            .unwrap_or(Behaviour::Apply);
        match &behaviour {
            Behaviour::FailBefore => return Err(ProviderError::Unavailable),
            Behaviour::Block(gate) => {
                gate.entered.send(()).expect("the test waits at the gate");
                wait::recv(&gate.release, "the test opens the gate");
            }
            Behaviour::Apply | Behaviour::TimeOutAfter => {}
        }
        let mut conn = self.pool.get().expect("a provider connection");
        let (charge, first_cents) = D::apply_charge(&mut conn, provider_key, cents).expect("the provider's table");
        if first_cents != cents {
            return Err(ProviderError::KeyReused);
        }
        match behaviour {
            Behaviour::TimeOutAfter => Err(ProviderError::TimedOut),
            _ => Ok(charge),
        }
    }
}

/// A point of the ride operation a process can die at.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Boundary {
    /// The ride is written, its transaction (the first commit) still open.
    InsideFirstPhase,
    AfterFirstPhase,
    /// The call is committed as started; the provider has not been asked.
    BeforeCall,
    /// The provider charged; the call's result is not committed.
    AfterProviderApplied,
    /// The charge and the receipt are written, the last transaction open.
    InsideFinish,
    AfterFinish,
}

/// What the operation does on reaching a boundary.
type Stop<'a> = &'a (dyn Fn(Boundary) + Sync);

fn go_on(_: Boundary) {}

/// The ride operation with its provider, as a client handler and a
/// completer run it.
struct Rides<D: TestDb> {
    phased: Phased,
    provider: Arc<Provider<D>>,
}

impl<D: TestDb> Clone for Rides<D> {
    fn clone(&self) -> Self {
        Rides {
            phased: self.phased.clone(),
            provider: Arc::clone(&self.provider),
        }
    }
}

impl<D: RideDb> Rides<D> {
    fn new(db: &D, phased: Phased) -> Self {
        Rides {
            phased,
            provider: Arc::new(Provider::new(db.url())),
        }
    }

    /// The same operation and provider under another policy.
    fn with(&self, phased: Phased) -> Self {
        Rides {
            phased,
            provider: Arc::clone(&self.provider),
        }
    }

    fn create(&self, conn: &mut D::Conn, key: &str, request: &NewRide) -> Result<Outcome<Reply>, Error<RideError>> {
        self.create_stopping(conn, key, request, &go_on)
    }

    /// Creates the ride, charges it and records the charge with its receipt,
    /// calling `stop` at every boundary.
    fn create_stopping(
        &self,
        conn: &mut D::Conn,
        key: &str,
        request: &NewRide,
        stop: Stop<'_>,
    ) -> Result<Outcome<Reply>, Error<RideError>> {
        self.phased.run(conn, SCOPE, key, request, |s| {
            let ride = s.phase("ride_created", |tx| {
                let id = crate::common::unique_name("ride");
                D::insert_ride(tx, &id, request)?;
                stop(Boundary::InsideFirstPhase);
                Ok::<_, RideError>(id)
            })?;
            stop(Boundary::AfterFirstPhase);
            let charge = s.call("charged", |provider_key| {
                stop(Boundary::BeforeCall);
                let charge = self.provider.charge(provider_key, request.cents);
                if charge.is_ok() {
                    stop(Boundary::AfterProviderApplied);
                }
                charge.map_err(RideError::Provider)
            })?;
            let finished = s.finish(|tx| {
                assert_eq!(D::set_ride_charge(tx, &ride, &charge)?, 1, "the ride exists");
                let receipt = Receipt {
                    ride: ride.clone(),
                    charge: charge.clone(),
                    cents: request.cents,
                };
                outbox::enqueue(tx, RECEIPTS, &receipt)?;
                stop(Boundary::InsideFinish);
                Ok::<_, RideError>(Reply { ride, charge })
            })?;
            stop(Boundary::AfterFinish);
            Ok(finished)
        })
    }

    /// A completer that resumes this operation with this policy.
    fn completer(&self) -> Completer<D::Conn> {
        let rides = self.clone();
        Completer::new().operation(OPERATION, move |conn: &mut D::Conn, scope, key, request: NewRide| {
            assert_eq!(scope, SCOPE, "resumed under the scope it was created in");
            rides.create(conn, key, &request)
        })
    }
}

fn config(clock: &ManualClock) -> Config {
    Config::default().clock(clock.source())
}

/// The operation under a manual clock, its request stored for completers.
fn create_ride(clock: &ManualClock) -> Phased {
    Phased::new(OPERATION).store_requests(true).config(config(clock))
}

/// The recovery points committed for `key`: step names, an unfinished call
/// marked `(started)`; `None` without an operation, `completed` and `parked`
/// for operations that ended.
fn recovery_points<D: RideDb>(conn: &mut D::Conn, key: &str) -> Option<Vec<String>> {
    let (status, _, points) = D::operation(conn, key)?;
    if status != "running" {
        return Some(vec![status]);
    }
    let points: Vec<serde_json::Value> = serde_json::from_str(&points).expect("points are a json array");
    Some(
        points
            .iter()
            .map(|point| {
                let name = point["name"].as_str().expect("a named point").to_owned();
                match point.get("output") {
                    Some(_) => name,
                    None => format!("{name} (started)"),
                }
            })
            .collect(),
    )
}

fn attempts<D: RideDb>(conn: &mut D::Conn, key: &str) -> i32 {
    D::operation(conn, key).expect("the operation exists").1
}

/// Checks the effects of the operation under `key` against `reply`: one
/// ride, charged once with its charge recorded, one receipt naming both;
/// `requests` is how often the provider was asked for it, failed requests
/// not counted.
fn assert_charged_once<D: RideDb>(conn: &mut D::Conn, reply: &Reply, requests: i32) {
    assert_eq!(
        D::rides(conn),
        [(reply.ride.clone(), Some(reply.charge.clone()))],
        "one ride, with the charge of the reply"
    );
    let charges = D::charges(conn);
    assert_eq!(charges.len(), 1, "one charge applied: {charges:?}");
    assert_eq!(
        (&charges[0].1, charges[0].2, charges[0].3),
        (&reply.charge, ada().cents, requests),
        "the reply's charge, asked for {requests} times"
    );
    let receipts: Vec<Receipt> = D::receipts(conn)
        .iter()
        .map(|payload| serde_json::from_str(payload).expect("a receipt"))
        .collect();
    assert_eq!(
        receipts,
        [Receipt {
            ride: reply.ride.clone(),
            charge: reply.charge.clone(),
            cents: ada().cents,
        }],
        "one receipt message"
    );
}

fn executed(result: Result<Outcome<Reply>, Error<RideError>>) -> Reply {
    match result {
        Ok(Outcome::Executed(reply)) => reply,
        other => panic!("expected the operation to finish now, got {other:?}"),
    }
}

/// The fields of a report, comparable although it is non-exhaustive:
/// (picked, completed, failed, skipped, parked).
fn counts(report: &Completions) -> (usize, usize, usize, usize, usize) {
    (
        report.picked,
        report.completed,
        report.failed,
        report.skipped,
        report.parked,
    )
}

// --- A process killed at every boundary ---

/// The operation of the kill tests: a lease short enough that the parent
/// takes over soon after the kill, and the wait for it long enough to.
fn killable() -> Phased {
    Phased::new(OPERATION)
        .store_requests(true)
        .lease(Duration::seconds(1))
        .config(Config::default().in_flight(InFlight::Wait(Duration::seconds(20))))
}

/// The child: runs the operation as a server process would, and at
/// `boundary` says so and waits to be killed.
fn crashing_child<D: RideDb>(url: &str, boundary: Boundary) {
    let db_pool = D::pool_at(url, 1);
    let mut conn = db_pool.get().expect("the child's connection");
    let rides = Rides::<D> {
        phased: killable(),
        provider: Arc::new(Provider::new(url)),
    };
    let stop = |reached: Boundary| {
        if reached == boundary {
            report_and_wait_for_the_kill(CHILD_READY);
        }
    };
    let result = rides.create_stopping(&mut conn, KEY, &ada(), &stop);
    panic!("the child went past {boundary:?}: {result:?}");
}

/// Runs test `test` again as a child process on `db`, and kills it with
/// SIGKILL once it stands at its boundary.
fn kill_child_at_its_boundary<D: RideDb>(db: &D, test: &str) {
    let test = crate::common::test_name::<D>(module_path!(), test);
    let mut child = Child::start(&test, db.url());
    child.wait_for("its boundary", |line| (line == CHILD_READY).then_some(()));
    let status = child.kill();
    assert_eq!(status.signal(), Some(9), "the child was killed, not finished: {status}");
}

/// Passes of `completer` until one picks the operation, which that pass must
/// finish: meanwhile the killed attempt's lease runs out, and passes find
/// nothing to do.
fn complete_once<D: RideDb>(completer: &Completer<D::Conn>, conn: &mut D::Conn) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let report = completer.run_once(conn).expect("a completer pass");
        if report.picked > 0 {
            assert_eq!(counts(&report), (1, 1, 0, 0, 0), "one operation picked and finished");
            return;
        }
        assert_eq!(report, Completions::default(), "nothing is done while the lease runs");
        assert!(Instant::now() < deadline, "the killed attempt's lease never ran out");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The recovery points a process killed at `boundary` leaves behind.
fn left_behind(boundary: Boundary) -> Option<Vec<String>> {
    let points: &[&str] = match boundary {
        Boundary::InsideFirstPhase => return None,
        Boundary::AfterFirstPhase => &["ride_created"],
        Boundary::BeforeCall | Boundary::AfterProviderApplied => &["ride_created", "charged (started)"],
        Boundary::InsideFinish => &["ride_created", "charged"],
        Boundary::AfterFinish => &["completed"],
    };
    Some(points.iter().map(|point| point.to_string()).collect())
}

/// The kill test of `boundary`, named `test`: kills a child there, then
/// resumes once by a client's retry and, on a second database, once by the
/// completer. Each way ends with one ride, charged once, one receipt and
/// the same reply on every retry.
fn killed_at<D: RideDb>(boundary: Boundary, test: &str) {
    if let Some(url) = parent_database() {
        return crashing_child::<D>(&url, boundary);
    }
    // Only a kill after the provider answered leaves a request to repeat;
    // a kill after the call's result committed leaves none to make.
    let requests = if boundary == Boundary::AfterProviderApplied {
        2
    } else {
        1
    };
    let requests_here = match boundary {
        Boundary::InsideFinish | Boundary::AfterFinish => 0,
        _ => 1,
    };
    // Without a commit there was nothing to take over; once finished,
    // nothing to resume.
    let attempts_made = match boundary {
        Boundary::InsideFirstPhase | Boundary::AfterFinish => 1,
        _ => 2,
    };
    for by_completer in [false, true] {
        let db = ride_db::<D>();
        kill_child_at_its_boundary(&db, test);
        let mut conn = db.conn();
        assert_eq!(
            recovery_points::<D>(&mut conn, KEY),
            left_behind(boundary),
            "what the child committed before {boundary:?}"
        );
        let rides = Rides::new(&db, killable());
        let reply = if by_completer {
            let completer = rides.completer().grace(Duration::milliseconds(1));
            match boundary {
                Boundary::InsideFirstPhase | Boundary::AfterFinish => {
                    let report = completer.run_once(&mut conn).expect("a completer pass");
                    assert_eq!(report, Completions::default(), "nothing to finish");
                }
                _ => complete_once::<D>(&completer, &mut conn),
            }
            match rides.create(&mut conn, KEY, &ada()) {
                Ok(Outcome::Replayed(reply)) if boundary != Boundary::InsideFirstPhase => reply,
                Ok(Outcome::Executed(reply)) if boundary == Boundary::InsideFirstPhase => reply,
                other => panic!("unexpected answer to the client: {other:?}"),
            }
        } else {
            match rides.create(&mut conn, KEY, &ada()) {
                Ok(Outcome::Replayed(reply)) if boundary == Boundary::AfterFinish => reply,
                Ok(Outcome::Executed(reply)) if boundary != Boundary::AfterFinish => reply,
                other => panic!("unexpected answer to the client: {other:?}"),
            }
        };
        let again = rides.create(&mut conn, KEY, &ada()).expect("another retry");
        assert_eq!(again, Outcome::Replayed(reply.clone()), "the same reply every time");
        assert_charged_once::<D>(&mut conn, &reply, requests);
        assert_eq!(rides.provider.requests(), requests_here, "requests after the kill");
        assert_eq!(
            attempts::<D>(&mut conn, KEY),
            attempts_made,
            "the killed attempt's and the resumer's"
        );
    }
}

fn killed_inside_the_first_phase_leaves_the_key_free<D: RideDb>() {
    killed_at::<D>(
        Boundary::InsideFirstPhase,
        "killed_inside_the_first_phase_leaves_the_key_free",
    );
}

fn killed_after_the_first_phase_resumes_once<D: RideDb>() {
    killed_at::<D>(Boundary::AfterFirstPhase, "killed_after_the_first_phase_resumes_once");
}

fn killed_before_the_call_calls_the_provider_once<D: RideDb>() {
    killed_at::<D>(Boundary::BeforeCall, "killed_before_the_call_calls_the_provider_once");
}

fn killed_after_the_provider_applied_charges_once<D: RideDb>() {
    killed_at::<D>(
        Boundary::AfterProviderApplied,
        "killed_after_the_provider_applied_charges_once",
    );
}

fn killed_inside_finish_sends_one_receipt<D: RideDb>() {
    killed_at::<D>(Boundary::InsideFinish, "killed_inside_finish_sends_one_receipt");
}

fn killed_after_finish_replays_the_reply<D: RideDb>() {
    killed_at::<D>(Boundary::AfterFinish, "killed_after_finish_replays_the_reply");
}

// --- Failures of the steps and of the provider ---

fn failure_in_the_first_phase_leaves_the_key_free<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let failed = Phased::new(OPERATION).run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-1", &ada())?;
            Err::<String, _>(RideError::GaveUp)
        })?;
        unreachable!("the first phase failed")
    });
    let failed: Result<Outcome<Reply>, _> = failed;
    assert!(matches!(failed, Err(Error::Operation(RideError::GaveUp))), "{failed:?}");
    assert_eq!(recovery_points::<D>(&mut conn, KEY), None, "nothing committed");
    assert!(D::rides(&mut conn).is_empty(), "the phase's write rolled back");

    let other = NewRide {
        rider: String::from("grace"),
        cents: 25_00,
    };
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let reply = executed(rides.create(&mut conn, KEY, &other));
    assert_eq!(D::rides(&mut conn), [(reply.ride, Some(reply.charge))]);
}

/// A phase's output is what a resume returns in its place, so one that would
/// read back as another value (`Some(())` comes back as `None`) is refused
/// before its phase commits, as a result is.
fn phase_output_that_would_not_read_back_is_refused_and_rolls_back<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let refused: Result<Outcome<Reply>, _> = Phased::new(OPERATION).run(&mut conn, SCOPE, KEY, &ada(), |s| {
        let wrapped: Option<()> = s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-1", &ada())?;
            Ok::<_, RideError>(Some(()))
        })?;
        unreachable!("the phase was refused, not {wrapped:?}")
    });
    assert!(matches!(refused, Err(Error::Codec(_))), "{refused:?}");
    assert_eq!(recovery_points::<D>(&mut conn, KEY), None, "nothing committed");
    assert!(D::rides(&mut conn).is_empty(), "the phase's write rolled back");

    let rides = Rides::new(&db, Phased::new(OPERATION));
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(D::rides(&mut conn), [(reply.ride, Some(reply.charge))]);
}

/// A panic in a phase or in `finish` rolls that step back, leaves the
/// connection out of its transaction and frees the lease: a retry on the
/// same connection resumes at once, not after the lease.
fn panic_in_a_step_rolls_it_back_and_frees_the_lease<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    // The lease is 90 s: a retry that resumes within this wait found it
    // freed. (The key is the test's own: PostgreSQL's advisory locks are
    // shared by every schema of the database, so other tests' keys would
    // hold this one's lock for a moment.)
    let phased = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(5))));
    let attempt = |conn: &mut D::Conn, panic_in: &str| {
        phased.run(conn, SCOPE, "panic-in-a-step", &ada(), |s| {
            let ride: String = s.phase("ride_created", |tx| {
                D::insert_ride(tx, "ride-1", &ada())?;
                Ok::<_, RideError>(String::from("ride-1"))
            })?;
            s.phase("charge_noted", |tx| {
                D::set_ride_charge(tx, &ride, "charge-1")?;
                assert_ne!(panic_in, "phase", "a bug in the second phase");
                Ok::<_, RideError>(())
            })?;
            s.finish(|tx| {
                D::insert_ride(tx, "ride-2", &ada())?;
                assert_ne!(panic_in, "finish", "a bug in finish");
                Ok::<_, RideError>(ride)
            })
        })
    };

    // The second phase panics: the first stays, the second rolled back.
    // Then `finish` panics: the second phase is committed by now, `finish`
    // rolled back.
    for (panic_in, left) in [("phase", None), ("finish", Some(String::from("charge-1")))] {
        let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| attempt(&mut conn, panic_in)));
        assert!(crashed.is_err(), "the {panic_in} panicked");
        assert_eq!(
            D::rides(&mut conn),
            [(String::from("ride-1"), left)],
            "after the {panic_in} panicked"
        );
    }
    let finished = attempt(&mut conn, "nowhere").expect("the retry resumes at once");
    assert_eq!(finished, Outcome::Executed(String::from("ride-1")));
    assert_eq!(
        D::rides(&mut conn),
        [
            (String::from("ride-1"), Some(String::from("charge-1"))),
            (String::from("ride-2"), None)
        ]
    );
}

/// `Finished` is what an operation's own `finish` returns; one kept from
/// another operation would answer with a response this operation never
/// stored. `run` refuses it with a panic, after freeing the lease.
fn result_kept_from_another_operation_is_refused<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let phased = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(5))));
    let mut kept = None;
    let first: Result<Outcome<i64>, Error<RideError>> = phased.run(&mut conn, SCOPE, "kept-first", &1, |s| {
        kept = Some(s.finish(|_| Ok::<_, RideError>(42))?);
        Err(Error::Operation(RideError::GaveUp))
    });
    assert!(first.is_err(), "{first:?}");

    let smuggled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        phased.run(&mut conn, SCOPE, "kept-second", &1, |s| {
            s.phase("ride_created", |tx| {
                D::insert_ride(tx, "ride-2", &ada()).map_err(RideError::from)
            })?;
            Ok(kept.take().expect("kept from the first operation"))
        })
    }));
    assert!(smuggled.is_err(), "the second operation did not answer 42");

    let second = phased.run(&mut conn, SCOPE, "kept-second", &1, |s| {
        s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-2", &ada()).map_err(RideError::from)
        })?;
        s.finish(|_| Ok::<_, RideError>(7))
    });
    assert_eq!(second.expect("resumes at once"), Outcome::Executed(7));
}

fn provider_failing_before_charging_is_called_again_with_the_same_key<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    rides.provider.then(Behaviour::FailBefore);
    let failed = rides.create(&mut conn, KEY, &ada());
    assert!(
        matches!(
            failed,
            Err(Error::Operation(RideError::Provider(ProviderError::Unavailable)))
        ),
        "{failed:?}"
    );
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the key is spent"),
        ["ride_created", "charged (started)"]
    );
    assert!(D::charges(&mut conn).is_empty());

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(rides.provider.requests(), 2);
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(attempts::<D>(&mut conn, KEY), 2);
}

fn provider_timing_out_after_charging_gives_the_retry_the_same_charge<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    rides.provider.then(Behaviour::TimeOutAfter);
    let timed_out = rides.create(&mut conn, KEY, &ada());
    assert!(
        matches!(
            timed_out,
            Err(Error::Operation(RideError::Provider(ProviderError::TimedOut)))
        ),
        "{timed_out:?}"
    );
    let charged = D::charges(&mut conn);
    assert_eq!(
        charged.len(),
        1,
        "the provider charged although the caller saw a timeout"
    );

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(
        reply.charge, charged[0].1,
        "the retry got the charge the timed-out call made"
    );
    assert_charged_once::<D>(&mut conn, &reply, 2);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}

// --- Concurrency and fencing ---

fn concurrent_retries_during_a_blocked_call_charge_once<D: RideDb>() {
    const RETRIES: usize = 32;
    let db = ride_db::<D>();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    let pool = db.pool(RETRIES as u32 + 1);
    let rejecting = rides.with(Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Reject)));
    let waiting =
        rides.with(Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(60)))));
    let barrier = Barrier::new(RETRIES);
    let retry = |rides: &Rides<D>| {
        let mut conn = pool.get().expect("a connection");
        barrier.wait();
        rides.create(&mut conn, KEY, &ada())
    };
    std::thread::scope(|s| {
        let first = s.spawn(|| rides.create(&mut pool.get().expect("a connection"), KEY, &ada()));
        wait::recv(&arrived, "the first attempt reaches the provider");
        let rejected: Vec<_> = (0..RETRIES / 2).map(|_| s.spawn(|| retry(&rejecting))).collect();
        let waited: Vec<_> = (0..RETRIES / 2).map(|_| s.spawn(|| retry(&waiting))).collect();
        for retry in rejected {
            let result = retry.join().expect("a rejected retry");
            assert!(matches!(result, Err(Error::InProgress)), "{result:?}");
        }
        open.send(()).expect("release the provider");
        let reply = executed(first.join().expect("the first attempt"));
        for retry in waited {
            let result = retry.join().expect("a waiting retry");
            assert_eq!(result.expect("a waiting retry"), Outcome::Replayed(reply.clone()));
        }
        assert_eq!(rides.provider.requests(), 1, "the provider was asked once");
        assert_charged_once::<D>(&mut pool.get().expect("a connection"), &reply, 1);
    });
}

fn attempt_whose_lease_ran_out_mid_call_is_fenced_out<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).lease(Duration::minutes(1)));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    std::thread::scope(|s| {
        let late = s.spawn(|| rides.create(&mut db.conn(), KEY, &ada()));
        wait::recv(&arrived, "the first attempt reaches the provider");
        clock.advance(Duration::minutes(2));

        let mut conn = db.conn();
        let reply = executed(rides.create(&mut conn, KEY, &ada()));
        assert_eq!(attempts::<D>(&mut conn, KEY), 2, "the retry took the operation over");
        open.send(()).expect("release the late attempt's call");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Err(Error::InProgress)), "{late:?}");

        assert_eq!(
            recovery_points::<D>(&mut conn, KEY).expect("the operation"),
            ["completed"]
        );
        assert_eq!(
            rides.create(&mut conn, KEY, &ada()).expect("a replay"),
            Outcome::Replayed(reply.clone()),
            "the late attempt changed nothing"
        );
        assert_charged_once::<D>(&mut conn, &reply, 2);
    });
}

fn retry_taking_over_after_another_attempt_progressed_resumes_from_its_progress<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let plain = Phased::new(OPERATION).config(config(&clock));
    // A clock that holds its first reading after it is armed: the reading
    // an attempt takes right after it read the operation, before it takes
    // it over.
    let armed = Arc::new(AtomicBool::new(false));
    let (read_tx, read) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let pausing = {
        let (clock, armed, go_rx) = (clock.clone(), Arc::clone(&armed), Mutex::new(go_rx));
        Phased::new(OPERATION).config(Config::default().clock(move || {
            if armed.swap(false, Ordering::SeqCst) {
                read_tx.send(()).expect("the test waits for the read");
                wait::recv(&go_rx.lock().expect("the gate"), "the test lets it go");
            }
            clock.now()
        }))
    };
    // Books the ride and queues its receipt in two phases; an attempt with
    // `give_up_after` returns an error after that many.
    let attempt = |phased: &Phased, give_up_after: Option<usize>| {
        phased.run(&mut db.conn(), SCOPE, KEY, &ada(), |s| {
            let ride = s.phase("ride_created", |tx| {
                let id = crate::common::unique_name("ride");
                D::insert_ride(tx, &id, &ada())?;
                Ok::<_, RideError>(id)
            })?;
            if give_up_after == Some(1) {
                return Err(Error::Operation(RideError::GaveUp));
            }
            s.phase("receipt_queued", |tx| {
                outbox::enqueue(tx, RECEIPTS, &ride)?;
                Ok::<_, RideError>(())
            })?;
            if give_up_after == Some(2) {
                return Err(Error::Operation(RideError::GaveUp));
            }
            s.finish(|_| Ok::<_, RideError>(ride))
        })
    };
    assert!(attempt(&plain, Some(1)).is_err());
    armed.store(true, Ordering::SeqCst);
    std::thread::scope(|s| {
        let late = s.spawn(|| attempt(&pausing, None));
        wait::recv(&read, "the late attempt read the operation");
        assert!(
            attempt(&plain, Some(2)).is_err(),
            "another attempt queued the receipt and gave up"
        );
        go.send(()).expect("let the late attempt go on");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Ok(Outcome::Executed(_))), "{late:?}");
    });
    let mut conn = db.conn();
    assert_eq!(D::rides(&mut conn).len(), 1);
    assert_eq!(D::receipts(&mut conn).len(), 1, "the committed phase ran once");
}

// --- The completer ---

fn completer_finishes_an_abandoned_operation<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock));
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err(), "the client went away");

    let completer = rides.completer().clock(clock.source());
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
    clock.advance(Duration::minutes(5));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 1, 0, 0, 0));
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the operation"),
        ["completed"]
    );

    let replay = rides.create(&mut conn, KEY, &ada()).expect("the client's retry");
    let Outcome::Replayed(reply) = replay else {
        panic!("the completer finished it: {replay:?}")
    };
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
}

fn completer_leaves_operations_without_a_stored_request_to_their_clients<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).store_requests(false));
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err(), "the client went away");

    clock.advance(Duration::minutes(10));
    let completer = rides.completer().clock(clock.source());
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
    assert!(completer.parked(&mut conn, 10).expect("parked ones").is_empty());

    let resumed = rides.create(&mut conn, KEY, &ada()).expect("the client's retry");
    assert!(!resumed.is_replayed(), "the client's retry finishes it");
    assert_charged_once::<D>(&mut conn, &resumed.into_inner(), 1);
}

fn completer_racing_client_retries_finishes_each_operation_once<D: RideDb>() {
    const OPERATIONS: usize = 6;
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let phased = create_ride(&clock).config(config(&clock).in_flight(InFlight::Wait(Duration::seconds(30))));
    let rides = Rides::new(&db, phased);
    let keys: Vec<String> = (0..OPERATIONS).map(|i| format!("ride-{i}")).collect();
    for key in &keys {
        rides.provider.then(Behaviour::FailBefore);
        assert!(rides.create(&mut db.conn(), key, &ada()).is_err(), "abandoned");
    }
    clock.advance(Duration::minutes(5));

    let completer = rides.completer().clock(clock.source());
    let pool = db.pool(OPERATIONS as u32 + 1);
    let barrier = Barrier::new(OPERATIONS + 1);
    let (report, replies) = std::thread::scope(|s| {
        let completing = s.spawn(|| {
            let mut conn = pool.get().expect("a connection");
            barrier.wait();
            completer.run_once(&mut conn)
        });
        let clients: Vec<_> = keys
            .iter()
            .map(|key| {
                let (pool, barrier, rides) = (&pool, &barrier, &rides);
                s.spawn(move || {
                    let mut conn = pool.get().expect("a connection");
                    barrier.wait();
                    rides.create(&mut conn, key, &ada())
                })
            })
            .collect();
        let replies: Vec<Reply> = clients
            .into_iter()
            .map(|client| client.join().expect("a client").expect("a reply").into_inner())
            .collect();
        (completing.join().expect("the completer").expect("a pass"), replies)
    });
    let (picked, completed, failed, skipped, parked) = counts(&report);
    assert!(picked <= OPERATIONS, "{report:?}");
    assert_eq!((completed + skipped, failed, parked), (picked, 0, 0), "{report:?}");

    let mut conn = db.conn();
    for (key, reply) in keys.iter().zip(&replies) {
        let again = rides.create(&mut conn, key, &ada()).expect("a replay");
        assert_eq!(again, Outcome::Replayed(reply.clone()), "the same reply for {key}");
    }
    let mut rides_made: Vec<_> = D::rides(&mut conn);
    let mut replied: Vec<_> = replies
        .iter()
        .map(|reply| (reply.ride.clone(), Some(reply.charge.clone())))
        .collect();
    rides_made.sort();
    replied.sort();
    assert_eq!(rides_made, replied, "one ride per operation, as replied");
    let charges = D::charges(&mut conn);
    assert_eq!(charges.len(), OPERATIONS);
    assert!(
        charges.iter().all(|charge| charge.3 == 1),
        "each charged at one request: {charges:?}"
    );
    assert_eq!(D::receipts(&mut conn).len(), OPERATIONS);
    assert_eq!(
        rides.provider.requests(),
        2 * OPERATIONS,
        "a failed and a charging request each"
    );
}

fn completer_skips_operations_in_their_grace_period_or_under_lease<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).lease(Duration::minutes(10)));
    let completer = rides.completer().clock(clock.source());
    let mut conn = db.conn();
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, "abandoned", &ada()).is_err());
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    std::thread::scope(|s| {
        let held = s.spawn(|| rides.create(&mut db.conn(), "held", &ada()));
        wait::recv(&arrived, "the held attempt reaches the provider");

        clock.advance(Duration::minutes(4));
        assert_eq!(
            completer.run_once(&mut conn).expect("a pass"),
            Completions::default(),
            "both in their grace period"
        );
        clock.advance(Duration::minutes(2));
        let report = completer.run_once(&mut conn).expect("a pass");
        assert_eq!(counts(&report), (1, 1, 0, 0, 0), "only the abandoned one");
        assert_eq!(recovery_points::<D>(&mut conn, "abandoned").expect("it"), ["completed"]);
        assert_eq!(
            recovery_points::<D>(&mut conn, "held").expect("it"),
            ["ride_created", "charged (started)"],
            "the held one is left to its attempt"
        );
        open.send(()).expect("release the held attempt");
        executed(held.join().expect("the held attempt"));
    });
    assert_eq!(rides.provider.requests(), 3);
    assert_eq!(D::charges(&mut conn).len(), 2);
}

fn completer_parks_after_max_attempts_and_requeue_brings_it_back<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock));
    let completer = rides.completer().clock(clock.source()).max_attempts(2);
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err(), "attempt 1");

    clock.advance(Duration::minutes(5));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 0, 1, 0, 0), "attempt 2 failed");
    assert_eq!(
        completer.run_once(&mut conn).expect("a pass"),
        Completions::default(),
        "in grace"
    );
    clock.advance(Duration::minutes(5));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (0, 0, 0, 0, 1), "out of attempts");

    let parked = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(parked.len(), 1);
    let (scope, key, operation) = (&parked[0].scope, &parked[0].key, &parked[0].operation);
    assert_eq!(
        (scope.as_str(), key.as_str(), operation.as_str()),
        (SCOPE, KEY, OPERATION)
    );
    assert_eq!(parked[0].attempts, 2);
    assert_eq!(parked[0].reason.as_deref(), Some("gave up after 2 attempts"));
    assert_eq!(parked[0].parked_at, clock.now());
    let parked_retry = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked_retry, Err(Error::Parked)), "{parked_retry:?}");
    assert_eq!(rides.provider.requests(), 2, "a parked operation calls nobody");

    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    assert!(
        !completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"),
        "no longer parked"
    );
    assert!(
        completer
            .parked(&mut conn, 10)
            .expect("the parked operations")
            .is_empty()
    );
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(attempts::<D>(&mut conn, KEY), 1, "attempts counted afresh");
}

fn completer_retries_a_failed_operation_once_its_grace_ran_out<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock));
    let completer = rides.completer().clock(clock.source()).grace(Duration::minutes(1));
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err(), "the client went away");

    clock.advance(Duration::minutes(1));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 0, 1, 0, 0), "its attempt failed");
    assert_eq!(
        completer.run_once(&mut conn).expect("a pass"),
        Completions::default(),
        "in grace"
    );
    clock.advance(Duration::minutes(1));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 1, 0, 0, 0), "taken up again after the grace");
    assert_eq!(attempts::<D>(&mut conn, KEY), 3);
}

// --- Parking, renamed steps, mismatches ---

fn provider_horizon_parks_the_operation_for_a_person<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).provider_horizon(Duration::hours(1)));
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert!(
        rides.create(&mut conn, KEY, &ada()).is_err(),
        "the call was made and failed"
    );
    clock.advance(Duration::minutes(59));
    assert!(
        rides.create(&mut conn, KEY, &ada()).is_err(),
        "made again within the horizon"
    );
    assert_eq!(rides.provider.requests(), 2);

    clock.advance(Duration::minutes(1));
    let parked = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked, Err(Error::Parked)), "{parked:?}");
    assert_eq!(rides.provider.requests(), 2, "never made past the horizon");
    let parked_again = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked_again, Err(Error::Parked)), "{parked_again:?}");
    assert_eq!(rides.provider.requests(), 2);

    let completer = rides.completer().clock(clock.source());
    let listed = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, KEY);
    assert_eq!(listed[0].attempts, 3);
    assert_eq!(
        listed[0].reason.as_deref(),
        Some("call charged is past its provider horizon")
    );
    clock.advance(Duration::hours(1));
    assert_eq!(
        completer.run_once(&mut conn).expect("a pass"),
        Completions::default(),
        "completers leave parked operations alone"
    );
    assert!(D::charges(&mut conn).is_empty());
}

fn requeued_operation_past_its_horizon_makes_the_call_again<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).provider_horizon(Duration::hours(1)));
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err());
    clock.advance(Duration::hours(2));
    assert!(matches!(rides.create(&mut conn, KEY, &ada()), Err(Error::Parked)));

    // Someone checked with the provider that nothing was charged.
    let completer = rides.completer().clock(clock.source());
    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(rides.provider.requests(), 2, "the call was made again");
    assert_charged_once::<D>(&mut conn, &reply, 1);
}

fn interrupted_at_most_once_call_parks_until_requeued<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let provider = Provider::<D>::new(db.url());
    let phased = create_ride(&clock);
    // A provider that does not deduplicate: its call is made at most once.
    let pay = |conn: &mut D::Conn| {
        phased.run(conn, SCOPE, KEY, &ada(), |s| {
            let charge = s.call_at_most_once("charged", |provider_key| {
                provider.charge(provider_key, ada().cents).map_err(RideError::Provider)
            })?;
            s.finish(|_| Ok::<_, RideError>(charge))
        })
    };
    provider.then(Behaviour::FailBefore);
    assert!(pay(&mut conn).is_err(), "the call failed: it may have been applied");
    let parked = pay(&mut conn);
    assert!(matches!(parked, Err(Error::Parked)), "{parked:?}");
    assert_eq!(provider.requests(), 1, "never made twice by itself");

    let completer = Completer::<D::Conn>::new().clock(clock.source());
    let listed = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].reason.as_deref(),
        Some("call charged was interrupted and is never repeated")
    );
    // Someone checked with the provider that nothing was charged.
    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    let charge = pay(&mut conn).expect("the call made again").into_inner();
    assert_eq!(provider.requests(), 2);
    assert_eq!(D::charges(&mut conn)[0].1, charge);
}

/// A loop that charges two cards under one call name: each call gets its own
/// provider key (a provider deduplicating on one key would otherwise return
/// the first card's charge for the second), and a retry repeats the
/// unfinished second call under the key it had.
fn calls_sharing_a_name_get_a_provider_key_each<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let split = Phased::new("split_payment");
    let provider_keys = Mutex::new(Vec::<(String, String)>::new());
    let pay = |conn: &mut D::Conn, decline_second: bool| {
        split.run(conn, SCOPE, KEY, &ada(), |s| {
            s.phase("ride_created", |_| Ok::<_, RideError>(1_i64))?;
            let mut charges = Vec::new();
            for card in ["card-a", "card-b"] {
                let charge: String = s.call("charged", |provider_key| {
                    provider_keys
                        .lock()
                        .expect("not poisoned")
                        .push((card.to_owned(), provider_key.to_owned()));
                    if decline_second && card == "card-b" {
                        Err(RideError::Provider(ProviderError::Unavailable))
                    } else {
                        Ok(format!("{card}:{provider_key}"))
                    }
                })?;
                charges.push(charge);
            }
            s.finish(|_| Ok(charges))
        })
    };

    let failed = pay(&mut conn, true);
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    let retried = pay(&mut conn, false).expect("the retry finishes");

    let provider_keys = provider_keys.into_inner().expect("not poisoned");
    let cards: Vec<&str> = provider_keys.iter().map(|(card, _)| card.as_str()).collect();
    assert_eq!(
        cards,
        ["card-a", "card-b", "card-b"],
        "the retry calls only the unfinished card"
    );
    assert_ne!(provider_keys[0].1, provider_keys[1].1, "a provider key per call");
    assert_eq!(
        provider_keys[1].1, provider_keys[2].1,
        "the repeated call keeps its key"
    );
    assert_eq!(
        retried.into_inner(),
        [
            format!("card-a:{}", provider_keys[0].1),
            format!("card-b:{}", provider_keys[1].1)
        ]
    );
}

/// `result` is the refusal of a step renamed at `position` from `recorded`
/// to `found`.
fn assert_renamed(result: Result<Outcome<Reply>, Error<RideError>>, (position, recorded, found): (usize, &str, &str)) {
    let Err(Error::PhaseRenamed {
        position: at,
        recorded: was,
        found: is,
    }) = result
    else {
        panic!("a renamed step is refused: {result:?}")
    };
    assert_eq!((at, was.as_str(), is.as_str()), (position, recorded, found));
}

fn renamed_step_is_refused_and_runs_nothing<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err());
    let ran = AtomicUsize::new(0);

    // A deploy renamed the first phase.
    let renamed: Result<Outcome<Reply>, _> = rides.phased.run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_booked", |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, RideError>(String::new())
        })?;
        unreachable!("the renamed phase is refused")
    });
    assert_renamed(renamed, (0, "ride_created", "ride_booked"));

    // And the call.
    let renamed: Result<Outcome<Reply>, _> = rides.phased.run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_created", |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, RideError>(String::new())
        })?;
        s.call("card_charged", |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, RideError>(String::new())
        })?;
        unreachable!("the renamed call is refused")
    });
    assert_renamed(renamed, (1, "charged", "card_charged"));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no step ran");
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the operation"),
        ["ride_created", "charged (started)"],
        "nothing written"
    );

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<D>(&mut conn, &reply, 1);
}

fn another_request_under_the_same_key_is_a_mismatch<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let dearer = NewRide { cents: 25_00, ..ada() };
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err(), "running, not finished");
    let running = rides.create(&mut conn, KEY, &dearer);
    assert!(matches!(running, Err(Error::Mismatch)), "{running:?}");

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    let finished = rides.create(&mut conn, KEY, &dearer);
    assert!(matches!(finished, Err(Error::Mismatch)), "{finished:?}");
    assert_eq!(rides.provider.requests(), 2, "a mismatch calls nobody");
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}

/// The operation that gives a ride's charge back: another name under the
/// ride's key, with the ride's request.
const REFUND: &str = "refund-ride";

fn refund<D: RideDb>(conn: &mut D::Conn, phased: &Phased, ran: &AtomicUsize) -> Result<Outcome<u32>, Error<RideError>> {
    phased.run(conn, SCOPE, KEY, &ada(), |s| {
        s.finish(|_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, RideError>(7)
        })
    })
}

fn another_operation_under_a_spent_key_is_a_mismatch<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let ran = AtomicUsize::new(0);
    rides.provider.then(Behaviour::FailBefore);
    assert!(matches!(
        rides.create(&mut conn, KEY, &ada()),
        Err(Error::Operation(RideError::Provider(ProviderError::Unavailable)))
    ));
    // Running with its lease freed: the refund may not take it over.
    let running = refund::<D>(&mut conn, &Phased::new(REFUND), &ran);
    assert!(matches!(running, Err(Error::Mismatch)), "{running:?}");
    // The same phases under another name: not a resume of the ride either.
    let renamed = rides.with(Phased::new(REFUND)).create(&mut conn, KEY, &ada());
    assert!(matches!(renamed, Err(Error::Mismatch)), "{renamed:?}");

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    // Finished: neither the ride's reply nor a `Codec` failure for the
    // whole retention because a `u32` cannot read it.
    let finished = refund::<D>(&mut conn, &Phased::new(REFUND), &ran);
    assert!(matches!(finished, Err(Error::Mismatch)), "{finished:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the refund never ran");
    assert_eq!(rides.provider.requests(), 2, "a mismatch calls nobody");
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}

fn another_operation_under_a_key_in_progress_is_a_mismatch_at_once<D: RideDb>() {
    let db = ride_db::<D>();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    let pool = db.pool(2);
    let ran = AtomicUsize::new(0);
    // Waiting for a lease that the ride holds until the test opens the gate:
    // anything but an answer at once would be `InProgress` after the wait.
    let patient = Phased::new(REFUND).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(10))));
    std::thread::scope(|s| {
        let first = s.spawn(|| rides.create(&mut pool.get().expect("a connection"), KEY, &ada()));
        wait::recv(&arrived, "the ride reaches the provider");
        let refunded = refund::<D>(&mut pool.get().expect("a connection"), &patient, &ran);
        assert!(matches!(refunded, Err(Error::Mismatch)), "{refunded:?}");
        open.send(()).expect("release the provider");
        let reply = executed(first.join().expect("the ride"));
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the refund never ran");
        assert_charged_once::<D>(&mut pool.get().expect("a connection"), &reply, 1);
    });
}

fn key_executing_again_after_retention_charges_under_a_new_provider_key<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock));
    let first = executed(rides.create(&mut conn, KEY, &ada()));
    clock.advance(Duration::hours(23));
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(first.clone())
    );

    clock.advance(Duration::hours(1));
    let second = executed(rides.create(&mut conn, KEY, &ada()));
    assert_ne!(second.ride, first.ride, "a new ride");
    assert_ne!(second.charge, first.charge, "charged anew, not handed the old charge");
    let charges = D::charges(&mut conn);
    assert_eq!(charges.len(), 2);
    assert_ne!(charges[0].0, charges[1].0, "under another provider key");
    assert_eq!(D::rides(&mut conn).len(), 2);
}

fn purge_deletes_finished_operations_only<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).provider_horizon(Duration::hours(1)));
    executed(rides.create(&mut conn, "finished", &ada()));
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, "running", &ada()).is_err());
    assert!(rides.create(&mut conn, "parked", &ada()).is_err());
    clock.advance(Duration::hours(2));
    assert!(matches!(rides.create(&mut conn, "parked", &ada()), Err(Error::Parked)));
    clock.advance(Duration::days(30));

    assert_eq!(config(&clock).purge_expired(&mut conn, 1).expect("purge"), 1);
    assert_eq!(recovery_points::<D>(&mut conn, "finished"), None);
    assert_eq!(
        recovery_points::<D>(&mut conn, "running").expect("kept"),
        ["ride_created", "charged (started)"]
    );
    assert_eq!(recovery_points::<D>(&mut conn, "parked").expect("kept"), ["parked"]);
}

/// SQLite: taking an operation over takes the write lock, which another
/// writer may hold; under `InFlight::Reject` that is a 409, as for every
/// other write of an attempt.
#[test]
fn sqlite_takeover_kept_out_by_another_writer_is_in_progress() {
    let db = ride_db::<crate::common::sqlite::Db>();
    let mut conn = db.conn();
    let rejecting = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Reject));
    let rides = Rides::new(&db, rejecting);
    rides.provider.then(Behaviour::FailBefore);
    assert!(rides.create(&mut conn, KEY, &ada()).is_err());

    let mut writer = db.conn();
    writer.batch_execute("BEGIN IMMEDIATE").expect("hold the write lock");
    let kept_out = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(kept_out, Err(Error::InProgress)), "{kept_out:?}");
    writer.batch_execute("ROLLBACK").expect("let the write lock go");
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<crate::common::sqlite::Db>(&mut conn, &reply, 1);
}

/// PostgreSQL: an attempt whose lease ran out while its last transaction was
/// open finds the operation taken over when it commits, and its writes roll
/// back. On SQLite an open transaction holds the write lock, so no attempt
/// can take the operation over meanwhile.
#[cfg(feature = "postgres")]
#[test]
fn postgres_finish_fenced_after_its_lease_ran_out_rolls_back_its_writes() {
    use crate::common::ServerDb;
    use crate::common::pg::Db;

    let db = ride_db::<Db>();
    let clock = ManualClock::new();
    let phased = Phased::new(OPERATION)
        .lease(Duration::minutes(1))
        .config(config(&clock).in_flight(InFlight::Wait(Duration::seconds(30))));
    let rides = Rides::new(&db, phased);
    let (inside_tx, inside) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let hold_inside_finish = |reached: Boundary| {
        if reached == Boundary::InsideFinish {
            inside_tx.send(()).expect("the test waits");
            wait::recv(&go_rx.lock().expect("the gate"), "the test lets it go");
        }
    };
    let mut admin = db.conn();
    let mut retry_conn = db.conn();
    let retry_session = Db::session_id(&mut retry_conn);
    let reply = std::thread::scope(|s| {
        let late = s.spawn(|| rides.create_stopping(&mut db.conn(), KEY, &ada(), &hold_inside_finish));
        wait::recv(&inside, "the late attempt wrote the charge and the receipt");
        clock.advance(Duration::minutes(2));
        let retry = s.spawn(|| rides.create(&mut retry_conn, KEY, &ada()));
        // The retry took the operation over and waits for the key, which
        // the late attempt's open transaction holds.
        Db::wait_until_waiting_for_a_key(&mut admin, retry_session);
        go.send(()).expect("let the late attempt commit");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Err(Error::InProgress)), "{late:?}");
        executed(retry.join().expect("the retry"))
    });
    assert_charged_once::<Db>(&mut admin, &reply, 1);
    assert_eq!(attempts::<Db>(&mut admin, KEY), 2);
}
