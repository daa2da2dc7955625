//! One turn at a time per key in this process: duplicates of a request wait
//! for the one in progress here, before they check out a connection, so a
//! flood of them holds one pooled connection and not the pool. The
//! database still decides what each turn gets (replay, mismatch, or a
//! holder in another process to wait for).
//!
//! A key is told apart by its scope, the key and the connection type: two
//! pools of one backend in one process (two databases) share the turns of
//! a scope and key, so a duplicate there may wait for the other database's
//! request, and answer 409 if that outlasts the wait. Under
//! `InFlight::Reject` no one waits, so there are no turns: the database
//! answers at once, holding its connection only for that.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use tokio::sync::{Mutex as TurnLock, OwnedMutexGuard};

use crate::InFlight;
use crate::telemetry::TARGET;

/// The connection type, a scope and a key.
type Id = (&'static str, String, String);

/// The lock of every key that someone holds or waits for in this process;
/// an entry leaves with the last of them, so the map holds no idle key.
static TURNS: LazyLock<Mutex<HashMap<Id, Arc<TurnLock<()>>>>> = LazyLock::new(Mutex::default);

/// The turn of one request with its key: the others with the key wait
/// until it is dropped. None under `InFlight::Reject`.
pub(crate) struct Turn {
    _held: Option<TurnGuard>,
}

struct TurnGuard {
    // Dropped before the interest, which may then remove the entry.
    _held: OwnedMutexGuard<()>,
    _interest: Interest,
}

/// The key is still in the process.
#[derive(Debug)]
pub(crate) struct StillInProgress;

/// Waits for the turn of `key` in `scope` on the backend named `backend`
/// (the same for sync and async connections to it), as long as
/// `in_flight` allows.
///
/// # Errors
///
/// [`StillInProgress`] when another request of this process held the key
/// throughout the wait.
pub(crate) async fn turn(
    backend: &'static str,
    scope: &str,
    key: &str,
    in_flight: InFlight,
) -> Result<Turn, StillInProgress> {
    let InFlight::Wait(wait) = in_flight else {
        return Ok(Turn { _held: None });
    };
    let interest = Interest::in_key((backend, scope.to_owned(), key.to_owned()));
    let lock = interest.lock.clone();
    let held = match lock.clone().try_lock_owned() {
        Ok(held) => held,
        Err(_) => {
            tracing::debug!(target: TARGET, scope, "waiting for a request with the same key in this process");
            let wait = wait.to_std().unwrap_or_default();
            tokio::time::timeout(wait, lock.lock_owned())
                .await
                .map_err(|_| StillInProgress)?
        }
    };
    Ok(Turn {
        _held: Some(TurnGuard {
            _held: held,
            _interest: interest,
        }),
    })
}

/// A request that holds or waits for the lock of a key.
struct Interest {
    id: Id,
    lock: Arc<TurnLock<()>>,
}

impl Interest {
    fn in_key(id: Id) -> Interest {
        let lock = turns().entry(id.clone()).or_default().clone();
        Interest { id, lock }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut turns = turns();
        // Every other clone of the lock belongs to an interest that has not
        // yet been dropped, and clones are made under this map's lock: two
        // left (the map's and this one) means no one else is interested.
        if Arc::strong_count(&self.lock) == 2 {
            turns.remove(&self.id);
        }
    }
}

fn turns() -> std::sync::MutexGuard<'static, HashMap<Id, Arc<TurnLock<()>>>> {
    // The map stays consistent whatever panicked while it was locked.
    TURNS.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use chrono::Duration;

    use super::*;

    #[tokio::test]
    async fn a_key_leaves_the_map_with_its_last_request() {
        let wait = |ms| InFlight::Wait(Duration::milliseconds(ms));
        let id = ("a", "gate-test".to_owned(), "k-1".to_owned());
        let first = turn("a", &id.1, &id.2, wait(0)).await.expect("a free key");
        let waited = turn("a", &id.1, &id.2, wait(10)).await;
        assert!(matches!(waited, Err(StillInProgress)));
        assert!(turns().contains_key(&id));
        // Another connection type, another database.
        let elsewhere = turn("b", &id.1, &id.2, wait(0)).await.expect("a free key elsewhere");
        drop(first);
        assert!(!turns().contains_key(&id), "no one holds or waits for the key");
        let again = turn("a", &id.1, &id.2, wait(0)).await.expect("a free key");
        drop((again, elsewhere));
        assert!(!turns().contains_key(&id));
    }

    #[tokio::test]
    async fn no_one_takes_turns_when_no_one_waits() {
        let first = turn("a", "gate-test", "k-2", InFlight::Reject).await.expect("no turn");
        let second = turn("a", "gate-test", "k-2", InFlight::Reject).await.expect("no turn");
        assert!(
            !turns()
                .keys()
                .any(|(_, scope, key)| (scope.as_str(), key.as_str()) == ("gate-test", "k-2"))
        );
        drop((first, second));
    }
}
