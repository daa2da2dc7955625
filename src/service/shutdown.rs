//! Stopping the background services.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Tells background services ([`Relay::serve`](crate::outbox::Relay::serve),
/// [`Purger::serve`](crate::Purger::serve),
/// [`Completer::serve`](crate::phased::Completer::serve)) to stop. Clones share one signal:
/// keep one where the application shuts down (a signal handler, the end of
/// `main`) and give clones to the services.
///
/// Triggering is permanent and wakes every service at once, whatever it is
/// waiting for.
///
/// ```
/// use std::thread;
/// use idempotency::Shutdown;
///
/// let shutdown = Shutdown::new();
/// let service = {
///     let shutdown = shutdown.clone();
///     thread::spawn(move || {
///         while !shutdown.is_triggered() {
///             shutdown.wait(chrono::Duration::seconds(60));
///         }
///     })
/// };
/// shutdown.trigger();
/// assert!(service.join().is_ok(), "the service stopped at once, not after a minute");
/// ```
#[derive(Clone, Default)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    /// Wakes the async services' tasks as `changed` wakes the threads.
    #[cfg(feature = "diesel-async")]
    notify: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    triggered: bool,
    /// How often the relay was woken early: a new outbox message was
    /// announced.
    wakes: u64,
}

impl fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shutdown")
            .field("triggered", &self.is_triggered())
            .finish()
    }
}

impl Shutdown {
    /// A signal that has not been triggered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tells every service holding a clone to stop.
    pub fn trigger(&self) {
        self.state().triggered = true;
        self.notify_all();
    }

    /// Whether [`trigger`](Shutdown::trigger) was called.
    pub fn is_triggered(&self) -> bool {
        self.state().triggered
    }

    /// Waits until the signal is triggered or `timeout` has passed; returns
    /// whether it was triggered. A `timeout` that is not positive waits for
    /// nothing.
    pub fn wait(&self, timeout: chrono::Duration) -> bool {
        self.pause(timeout.to_std().unwrap_or_default())
    }

    /// [`wait`](Shutdown::wait) on the monotonic clock's durations, which
    /// the services' own loops count in.
    pub(crate) fn pause(&self, timeout: Duration) -> bool {
        self.wait_until(timeout, |_| false)
    }

    /// Wakes the relay's workers waiting in
    /// [`wait_for_wake`](Shutdown::wait_for_wake) without stopping them;
    /// a wait in [`wait`](Shutdown::wait) goes on.
    pub(crate) fn wake(&self) {
        self.state().wakes += 1;
        self.notify_all();
    }

    /// Wakes every thread and task waiting on the signal.
    fn notify_all(&self) {
        self.inner.changed.notify_all();
        #[cfg(feature = "diesel-async")]
        self.inner.notify.notify_waiters();
    }

    /// [`pause`](Shutdown::pause) for a task: waits without blocking its
    /// thread.
    #[cfg(feature = "diesel-async")]
    pub(crate) async fn paused(&self, timeout: Duration) -> bool {
        self.woken_until(timeout, |_| false).await
    }

    /// [`wait_for_wake`](Shutdown::wait_for_wake) for a task.
    #[cfg(feature = "diesel-async")]
    pub(crate) async fn woken_for(&self, seen: u64, timeout: Duration) {
        self.woken_until(timeout, |state| state.wakes != seen).await;
    }

    /// [`wait_until`](Shutdown::wait_until) for a task.
    #[cfg(feature = "diesel-async")]
    async fn woken_until(&self, timeout: Duration, woken: impl Fn(&State) -> bool) -> bool {
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        loop {
            // Registered before the state is read: a change after the read
            // wakes this wait.
            let mut notified = std::pin::pin!(self.inner.notify.notified());
            notified.as_mut().enable();
            {
                let state = self.state();
                if state.triggered || woken(&state) {
                    return state.triggered;
                }
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return self.is_triggered();
                    }
                }
                None => notified.await,
            }
        }
    }

    /// The number of wakes so far, to wait for the next one.
    pub(crate) fn wakes(&self) -> u64 {
        self.state().wakes
    }

    /// Waits until the signal is triggered, a wake after `seen` arrives, or
    /// `timeout` has passed.
    pub(crate) fn wait_for_wake(&self, seen: u64, timeout: Duration) {
        self.wait_until(timeout, |state| state.wakes != seen);
    }

    /// Waits until the signal is triggered, `woken` holds, or `timeout` has
    /// passed; returns whether the signal was triggered.
    fn wait_until(&self, timeout: Duration, woken: impl Fn(&State) -> bool) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.state();
        while !state.triggered && !woken(&state) {
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if left.is_zero() {
                break;
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        state.triggered
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
