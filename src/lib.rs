//! Run retried operations at most once.
//!
//! A client that loses a response retries the request. Without help the
//! server performs it twice: two orders, two charges. With this crate the
//! client sends one *idempotency key* with every retry of one logical
//! operation; the server runs the operation at most once and answers every
//! retry with the first result.
//!
//! [`run_idempotent`] writes the key record and the operation's own writes
//! in **one database transaction**:
//!
//! - a worker that crashes mid-operation rolls back both, so no key is left
//!   stranded "in progress" and no executed operation lacks its stored result;
//! - a key is *spent* exactly when that transaction commits. An operation
//!   that returns `Err` spends nothing: the client may correct the request
//!   and retry with the same key. A failure that should be remembered (a
//!   declined card) is returned as `Ok` with a response describing it, and is
//!   replayed like any other result.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use diesel::prelude::*;
//! use idempotency::{run_idempotent, Outcome};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize)]
//! struct PlaceOrder { item: String, quantity: i32 }
//!
//! #[derive(Serialize, Deserialize, Debug, PartialEq)]
//! struct Placed { order_id: i64 }
//!
//! let mut conn = idempotency::testing::sqlite_memory();
//! diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT, quantity INTEGER)")
//!     .execute(&mut conn)?;
//!
//! let request = PlaceOrder { item: "book".into(), quantity: 1 };
//! let place = |conn: &mut SqliteConnection| {
//!     run_idempotent(conn, "tenant-1", "order-2b9c", &request, |tx| {
//!         diesel::sql_query("INSERT INTO orders (item, quantity) VALUES (?, ?)")
//!             .bind::<diesel::sql_types::Text, _>(&request.item)
//!             .bind::<diesel::sql_types::Integer, _>(request.quantity)
//!             .execute(tx)?;
//!         Ok::<_, diesel::result::Error>(Placed { order_id: 1 })
//!     })
//! };
//!
//! assert_eq!(place(&mut conn)?, Outcome::Executed(Placed { order_id: 1 }));
//! assert_eq!(place(&mut conn)?, Outcome::Replayed(Placed { order_id: 1 }));
//! # Ok(())
//! # }
//! ```
//!
//! # The contract
//!
//! - **Scope.** Records are looked up by `(scope, key)` only; the same key
//!   under two scopes is two independent operations, and one tenant can never
//!   read another's result. Use the tenant or client id as scope.
//! - **Fingerprint.** A key is bound to the SHA-256 of the request's
//!   canonical JSON. The same key with another request is
//!   [`Error::Mismatch`]. The fingerprint covers the request alone: where one
//!   scope serves several operations, put the operation's name in the
//!   request or the scope.
//! - **Retention.** A completed key is remembered for
//!   [`Config::retention`] (default 24 hours), counted from the call that
//!   executed it. After that the key may execute
//!   again as new. [`Config::purge_expired`] deletes expired records.
//! - **What spends a key.** Only a committed `Ok`. [`Error::Operation`], a
//!   panic, a killed process, a lost connection before the commit and every
//!   other error of a call that would have executed leave the key free.
//!   [`Error::Mismatch`], and [`Error::Codec`] for a stored response that no
//!   longer decodes, leave a spent key as it was; [`Error::OutcomeUnknown`]
//!   (the connection was lost during the commit) may have spent it, and a
//!   retry with the same key and request tells which.
//! - **Concurrent requests with one key.** On PostgreSQL the second request
//!   blocks on the key's advisory lock until the first commits (it then
//!   replays) or rolls back (it then executes), bounded by
//!   [`InFlight`]; on timeout it fails with [`Error::InProgress`]. On MySQL
//!   and MariaDB it waits the same way on a named lock of the key. On SQLite,
//!   writers queue for the database lock, bounded by the same policy as the
//!   busy timeout. Either way the operation runs once.
//!
//! # Backends
//!
//! `sqlite` (default, compiled in), `postgres` (needs libpq) and `mysql`
//! (MySQL 8.0+ or MariaDB 10.6+; needs libmysqlclient or libmariadb), each a
//! cargo feature. Calls take `&mut SqliteConnection`, `&mut PgConnection`,
//! `&mut MysqlConnection`, or an r2d2 pooled connection of any of them; see
//! [`StoreConnection`]. Apply the tables with [`run_migrations`] or embed
//! [`MIGRATIONS`] with your own.
//!
//! # Beyond the single call
//!
//! - [`Idempotent`] makes an existing repository function idempotent at its
//!   call site: `create_order.idempotent(conn, scope, key, &new_order)`.
//! - [`batch::Runner`] reruns batch jobs safely, with keys derived from the
//!   job and the item.
//! - [`outbox`] writes messages for other systems in the same transaction
//!   and delivers them afterwards, at least once, with a stable key.
//! - [`testing`] has what domain tests need: in-memory SQLite with the
//!   migrations applied, a manual clock, and the stories that matter (a lost
//!   response, a crash, expiry, a racing duplicate).
//!
//! On SQLite, enable WAL (`PRAGMA journal_mode = WAL`) for file databases
//! shared by several connections, so that replays, which only read, do not
//! queue behind writers.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod backend;
pub mod batch;
mod clock;
mod codec;
mod config;
mod error;
mod fingerprint;
#[cfg(feature = "axum")]
pub mod http;
mod id;
mod in_flight;
pub mod key;
pub mod outbox;
mod outcome;
pub mod phased;
mod repository;
mod run;
mod schema;
mod service;
mod telemetry;
#[cfg(feature = "sqlite")]
pub mod testing;

pub use backend::migrate::{MIGRATIONS, Migrations, run_migrations};
pub use backend::{RawConnection, StoreConnection};
pub use config::Config;
pub use error::{Error, KeyError};
pub use in_flight::InFlight;
pub use outcome::{Outcome, Recorded};
pub use repository::Idempotent;
pub use run::run_idempotent;
pub use service::{Purged, Purger, Shutdown, Stopped};
#[cfg(feature = "metrics")]
pub use telemetry::describe_metrics;

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!("enable at least one backend feature: `sqlite` (the default), `postgres` or `mysql`");
