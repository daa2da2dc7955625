//! The backends: the connection types this crate stores keys on, and the
//! traits generic code names in its bounds.
//!
//! Code written once for every backend is generic over
//! [`StoreConnection`] (a plain diesel connection or a pooled one) or
//! [`RawConnection`] (the plain connection an operation receives). Both are
//! sealed, the way diesel seals `Connection`: the statements each database
//! needs are the methods of supertraits in a private module, which only
//! the crate implements and calls. Each table has one store trait, the same
//! for both kinds of connection ([`KeyStore`], `PhaseStore`, `OutboxStore`):
//! async-shaped, so that the protocol written against it exists once; a
//! synchronous connection's methods complete as they are sent, and a
//! synchronous entry point drives them with [`block_on`]. What only the
//! services on threads run is in the `Blocking*` traits beside them. A
//! database's rules (its name, limits and error classifiers) are
//! [`BackendRules`] on diesel's backend type.
//!
//! Everything one database does lives in its own folder of the source
//! (`sqlite/`, `postgres/`, `mysql/`: its connection impls, how it holds a
//! key, its clock, and its key, outbox and phase statements); what the
//! backends share is written once beside them: `keys/`, `outbox/` and
//! `phases/` (each statement trait, its rows and its shared statements),
//! `transaction.rs` and `purge.rs`.
//!
//! The write transaction first holds the key (SQLite: the database's write
//! lock; PostgreSQL: an advisory lock on the key; MySQL: a named lock on the
//! key). On SQLite it reads the record under that lock, runs the operation
//! and inserts the record once, completed. On PostgreSQL a key the replay
//! read found free is claimed in the round trip that takes the lock, and the
//! claim is completed after the operation. Where a read under the lock could
//! miss a concurrent commit (a call nested in a caller's transaction, a
//! PostgreSQL session at `REPEATABLE READ` or above, every call on MySQL,
//! whose named locks do not last as long as a caller's transaction), the
//! transaction claims the key with a guarded insert before the operation and
//! completes the record after it; otherwise a record found is read under the
//! lock and replaced once. Either way the primary key backs the lock: a
//! writer that got past it cannot commit a second record.

mod connection;
mod future;
mod history;
mod keys;
pub(crate) mod migrate;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
pub(crate) mod outbox;
pub(crate) mod phases;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod purge;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod row_with;
mod rules;
pub(crate) mod sealed;
pub(crate) mod send;
#[cfg(feature = "sqlite")]
mod sqlite;
mod transaction;

#[cfg(any(feature = "postgres-async", feature = "mysql-async"))]
pub(crate) use future::{AsyncTransaction, async_transaction_depth, async_unwind_to_depth, end_transaction};
pub(crate) use future::{Panic, block_on, catch_unwind};
pub(crate) use keys::{
    BlockingStore, Claim, ClaimOutcome, HeldKey, Hold, KeyNotClaimed, KeyRecordChanged, KeyStatements, KeyStore, Read,
    Record, Stored,
};
pub(crate) use phases::BlockingPhaseStore;
pub(crate) use purge::{purge_in_batches, sql_limit};
pub(crate) use rules::BackendRules;

/// The rules of the database that connection `C` reaches.
pub(crate) type RulesOf<C> = <C as KeyStore>::Rules;
pub(crate) use transaction::{transaction_depth, unwind_to_depth};

#[cfg(feature = "diesel-async")]
pub use connection::AsyncStoreConnection;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use connection::raw_connection;
pub use connection::{RawConnection, StoreConnection};
