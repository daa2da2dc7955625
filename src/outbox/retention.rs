//! How long delivered messages are kept, and their purge; how long the
//! outbox's own writes wait for SQLite's write lock.

use super::error::Error;
use crate::backend::outbox::BlockingOutboxStore;
use crate::backend::{self, BlockingStore, StoreConnection};
use crate::clock::Clock;
use crate::in_flight::InFlight;

/// How long delivered messages are kept by default.
pub(crate) const DEFAULT_RETENTION: chrono::Duration = chrono::Duration::days(7);

/// How long the outbox's own writes (claims, outcomes, requeues, purges)
/// wait for SQLite's write lock while the application's calls hold it; as
/// long as a call waits by default.
pub(super) const WRITE_LOCK_WAIT: InFlight = InFlight::Wait(chrono::Duration::seconds(5));

/// Deletes the messages delivered `retention` ago on `clock`, in batches of
/// `batch_size`, ending after the batch in which `stop` becomes true.
pub(crate) fn purge_delivered<C: StoreConnection>(
    conn: &mut C,
    clock: &Clock,
    retention: chrono::Duration,
    batch_size: usize,
    stop: &dyn Fn() -> bool,
) -> Result<usize, Error> {
    let conn = conn.raw();
    // One fixed cut-off, so the loop ends while deliveries go on.
    let cutoff = clock.now(conn)? - retention;
    let purged = backend::purge_in_batches("idempotency_outbox", batch_size, stop, |limit| {
        conn.write_now(WRITE_LOCK_WAIT, |tx| tx.purge_delivered_batch(cutoff, limit))
    })?;
    Ok(purged)
}
