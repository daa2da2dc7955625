//! Purges in bounded batches, each its own short transaction, so that they
//! can run beside live traffic.

use std::time::Instant;

use diesel::QueryResult;

use crate::telemetry;

/// A row count as SQL's `LIMIT` takes it.
pub(crate) fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// Runs `batch` with `batch_size` until it deletes fewer rows than that, or
/// `stop` holds after a batch, and returns the total: a purge of `table` in
/// bounded batches, each reported with the time it took.
///
/// # Panics
///
/// If `batch_size` is zero.
pub(crate) fn purge_in_batches(
    table: &'static str,
    batch_size: usize,
    stop: &dyn Fn() -> bool,
    mut batch: impl FnMut(usize) -> QueryResult<usize>,
) -> QueryResult<usize> {
    assert!(batch_size > 0, "batch_size must be positive");
    let started = Instant::now();
    let (mut total, mut batches) = (0, 0);
    loop {
        let batch_started = Instant::now();
        let deleted = match batch(batch_size) {
            Ok(deleted) => deleted,
            Err(error) => {
                // The batches before this one are committed: counted, so a
                // purge that keeps failing halfway still shows its work.
                if batches > 0 {
                    telemetry::purged(table, total, batches, started.elapsed());
                }
                return Err(error);
            }
        };
        telemetry::purge_batch(table, deleted, batch_started.elapsed());
        total += deleted;
        batches += 1;
        if deleted < batch_size || stop() {
            telemetry::purged(table, total, batches, started.elapsed());
            return Ok(total);
        }
    }
}
