//! The orders: what a request asks for, what the API shows, and the
//! statements that store them on each backend.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::R2D2Connection;
use idempotency::StoreConnection;
use serde::{Deserialize, Serialize};

diesel::table! {
    orders (id) {
        id -> BigInt,
        account -> Text,
        item -> Text,
        quantity -> Integer,
    }
}

/// The longest `item` of an order, in characters. The same request must
/// get the same answer on every backend, so the bound is one that all of
/// them store: MariaDB's `TEXT`, the tightest, holds 65,535 bytes, and
/// 1,000 characters take at most 4,000 bytes of UTF-8.
pub const MAX_ITEM_CHARS: usize = 1_000;

/// The body of `POST /orders`. Unknown fields are refused rather than
/// ignored: an ignored field would not be part of the fingerprint, and a
/// retry that changed it would replay instead of being told it differs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    item: String,
    quantity: i32,
}

impl NewOrder {
    /// Why the order cannot be placed, if it cannot. Checked before any
    /// database work, so that a request that can never succeed is refused
    /// even while every connection is busy, with the same answer on every
    /// backend: PostgreSQL's text cannot hold U+0000, which the others
    /// store, so no backend gets it.
    pub(super) fn refusal(&self) -> Option<&'static str> {
        if self.quantity < 1 {
            Some("quantity must be at least 1")
        } else if self.item.contains('\0') {
            Some("item must not contain U+0000 (NUL)")
        } else if self.item.chars().count() > MAX_ITEM_CHARS {
            Some("item must be at most 1000 characters long")
        } else {
            None
        }
    }
}

/// An order as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Queryable)]
pub struct Order {
    /// Where the order is found: `GET /orders/{id}`.
    pub id: i64,
    /// What was ordered.
    pub item: String,
    /// How many.
    pub quantity: i32,
}

/// The row of a new order of `account`.
#[derive(Insertable)]
#[diesel(table_name = orders)]
struct NewRow<'a> {
    account: &'a str,
    item: &'a str,
    quantity: i32,
}

impl<'a> NewRow<'a> {
    fn of(account: &'a str, order: &'a NewOrder) -> Self {
        NewRow {
            account,
            item: &order.item,
            quantity: order.quantity,
        }
    }
}

/// The columns of an [`Order`].
const ORDER: (orders::id, orders::item, orders::quantity) = (orders::id, orders::item, orders::quantity);

/// The orders of `account`, oldest first.
#[diesel::dsl::auto_type]
fn of_account<'a>(account: &'a str) -> _ {
    orders::table
        .filter(orders::account.eq(account))
        .order(orders::id)
        .select((orders::id, orders::item, orders::quantity))
}

/// The order table's statements on each backend.
pub trait OrderStore: StoreConnection<Raw = Self> + R2D2Connection + Send + 'static {
    /// Creates the orders table if it is missing.
    ///
    /// # Errors
    ///
    /// The database's, for instance when it refuses the statement.
    fn create_orders_table(&mut self) -> QueryResult<()>;

    /// Inserts an order of `account`.
    ///
    /// # Errors
    ///
    /// The database's.
    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order>;

    /// The order `id` if it belongs to `account`.
    ///
    /// # Errors
    ///
    /// The database's.
    fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>>;

    /// The orders of `account`, oldest first.
    ///
    /// # Errors
    ///
    /// The database's.
    fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>>;
}

impl OrderStore for SqliteConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 account TEXT NOT NULL,
                 item TEXT NOT NULL,
                 quantity INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS orders_account ON orders (account, id);",
        )
    }

    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order> {
        diesel::insert_into(orders::table)
            .values(NewRow::of(account, order))
            .returning(ORDER)
            .get_result(self)
    }

    fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>> {
        of_account(account).filter(orders::id.eq(id)).first(self).optional()
    }

    fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>> {
        of_account(account).load(self)
    }
}

#[cfg(feature = "postgres")]
impl OrderStore for PgConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id BIGSERIAL PRIMARY KEY,
                 account TEXT NOT NULL,
                 item TEXT NOT NULL,
                 quantity INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS orders_account ON orders (account, id);",
        )
    }

    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order> {
        diesel::insert_into(orders::table)
            .values(NewRow::of(account, order))
            .returning(ORDER)
            .get_result(self)
    }

    fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>> {
        of_account(account).filter(orders::id.eq(id)).first(self).optional()
    }

    fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>> {
        of_account(account).load(self)
    }
}

#[cfg(feature = "mysql")]
diesel::define_sql_function! {
    /// The id the last insert on this connection gave its row.
    fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
}

#[cfg(feature = "mysql")]
impl OrderStore for MysqlConnection {
    fn create_orders_table(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id BIGINT AUTO_INCREMENT PRIMARY KEY,
                 account VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                 item TEXT CHARACTER SET utf8mb4 NOT NULL,
                 quantity INTEGER NOT NULL,
                 INDEX orders_account (account, id)
             )",
        )
    }

    /// MySQL has no `RETURNING`: the row is read back by the id the insert
    /// gave it.
    fn insert_order(&mut self, account: &str, order: &NewOrder) -> QueryResult<Order> {
        diesel::insert_into(orders::table)
            .values(NewRow::of(account, order))
            .execute(self)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(self)?;
        let id = i64::try_from(id).map_err(|error| diesel::result::Error::DeserializationError(Box::new(error)))?;
        orders::table.find(id).select(ORDER).get_result(self)
    }

    fn find_order(&mut self, account: &str, id: i64) -> QueryResult<Option<Order>> {
        of_account(account).filter(orders::id.eq(id)).first(self).optional()
    }

    fn list_orders(&mut self, account: &str) -> QueryResult<Vec<Order>> {
        of_account(account).load(self)
    }
}
