//! The relay service's handler threads: each worker hands its messages to
//! a thread of its own, so that it can give up on an attempt that outlasts
//! its lease and go on with another thread.

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::Instant;

use tracing::{Dispatch, Span};

use super::failure::{Failure, HandlerError};
use super::message::Message;
use crate::telemetry;

/// How many handlers it gave up on a service leaves running
/// per worker before its workers stop claiming until one has returned: a
/// bound on the threads left behind while every attempt hangs.
const ABANDONED_PER_WORKER: usize = 4;

/// A worker's way to its handler: a thread of the service that runs the
/// handler, so that the worker can give up on an attempt that outlasts its
/// lease and go on with another thread.
pub(super) struct Attempts<'scope, 'env, F> {
    scope: &'scope thread::Scope<'scope, 'env>,
    handler: &'env F,
    dispatch: &'env Dispatch,
    span: &'env Span,
    /// The service's handler threads given up on and still running.
    abandoned: &'env AtomicUsize,
    runner: Option<Runner>,
}

/// The thread that runs a worker's handler, one message at a time.
struct Runner {
    messages: mpsc::Sender<Message>,
    outcomes: mpsc::Receiver<Result<(), Failure>>,
    /// Set when the worker gives up on it.
    given_up: Arc<AtomicBool>,
}

impl<'scope, 'env, F> Attempts<'scope, 'env, F> {
    /// A worker's way to `handler`, its threads spawned in `scope`,
    /// reporting to `dispatch` inside `span`, and counted in `abandoned`
    /// (shared by the service's workers) while given up on and running.
    pub(super) fn new(
        scope: &'scope thread::Scope<'scope, 'env>,
        handler: &'env F,
        dispatch: &'env Dispatch,
        span: &'env Span,
        abandoned: &'env AtomicUsize,
    ) -> Self {
        Attempts {
            scope,
            handler,
            dispatch,
            span,
            abandoned,
            runner: None,
        }
    }

    /// Whether the service left so many handlers behind, given up on and
    /// still running, that its `workers` should claim nothing until one
    /// has returned: claims now would only leave more threads behind.
    pub(super) fn too_many_abandoned(&self, workers: usize) -> bool {
        self.abandoned.load(Ordering::SeqCst) >= ABANDONED_PER_WORKER * workers
    }

    /// The outcome of the handler for `message`, or `Err` with the failure
    /// to record when it did not return before `deadline`. Then the thread
    /// is left to its handler: a thread cannot be stopped from outside.
    /// What the handler returns later is dropped; its message was recorded
    /// as failed and is delivered again, as at-least-once allows.
    pub(super) fn hand_over<E>(
        &mut self,
        message: &Message,
        deadline: Option<Instant>,
    ) -> Result<Result<(), Failure>, String>
    where
        E: HandlerError,
        F: Fn(&Message) -> Result<(), E> + Sync,
    {
        let runner = match &mut self.runner {
            Some(runner) => runner,
            None => self.runner.insert(self.spawn()),
        };
        if runner.messages.send(message.clone()).is_err() {
            self.runner = None;
            return Ok(Err(Failure::Retry(String::from("the handler's thread ended"))));
        }
        let outcome = match deadline {
            Some(deadline) => runner
                .outcomes
                .recv_timeout(deadline.saturating_duration_since(Instant::now())),
            None => runner.outcomes.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match outcome {
            Ok(outcome) => Ok(outcome),
            Err(RecvTimeoutError::Timeout) => {
                // Counted before the channels close: the thread counts
                // itself out once it sees them closed.
                runner.given_up.store(true, Ordering::SeqCst);
                self.abandoned.fetch_add(1, Ordering::SeqCst);
                self.runner = None;
                given_up(message);
                Err(String::from(GIVEN_UP))
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.runner = None;
                Ok(Err(Failure::Retry(String::from("the handler's thread ended"))))
            }
        }
    }

    /// Starts a thread that runs the handler on each message sent to it.
    fn spawn<E>(&self) -> Runner
    where
        E: HandlerError,
        F: Fn(&Message) -> Result<(), E> + Sync,
    {
        let (messages, inbox) = mpsc::channel::<Message>();
        let (reply, outcomes) = mpsc::channel();
        let given_up = Arc::new(AtomicBool::new(false));
        let (handler, dispatch, span, abandoned) = (self.handler, self.dispatch, self.span, self.abandoned);
        let gave_up = Arc::clone(&given_up);
        self.scope.spawn(move || {
            traced(dispatch, span, || {
                for message in inbox {
                    if reply.send(handle(handler, &message)).is_err() {
                        break;
                    }
                }
            });
            if gave_up.load(Ordering::SeqCst) {
                abandoned.fetch_sub(1, Ordering::SeqCst);
            }
        });
        Runner {
            messages,
            outcomes,
            given_up,
        }
    }
}

/// Hands `message` to `handler`, with a panic as a failure of this message:
/// recorded like an error (backed off, and parked as dead after the last
/// attempt), so that a message that panics every time ends neither its
/// worker nor, after the lease, the next one. The handler sees only the
/// message, so the unwinding leaves no connection half-way.
fn handle<E, F>(handler: &F, message: &Message) -> Result<(), Failure>
where
    E: HandlerError,
    F: Fn(&Message) -> Result<(), E>,
{
    match panic::catch_unwind(AssertUnwindSafe(|| handler(message))) {
        Ok(handled) => handled.map_err(failure_of),
        Err(payload) => Err(panicked(&*payload)),
    }
}

/// How a handler's error is recorded: parked at once when permanent,
/// retried otherwise.
pub(super) fn failure_of<E: HandlerError>(failure: E) -> Failure {
    match failure.is_permanent() {
        true => Failure::Permanent(failure.text()),
        false => Failure::Retry(failure.text()),
    }
}

/// A handler's panic as the failure of its message, with the panic's text.
pub(super) fn panicked(payload: &(dyn std::any::Any + Send)) -> Failure {
    let text = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
    Failure::Retry(match text {
        Some(text) => format!("the handler panicked: {text}"),
        None => String::from("the handler panicked"),
    })
}

/// The error recorded for an attempt given up on at three quarters of its
/// lease.
pub(super) const GIVEN_UP: &str =
    "the handler did not return within three quarters of the lease; the attempt was given up";

/// Reports an attempt given up on.
pub(super) fn given_up(message: &Message) {
    tracing::warn!(
        target: telemetry::TARGET, message_id = %message.id, topic = %message.topic,
        attempt = message.attempt, "handler still running at three quarters of its lease; attempt given up"
    );
}

/// Runs `f` with `dispatch` as the thread's subscriber, inside `span`.
pub(super) fn traced<T>(dispatch: &Dispatch, span: &Span, f: impl FnOnce() -> T) -> T {
    tracing::dispatcher::with_default(dispatch, || span.in_scope(f))
}
