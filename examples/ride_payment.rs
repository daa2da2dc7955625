//! A ride booked in phases: create the ride, charge the card at a payment
//! provider, record the charge and queue the receipt, answer.
//!
//! No database transaction can hold the call to the provider, so each step
//! commits a recovery point and a retry resumes from the last one. The
//! provider here is a fake that deduplicates charges by the key it is given,
//! in a table of its own. It is down on the first request and times out
//! after charging on the second; the client retries with the same
//! idempotency key until it gets its answer, and the card is charged once.
//! Then the server process is killed right after the provider charged a
//! card, and a completer finishes the ride its client gave up on.
//!
//! Run with `cargo run --example ride_payment`.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration as StdDuration, Instant};

use anyhow::Context;
use chrono::Duration;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use idempotency::outbox::{self, Relay};
use idempotency::phased::{Completer, Phased};
use idempotency::{Config, Error, InFlight, Outcome};
use serde::{Deserialize, Serialize};

diesel::table! {
    rides (id) {
        id -> BigInt,
        rider -> Text,
        cents -> BigInt,
        charge -> Nullable<Text>,
    }
}

diesel::table! {
    /// The provider's own records, one per charge it made.
    provider_charges (provider_key) {
        provider_key -> Text,
        charge_id -> Text,
        cents -> BigInt,
    }
}

/// Set in the child process: the database it works on.
const CHILD_DB: &str = "RIDE_PAYMENT_CHILD_DB";
/// What the child prints once the provider charged the card.
const CHARGED: &str = "the provider charged the card";

const OPERATION: &str = "book-ride";
const RECEIPTS: &str = "ride-receipts";

#[derive(Serialize, Deserialize, Debug, Clone)]
struct BookRide {
    rider: String,
    card: String,
    cents: i64,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Booked {
    ride: i64,
    charge: String,
}

#[derive(Serialize, Deserialize, Debug)]
struct Receipt {
    ride: i64,
    rider: String,
    charge: String,
    cents: i64,
}

#[derive(Debug)]
enum RideError {
    Database(diesel::result::Error),
    Outbox(outbox::Error),
    Provider(ProviderError),
}

impl std::fmt::Display for RideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RideError::Database(_) => f.write_str("the ride could not be saved"),
            RideError::Outbox(_) => f.write_str("the receipt could not be queued"),
            RideError::Provider(error) => write!(f, "the payment provider failed: {error}"),
        }
    }
}

impl std::error::Error for RideError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RideError::Database(error) => Some(error),
            RideError::Outbox(error) => Some(error),
            RideError::Provider(_) => None,
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
    Unavailable,
    TimedOut,
}

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProviderError::Unavailable => f.write_str("service unavailable"),
            ProviderError::TimedOut => f.write_str("no answer in time"),
        }
    }
}

/// A payment provider that deduplicates by provider key, as Stripe does:
/// a second request with a key gets the charge the first one made. Its
/// records live in a table of its own, reached through a connection of its
/// own, so they outlive a killed server.
struct Provider {
    url: String,
    /// Trouble on purpose, one entry per request, then none.
    trouble: Mutex<VecDeque<ProviderError>>,
}

impl Provider {
    fn new(url: &str, trouble: impl IntoIterator<Item = ProviderError>) -> Self {
        Provider {
            url: url.to_owned(),
            trouble: Mutex::new(trouble.into_iter().collect()),
        }
    }

    fn charge(&self, card: &str, cents: i64, provider_key: &str) -> Result<String, ProviderError> {
        let trouble = self.trouble.lock().map_err(|_| ProviderError::Unavailable)?.pop_front();
        if trouble == Some(ProviderError::Unavailable) {
            println!("     provider: down, nothing charged");
            return Err(ProviderError::Unavailable);
        }
        let (charge, new) = self
            .record(cents, provider_key)
            .map_err(|_| ProviderError::Unavailable)?;
        if new {
            println!("     provider: {card} charged {}: {charge}", dollars(cents));
        } else {
            println!("     provider: key seen before, no new charge: {charge}");
        }
        match trouble {
            Some(ProviderError::TimedOut) => {
                println!("     provider: the answer is lost on the way back");
                Err(ProviderError::TimedOut)
            }
            _ => Ok(charge),
        }
    }

    /// The charge made with `provider_key`, made now if there is none, and
    /// whether it is new.
    fn record(&self, cents: i64, provider_key: &str) -> anyhow::Result<(String, bool)> {
        let mut conn = connect(&self.url)?;
        let recorded = conn.immediate_transaction(|tx| {
            let made = provider_charges::table
                .find(provider_key)
                .select(provider_charges::charge_id)
                .first(tx)
                .optional()?;
            if let Some(charge) = made {
                return Ok((charge, false));
            }
            let count: i64 = provider_charges::table.count().get_result(tx)?;
            let charge = format!("ch_{:04}", count + 1);
            diesel::insert_into(provider_charges::table)
                .values((
                    provider_charges::provider_key.eq(provider_key),
                    provider_charges::charge_id.eq(&charge),
                    provider_charges::cents.eq(cents),
                ))
                .execute(tx)?;
            Ok::<_, diesel::result::Error>((charge, true))
        })?;
        Ok(recorded)
    }
}

fn dollars(cents: i64) -> String {
    format!("${}.{:02}", cents / 100, cents % 100)
}

/// The handler's work: the same function serves the client's request, its
/// retries and the completer. `charged` runs once the provider has charged
/// the card, before the charge is recorded.
fn book_ride(
    conn: &mut SqliteConnection,
    phased: &Phased,
    provider: &Provider,
    (scope, key): (&str, &str),
    request: &BookRide,
    charged: &dyn Fn(),
) -> Result<Outcome<Booked>, Error<RideError>> {
    phased.run(conn, scope, key, request, |s| {
        // Commits with the claim of the key; a resume gets the stored id.
        let ride: i64 = s.phase("ride_created", |tx| {
            let ride = diesel::insert_into(rides::table)
                .values((rides::rider.eq(&request.rider), rides::cents.eq(request.cents)))
                .returning(rides::id)
                .get_result(tx)?;
            println!("     ride {ride} created");
            Ok::<_, RideError>(ride)
        })?;
        // No transaction is open here; the provider key is the same on
        // every attempt, and never the client's key.
        let charge = s.call("card_charged", |provider_key| {
            let charge = provider.charge(&request.card, request.cents, provider_key);
            if charge.is_ok() {
                charged();
            }
            charge.map_err(RideError::Provider)
        })?;
        s.finish(|tx| {
            diesel::update(rides::table.find(ride))
                .set(rides::charge.eq(&charge))
                .execute(tx)?;
            let receipt = Receipt {
                ride,
                rider: request.rider.clone(),
                charge: charge.clone(),
                cents: request.cents,
            };
            outbox::enqueue(tx, RECEIPTS, &receipt)?;
            println!("     charge recorded, receipt queued");
            Ok::<_, RideError>(Booked { ride, charge })
        })
    })
}

/// The operation's policy: requests are stored so that a completer can
/// finish rides whose clients went away. The lease is short here so that
/// the example does not wait long for the killed server's lease to run out;
/// in production it must outlast the provider's timeout.
fn phased() -> Phased {
    Phased::new(OPERATION)
        .store_requests(true)
        .lease(Duration::seconds(1))
        .config(Config::default().in_flight(InFlight::Wait(Duration::seconds(5))))
}

fn connect(url: &str) -> anyhow::Result<SqliteConnection> {
    let mut conn = SqliteConnection::establish(url)?;
    conn.batch_execute("PRAGMA busy_timeout = 5000")?;
    Ok(conn)
}

fn ada() -> BookRide {
    BookRide {
        rider: String::from("ada"),
        card: String::from("card ending 4242"),
        cents: 23_50,
    }
}

fn grace() -> BookRide {
    BookRide {
        rider: String::from("grace"),
        card: String::from("card ending 1881"),
        cents: 17_25,
    }
}

/// How a client sees one attempt.
fn show(result: &Result<Outcome<Booked>, Error<RideError>>) {
    match result {
        Ok(Outcome::Executed(booked)) => println!("   → 201 ride {} booked, charge {}", booked.ride, booked.charge),
        Ok(Outcome::Replayed(booked)) => println!(
            "   → 201 ride {} booked, charge {} (replayed, nothing ran)",
            booked.ride, booked.charge
        ),
        Err(Error::Operation(error)) => {
            println!("   → 500 {error}; the ride stays, a retry with the key resumes it")
        }
        Err(error) => println!("   → {} {error}", error.status_code()),
    }
}

fn main() -> anyhow::Result<()> {
    if let Ok(url) = std::env::var(CHILD_DB) {
        return server_killed_after_the_charge(&url);
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("rides.db");
    let url = path.to_str().context("temporary path is not utf-8")?;
    let mut conn = connect(url)?;
    // WAL: the provider's connection and the server's read while the other writes.
    conn.batch_execute("PRAGMA journal_mode = WAL")?;
    idempotency::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!("migrate: {e}"))?;
    conn.batch_execute(
        "CREATE TABLE rides (id INTEGER PRIMARY KEY AUTOINCREMENT, rider TEXT NOT NULL, cents BIGINT NOT NULL,
             charge TEXT);
         CREATE TABLE provider_charges (provider_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL, cents BIGINT NOT NULL);",
    )?;
    println!("database: {}", path.display());

    println!("\n1. ada books a ride; the provider is down, then times out after charging");
    let provider = Provider::new(url, [ProviderError::Unavailable, ProviderError::TimedOut]);
    let mut replies = Vec::new();
    for attempt in 1..=4 {
        println!("   attempt {attempt} (key ride-ada-1)");
        let result = book_ride(&mut conn, &phased(), &provider, ("ada", "ride-ada-1"), &ada(), &|| {});
        show(&result);
        if let Ok(outcome) = result {
            replies.push(outcome.into_inner());
        }
    }
    let charges: i64 = provider_charges::table.count().get_result(&mut conn)?;
    let booked: i64 = rides::table.count().get_result(&mut conn)?;
    println!("   the provider made {charges} charge; {booked} ride exists");
    anyhow::ensure!(charges == 1 && booked == 1, "one ride, charged once");
    anyhow::ensure!(
        replies.windows(2).all(|pair| pair[0] == pair[1]),
        "the same answer every time"
    );

    println!("\n2. grace books a ride; the server is killed right after the provider charged her card");
    let mut server = KillOnDrop(
        Command::new(std::env::current_exe()?)
            .env(CHILD_DB, url)
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut lines = BufReader::new(server.0.stdout.take().context("the server's output")?).lines();
    for line in lines.by_ref() {
        let line = line?;
        println!("   server: {}", line.trim());
        if line.trim() == CHARGED {
            break;
        }
    }
    server.0.kill()?;
    println!("   server killed: {}", server.0.wait()?);
    drop(lines);
    let ride: (i64, Option<String>) = rides::table
        .filter(rides::rider.eq("grace"))
        .select((rides::id, rides::charge))
        .first(&mut conn)?;
    anyhow::ensure!(ride.1.is_none(), "the server died before the charge was recorded");
    println!(
        "   left behind: ride {} without its charge recorded, a charge at the provider, no receipt",
        ride.0
    );

    println!("\n   her client went away; a completer finishes the ride");
    let provider = Provider::new(url, []);
    let completer = Completer::new().grace(Duration::seconds(1)).operation(
        OPERATION,
        move |conn: &mut SqliteConnection, scope, key, request: BookRide| {
            book_ride(conn, &phased(), &provider, (scope, key), &request, &|| {})
        },
    );
    let deadline = Instant::now() + StdDuration::from_secs(30);
    let report = loop {
        let report = completer.run_once(&mut conn)?;
        if report.picked > 0 {
            break report;
        }
        anyhow::ensure!(Instant::now() < deadline, "the killed server's lease never ran out");
        // The killed server's lease and the grace period run out meanwhile.
        std::thread::sleep(StdDuration::from_millis(200));
    };
    println!(
        "   completer: {} picked, {} completed, {} failed",
        report.picked, report.completed, report.failed
    );
    println!("   grace's client retries later with its key");
    let provider = Provider::new(url, []);
    let retry = book_ride(
        &mut conn,
        &phased(),
        &provider,
        ("grace", "ride-grace-1"),
        &grace(),
        &|| {},
    );
    show(&retry);
    anyhow::ensure!(
        retry.is_ok_and(|outcome| outcome.is_replayed()),
        "the completer finished it"
    );

    println!("\n3. the relay delivers the receipts");
    let receipts = Relay::default().run_once(&mut conn, |message| {
        let receipt: Receipt = message.payload().map_err(|e| e.to_string())?;
        println!(
            "   to {}: ride {}, {} charged ({})",
            receipt.rider,
            receipt.ride,
            dollars(receipt.cents),
            receipt.charge
        );
        Ok::<_, String>(())
    })?;
    let charges: i64 = provider_charges::table.count().get_result(&mut conn)?;
    println!(
        "\nin the end: 2 rides, {charges} charges at the provider, {} receipts",
        receipts.delivered
    );
    anyhow::ensure!(
        charges == 2 && receipts.delivered == 2,
        "each ride charged and receipted once"
    );
    Ok(())
}

/// The child: a server process that books grace's ride and dies after the
/// provider charged her card, before the charge is recorded.
fn server_killed_after_the_charge(url: &str) -> anyhow::Result<()> {
    let mut conn = connect(url)?;
    let provider = Provider::new(url, []);
    let wait_for_the_kill = || {
        println!("{CHARGED}");
        let _ = std::io::stdout().flush();
        loop {
            std::thread::park();
        }
    };
    book_ride(
        &mut conn,
        &phased(),
        &provider,
        ("grace", "ride-grace-1"),
        &grace(),
        &wait_for_the_kill,
    )?;
    anyhow::bail!("the server was meant to be killed")
}

/// Kills the child server however `main` ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
