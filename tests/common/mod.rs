//! The test harness: one test body, run against every backend.
//!
//! `backend_tests! { ... }` expands the tests it is given twice, into a
//! `sqlite` module (a file database in a temporary directory) and, with the
//! `postgres` feature, a `postgres` module (a schema of its own in the
//! database named by `DATABASE_URL`, dropped afterwards). Inside, the names
//! `Conn`, `Db`, `place_order` and `order_count` refer to that backend.

// Each test binary uses a different part of the harness.
#![allow(dead_code, unused_macros)]

use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "postgres")]
pub mod pg;
pub mod sqlite;

macro_rules! backend_tests {
    ($($body:tt)*) => {
        mod sqlite {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_imports)]
            use crate::common::sqlite::*;
            $($body)*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_imports)]
            use crate::common::pg::*;
            $($body)*
        }
    };
}
pub(crate) use backend_tests;

/// The domain table of the tests and the repository functions on it, the
/// same on both backends once `Conn` names the connection.
macro_rules! orders_repository {
    () => {
        diesel::table! {
            orders (id) {
                id -> BigInt,
                item -> Text,
                quantity -> Integer,
            }
        }

        /// Inserts an order and returns its id.
        pub fn place_order(conn: &mut Conn, item: &str, quantity: i32) -> diesel::QueryResult<i64> {
            use diesel::prelude::*;
            diesel::insert_into(orders::table)
                .values((orders::item.eq(item), orders::quantity.eq(quantity)))
                .returning(orders::id)
                .get_result(conn)
        }

        /// How many orders there are.
        pub fn order_count(conn: &mut Conn) -> i64 {
            use diesel::prelude::*;
            orders::table.count().get_result(conn).expect("count orders")
        }

        /// Whether the connection is inside a transaction.
        pub fn in_transaction(conn: &mut Conn) -> bool {
            use diesel::connection::{AnsiTransactionManager, TransactionManager};
            AnsiTransactionManager::transaction_manager_status_mut(conn)
                .transaction_depth()
                .expect("a healthy transaction manager")
                .is_some()
        }

        /// How many key records there are.
        pub fn key_count(conn: &mut Conn) -> i64 {
            use diesel::prelude::*;
            #[derive(QueryableByName)]
            struct Count {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            diesel::sql_query("SELECT count(*) AS n FROM idempotency_keys")
                .get_result::<Count>(conn)
                .expect("count key records")
                .n
        }
    };
}
pub(crate) use orders_repository;

/// A name no other test, in this process or another, is using.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
