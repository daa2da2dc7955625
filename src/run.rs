//! The combinator: validate, fingerprint, claim, run the operation, store.

use std::panic::{self, AssertUnwindSafe};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::Config;
use crate::error::Error;
use crate::outcome::Outcome;
use crate::store::{self, Backend, COMPLETED, NewRecord, PROCESSING, StoreConnection, Stored};
use crate::{fingerprint, key};

/// Runs `op` at most once for `(scope, key)` with [`Config::default()`]; see
/// [`Config::run`].
///
/// # Errors
///
/// As [`Config::run`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::prelude::*;
/// use idempotency::{run_idempotent, Outcome};
///
/// let mut conn = idempotency::testing::sqlite_memory();
/// diesel::sql_query("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)").execute(&mut conn)?;
///
/// let place = |conn: &mut SqliteConnection| {
///     run_idempotent(conn, "orders", "3f6c1f2e-retry-me", &"one book", |tx| {
///         diesel::sql_query("INSERT INTO orders (item) VALUES ('book')").execute(tx)?;
///         Ok::<_, diesel::result::Error>(String::from("order 1 placed"))
///     })
/// };
///
/// assert_eq!(place(&mut conn)?, Outcome::Executed(String::from("order 1 placed")));
/// // The response was lost; the client retries with the same key.
/// assert_eq!(place(&mut conn)?, Outcome::Replayed(String::from("order 1 placed")));
///
/// #[derive(QueryableByName)]
/// struct Count { #[diesel(sql_type = diesel::sql_types::BigInt)] n: i64 }
/// let orders: Count = diesel::sql_query("SELECT count(*) AS n FROM orders").get_result(&mut conn)?;
/// assert_eq!(orders.n, 1);
/// # Ok(())
/// # }
/// ```
pub fn run_idempotent<C, Q, R, E, F>(
    conn: &mut C,
    scope: &str,
    key: &str,
    request: &Q,
    op: F,
) -> Result<Outcome<R>, Error<E>>
where
    C: StoreConnection,
    Q: Serialize + ?Sized,
    R: Serialize + DeserializeOwned,
    F: FnOnce(&mut C::Raw) -> Result<R, E>,
{
    Config::default().run(conn, scope, key, request, op)
}

impl Config {
    /// Runs `op` at most once for `(scope, key)` and returns its result on
    /// this and every later call with the same key and request.
    ///
    /// The key record and everything `op` writes through its connection are
    /// committed in one transaction (a savepoint when `conn` is already in
    /// one), so either both exist or neither does:
    ///
    /// 1. `scope` and `key` are checked: non-empty, at most
    ///    [`max_key_len`](Config::max_key_len) bytes, visible ASCII; a key
    ///    that looks like a payment card number is refused.
    /// 2. `request` is fingerprinted: SHA-256 of its canonical JSON.
    /// 3. A completed, unexpired record for `(scope, key)` is answered from
    ///    storage with one read: [`Outcome::Replayed`] when the fingerprints
    ///    match, [`Error::Mismatch`] when they do not. `op` is not called.
    /// 4. Otherwise the key is claimed in a write transaction, waiting for a
    ///    transaction that holds it as the [`InFlight`](crate::InFlight)
    ///    policy allows. `op` runs on the same connection, its result is
    ///    stored as JSON, and the transaction commits: [`Outcome::Executed`].
    ///
    /// The fingerprint covers `request` alone. Where one scope serves several
    /// operations, put the operation's name in the request or in the scope,
    /// or one operation's key would replay another's result.
    ///
    /// A record whose retention has ended is taken over as new, so after
    /// [`retention`](Config::retention) a key may execute again.
    ///
    /// # Errors
    ///
    /// No error spends the key: every one leaves nothing written.
    ///
    /// - [`Error::InvalidScope`], [`Error::InvalidKey`]: refused before
    ///   anything was read or written.
    /// - [`Error::Mismatch`]: the key was used with another request.
    /// - [`Error::InProgress`]: another transaction still holds the key when
    ///   the in-flight policy ran out.
    /// - [`Error::Operation`]: `op` failed; its writes were rolled back.
    /// - [`Error::Codec`]: the request or the result did not serialize
    ///   (rolled back), or a stored response no longer decodes into `R`
    ///   (`op` is not run again).
    /// - [`Error::Storage`]: the database failed; rolled back.
    ///
    /// # Panics
    ///
    /// A panic in `op` rolls the transaction (or savepoint) back and then
    /// resumes; the key stays free and the connection is left as it was
    /// before the call: outside a transaction, or in the caller's.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::{Config, Error};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let config = Config::default();
    /// let charge = |conn: &mut _, cents: u32| {
    ///     config.run(conn, "payments", "charge-7f3a", &cents, |_tx| Ok::<_, std::convert::Infallible>(cents))
    /// };
    ///
    /// assert_eq!(charge(&mut conn, 500)?.into_inner(), 500);
    /// assert!(matches!(charge(&mut conn, 900), Err(Error::Mismatch)));
    /// assert!(charge(&mut conn, 500)?.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    pub fn run<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        op: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C::Raw) -> Result<R, E>,
    {
        key::validate_scope(scope, self.max_key_len).map_err(Error::InvalidScope)?;
        key::validate_key(key, self.max_key_len).map_err(Error::InvalidKey)?;
        let request_hash = fingerprint::of(request).map_err(Error::Codec)?;
        let conn = conn.raw();
        let now = self.now();
        let record = NewRecord {
            scope,
            idempotency_key: key,
            request_hash: &request_hash,
            status: PROCESSING,
            created_at: now.naive_utc(),
            expires_at: (now + self.retention).naive_utc(),
        };

        let outcome = match conn.find(scope, key) {
            Ok(Some(stored)) if stored.status == COMPLETED && stored.expires_at > record.created_at => {
                replay(stored, &request_hash)
            }
            Ok(_) => self.execute(conn, &record, op),
            // A reader kept out by a writer (SQLite outside WAL mode) takes
            // the write path, which waits as the in-flight policy allows and
            // reads again once it holds the lock.
            Err(error) if C::Raw::is_in_flight_timeout(&error) => self.execute(conn, &record, op),
            Err(error) => Err(Error::Storage(error)),
        };
        outcome.map_err(|error| match error {
            Error::Storage(ref storage) if C::Raw::is_in_flight_timeout(storage) => Error::InProgress,
            other => other,
        })
    }

    fn execute<B, R, E, F>(&self, conn: &mut B, record: &NewRecord<'_>, op: F) -> Result<Outcome<R>, Error<E>>
    where
        B: Backend,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut B) -> Result<R, E>,
    {
        let (scope, key) = (record.scope, record.idempotency_key);
        // A panic in `op` is carried out of the transaction, so that it
        // rolls back before the panic goes on.
        let mut panicked = None;
        let result = conn.write_transaction(self.in_flight, |tx| {
            if !tx.claim(record)? {
                // Held by a record that is not ours to take over: replay it
                // (or report it in progress) without calling `op`.
                match tx.find(scope, key)? {
                    Some(stored) => return replay(stored, record.request_hash),
                    // Purged between the claim and this read, so free now.
                    None if tx.claim(record)? => {}
                    None => return Err(Error::InProgress),
                }
            }
            let depth = store::transaction_depth(tx)?;
            let value = match panic::catch_unwind(AssertUnwindSafe(|| op(tx))) {
                Ok(Ok(value)) => value,
                Ok(Err(error)) => return Err(Error::Operation(error)),
                Err(payload) => {
                    // The panic goes on whatever this finds: a connection
                    // that cannot roll back is left marked broken, which
                    // makes r2d2 discard it.
                    let _ = store::unwind_to_depth(tx, depth);
                    panicked = Some(payload);
                    return Err(Error::Storage(diesel::result::Error::RollbackTransaction));
                }
            };
            let response = serde_json::to_string(&value).map_err(Error::Codec)?;
            tx.complete(scope, key, &response, self.now().naive_utc())?;
            Ok(Outcome::Executed(value))
        });
        if let Some(payload) = panicked {
            panic::resume_unwind(payload);
        }
        result
    }
}

/// The answer from a stored record: its response when the request matches.
fn replay<R: DeserializeOwned, E>(stored: Stored, request_hash: &str) -> Result<Outcome<R>, Error<E>> {
    if stored.request_hash != request_hash {
        return Err(Error::Mismatch);
    }
    match stored.response {
        Some(response) if stored.status == COMPLETED => serde_json::from_str(&response)
            .map(Outcome::Replayed)
            .map_err(Error::Codec),
        // Claimed by an enclosing call on this same connection whose
        // operation has not finished.
        _ => Err(Error::InProgress),
    }
}
