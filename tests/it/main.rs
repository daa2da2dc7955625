//! The test suite, one binary: every backend's tests, as modules of this
//! crate over the one harness in `common`. A module that needs a backend or
//! a layer of the crate is compiled only with its feature; the tests of every
//! backend it serves run with it. The failover suite (`tests/failover.rs`)
//! and the Citus suite (`tests/citus/`) are binaries of their own: each
//! needs a cluster started for it, and runs its tests, ignored otherwise,
//! with `-- --include-ignored`.

mod common;

#[cfg(feature = "axum")]
mod abandoned_requests;
#[cfg(feature = "actix")]
mod actix;
#[cfg(feature = "diesel-async")]
mod asynchronous;
mod batch;
#[cfg(feature = "axum")]
mod binding;
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "redis"))]
mod brokers;
#[cfg(feature = "postgres")]
mod clock_skew;
mod concurrency;
#[cfg(feature = "postgres")]
mod connection_loss;
#[cfg(feature = "deadpool")]
mod deadpool;
mod domain;
#[cfg(feature = "postgres")]
mod durable_replays;
mod errors;
mod fingerprint;
mod generic;
#[cfg(feature = "tonic")]
mod grpc;
#[cfg(feature = "axum")]
mod http;
#[cfg(feature = "axum")]
mod http_client;
mod keys;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod killed_sessions;
#[cfg(feature = "axum")]
mod lookup;
#[cfg(feature = "metrics")]
mod metrics;
mod migrations;
#[cfg(feature = "mysql")]
mod mysql;
mod on_completed;
#[cfg(feature = "openapi")]
mod openapi;
#[cfg(feature = "opentelemetry")]
mod origin;
mod outbox;
mod phased;
#[cfg(feature = "postgres")]
mod postgres;
mod purger;
#[cfg(feature = "axum")]
mod real_clients;
#[cfg(feature = "postgres")]
mod relay_postgres;
mod relay_service;
mod repository;
mod retention;
mod run;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod server;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod silent_callers;
mod status;
mod stored_values;
mod telemetry;
mod testing;
mod tombstones;
#[cfg(feature = "opentelemetry")]
mod trace;
