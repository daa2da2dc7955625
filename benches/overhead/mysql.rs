//! MySQL and MariaDB as the bench runs them: a database of its own on the
//! server `MYSQL_URL` names, with the key table's columns as the crate's
//! MySQL migration declares them, so that the floor scenarios compare with
//! the same collations and widths. MySQL has no `RETURNING`: the domain
//! operation takes two statements here, which the floor shares.

use diesel::MysqlConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;

use crate::db::{Bench, Statement, new_order, orders};

/// A statement MySQL executes.
pub trait Executable: ExecuteDsl<MysqlConnection> {}

impl<S: ExecuteDsl<MysqlConnection>> Executable for S {}

diesel::define_sql_function! {
    /// The id the last insert on this connection gave its row.
    fn last_insert_id() -> diesel::sql_types::Unsigned<diesel::sql_types::BigInt>;
}

/// The key table's columns, as the crate's MySQL migration has them.
const KEY_COLUMNS: &str = "scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    response LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    created_at DATETIME(6) NOT NULL, completed_at DATETIME(6), expires_at DATETIME(6) NOT NULL";

/// A database of its own on the server named by `MYSQL_URL`.
impl Bench for MysqlConnection {
    const NAME: &'static str = "mysql";

    fn create_tables(&mut self) -> QueryResult<()> {
        self.batch_execute(&format!(
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, quantity INTEGER NOT NULL);
             CREATE TABLE floor_keys ({KEY_COLUMNS}, PRIMARY KEY (scope, idempotency_key), INDEX floor_keys_expires_at (expires_at))
                 DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
             CREATE TABLE bare_keys ({KEY_COLUMNS}) DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;"
        ))
    }

    fn fill_expired(&mut self, records: i64) -> QueryResult<usize> {
        // Numbers from the cross product of six digit tables: MySQL caps
        // a recursive CTE at 1,000 steps by default.
        let inserted = diesel::sql_query(
            "INSERT INTO idempotency_keys
                 (scope, idempotency_key, request_hash, status, response, created_at, completed_at, expires_at)
             SELECT 'bench', MD5(n), SHA2(n, 256), 'completed', '12345',
                    '2000-01-01', '2000-01-01', TIMESTAMP('2000-01-02') + INTERVAL n SECOND
             FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d + 1 AS n
                   FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS a,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS b,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS c,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS e,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS f,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
                         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) AS g
                  ) AS numbers
             WHERE n <= ?",
        )
        .bind::<diesel::sql_types::BigInt, _>(records)
        .execute(self)?;
        self.batch_execute("ANALYZE TABLE idempotency_keys")?;
        Ok(inserted)
    }

    /// MySQL has no `RETURNING`: the id comes from the connection, a
    /// second statement.
    fn place_order(&mut self) -> QueryResult<i64> {
        diesel::insert_into(orders::table).values(new_order()).execute(self)?;
        let id: u64 = diesel::select(last_insert_id()).get_result(self)?;
        Ok(id as i64)
    }

    fn send(&mut self, statement: impl Statement) -> QueryResult<usize> {
        ExecuteDsl::execute(statement, self)
    }
}
