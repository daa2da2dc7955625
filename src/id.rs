//! Ids made by this crate (outbox messages, leases, operations in phases):
//! UUIDs in the version 7 layout (RFC 9562), so that their text
//! sorts in the order they were made.
//!
//! 48 bits of Unix milliseconds, then a 12-bit counter that keeps ids made in
//! the same millisecond by this process increasing, then 62 random bits that
//! keep ids of different processes apart. One migration serves every backend
//! because the id is plain text made here rather than a database sequence.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::key::uuid_text;

/// The last millisecond handed out and the counter within it.
static LAST: Mutex<(u64, u16)> = Mutex::new((0, 0));

const COUNTER_LIMIT: u16 = 1 << 12;

/// A new id, greater than every id this process made before.
pub(crate) fn new() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let (millis, counter) = {
        let mut last = LAST.lock().unwrap_or_else(PoisonError::into_inner);
        if now > last.0 {
            *last = (now, 0);
        } else if last.1 + 1 < COUNTER_LIMIT {
            last.1 += 1;
        } else {
            // The counter ran out within one millisecond, or the system
            // clock went back: borrow the next millisecond rather than
            // break the order.
            *last = (last.0 + 1, 0);
        }
        *last
    };
    let random = random_bits();

    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&millis.to_be_bytes()[2..]);
    bytes[6..8].copy_from_slice(&(0x7000 | counter).to_be_bytes());
    bytes[8..].copy_from_slice(&((random >> 2) | (0b10 << 62)).to_be_bytes());
    uuid_text(&bytes)
}

/// 64 bits that differ between processes and between calls. `RandomState`
/// is seeded from the operating system's randomness, which spares a
/// dependency; the process id and a counter make every input distinct.
fn random_bits() -> u64 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    hasher.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_uuid_v7_shaped_and_increase() {
        let ids: Vec<String> = (0..10_000).map(|_| super::new()).collect();
        for id in &ids {
            assert_eq!(id.len(), 36);
            assert_eq!(&id[14..15], "7", "version nibble of {id}");
            assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"), "variant bits of {id}");
        }
        assert!(
            ids.windows(2).all(|pair| pair[0] < pair[1]),
            "ids made in sequence sort in sequence"
        );
    }
}
