//! Operations in phases: a ride is created, its card charged at a payment
//! provider and the charge recorded with a receipt, resumed from every point
//! a process can die at, raced by retries and completers, parked and
//! requeued.
//!
//! The provider is a fake that deduplicates charges by provider key in a
//! table of its own, so it remembers them across a killed process, and
//! counts every request it gets. Each charge it applied is a row, so "one
//! charge" is a row count.

use std::convert::identity;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use chrono::Duration;
use diesel::connection::SimpleConnection;
use idempotency::outbox;
use idempotency::phased::{Completer, Completions, Phased};
use idempotency::testing::ManualClock;
use idempotency::{Config, Error, InFlight, Outcome};

use crate::common::TestDb;
use crate::common::child::{Child, parent_database, report_and_wait_for_the_kill};
use crate::common::wait::{self, Barrier, PATIENCE};

pub(crate) const SCOPE: &str = "riders";
const KEY: &str = "ride-7c1e";
const OPERATION: &str = "create-ride";
const RECEIPTS: &str = "ride-receipt";

mod call_results;
mod completer;
mod concurrency;
mod failures;
mod killed;
mod mismatches;
mod parking;
mod provider;
mod retention;
pub(crate) mod rides;

use provider::*;
use rides::*;

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

/// A database of the test's own with the ride tables, a connection to it,
/// and the ride operation under `phased`. The test keeps the database for
/// as long as it uses the connection.
fn rides_on<D: RideDb>(phased: Phased) -> (D, D::Conn, Rides<D>) {
    let db = ride_db::<D>();
    let conn = db.conn();
    let rides = Rides::new(&db, phased);
    (db, conn, rides)
}

/// [`rides_on`] under a manual clock: the operation as [`create_ride`]
/// makes it with `policy` applied, and the clock that drives it.
fn clocked_rides<D: RideDb>(policy: impl FnOnce(Phased) -> Phased) -> (D, D::Conn, ManualClock, Rides<D>) {
    let clock = ManualClock::new();
    let (db, conn, rides) = rides_on::<D>(policy(create_ride(&clock)));
    (db, conn, clock, rides)
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
pub(crate) fn recovery_points<D: RideDb>(conn: &mut D::Conn, key: &str) -> Option<Vec<String>> {
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

/// Asserts that `result` is the provider's refusal before it charged
/// ([`Behaviour::FailBefore`]), which fails the attempt and frees the key.
fn assert_provider_unavailable(result: Result<Outcome<Reply>, Error<RideError>>) {
    assert!(
        matches!(
            result,
            Err(Error::Operation(RideError::Provider(ProviderError::Unavailable)))
        ),
        "{result:?}"
    );
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
