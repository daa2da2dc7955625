//! Domain tests written the way an application writes its own: a small shop
//! with its own migration, tested against in-memory SQLite with the helpers
//! of `idempotency::testing`. No server, milliseconds per test.

use chrono::Duration;
use diesel::prelude::*;
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use idempotency::testing::{self, ManualClock, SqliteFile};
use idempotency::{Config, Error, Idempotent, Outcome};

use shop::{NewOrder, NewRefund, RefundError};

/// The application's own migrations, applied after the crate's.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/migrations");

/// The application code under test: plain repository functions.
mod shop {
    use diesel::prelude::*;
    use diesel::result::{DatabaseErrorKind, Error as DieselError};
    use serde::{Deserialize, Serialize};

    diesel::table! {
        orders (id) {
            id -> BigInt,
            item -> Text,
            quantity -> Integer,
            status -> Text,
        }
    }

    diesel::table! {
        refunds (id) {
            id -> BigInt,
            order_id -> BigInt,
            reason -> Text,
        }
    }

    #[derive(Serialize)]
    pub struct NewOrder {
        pub item: String,
        pub quantity: i32,
    }

    #[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
    pub struct Order {
        pub id: i64,
        pub item: String,
    }

    #[derive(Serialize)]
    pub struct NewRefund {
        pub order_id: i64,
        pub reason: String,
    }

    #[derive(Debug, PartialEq)]
    pub enum RefundError {
        /// The order has been refunded already, under whatever key.
        AlreadyRefunded,
        Db(String),
    }

    pub fn create_order(conn: &mut SqliteConnection, new: &NewOrder) -> QueryResult<Order> {
        let id = diesel::insert_into(orders::table)
            .values((orders::item.eq(&new.item), orders::quantity.eq(new.quantity)))
            .returning(orders::id)
            .get_result(conn)?;
        Ok(Order {
            id,
            item: new.item.clone(),
        })
    }

    /// One refund per order, enforced by a unique constraint.
    pub fn refund_order(conn: &mut SqliteConnection, refund: &NewRefund) -> Result<i64, RefundError> {
        let inserted = diesel::insert_into(refunds::table)
            .values((
                refunds::order_id.eq(refund.order_id),
                refunds::reason.eq(&refund.reason),
            ))
            .returning(refunds::id)
            .get_result(conn);
        match inserted {
            Ok(id) => {
                diesel::update(orders::table.find(refund.order_id))
                    .set(orders::status.eq("refunded"))
                    .execute(conn)
                    .map_err(|e| RefundError::Db(e.to_string()))?;
                Ok(id)
            }
            Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Err(RefundError::AlreadyRefunded),
            Err(error) => Err(RefundError::Db(error.to_string())),
        }
    }

    pub fn order_count(conn: &mut SqliteConnection) -> i64 {
        orders::table.count().get_result(conn).expect("count orders")
    }

    pub fn refund_count(conn: &mut SqliteConnection) -> i64 {
        refunds::table.count().get_result(conn).expect("count refunds")
    }
}

fn book() -> NewOrder {
    NewOrder {
        item: "book".into(),
        quantity: 1,
    }
}

#[test]
fn lost_response_places_one_order() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let order = testing::lost_response(&mut conn, |conn| {
        shop::create_order.idempotent(conn, "shop", "order-1", &book())
    });
    assert_eq!(order.item, "book");
    assert_eq!(shop::order_count(&mut conn), 1);
}

#[test]
fn crash_after_the_insert_leaves_no_order_and_the_retry_places_it() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    testing::crash_midway(&mut conn, "shop", "order-1", &book(), shop::create_order);
    assert_eq!(shop::order_count(&mut conn), 0);

    let retry = shop::create_order
        .idempotent(&mut conn, "shop", "order-1", &book())
        .expect("retry");
    assert!(!retry.is_replayed(), "the crashed call did not spend the key");
    assert_eq!(shop::order_count(&mut conn), 1);
}

#[test]
fn retry_after_the_retention_places_a_second_order() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let clock = ManualClock::new();
    let config = Config::default().clock(clock.source()).retention(Duration::hours(24));
    let (first, second) = testing::retry_after_expiry(&mut conn, &clock, Duration::hours(24), |conn| {
        shop::create_order.idempotent_with(&config, conn, "shop", "order-1", &book())
    });
    // The documented contract: after the retention a key is new again.
    assert_ne!(first.id, second.id);
    assert_eq!(shop::order_count(&mut conn), 2);
}

#[test]
fn racing_duplicates_place_one_order() {
    let db = SqliteFile::with_migrations(MIGRATIONS);
    let order = testing::racing_duplicate(&db, |conn| {
        shop::create_order.idempotent(conn, "shop", "order-1", &book())
    });
    assert_eq!(order.item, "book");
    assert_eq!(shop::order_count(&mut db.conn()), 1);
}

/// An order placed in the shop, and the refund of it as damaged.
fn damaged_order(conn: &mut SqliteConnection) -> NewRefund {
    let order = shop::create_order(conn, &book()).expect("an order");
    NewRefund {
        order_id: order.id,
        reason: "damaged".into(),
    }
}

#[test]
fn retried_refund_takes_effect_once() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let refund = damaged_order(&mut conn);
    testing::lost_response(&mut conn, |conn| {
        shop::refund_order.idempotent(conn, "shop", "refund-1", &refund)
    });
    assert_eq!(shop::refund_count(&mut conn), 1);
}

#[test]
fn second_refund_under_a_new_key_is_refused_by_the_domain() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let refund = damaged_order(&mut conn);
    shop::refund_order
        .idempotent(&mut conn, "shop", "refund-1", &refund)
        .expect("first refund");

    // A second click in another browser tab: a new key, so a new request as
    // far as keys go. Only the domain knows it is a duplicate.
    let again = shop::refund_order.idempotent(&mut conn, "shop", "refund-2", &refund);
    assert!(
        matches!(again, Err(Error::Operation(RefundError::AlreadyRefunded))),
        "{again:?}"
    );
    assert_eq!(shop::refund_count(&mut conn), 1);
}

#[test]
fn refund_retried_after_the_retention_is_still_refused_by_the_domain() {
    let mut conn = testing::sqlite_memory_with(MIGRATIONS);
    let clock = ManualClock::new();
    let config = Config::default().clock(clock.source());
    let refund = damaged_order(&mut conn);
    let refund_once =
        |conn: &mut SqliteConnection| shop::refund_order.idempotent_with(&config, conn, "shop", "refund-1", &refund);
    assert!(matches!(refund_once(&mut conn), Ok(Outcome::Executed(_))));

    clock.advance(config.retention_period());
    let late = refund_once(&mut conn);
    assert!(
        matches!(late, Err(Error::Operation(RefundError::AlreadyRefunded))),
        "{late:?}"
    );
    assert_eq!(shop::refund_count(&mut conn), 1);
}
