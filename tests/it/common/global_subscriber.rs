//! This test binary's global `tracing` subscriber, installed once.
//!
//! A callsite caches whether any subscriber wants it the first time a
//! thread meets it. Tests capture events with a thread-local subscriber,
//! and a callsite met first by another test's thread while no such
//! subscriber was live could stay cached as unwanted, racing with a
//! capture that begins at that moment. The global subscriber wants every
//! callsite of the crate, so none is ever cached as unwanted; with the
//! `axum` feature it also counts the requests that waited for their turn
//! ([`turn_waits`](super::http::turn_waits)).

use std::sync::Once;

use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::layer::{Layer, SubscriberExt};

/// Installs the global subscriber, once per process.
pub fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(CrateCallsites);
        #[cfg(feature = "axum")]
        let subscriber = subscriber.with(super::http::turn_waits::Counter);
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber in the tests");
    });
    tracing::callsite::rebuild_interest_cache();
}

/// Wants every callsite of the crate and does nothing with what it gets.
struct CrateCallsites;

impl<S: Subscriber> Layer<S> for CrateCallsites {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        crate_interest(metadata)
    }
}

/// The interest of a layer of the global subscriber in a callsite: always
/// in the crate's, never in another's.
pub fn crate_interest(metadata: &Metadata<'_>) -> Interest {
    if metadata.target() == "idempotency" {
        Interest::always()
    } else {
        Interest::never()
    }
}
