//! The bench's database and what a scenario needs of a backend. The
//! scenarios are generic over the connection, so that every backend runs
//! the very same code and its figures compare; `Bench` is what they need
//! beyond the crate's `RawConnection` and diesel's `Connection`, and each
//! backend's module implements it. The tables here are the domain's one
//! order table, the crate's key table as the two-phase scenario writes it,
//! and the floor scenarios' twins of the key table.

use std::marker::PhantomData;

use chrono::{NaiveDateTime, Utc};
use diesel::backend::Backend;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::query_dsl::LoadQuery;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, R2D2Connection};
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Text, Timestamp};
use idempotency::RawConnection;

use crate::server::Probe;
use crate::{common, mysql, postgres, sqlite};

diesel::table! {
    orders (id) {
        id -> BigInt,
        item -> Text,
        quantity -> Integer,
    }
}

diesel::table! {
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

diesel::table! {
    /// The key table's twin: its columns, primary key and `expires_at`
    /// index.
    floor_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

diesel::table! {
    /// The same columns without any index: the floor of earlier runs, kept
    /// as a second reference.
    bare_keys (rowid) {
        rowid -> BigInt,
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}

#[derive(serde::Serialize)]
pub struct PlaceOrder<'a> {
    pub item: &'a str,
    pub quantity: i32,
}

pub const REQUEST: PlaceOrder<'static> = PlaceOrder {
    item: "book",
    quantity: 1,
};
/// What the library stores for `REQUEST`: its SHA-256, in hex.
pub const REQUEST_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
pub const SCOPE: &str = "bench";

/// What the scenarios need of a backend beyond the crate's `RawConnection`
/// and diesel's `Connection`: its database's setup, the statements that
/// differ and what its server tells of its work. Implemented by each
/// backend compiled in.
pub trait Bench:
    RawConnection + R2D2Connection + Connection<TransactionManager = AnsiTransactionManager> + Send + 'static
{
    const NAME: &'static str;

    /// What the server tells of this connection's work: see `server.rs`.
    type Probe: Probe<Self>;

    /// Sets up a new connection, pooled or not.
    fn configure(&mut self) -> QueryResult<()> {
        Ok(())
    }

    /// Creates the bench's own tables in a new database.
    fn create_tables(&mut self) -> QueryResult<()>;

    /// Inserts `records` expired key records into the crate's key table.
    fn fill_expired(&mut self, records: i64) -> QueryResult<usize>;

    /// The domain operation: one order row; returns its id.
    fn place_order(&mut self) -> QueryResult<i64>;

    /// Executes `statement`; returns the number of rows it affected.
    fn send(&mut self, statement: impl Statement) -> QueryResult<usize>;

    /// Reads the record of `key` in `table` by its primary key, as a replay
    /// reads one; whether there is one.
    fn find_key(&mut self, table: KeyTable, key: &str) -> QueryResult<bool>;

    /// Opens a transaction and claims `claim`'s key in the floor's table, as
    /// the crate's calls claim theirs: on PostgreSQL in the round trip of
    /// the `BEGIN`, elsewhere by a statement of its own.
    fn begin_claim(&mut self, claim: &FloorRecord<'_>) -> QueryResult<()> {
        AnsiTransactionManager::begin_transaction(self)?;
        self.send(diesel::insert_into(floor_keys::table).values(claim))
            .map(drop)
    }

    /// The probe of this connection: what it measures on this server, and
    /// what not.
    fn probe(&mut self) -> Self::Probe;
}

/// A table of key records: the crate's, or the floor's twin of it.
#[derive(Debug, Clone, Copy)]
pub enum KeyTable {
    Crate,
    Floor,
}

/// What a replay reads of a key record.
pub type KeyRow = (String, String, Option<String>, NaiveDateTime);

type CrateLookup<'a> = diesel::dsl::Select<
    diesel::dsl::Find<idempotency_keys::table, (&'a str, &'a str)>,
    (
        idempotency_keys::request_hash,
        idempotency_keys::status,
        idempotency_keys::response,
        idempotency_keys::expires_at,
    ),
>;

type FloorLookup<'a> = diesel::dsl::Select<
    diesel::dsl::Find<floor_keys::table, (&'a str, &'a str)>,
    (
        floor_keys::request_hash,
        floor_keys::status,
        floor_keys::response,
        floor_keys::expires_at,
    ),
>;

/// [`Bench::find_key`], written once for every backend.
pub fn find_key_in<C>(conn: &mut C, table: KeyTable, key: &str) -> QueryResult<bool>
where
    C: Connection,
    for<'a> CrateLookup<'a>: LoadQuery<'a, C, KeyRow>,
    for<'a> FloorLookup<'a>: LoadQuery<'a, C, KeyRow>,
{
    use idempotency_keys as k;
    // A primary key lookup without LIMIT, as the crate's: a bound LIMIT
    // would make SQLite prepare the statement again on every call.
    let row = match table {
        KeyTable::Crate => k::table
            .find((SCOPE, key))
            .select((k::request_hash, k::status, k::response, k::expires_at))
            .get_result::<KeyRow>(conn),
        KeyTable::Floor => floor_keys::table
            .find((SCOPE, key))
            .select((
                floor_keys::request_hash,
                floor_keys::status,
                floor_keys::response,
                floor_keys::expires_at,
            ))
            .get_result::<KeyRow>(conn),
    };
    row.optional().map(|row| row.is_some())
}

/// A statement that every backend compiled in can execute. diesel checks a
/// statement against each backend apart, so a function generic over the
/// connection hands its statements to [`Bench::send`] as `impl Statement`.
pub trait Statement: sqlite::Executable + postgres::Executable + mysql::Executable {}

impl<S: sqlite::Executable + postgres::Executable + mysql::Executable> Statement for S {}

/// The order row of the domain operation.
pub type NewOrder = (
    diesel::dsl::Eq<orders::item, &'static str>,
    diesel::dsl::Eq<orders::quantity, i32>,
);

pub fn new_order() -> NewOrder {
    (orders::item.eq(REQUEST.item), orders::quantity.eq(REQUEST.quantity))
}

/// The order's `INSERT` returning its id.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub type InsertOrderReturningId =
    diesel::dsl::Returning<diesel::dsl::Values<diesel::dsl::insert_into<orders::table>, NewOrder>, orders::id>;

/// The domain operation on the backends whose `INSERT` returns the id.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub fn place_order_returning_id<C>(conn: &mut C) -> QueryResult<i64>
where
    C: Connection,
    InsertOrderReturningId: diesel::query_dsl::LoadQuery<'static, C, i64>,
{
    diesel::insert_into(orders::table)
        .values(new_order())
        .returning(orders::id)
        .get_result(conn)
}

/// The key table's columns on SQLite and PostgreSQL, as the crate's
/// migrations have them, for the floor scenarios' tables.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub const KEY_COLUMNS: &str = "scope TEXT NOT NULL, idempotency_key TEXT NOT NULL, request_hash TEXT NOT NULL,
    status TEXT NOT NULL, response TEXT, created_at TIMESTAMP NOT NULL, completed_at TIMESTAMP,
    expires_at TIMESTAMP NOT NULL";

/// A completed key record as the floor scenarios insert it.
#[derive(Insertable)]
#[diesel(table_name = floor_keys)]
#[diesel(table_name = bare_keys)]
pub struct CompletedKey<'a> {
    scope: &'a str,
    idempotency_key: &'a str,
    request_hash: &'a str,
    status: &'a str,
    response: String,
    created_at: NaiveDateTime,
    completed_at: NaiveDateTime,
    expires_at: NaiveDateTime,
}

impl<'a> CompletedKey<'a> {
    /// The record of `(scope, key)` completed now with the order `id`.
    pub fn now(scope: &'a str, key: &'a str, id: i64) -> Self {
        let now = Utc::now().naive_utc();
        CompletedKey {
            scope,
            idempotency_key: key,
            request_hash: REQUEST_HASH,
            status: "completed",
            response: id.to_string(),
            created_at: now,
            completed_at: now,
            expires_at: now + chrono::Duration::hours(24),
        }
    }
}

/// A key record of the floor's table as it is claimed, before the
/// operation: no response, no completion, as the crate's claims are.
#[derive(Insertable)]
#[diesel(table_name = floor_keys)]
pub struct FloorRecord<'a> {
    pub scope: &'a str,
    pub idempotency_key: &'a str,
    pub request_hash: &'a str,
    pub status: &'a str,
    pub response: Option<String>,
    pub created_at: NaiveDateTime,
    pub completed_at: Option<NaiveDateTime>,
    pub expires_at: NaiveDateTime,
}

impl<'a> FloorRecord<'a> {
    /// The claim of `(scope, key)` now.
    pub fn claimed(scope: &'a str, key: &'a str) -> Self {
        let now = Utc::now().naive_utc();
        FloorRecord {
            scope,
            idempotency_key: key,
            request_hash: REQUEST_HASH,
            status: "processing",
            response: None,
            created_at: now,
            completed_at: None,
            expires_at: now + chrono::Duration::hours(24),
        }
    }
}

/// `UPDATE floor_keys SET status, response, completed_at WHERE` the key:
/// the completion of a claimed record, the columns the crate's completion
/// sets. A query type of its own, as the crate's is, so that diesel
/// prepares it once per connection rather than on every call.
pub struct CompleteFloorKey<'a> {
    scope: &'a str,
    key: &'a str,
    response: String,
    completed_at: NaiveDateTime,
}

impl<'a> CompleteFloorKey<'a> {
    /// The completion of `(scope, key)` now with the order `id`.
    pub fn now(scope: &'a str, key: &'a str, id: i64) -> Self {
        CompleteFloorKey {
            scope,
            key,
            response: id.to_string(),
            completed_at: Utc::now().naive_utc(),
        }
    }
}

impl QueryId for CompleteFloorKey<'_> {
    type QueryId = CompleteFloorKey<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<DB> QueryFragment<DB> for CompleteFloorKey<'_>
where
    DB: Backend + HasSqlType<Text> + HasSqlType<Timestamp>,
    str: ToSql<Text, DB>,
    String: ToSql<Text, DB>,
    NaiveDateTime: ToSql<Timestamp, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("UPDATE floor_keys SET status = ");
        out.push_bind_param::<Text, _>("completed")?;
        out.push_sql(", response = ");
        out.push_bind_param::<Text, _>(&self.response)?;
        out.push_sql(", completed_at = ");
        out.push_bind_param::<Timestamp, _>(&self.completed_at)?;
        out.push_sql(" WHERE scope = ");
        out.push_bind_param::<Text, _>(self.scope)?;
        out.push_sql(" AND idempotency_key = ");
        out.push_bind_param::<Text, _>(self.key)?;
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for CompleteFloorKey<'_> {}

/// The bench's database: its own tables and the crate's, removed at the end.
pub struct Db<C> {
    scratch: common::Scratch,
    backend: PhantomData<C>,
}

impl<C: Bench> Db<C> {
    pub fn new() -> Db<C> {
        let scratch = common::Scratch::new(C::NAME, "idem_bench").expect("create the bench database");
        let db: Db<C> = Db {
            scratch,
            backend: PhantomData,
        };
        let mut conn = db.conn();
        conn.create_tables().expect("create the bench tables");
        idempotency::run_migrations(&mut conn).expect("migrate");
        db
    }

    /// Where the bench database is.
    #[cfg(feature = "postgres-async")]
    pub fn url(&self) -> &str {
        self.scratch.url()
    }

    pub fn conn(&self) -> C {
        let mut conn = C::establish(self.scratch.url()).expect("connect to the bench database");
        conn.configure().expect("configure the connection");
        conn
    }

    pub fn pool(&self, size: u32) -> Pool<ConnectionManager<C>> {
        Pool::builder()
            .max_size(size)
            .connection_customizer(Box::new(Configure))
            .build(ConnectionManager::new(self.scratch.url()))
            .expect("build a pool")
    }
}

/// Sets up every pooled connection as [`Db::conn`] does.
#[derive(Debug)]
struct Configure;

impl<C: Bench> CustomizeConnection<C, diesel::r2d2::Error> for Configure {
    fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
        conn.configure().map_err(diesel::r2d2::Error::QueryError)
    }
}
