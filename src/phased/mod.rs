//! Operations in phases: idempotent operations with a foreign call in the
//! middle.
//!
//! [`run_idempotent`](crate::run_idempotent) makes an operation atomic
//! because everything happens in one database transaction. "Create the
//! ride, charge the card at the provider, record the charge and answer"
//! cannot: no transaction can hold the call to the payment provider (and on
//! SQLite it must not, since it would hold the only write lock). A
//! [`Phased`] operation instead commits a *recovery point* after each step:
//!
//! - [`Steps::phase`] runs a closure in a transaction of its own and stores
//!   its output with the recovery point in the same commit;
//! - [`Steps::call`] runs outside any transaction, with a *provider key*
//!   the provider deduplicates on, and stores the call's result in a short
//!   commit of its own;
//! - [`Steps::finish`] stores the response in the last transaction.
//!
//! On diesel-async connections (feature `diesel-async`),
//! `Phased::run_async` gives the body `AsyncSteps`, whose steps take async
//! closures and are awaited, under the same contract: see the
//! [async guide](crate::guide::asynchronous).
//!
//! A retry (or the [`Completer`]) runs the closure again from the top:
//! every step that committed returns its stored output without running, and
//! the operation goes on from the first step that did not. Once finished,
//! every retry replays the response with one read.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use diesel::prelude::*;
//! use idempotency::phased::Phased;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize)]
//! struct NewRide { rider: String, card: String }
//!
//! #[derive(Serialize, Deserialize, Debug, PartialEq)]
//! enum Reply { Created { ride: i64, charge: String }, Declined }
//!
//! #[derive(Debug)]
//! enum RideError { Database(diesel::result::Error), Provider(String) }
//!
//! impl From<diesel::result::Error> for RideError {
//!     fn from(error: diesel::result::Error) -> Self { RideError::Database(error) }
//! }
//!
//! impl std::fmt::Display for RideError {
//!     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
//!         match self {
//!             RideError::Database(_) => f.write_str("the ride could not be saved"),
//!             RideError::Provider(why) => write!(f, "the payment provider failed: {why}"),
//!         }
//!     }
//! }
//!
//! impl std::error::Error for RideError {}
//!
//! /// A payment provider that deduplicates on the key it is given; `None`
//! /// when it declines the card.
//! fn charge(_card: &str, cents: u32, provider_key: &str) -> Result<Option<String>, RideError> {
//!     Ok(Some(format!("ch_{}_{cents}", &provider_key[..8])))
//! }
//!
//! let mut conn = idempotency::testing::sqlite_memory();
//! diesel::sql_query("CREATE TABLE rides (id INTEGER PRIMARY KEY, rider TEXT NOT NULL, charge TEXT)").execute(&mut conn)?;
//!
//! let request = NewRide { rider: "ada".into(), card: "tok_visa".into() };
//! let create_ride = |conn: &mut SqliteConnection| {
//!     Phased::new("create-ride").run(conn, "rider-ada", "ride-7c1e", &request, |s| {
//!         let ride: i64 = s.phase("ride_created", |tx| {
//!             diesel::sql_query("INSERT INTO rides (rider) VALUES (?)")
//!                 .bind::<diesel::sql_types::Text, _>(&request.rider)
//!                 .execute(tx)?;
//!             Ok::<i64, RideError>(
//!                 diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>("last_insert_rowid()")).get_result(tx)?,
//!             )
//!         })?;
//!         let charged = s.call("charged", |provider_key| charge(&request.card, 20_00, provider_key))?;
//!         s.finish(|tx| match charged {
//!             // A declined card is an answer: stored and replayed.
//!             None => Ok::<_, RideError>(Reply::Declined),
//!             Some(charge) => {
//!                 diesel::sql_query("UPDATE rides SET charge = ? WHERE id = ?")
//!                     .bind::<diesel::sql_types::Text, _>(&charge)
//!                     .bind::<diesel::sql_types::BigInt, _>(ride)
//!                     .execute(tx)?;
//!                 Ok(Reply::Created { ride, charge })
//!             }
//!         })
//!     })
//! };
//!
//! let first = create_ride(&mut conn)?;
//! assert!(!first.is_replayed());
//! assert_eq!(create_ride(&mut conn)?.into_inner(), first.into_inner());
//! # let _ = RideError::Provider(String::new());
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! # }
//! ```
//!
//! # The contract
//!
//! - **The key is spent at the first commit**: the first phase's (or, when
//!   the operation starts with a call, the commit that records the call as
//!   started). An error after that keeps the recovery point: the client
//!   retries *the same request* until it gets a definitive answer, a
//!   success or a failure the operation chose to store (a declined card is
//!   a response, not an error). Only a failure before the first commit
//!   leaves the key free, as for a single call. Another request under the
//!   key, or another operation (a [`Phased`] of another name), is
//!   [`Error::Mismatch`](crate::Error::Mismatch), also while the first one
//!   runs.
//! - **One attempt at a time.** An attempt holds a lease (default 90
//!   seconds, renewed at every commit); every commit requires the lease's
//!   token, so an attempt whose lease was taken over commits nothing (its
//!   phase rolls back, the step fails with [`Error::InProgress`](crate::Error::InProgress)). A retry
//!   that arrives while another attempt holds the lease waits as the
//!   [`InFlight`](crate::InFlight) policy allows, then gets
//!   [`Error::InProgress`](crate::Error::InProgress) (409). Choose the lease longer than any single
//!   step takes, foreign calls included.
//! - **A crashed attempt** leaves its lease to run out; the next retry, or
//!   the [`Completer`], takes it over and resumes from the last committed
//!   recovery point. An attempt that fails (an error or a panic) frees its
//!   lease at once.
//! - **Deterministic steps.** A resume runs the closure from the top, so
//!   the steps must come in the same order with the same names; a step
//!   whose name differs from the one recorded at its position is refused
//!   with [`Error::PhaseRenamed`](crate::Error::PhaseRenamed) (a deploy renamed a phase while operations
//!   were in flight).
//! - **Foreign calls.** [`Steps::call`] is repeated with the same provider
//!   key until its result is committed; the provider must deduplicate on
//!   that key. The key derives from an id minted at the first commit, never
//!   from the client's key, so a key that executes again after the
//!   retention cannot fetch an old charge back. Providers forget their keys
//!   (Stripe after at least 24 hours): once the
//!   [`provider_horizon`](Phased::provider_horizon) has passed since a call
//!   was first made, it is never repeated; the operation is *parked* for a
//!   person ([`Error::Parked`](crate::Error::Parked)). [`Steps::call_at_most_once`] serves
//!   providers that do not deduplicate: an interrupted call parks instead
//!   of calling again.
//! - **Retention** counts from the finish, as for single calls; a running
//!   or parked operation is never purged.
//! - **The request** is stored only with
//!   [`store_requests`](Phased::store_requests), which a [`Completer`] needs
//!   to finish operations whose clients went away. Without it, an
//!   abandoned operation waits for its client's retry.
//!
//! # Which tool for which operation
//!
//! A single transaction ([`run_idempotent`](crate::run_idempotent)) when
//! the operation only writes to the database: one commit, the cheapest.
//! The [outbox](crate::outbox) when another system must hear of it but the
//! answer does not depend on that system: the message commits with the
//! operation and is delivered afterwards. A phased operation when the
//! answer depends on a foreign call (a charge): several commits, a stored
//! request for the completer, and a provider that deduplicates.

#[cfg(feature = "diesel-async")]
mod async_steps;
mod attempt;
mod completer;
mod definition;
mod operation;
mod steps;

#[cfg(feature = "diesel-async")]
pub use async_steps::AsyncSteps;
pub use attempt::Finished;
pub use completer::{Completer, Completions, Parked};
pub use definition::Phased;
pub use steps::Steps;
