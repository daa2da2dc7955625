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

#[cfg(feature = "sqlite")]
impl ToSql<Timestamp, diesel::sqlite::Sqlite> for NaiveDateTime {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, diesel::sqlite::Sqlite>) -> serialize::Result {
        ToSql::<sql_types::Timestamp, _>::to_sql(self, out)
    }
}

#[cfg(feature = "sqlite")]
impl FromSql<Timestamp, diesel::sqlite::Sqlite> for NaiveDateTime {
    fn from_sql(value: diesel::sqlite::SqliteValue<'_, '_, '_>) -> deserialize::Result<Self> {
        <NaiveDateTime as FromSql<sql_types::Timestamp, diesel::sqlite::Sqlite>>::from_sql(value)
    }
}

#[cfg(feature = "postgres")]
impl ToSql<Timestamp, diesel::pg::Pg> for NaiveDateTime {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, diesel::pg::Pg>) -> serialize::Result {
        ToSql::<sql_types::Timestamp, _>::to_sql(self, out)
    }
}

#[cfg(feature = "postgres")]
impl FromSql<Timestamp, diesel::pg::Pg> for NaiveDateTime {
    fn from_sql(value: diesel::pg::PgValue<'_>) -> deserialize::Result<Self> {
        <NaiveDateTime as FromSql<sql_types::Timestamp, diesel::pg::Pg>>::from_sql(value)
    }
}

#[cfg(feature = "mysql")]
impl ToSql<Timestamp, diesel::mysql::Mysql> for NaiveDateTime {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, diesel::mysql::Mysql>) -> serialize::Result {
        ToSql::<sql_types::Datetime, _>::to_sql(self, out)
    }
}

#[cfg(feature = "mysql")]
impl FromSql<Timestamp, diesel::mysql::Mysql> for NaiveDateTime {
    fn from_sql(value: diesel::mysql::MysqlValue<'_>) -> deserialize::Result<Self> {
        <NaiveDateTime as FromSql<sql_types::Datetime, diesel::mysql::Mysql>>::from_sql(value)
    }
}
