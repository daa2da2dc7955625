//! An operation in phases as the application defines it: its name and
//! its policy, and what an attempt of it knows before it reads the
//! operation.

use chrono::Duration;

use crate::clock::assert_duration;
use crate::config::Config;
use crate::outcome::Origin;

/// An operation in phases, named for the [`Completer`](super::Completer),
/// and its policy. Built with consuming builder methods:
///
/// | setting | default |
/// | --- | --- |
/// | [`config`](Phased::config) | [`Config::default()`]: retention, in-flight policy, key length, clock |
/// | [`lease`](Phased::lease) | 90 seconds |
/// | [`provider_horizon`](Phased::provider_horizon) | 23 hours |
/// | [`store_requests`](Phased::store_requests) | `false` |
///
/// See the [module docs](super) for the contract.
///
/// ```
/// use chrono::Duration;
/// use idempotency::phased::Phased;
///
/// let create_ride = Phased::new("create-ride")
///     .lease(Duration::seconds(60))
///     .provider_horizon(Duration::hours(20))
///     .store_requests(true);
/// # let _ = create_ride;
/// ```
#[derive(Debug, Clone)]
pub struct Phased {
    pub(super) name: String,
    pub(crate) config: Config,
    pub(super) lease: Duration,
    pub(super) provider_horizon: Duration,
    pub(super) store_requests: bool,
}

impl Phased {
    /// An operation named `name`, with the defaults in the table above. The
    /// name is stored with every operation, so that a
    /// [`Completer`](super::Completer) finds the code that finishes it.
    pub fn new(name: impl Into<String>) -> Self {
        Phased {
            name: name.into(),
            config: Config::default(),
            lease: Duration::seconds(90),
            provider_horizon: Duration::hours(23),
            store_requests: false,
        }
    }

    /// The policy for keys, retention, waiting for another attempt and the
    /// clock (default [`Config::default()`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// How long an attempt holds the operation without committing (default
    /// 90 seconds): after it, another attempt may take the operation over.
    /// Every commit renews it. Choose it longer than any step takes, the
    /// foreign call's timeout included.
    ///
    /// # Panics
    ///
    /// If `lease` is not positive or longer than 100 years.
    pub fn lease(mut self, lease: Duration) -> Self {
        assert_duration(lease, "lease");
        self.lease = lease;
        self
    }

    /// How long after a call was first made it may still be repeated
    /// (default 23 hours, under the 24 hours Stripe keeps its idempotency
    /// keys at least). Past it, an unfinished call is never repeated: the
    /// provider may have forgotten the key and would apply it again. The
    /// operation is parked for a person instead.
    ///
    /// # Panics
    ///
    /// If `horizon` is not positive or longer than 100 years.
    pub fn provider_horizon(mut self, horizon: Duration) -> Self {
        assert_duration(horizon, "provider horizon");
        self.provider_horizon = horizon;
        self
    }

    /// Whether the request is stored with the operation (default `false`).
    /// A [`Completer`](super::Completer) needs it to finish operations whose
    /// clients went away; otherwise the crate never stores request bodies,
    /// only their fingerprints. Keep personal data out of requests you store.
    pub fn store_requests(mut self, store: bool) -> Self {
        self.store_requests = store;
        self
    }
}

/// What an attempt knows before it reads the operation.
pub(super) struct Admitted {
    pub(super) request_hash: String,
    pub(super) request: Option<String>,
    pub(super) token: String,
    pub(super) caller_hash: Option<String>,
    /// Where a result this attempt executes comes from, if it is the first.
    pub(super) origin: Origin,
}
