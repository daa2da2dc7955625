//! A message as a relay hands it over, and what a relay did.

use std::collections::BTreeMap;
use std::ops::AddAssign;

use serde::de::DeserializeOwned;

use crate::backend::outbox::Settlement;

/// One delivery of a message, as a [`Relay`](super::Relay) hands it to its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The message id: a time-ordered UUID, unique across processes.
    pub id: String,
    /// The scope of the call whose operation enqueued it, empty for a
    /// message enqueued outside a call.
    pub scope: String,
    /// The topic it was enqueued for.
    pub topic: String,
    /// The payload as JSON text; [`Message::payload`] decodes it.
    pub payload_json: String,
    /// The idempotency key for the receiver: the message id, the same on
    /// every delivery, so a receiver that deduplicates on it performs the
    /// message's effect once however often it arrives.
    pub key: String,
    /// Which attempt this is, from 1. Attempts cut short by a relay that died
    /// or a lease that ran out count too.
    pub attempt: u32,
    pub(super) headers: BTreeMap<String, String>,
    pub(super) ordering_key: Option<String>,
    pub(super) traceparent: Option<String>,
    pub(super) tracestate: Option<String>,
}

impl Message {
    /// The payload decoded into `T`.
    ///
    /// # Errors
    ///
    /// The JSON error when the payload does not decode into `T`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::outbox::{self, Relay};
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// outbox::enqueue(&mut conn, "receipts", &(7, "ada@example.com"))?;
    /// Relay::default().run_once(&mut conn, |message| {
    ///     let (order, email): (u32, String) = message.payload()?;
    ///     assert_eq!((order, email.as_str()), (7, "ada@example.com"));
    ///     Ok::<_, serde_json::Error>(())
    /// })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.payload_json)
    }

    /// The headers it was enqueued with ([`Envelope::header`](super::Envelope::header)), by name;
    /// empty for a message enqueued without.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The value of header `name` (as enqueued, case and all), if it has
    /// one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// Its ordering key ([`Envelope::ordering_key`](super::Envelope::ordering_key)), if it has one.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The W3C `traceparent` captured when it was enqueued
    /// ([`Envelope::traceparent`](super::Envelope::traceparent)): hand it on to the broker so the
    /// consumer's span joins the trace of the request that caused the
    /// message, not the relay's.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// The W3C `tracestate` captured with the
    /// [`traceparent`](Message::traceparent).
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }
}

/// What a relay did: one [`Relay::run_once`](super::Relay::run_once), or all of them added up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Deliveries {
    /// Messages claimed; zero means none was due.
    pub claimed: usize,
    /// Messages the handler accepted and that are now marked delivered.
    pub delivered: usize,
    /// Messages the handler failed and that are scheduled again.
    pub retried: usize,
    /// Messages parked as dead.
    pub dead: usize,
    /// Messages whose lease was taken over (or that were requeued) before
    /// this relay settled them, or whose lease ran out before the relay
    /// reached them in its batch; they are left to the next claim.
    pub lost: usize,
    /// Messages given back unattempted because the relay was stopping; due
    /// at once for the next claim.
    pub released: usize,
}

impl Deliveries {
    /// Counts a settlement that was written.
    pub(super) fn count(&mut self, settlement: &Settlement) {
        match settlement {
            Settlement::Delivered { .. } => self.delivered += 1,
            Settlement::Retry { .. } => self.retried += 1,
            Settlement::Dead { .. } => self.dead += 1,
        }
    }
}

impl AddAssign for Deliveries {
    fn add_assign(&mut self, other: Deliveries) {
        self.claimed += other.claimed;
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.dead += other.dead;
        self.lost += other.lost;
        self.released += other.released;
    }
}
