//! Run retried operations at most once.
//!
//! A client that loses a response retries the request. Without help the
//! server performs it twice: two orders, two charges. With this crate the
//! client sends one *idempotency key* with every retry of one logical
//! operation; the server runs the operation at most once and answers every
//! retry with the first result. [`run_idempotent`] writes the key record and
//! the operation's own writes in **one database transaction**, so a key is
//! spent exactly when that transaction commits: the whole contract is in
//! [`guide::contract`].
//!
//! # Where to start
//!
//! - **A function**: wrap the operation in [`run_idempotent`], as below;
//!   apply the crate's tables at start-up with [`run_migrations`] (the
//!   README's quick start is a whole program). On PostgreSQL, the
//!   [PostgreSQL guide](guide::postgres) starts from there.
//! - **An axum handler** (feature `axum`): the [HTTP guide](guide::http)
//!   has a complete service, the `Idempotency-Key` extractor and stored
//!   responses; on diesel-async connections, the
//!   [async guide](guide::asynchronous). **An actix-web handler** (feature
//!   `actix`): the same rules, in the [actix guide](guide::actix). **A
//!   tonic service** (feature `tonic`): keys on gRPC calls, in the
//!   [gRPC guide](guide::grpc).
//! - **An outbox**: messages to other systems committed with the
//!   operation and delivered afterwards, in the [outbox guide](guide::outbox).
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
//! Every duration the crate's builders and functions take is a
//! [`chrono::Duration`], the type its clock and its records count in.
//!
//! # Guides
//!
//! The [`guide`] modules hold the documentation beyond the API, every
//! example in them compiled and run as a test:
//! [contract](guide::contract), [HTTP](guide::http),
//! [backends](guide::backends) ([SQLite](guide::sqlite),
//! [PostgreSQL](guide::postgres), [MySQL and MariaDB](guide::mysql)),
//! [repository functions](guide::repository), [outbox](guide::outbox),
//! [phased operations](guide::phased), [batch jobs](guide::batch),
//! [testing your domain](guide::testing),
//! [running in production](guide::production),
//! [high availability](guide::high_availability),
//! [scaling out with Citus](guide::citus),
//! [performance](guide::performance),
//! [async: diesel-async](guide::asynchronous).
//!
//! # Layers
//!
//! Each layer uses only the ones below it:
//!
//! - **integrations**: [`http`] for axum (feature `axum`) and actix-web
//!   (feature `actix`), one rule set with an adapter each, [`grpc`] for
//!   tonic (feature `tonic`), [`testing`] for
//!   domain tests (feature `testing`);
//! - **services**, background loops stopped by a [`Shutdown`], each beside
//!   the feature it serves and all on one loop (`src/service/`): the outbox
//!   [`Relay::serve`](outbox::Relay::serve), the [`Purger`], the phased
//!   [`Completer::serve`](phased::Completer::serve), each returning what it
//!   did as [`Stopped`];
//! - **features**: the combinator ([`run_idempotent`], [`Config::run`];
//!   on diesel-async connections `run_idempotent_async`, `Config::run_async`,
//!   `Phased::run_async`),
//!   the [`outbox`], [`phased`] operations, [`batch`] jobs, the
//!   [`Idempotent`] repository wrapper, purging
//!   ([`Config::purge_expired`]);
//! - **backends** (one folder per database under
//!   `src/backend/`): SQLite, PostgreSQL and MySQL/MariaDB, each a cargo
//!   feature, behind [`StoreConnection`]; the tables come from
//!   [`run_migrations`] or [`MIGRATIONS`];
//! - **ground**: errors ([`Error`], [`KeyError`]), the in-flight policy
//!   ([`InFlight`]), ids, the JSON codec, the request fingerprint, the key
//!   rules ([`key`]), [`Outcome`], the schema and its time type, the calls a thread is
//!   executing.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod backend;
pub mod batch;
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "redis"))]
pub mod brokers;
#[cfg(any(feature = "deadpool", feature = "diesel-async"))]
mod checkout;
mod clock;
mod codec;
mod config;
mod error;
mod executing;
mod fingerprint;
#[cfg(feature = "tonic")]
pub mod grpc;
#[cfg(any(feature = "axum", feature = "actix"))]
pub mod http;
mod id;
mod in_flight;
pub mod key;
pub mod outbox;
mod outcome;
pub mod phased;
#[cfg(feature = "diesel-async")]
mod pool;
#[cfg(test)]
mod property;
mod purging;
mod repository;
mod row_status;
mod run;
mod schema;
mod service;
mod sql_time;
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "opentelemetry")]
mod trace_context;

#[cfg(feature = "diesel-async")]
pub use backend::AsyncStoreConnection;
pub use backend::migrate::{MIGRATIONS, Migrations, SchemaError, SchemaHistory, check_schema, run_migrations};
#[cfg(feature = "postgres")]
pub use backend::postgres::citus;
pub use backend::{RawConnection, StoreConnection};
pub use config::{Config, OnCompleted};
#[cfg(all(feature = "sqlite", feature = "diesel-async"))]
pub use error::UnsupportedRuntime;
pub use error::{Error, KeyError};
pub use in_flight::InFlight;
pub use outcome::{Origin, Outcome, Recorded};
#[cfg(feature = "diesel-async")]
pub use pool::AsyncConnectionPool;
pub use purging::{Purged, Purger};
pub use repository::Idempotent;
#[cfg(feature = "diesel-async")]
pub use run::run_idempotent_async;
pub use run::{KeyStatus, run_idempotent};
pub use service::{Shutdown, Stopped};
#[cfg(feature = "metrics")]
pub use telemetry::describe_metrics;

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!("enable at least one backend feature: `sqlite` (the default), `postgres` or `mysql`");

// `diesel-async` alone has no connection to run on: each backend's async
// connection is a feature of its own, so that no backend's async client
// reaches a build that did not ask for it.
#[cfg(all(
    feature = "diesel-async",
    not(any(feature = "sqlite-async", feature = "postgres-async", feature = "mysql-async"))
))]
compile_error!(
    "the feature `diesel-async` is enabled through a backend's: `sqlite-async`, `postgres-async` or `mysql-async`"
);

/// Guides: documentation only. These modules hold no items; each one's page
/// is a guide from the crate's `docs/` folder, and every Rust example in
/// them is compiled and run as a doctest.
///
/// | guide | what it covers |
/// | --- | --- |
/// | [`contract`](guide::contract) | what spends a key, retention, fingerprints, which errors spend a key, racing requests on each backend, HTTP statuses |
/// | [`http`](guide::http) | the `Idempotency-Key` header with axum: a working handler, the answers, the example service |
/// | [`actix`](guide::actix) | the same rules on actix-web: the extractor, the optional key, a working handler, the endpoint a key is bound to |
/// | [`grpc`](guide::grpc) | keys on gRPC calls with tonic: from metadata or a `request_id` field, what a key is bound to, the statuses, a working service |
/// | [`backends`](guide::backends) | connection types, versions tested, code for every backend, the tables, the test suites |
/// | [`sqlite`](guide::sqlite), [`postgres`](guide::postgres), [`mysql`](guide::mysql) | what each backend does underneath and asks of its sessions |
/// | [`repository`](guide::repository) | existing repository functions made idempotent |
/// | [`outbox`](guide::outbox) | messages to other systems, committed with the operation |
/// | [`phased`](guide::phased) | operations with a foreign call in the middle |
/// | [`batch`](guide::batch) | jobs that are safe to rerun |
/// | [`testing`](guide::testing) | domain tests with in-memory SQLite and the stories that matter |
/// | [`production`](guide::production) | the services, what to watch, events, metrics |
/// | [`high_availability`](guide::high_availability) | failover, and what clients should do |
/// | [`citus`](guide::citus) | scaling writes out: the tables distributed by tenant |
/// | [`performance`](guide::performance) | what a call costs, measured |
/// | [`asynchronous`](guide::asynchronous) | the same contract on diesel-async connections: when to use which, an axum handler on a bb8 pool, phased operations with async steps and their completer, the outbox's relay on tokio, what a dropped future does |
pub mod guide {
    pub mod contract {
        #![doc = include_str!("../docs/contract.md")]
    }
    pub mod http {
        #![doc = include_str!("../docs/http.md")]
    }
    pub mod actix {
        #![doc = include_str!("../docs/actix.md")]
    }
    pub mod grpc {
        #![doc = include_str!("../docs/grpc.md")]
    }
    pub mod backends {
        #![doc = include_str!("../docs/backends.md")]
    }
    pub mod sqlite {
        #![doc = include_str!("../docs/sqlite.md")]
    }
    pub mod postgres {
        #![doc = include_str!("../docs/postgres.md")]
    }
    pub mod mysql {
        #![doc = include_str!("../docs/mysql.md")]
    }
    pub mod repository {
        #![doc = include_str!("../docs/repository.md")]
    }
    pub mod outbox {
        #![doc = include_str!("../docs/outbox.md")]
    }
    pub mod phased {
        #![doc = include_str!("../docs/phased.md")]
    }
    pub mod batch {
        #![doc = include_str!("../docs/batch.md")]
    }
    pub mod testing {
        #![doc = include_str!("../docs/testing.md")]
    }
    pub mod production {
        #![doc = include_str!("../docs/production.md")]
    }
    pub mod high_availability {
        #![doc = include_str!("../docs/high_availability.md")]
    }
    pub mod citus {
        #![doc = include_str!("../docs/citus.md")]
    }
    pub mod performance {
        #![doc = include_str!("../docs/performance.md")]
    }
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "redis"))]
    pub mod brokers {
        #![doc = include_str!("../docs/brokers.md")]
    }
    pub mod asynchronous {
        #![doc = include_str!("../docs/async.md")]
    }
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
