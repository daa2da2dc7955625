//! Waits with a deadline. A test that waits for another thread, a child
//! process, a background service or the server waits at most
//! [`PATIENCE`], then fails saying what it waited for: a hang is a failure
//! with a message, never a run that does not end.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use idempotency::Shutdown;

/// How long a test waits for something that a healthy run does in
/// milliseconds; far beyond what it needs, so it only ends a test that hangs.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Polls until `condition` holds, for what works on its own schedule (a
/// background service, the server); fails after [`PATIENCE`].
pub fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {PATIENCE:?} waiting for {what}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// The next value from `rx`, which a thread sends once it has reached a
/// point: `what` says what the value means, for the failure message.
pub fn recv<T>(rx: &Receiver<T>, what: &str) -> T {
    match rx.recv_timeout(PATIENCE) {
        Ok(value) => value,
        Err(RecvTimeoutError::Timeout) => panic!("{what}: nothing came within {PATIENCE:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what}: the sender is gone without sending"),
    }
}

/// Joins the thread `handle`, named `what`, once it has ended.
pub fn join<T>(handle: JoinHandle<T>, what: &str) -> T {
    let deadline = Instant::now() + PATIENCE;
    while !handle.is_finished() {
        assert!(Instant::now() < deadline, "{what} did not end within {PATIENCE:?}");
        thread::sleep(Duration::from_millis(1));
    }
    handle.join().unwrap_or_else(|_| panic!("{what} panicked"))
}

/// A barrier for `n` threads, as `std::sync::Barrier`, that fails a thread
/// that has waited [`PATIENCE`] for the others: a thread that panics before
/// it arrives does not leave the others waiting for ever.
pub struct Barrier {
    n: usize,
    state: Mutex<(usize, u64)>,
    all_arrived: Condvar,
}

impl Barrier {
    pub fn new(n: usize) -> Barrier {
        Barrier {
            n,
            state: Mutex::new((0, 0)),
            all_arrived: Condvar::new(),
        }
    }

    /// Waits until all `n` threads have called `wait` in this round.
    pub fn wait(&self) {
        let deadline = Instant::now() + PATIENCE;
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let round = state.1;
        state.0 += 1;
        if state.0 == self.n {
            *state = (0, round + 1);
            self.all_arrived.notify_all();
            return;
        }
        while state.1 == round {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "only {} of {} threads reached the barrier within {PATIENCE:?}",
                state.0,
                self.n
            );
            state = self
                .all_arrived
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
}

/// Triggers the shutdown however the test ends, so that a failed assertion
/// inside `thread::scope` does not wait for ever for the service it stops.
pub struct StopOnDrop<'a>(pub &'a Shutdown);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.trigger();
    }
}
