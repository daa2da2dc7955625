//! A monthly invoicing job over 2,000 customers that crashes halfway, is run
//! again, and invoices every customer exactly once.
//!
//! Run with `cargo run --example batch_job`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use anyhow::Context;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use idempotency::batch::{Item, Runner};
use serde::Serialize;

diesel::table! {
    invoices (customer_id) {
        customer_id -> BigInt,
        cents -> BigInt,
    }
}

const CUSTOMERS: u64 = 2_000;
const JOB: &str = "invoices-2026-11";

/// What the job needs of a customer. It is also the request each item's key
/// is bound to, so a customer whose data changed between runs is reported,
/// not invoiced twice.
#[derive(Serialize, Clone)]
struct Customer {
    id: u64,
    cents: i64,
    has_address: bool,
}

impl Item for Customer {
    fn id(&self) -> String {
        self.id.to_string()
    }
}

/// Every pooled connection waits for the write lock instead of failing.
#[derive(Debug)]
struct Busy;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for Busy {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("PRAGMA busy_timeout = 5000")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

fn customers(fixed: bool) -> impl Iterator<Item = Customer> {
    // Customer 777 has no billing address until someone fixes it.
    (1..=CUSTOMERS).map(move |id| Customer {
        id,
        cents: 1000 + id as i64,
        has_address: fixed || id != 777,
    })
}

/// The domain effect of one item.
fn invoice(tx: &mut SqliteConnection, customer: &Customer) -> Result<i64, anyhow::Error> {
    if !customer.has_address {
        anyhow::bail!("no billing address");
    }
    let customer_id = i64::try_from(customer.id)?;
    diesel::insert_into(invoices::table)
        .values((
            invoices::customer_id.eq(customer_id),
            invoices::cents.eq(customer.cents),
        ))
        .execute(tx)?;
    Ok(customer.cents)
}

fn invoice_count(pool: &Pool<ConnectionManager<SqliteConnection>>) -> anyhow::Result<i64> {
    Ok(invoices::table.count().get_result(&mut pool.get()?)?)
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("billing.db");
    let url = path.to_str().context("temporary path is not utf-8")?;
    let pool = Pool::builder()
        .max_size(4)
        .connection_customizer(Box::new(Busy))
        .build(ConnectionManager::new(url))?;
    {
        let mut conn = pool.get()?;
        // WAL lets the workers' replays read while another worker writes.
        conn.batch_execute("PRAGMA journal_mode = WAL")?;
        idempotency::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!(e))?;
        conn.batch_execute("CREATE TABLE invoices (customer_id BIGINT PRIMARY KEY, cents BIGINT NOT NULL)")?;
    }
    println!("database: {}", path.display());

    let runner = Runner::new(pool.clone())
        .workers(4)
        .scope("billing")
        .on_progress(|progress| {
            if progress.processed % 500 == 0 {
                println!(
                    "   {:>5} of {} processed ({} executed, {} replayed, {} failed)",
                    progress.processed, CUSTOMERS, progress.executed, progress.replayed, progress.failed
                );
            }
        });

    println!("\n1. the job starts; the process dies after about 1,000 customers");
    let started = AtomicUsize::new(0);
    let power = AtomicBool::new(true);
    // The crash is expected here; keep its panic message and backtrace quiet.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runner.run(JOB, customers(false), |tx, customer| {
            if started.fetch_add(1, Ordering::SeqCst) == 1_000 {
                power.store(false, Ordering::SeqCst);
            }
            // Stands in for the process dying: the item in hand is rolled
            // back like any transaction that never committed.
            assert!(power.load(Ordering::SeqCst), "power cut");
            invoice(tx, customer)
        })
    }));
    std::panic::set_hook(default_hook);
    anyhow::ensure!(crashed.is_err(), "the first run was meant to crash");
    let committed = invoice_count(&pool)?;
    println!("   crashed; {committed} invoices were committed, each together with its key");

    println!("\n2. the job is run again with the same job id");
    let report = runner.run(JOB, customers(false), invoice)?;
    println!(
        "   report: {} executed, {} replayed, {} failed",
        report.executed,
        report.replayed,
        report.failed.len()
    );
    for failure in &report.failed {
        println!("   customer {} failed: {}", failure.id, failure.error);
    }
    anyhow::ensure!(
        report.replayed as i64 == committed,
        "the rerun replays exactly what the crashed run committed"
    );

    println!("\n3. customer 777's address is fixed; the job runs once more");
    let report = runner.run(JOB, customers(true), invoice)?;
    println!(
        "   report: {} executed, {} replayed, {} failed",
        report.executed,
        report.replayed,
        report.failed.len()
    );

    let invoices = invoice_count(&pool)?;
    anyhow::ensure!(
        invoices == CUSTOMERS as i64,
        "expected {CUSTOMERS} invoices, found {invoices}"
    );
    println!("\nin the end: {invoices} invoices for {CUSTOMERS} customers, none twice");
    Ok(())
}
