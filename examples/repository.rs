//! An order repository (create, cancel, refund) made idempotent at the call
//! site with `Idempotent`, and a refund that keys alone cannot deduplicate.
//!
//! Run with `cargo run --example repository`.

use anyhow::Context;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idempotency::{Error, Idempotent, Outcome};
use serde::{Deserialize, Serialize};

diesel::table! {
    orders (id) {
        id -> BigInt,
        item -> Text,
        cents -> BigInt,
        status -> Text,
    }
}

diesel::table! {
    refunds (id) {
        id -> BigInt,
        order_id -> BigInt,
        cents -> BigInt,
    }
}

/// The application's schema. One refund per order is a business rule, so it
/// is a constraint of the domain table, not a matter of idempotency keys.
const SCHEMA: &str = "
    CREATE TABLE orders (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        item TEXT NOT NULL,
        cents BIGINT NOT NULL,
        status TEXT NOT NULL DEFAULT 'placed'
    );
    CREATE TABLE refunds (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        order_id BIGINT NOT NULL UNIQUE REFERENCES orders (id),
        cents BIGINT NOT NULL
    );";

#[derive(Serialize)]
struct NewOrder {
    item: String,
    cents: i64,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Order {
    id: i64,
    item: String,
    status: String,
}

#[derive(Serialize)]
struct CancelOrder {
    order_id: i64,
}

#[derive(Serialize)]
struct NewRefund {
    order_id: i64,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Refund {
    id: i64,
    order_id: i64,
    cents: i64,
}

#[derive(Debug)]
enum OrderError {
    NotCancellable { status: String },
    AlreadyRefunded,
    Db(DieselError),
}

impl std::fmt::Display for OrderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OrderError::NotCancellable { status } => write!(f, "the order is {status} and cannot be cancelled"),
            OrderError::AlreadyRefunded => f.write_str("the order has been refunded already"),
            OrderError::Db(_) => f.write_str("the order database failed"),
        }
    }
}

impl std::error::Error for OrderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OrderError::Db(error) => Some(error),
            OrderError::NotCancellable { .. } | OrderError::AlreadyRefunded => None,
        }
    }
}

impl From<DieselError> for OrderError {
    fn from(error: DieselError) -> Self {
        OrderError::Db(error)
    }
}

/// The repository: plain diesel functions that know nothing of keys.
mod repository {
    use super::*;

    pub fn create_order(conn: &mut SqliteConnection, new: &NewOrder) -> QueryResult<Order> {
        let id = diesel::insert_into(orders::table)
            .values((orders::item.eq(&new.item), orders::cents.eq(new.cents)))
            .returning(orders::id)
            .get_result(conn)?;
        Ok(Order {
            id,
            item: new.item.clone(),
            status: "placed".into(),
        })
    }

    pub fn cancel_order(conn: &mut SqliteConnection, cancel: &CancelOrder) -> Result<Order, OrderError> {
        let (item, status): (String, String) = orders::table
            .find(cancel.order_id)
            .select((orders::item, orders::status))
            .first(conn)?;
        if status != "placed" {
            return Err(OrderError::NotCancellable { status });
        }
        diesel::update(orders::table.find(cancel.order_id))
            .set(orders::status.eq("cancelled"))
            .execute(conn)?;
        Ok(Order {
            id: cancel.order_id,
            item,
            status: "cancelled".into(),
        })
    }

    pub fn refund_order(conn: &mut SqliteConnection, refund: &NewRefund) -> Result<Refund, OrderError> {
        let cents: i64 = orders::table.find(refund.order_id).select(orders::cents).first(conn)?;
        let inserted = diesel::insert_into(refunds::table)
            .values((refunds::order_id.eq(refund.order_id), refunds::cents.eq(cents)))
            .returning(refunds::id)
            .get_result(conn);
        let id = match inserted {
            Ok(id) => id,
            Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => {
                return Err(OrderError::AlreadyRefunded);
            }
            Err(error) => return Err(error.into()),
        };
        diesel::update(orders::table.find(refund.order_id))
            .set(orders::status.eq("refunded"))
            .execute(conn)?;
        Ok(Refund {
            id,
            order_id: refund.order_id,
            cents,
        })
    }
}

use repository::{cancel_order, create_order, refund_order};

fn describe<R: std::fmt::Debug>(outcome: &Outcome<R>) -> String {
    match outcome {
        Outcome::Executed(value) => format!("executed: {value:?}"),
        Outcome::Replayed(value) => format!("replayed: {value:?}"),
    }
}

fn count(conn: &mut SqliteConnection, table: &str) -> anyhow::Result<i64> {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let query = format!("SELECT count(*) AS n FROM {table}");
    Ok(diesel::sql_query(query).get_result::<Count>(conn)?.n)
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shop.db");
    let mut conn = SqliteConnection::establish(path.to_str().context("temporary path is not utf-8")?)?;
    idempotency::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!(e))?;
    conn.batch_execute(SCHEMA)?;
    println!("database: {}", path.display());

    // Each request carries the client's Idempotency-Key; the scope is the
    // stable id of the authenticated customer, so two customers' keys never
    // meet.
    let scope = "customer-42";

    println!("\n1. create an order; the response is lost and the client retries");
    let new_order = NewOrder {
        item: "rain jacket".into(),
        cents: 8900,
    };
    let first = create_order.idempotent(&mut conn, scope, "create-8d2f", &new_order)?;
    println!("   first call: {}", describe(&first));
    let retry = create_order.idempotent(&mut conn, scope, "create-8d2f", &new_order)?;
    println!("   retry:      {}", describe(&retry));
    let order = retry.into_inner();
    println!("   orders in the database: {}", count(&mut conn, "orders")?);

    println!("\n2. cancel a second order twice with one key");
    let other = create_order.idempotent(
        &mut conn,
        scope,
        "create-1b77",
        &NewOrder {
            item: "boots".into(),
            cents: 12000,
        },
    )?;
    let cancel = CancelOrder {
        order_id: other.into_inner().id,
    };
    let first = cancel_order.idempotent(&mut conn, scope, "cancel-40aa", &cancel)?;
    println!("   first call: {}", describe(&first));
    let retry = cancel_order.idempotent(&mut conn, scope, "cancel-40aa", &cancel)?;
    println!("   retry:      {} (the order is not cancelled twice)", describe(&retry));
    match cancel_order.idempotent(&mut conn, scope, "cancel-9c31", &cancel) {
        Err(Error::Operation(OrderError::NotCancellable { status })) => {
            println!("   a new key for the same cancel: refused by the domain, the order is {status}")
        }
        other => anyhow::bail!("expected the domain to refuse a second cancel, got {other:?}"),
    }

    println!("\n3. refund the first order; the client retries the refund");
    let refund = NewRefund { order_id: order.id };
    let first = refund_order.idempotent(&mut conn, scope, "refund-e310", &refund)?;
    println!("   first call: {}", describe(&first));
    let retry = refund_order.idempotent(&mut conn, scope, "refund-e310", &refund)?;
    println!("   retry:      {}", describe(&retry));
    println!("   refunds in the database: {}", count(&mut conn, "refunds")?);

    println!("\n4. a second refund of the same order under a new key (another tab, another client)");
    // The first key is still valid, but this is a different key: to the key
    // store it is a new request. The unique constraint on refunds.order_id
    // is what recognises the business-level duplicate.
    match refund_order.idempotent(&mut conn, scope, "refund-77d4", &refund) {
        Err(Error::Operation(error @ OrderError::AlreadyRefunded)) => {
            println!("   refused by the domain: {error}; the handler answers 409 Conflict, nothing was written")
        }
        other => anyhow::bail!("expected the domain to refuse a second refund, got {other:?}"),
    }
    println!("   refunds in the database: {}", count(&mut conn, "refunds")?);

    println!("\n5. the same key reused for another request is a client error");
    match refund_order.idempotent(&mut conn, scope, "refund-e310", &NewRefund { order_id: order.id + 1 }) {
        Err(error @ Error::Mismatch) => println!("   {error} (HTTP {})", error.status_code()),
        other => anyhow::bail!("expected a mismatch, got {other:?}"),
    }

    let (orders, refunds) = (count(&mut conn, "orders")?, count(&mut conn, "refunds")?);
    anyhow::ensure!(
        (orders, refunds) == (2, 1),
        "expected 2 orders and 1 refund, found {orders} and {refunds}"
    );
    println!("\nin the end: {orders} orders, {refunds} refund; every retried call took effect once");
    Ok(())
}
