//! The domain of the tests: rides, their tables on each backend, and the
//! provider's table of charges.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use serde::{Deserialize, Serialize};

use super::{RECEIPTS, SCOPE};
use crate::common::TestDb;
use idempotency::outbox;

pub(super) mod schema {
    diesel::table! {
        /// The domain table: one row per ride, its charge once recorded.
        rides (id) {
            id -> Text,
            rider -> Text,
            cents -> BigInt,
            charge -> Nullable<Text>,
        }
    }

    diesel::table! {
        /// The provider's own table: one row per charge it applied, and how
        /// many requests came with its key.
        provider_charges (provider_key) {
            provider_key -> Text,
            charge_id -> Text,
            cents -> BigInt,
            requests -> Integer,
        }
    }

    diesel::table! {
        /// The crate's operations, the columns the tests read.
        idempotency_phases (scope, idempotency_key) {
            scope -> Text,
            idempotency_key -> Text,
            status -> Text,
            points -> Text,
            attempts -> Integer,
        }
    }

    diesel::table! {
        /// The crate's outbox, the columns the tests read.
        idempotency_outbox (id) {
            id -> Text,
            topic -> Text,
            payload -> Text,
        }
    }
}

/// Portable SQL: the same on every backend.
pub(super) const RIDE_TABLES: &str = "
    CREATE TABLE rides (id TEXT PRIMARY KEY, rider TEXT NOT NULL, cents BIGINT NOT NULL, charge TEXT);
    CREATE TABLE provider_charges (
        provider_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL, cents BIGINT NOT NULL, requests INTEGER NOT NULL
    );";

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct NewRide {
    pub(super) rider: String,
    pub(super) cents: i64,
}

pub(super) fn ada() -> NewRide {
    NewRide {
        rider: String::from("ada"),
        cents: 20_00,
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(super) struct Reply {
    pub(super) ride: String,
    pub(super) charge: String,
}

/// The receipt message, as enqueued in the last step.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(super) struct Receipt {
    pub(super) ride: String,
    pub(super) charge: String,
    pub(super) cents: i64,
}

#[derive(Debug)]
pub(super) enum RideError {
    Database(diesel::result::Error),
    Outbox(outbox::Error),
    Provider(ProviderError),
    GaveUp,
}

impl std::fmt::Display for RideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RideError::Database(error) => write!(f, "the ride could not be saved: {error}"),
            RideError::Outbox(error) => write!(f, "the receipt could not be queued: {error}"),
            RideError::Provider(error) => write!(f, "the payment provider failed: {error:?}"),
            RideError::GaveUp => f.write_str("the attempt gave up"),
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
pub(super) enum ProviderError {
    /// Refused before it charged anything.
    Unavailable,
    /// Charged, but the answer never arrived.
    TimedOut,
    /// The key came with another amount than its first request.
    KeyReused,
}

/// A charge as the provider stores it: (provider key, charge id, cents,
/// requests with that key).
pub(crate) type ChargeRow = (String, String, i64, i32);

/// The queries of the ride tables, per backend.
pub(crate) trait RideDb: TestDb + 'static {
    /// The ride and provider tables, as the backend declares them.
    const TABLES: &'static str;

    fn insert_ride(tx: &mut Self::Conn, id: &str, request: &NewRide) -> QueryResult<usize>;

    fn set_ride_charge(tx: &mut Self::Conn, id: &str, charge: &str) -> QueryResult<usize>;

    /// Every ride as (id, charge).
    fn rides(conn: &mut Self::Conn) -> Vec<(String, Option<String>)>;

    /// Applies a charge unless one exists under `provider_key`, counting the
    /// request either way; returns the charge id and its amount.
    fn apply_charge(conn: &mut Self::Conn, provider_key: &str, cents: i64) -> QueryResult<(String, i64)>;

    fn charges(conn: &mut Self::Conn) -> Vec<ChargeRow>;

    /// The operation under `key` as (status, attempts, recovery points).
    fn operation(conn: &mut Self::Conn, key: &str) -> Option<(String, i32, String)>;

    /// The payloads of every receipt enqueued.
    fn receipts(conn: &mut Self::Conn) -> Vec<String>;
}

/// The bodies of [`RideDb`], written once and expanded per backend: diesel's
/// query types are concrete per connection.
macro_rules! ride_queries {
    () => {
        fn insert_ride(tx: &mut Self::Conn, id: &str, request: &NewRide) -> QueryResult<usize> {
            use schema::rides as r;
            diesel::insert_into(r::table)
                .values((
                    r::id.eq(id),
                    r::rider.eq(&request.rider),
                    r::cents.eq(request.cents),
                ))
                .execute(tx)
        }

        fn set_ride_charge(tx: &mut Self::Conn, id: &str, charge: &str) -> QueryResult<usize> {
            use schema::rides as r;
            diesel::update(r::table.find(id))
                .set(r::charge.eq(charge))
                .execute(tx)
        }

        fn rides(conn: &mut Self::Conn) -> Vec<(String, Option<String>)> {
            use schema::rides as r;
            r::table
                .order(r::id)
                .select((r::id, r::charge))
                .load(conn)
                .expect("read the rides")
        }

        fn charges(conn: &mut Self::Conn) -> Vec<ChargeRow> {
            use schema::provider_charges as p;
            p::table
                .order(p::provider_key)
                .select((p::provider_key, p::charge_id, p::cents, p::requests))
                .load(conn)
                .expect("read the provider's charges")
        }

        fn operation(conn: &mut Self::Conn, key: &str) -> Option<(String, i32, String)> {
            use schema::idempotency_phases as o;
            o::table
                .find((SCOPE, key))
                .select((o::status, o::attempts, o::points))
                .get_result(conn)
                .optional()
                .expect("read the operation")
        }

        fn receipts(conn: &mut Self::Conn) -> Vec<String> {
            use schema::idempotency_outbox as m;
            m::table
                .filter(m::topic.eq(RECEIPTS))
                .order(m::id)
                .select(m::payload)
                .load(conn)
                .expect("read the receipts")
        }
    };
}

/// The provider's insert-or-count: a new charge, or one more request for
/// the charge under `provider_key`, the conflict found by `$conflict` (the
/// key column where the backend has `ON CONFLICT`, any duplicated key on
/// MySQL).
macro_rules! apply_charge {
    ($conflict:expr) => {
        fn apply_charge(conn: &mut Self::Conn, provider_key: &str, cents: i64) -> QueryResult<(String, i64)> {
            use schema::provider_charges as p;
            diesel::insert_into(p::table)
                .values((
                    p::provider_key.eq(provider_key),
                    p::charge_id.eq(crate::common::unique_name("ch")),
                    p::cents.eq(cents),
                    p::requests.eq(1),
                ))
                .on_conflict($conflict)
                .do_update()
                .set(p::requests.eq(p::requests + 1))
                .execute(conn)?;
            p::table
                .find(provider_key)
                .select((p::charge_id, p::cents))
                .get_result(conn)
        }
    };
}

impl RideDb for crate::common::sqlite::Db {
    const TABLES: &'static str = RIDE_TABLES;
    ride_queries!();
    apply_charge!(schema::provider_charges::provider_key);
}

#[cfg(feature = "postgres")]
impl RideDb for crate::common::pg::Db {
    const TABLES: &'static str = RIDE_TABLES;
    ride_queries!();
    apply_charge!(schema::provider_charges::provider_key);
}

#[cfg(feature = "mysql")]
impl RideDb for crate::common::mysql::Db {
    const TABLES: &'static str = "
        CREATE TABLE rides (id VARCHAR(64) PRIMARY KEY, rider TEXT NOT NULL, cents BIGINT NOT NULL, charge TEXT);
        CREATE TABLE provider_charges (
            provider_key VARCHAR(255) PRIMARY KEY, charge_id TEXT NOT NULL, cents BIGINT NOT NULL, requests INTEGER NOT NULL
        );";
    ride_queries!();
    apply_charge!(diesel::dsl::DuplicatedKeys);
}

/// A new database with the ride and provider tables.
pub(crate) fn ride_db<D: RideDb>() -> D {
    let db = D::new();
    db.conn().batch_execute(D::TABLES).expect("create the ride tables");
    db
}
