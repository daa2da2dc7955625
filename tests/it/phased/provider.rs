//! The fake payment provider.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};

use diesel::r2d2::{ConnectionManager, Pool};

use super::rides::{ProviderError, RideDb};
use crate::common::TestDb;
use crate::common::wait;

/// What the provider does with the next request.
pub(super) enum Behaviour {
    /// Charges, or returns the charge made under the key before.
    Apply,
    /// Fails before charging.
    FailBefore,
    /// Charges, then fails as a timeout would: the caller cannot tell.
    TimeOutAfter,
    /// Waits at the gate, then charges.
    Block(Gate),
}

/// Holds a provider request until the test lets it go.
pub(super) struct Gate {
    pub(super) entered: mpsc::Sender<()>,
    pub(super) release: mpsc::Receiver<()>,
}

/// A gate, the receiver that hears a request arrive at it, and the sender
/// that lets the request go.
pub(super) fn gate() -> (Gate, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (entered, arrived) = mpsc::channel();
    let (open, release) = mpsc::channel();
    (Gate { entered, release }, arrived, open)
}

/// The fake payment provider: deduplicates by provider key in its own table,
/// reached through connections of its own, and follows a script of
/// behaviours, one per request, then applies.
pub(super) struct Provider<D: TestDb> {
    pub(super) pool: Pool<ConnectionManager<D::Conn>>,
    pub(super) script: Mutex<VecDeque<Behaviour>>,
    pub(super) requests: AtomicUsize,
    pub(super) db: PhantomData<fn() -> D>,
}

impl<D: RideDb> Provider<D> {
    pub(super) fn new(url: &str) -> Self {
        Provider {
            pool: D::pool_at(url, 2),
            script: Mutex::new(VecDeque::new()),
            requests: AtomicUsize::new(0),
            db: PhantomData,
        }
    }

    pub(super) fn then(&self, behaviour: Behaviour) -> &Self {
        self.script.lock().expect("the script").push_back(behaviour);
        self
    }

    /// Requests this process made, failed ones included.
    pub(super) fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    pub(super) fn charge(&self, provider_key: &str, cents: i64) -> Result<String, ProviderError> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let behaviour = self
            .script
            .lock()
            .expect("the script")
            .pop_front()
            .unwrap_or(Behaviour::Apply);
        match &behaviour {
            Behaviour::FailBefore => return Err(ProviderError::Unavailable),
            Behaviour::Block(gate) => {
                gate.entered.send(()).expect("the test waits at the gate");
                wait::recv(&gate.release, "the test opens the gate");
            }
            Behaviour::Apply | Behaviour::TimeOutAfter => {}
        }
        let mut conn = self.pool.get().expect("a provider connection");
        let (charge, first_cents) = D::apply_charge(&mut conn, provider_key, cents).expect("the provider's table");
        if first_cents != cents {
            return Err(ProviderError::KeyReused);
        }
        match behaviour {
            Behaviour::TimeOutAfter => Err(ProviderError::TimedOut),
            _ => Ok(charge),
        }
    }
}
