//! Repository functions made idempotent where they are called.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::StoreConnection;
use crate::config::Config;
use crate::error::Error;
use crate::outcome::Outcome;

/// Makes a repository function such as
/// `fn create_order(conn: &mut PgConnection, order: &NewOrder) -> QueryResult<Order>`
/// idempotent at the call site:
///
/// ```text
/// create_order.idempotent(&mut conn, scope, key, &new_order)
/// ```
///
/// This is [`run_idempotent`](crate::run_idempotent) with the request given
/// once: the value that is fingerprinted is exactly the value the function
/// receives, so the two cannot drift apart the way
/// `run_idempotent(conn, scope, key, &a, |tx| create_order(tx, &b))` can.
///
/// Implemented for every `FnOnce(&mut Conn, &Q) -> Result<R, E>`, where
/// `Conn` is the plain diesel connection (`SqliteConnection` or
/// `PgConnection`). `conn` may be that connection or an r2d2 pooled one; the
/// function always receives the plain connection, inside the transaction
/// that stores the key. Functions that are generic over the connection need
/// the connection named: `create_order::<PgConnection>.idempotent(..)`.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::{Idempotent, Outcome};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize)]
/// struct NewOrder { item: String }
///
/// #[derive(Serialize, Deserialize, Debug, PartialEq)]
/// struct Order { id: i64, item: String }
///
/// fn create_order(conn: &mut SqliteConnection, order: &NewOrder) -> QueryResult<Order> {
///     diesel::sql_query("INSERT INTO orders (item) VALUES (?)")
///         .bind::<diesel::sql_types::Text, _>(&order.item)
///         .execute(conn)?;
///     #[derive(QueryableByName)]
///     struct Id { #[diesel(sql_type = diesel::sql_types::BigInt)] id: i64 }
///     let row: Id = diesel::sql_query("SELECT last_insert_rowid() AS id").get_result(conn)?;
///     Ok(Order { id: row.id, item: order.item.clone() })
/// }
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
///
/// let new_order = NewOrder { item: "book".into() };
/// let first = create_order.idempotent(&mut conn, "shop", "order-5d1e", &new_order)?;
/// let retry = create_order.idempotent(&mut conn, "shop", "order-5d1e", &new_order)?;
/// assert_eq!(first, Outcome::Executed(Order { id: 1, item: "book".into() }));
/// assert_eq!(retry, Outcome::Replayed(Order { id: 1, item: "book".into() }));
/// # Ok(())
/// # }
/// ```
pub trait Idempotent<Conn, Q: ?Sized, R, E>: private::Sealed<Conn, Q, R, E> {
    /// Runs this function at most once for `(scope, key)` with
    /// [`Config::default()`]; see [`Config::run`].
    ///
    /// # Errors
    ///
    /// As [`Config::run`]; the function's own error is
    /// [`Error::Operation`].
    fn idempotent<C>(self, conn: &mut C, scope: &str, key: &str, request: &Q) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection<Raw = Conn>,
        Q: Serialize,
        R: Serialize + DeserializeOwned,
    {
        self.idempotent_with(&Config::default(), conn, scope, key, request)
    }

    /// Runs this function at most once for `(scope, key)` under `config`;
    /// see [`Config::run`].
    ///
    /// # Errors
    ///
    /// As [`Config::run`]; the function's own error is
    /// [`Error::Operation`].
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use chrono::Duration;
    /// use diesel::prelude::*;
    /// use idempotency::{Config, Idempotent};
    ///
    /// fn refund(_conn: &mut SqliteConnection, cents: &u32) -> QueryResult<u32> {
    ///     Ok(*cents)
    /// }
    ///
    /// let config = Config::default().retention(Duration::days(7));
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// assert!(!refund.idempotent_with(&config, &mut conn, "refunds", "refund-1", &250)?.is_replayed());
    /// assert!(refund.idempotent_with(&config, &mut conn, "refunds", "refund-1", &250)?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    fn idempotent_with<C>(
        self,
        config: &Config,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection<Raw = Conn>,
        Q: Serialize,
        R: Serialize + DeserializeOwned,
    {
        config.run(conn, scope, key, request, |tx| self(tx, request))
    }
}

impl<F, Conn, Q, R, E> Idempotent<Conn, Q, R, E> for F
where
    F: FnOnce(&mut Conn, &Q) -> Result<R, E>,
    Q: Serialize + ?Sized,
    R: Serialize + DeserializeOwned,
{
}

mod private {
    /// Keeps [`Idempotent`](super::Idempotent) to the functions it is
    /// implemented for, so that methods can be added to it later, and lets
    /// its methods call the function.
    pub trait Sealed<Conn, Q: ?Sized, R, E>: FnOnce(&mut Conn, &Q) -> Result<R, E> + Sized {}

    impl<F, Conn, Q, R, E> Sealed<Conn, Q, R, E> for F
    where
        F: FnOnce(&mut Conn, &Q) -> Result<R, E>,
        Q: ?Sized,
    {
    }
}
