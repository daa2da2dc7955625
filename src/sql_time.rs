//! The SQL type of the crate's times, one for every backend, so that one
//! schema (`crate::schema`) and one set of statements serve them all.
//!
//! A time is UTC without a zone, to the microsecond. PostgreSQL stores it
//! as `timestamp` and SQLite as text, which diesel binds and reads as its
//! `Timestamp`; MySQL stores it as `DATETIME(6)`, which diesel binds and
//! reads as its `Datetime`. diesel's `Timestamp` binds as MySQL's
//! `TIMESTAMP`, whose range ends in 2038: MariaDB stores a later time bound
//! that way as `NULL`. So a statement written against diesel's types for
//! two backends would be wrong on the third; written against this one it
//! is right on each, and a time the type does not bind cannot be written.

use chrono::NaiveDateTime;
use diesel::deserialize::{self, FromSql};
use diesel::expression::AsExpression;
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::{self, SqlOrd, ops};

/// A time column of the crate's tables, as `crate::schema` declares it.
/// Named as diesel names the SQL type, so that `diesel print-schema`, told
/// by `diesel.toml` to import it, writes the schema as it is.
#[derive(Debug, Clone, Copy, Default, diesel::query_builder::QueryId, diesel::sql_types::SqlType)]
#[diesel(postgres_type(oid = 1114, array_oid = 1115))]
#[diesel(sqlite_type(name = "Text"))]
#[diesel(mysql_type(name = "DateTime"))]
pub struct Timestamp;

impl SqlOrd for Timestamp {}

// What diesel's `table!` asks of a type it knows by the name `Timestamp`:
// a time plus or minus an interval is a time.
impl ops::Add for Timestamp {
    type Rhs = sql_types::Interval;
    type Output = Timestamp;
}

impl ops::Sub for Timestamp {
    type Rhs = sql_types::Interval;
    type Output = Timestamp;
}

/// A time bound as [`Timestamp`]. A `NaiveDateTime` binds as one where a
/// column may be `NULL` (`Option<NaiveDateTime>`) and wherever a statement
/// binds it by its type; an expression of a column that is never `NULL`
/// needs this wrapper, since diesel reserves that conversion of a type of
/// another crate for the other crate.
#[derive(Debug, Clone, Copy, AsExpression)]
#[diesel(sql_type = Timestamp)]
pub struct At(pub NaiveDateTime);

impl From<NaiveDateTime> for At {
    fn from(time: NaiveDateTime) -> At {
        At(time)
    }
}

impl<DB: diesel::backend::Backend> ToSql<Timestamp, DB> for At
where
    NaiveDateTime: ToSql<Timestamp, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        self.0.to_sql(out)
    }
}

/// The type a backend stores the crate's times as, which diesel binds and
/// reads a `NaiveDateTime` as.
pub trait StoredAs: diesel::backend::Backend {
    /// The backend's SQL type of the crate's time columns.
    type Native: diesel::sql_types::SqlType;
}

#[cfg(feature = "sqlite")]
impl StoredAs for diesel::sqlite::Sqlite {
    type Native = sql_types::Timestamp;
}

#[cfg(feature = "postgres")]
impl StoredAs for diesel::pg::Pg {
    type Native = sql_types::Timestamp;
}

#[cfg(feature = "mysql")]
impl StoredAs for diesel::mysql::Mysql {
    type Native = sql_types::Datetime;
}

impl<DB: StoredAs> ToSql<Timestamp, DB> for NaiveDateTime
where
    NaiveDateTime: ToSql<DB::Native, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        ToSql::<DB::Native, DB>::to_sql(self, out)
    }
}

impl<DB: StoredAs> FromSql<Timestamp, DB> for NaiveDateTime
where
    NaiveDateTime: FromSql<DB::Native, DB>,
{
    fn from_sql(value: DB::RawValue<'_>) -> deserialize::Result<Self> {
        <NaiveDateTime as FromSql<DB::Native, DB>>::from_sql(value)
    }
}
