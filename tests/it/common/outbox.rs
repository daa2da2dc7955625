//! Outbox scenarios that several suites observe, each from its own side:
//! the relay's results, the purge, the metrics, the tracing events.

use chrono::Duration;
use idempotency::outbox::{self, Deliveries, Message, Relay};
use idempotency::testing::ManualClock;
use serde::Serialize;

use super::TestDb;

/// The topic of the message that the receivers of [`refusing_poison`]
/// refuse.
pub const POISON: &str = "poison";

/// Runs `enqueue` in a transaction of `conn` that then fails, and checks
/// that the failure is what the transaction returned: all `enqueue` wrote
/// is rolled back.
pub fn enqueue_and_roll_back<C: diesel::Connection, T>(
    conn: &mut C,
    enqueue: impl FnOnce(&mut C) -> Result<T, outbox::Error>,
) {
    let rolled_back = conn.transaction(|tx| {
        enqueue(tx)?;
        Err::<(), _>(outbox::Error::Storage(diesel::result::Error::RollbackTransaction))
    });
    assert!(
        matches!(
            rolled_back,
            Err(outbox::Error::Storage(diesel::result::Error::RollbackTransaction))
        ),
        "{rolled_back:?}"
    );
}

/// A relay on `clock` that keeps delivered messages for `retention` and
/// parks a message at its first failure.
pub fn relay_keeping_delivered_for(clock: &ManualClock, retention: Duration) -> Relay {
    Relay::default()
        .clock(clock.source())
        .retention(retention)
        .max_attempts(1)
}

/// A receiver that refuses the messages of topic [`POISON`] and takes every
/// other.
pub fn refusing_poison(message: &Message) -> Result<(), &'static str> {
    if message.topic == POISON {
        Err("rejected")
    } else {
        Ok(())
    }
}

/// Enqueues `receipts` receipts and one [`POISON`] message, and has `relay`
/// deliver them once to [`refusing_poison`].
pub fn deliver_receipts_and_a_poison<D: TestDb>(conn: &mut D::Conn, relay: &Relay, receipts: usize) -> Deliveries {
    for i in 0..receipts {
        outbox::enqueue(conn, "receipts", &i).expect("enqueue");
    }
    outbox::enqueue(conn, POISON, &"x").expect("enqueue");
    relay.run_once(conn, refusing_poison).expect("deliver")
}

/// Four webhooks and the relay that delivers them on a clock of the test's
/// own, in two passes of [`FourWebhooks::handler`]. The first pass delivers
/// the first, fails the second, delivers the third while its lease runs out,
/// and reaches the fourth after the lease; the second fails the second for
/// the last time, and delivers the fourth on its second attempt.
pub struct FourWebhooks {
    pub relay: Relay,
    pub ids: Vec<String>,
    pub lease: Duration,
}

impl FourWebhooks {
    /// Enqueues the webhooks with the payloads `payload(0..4)`.
    pub fn enqueue<D: TestDb, P: Serialize>(
        conn: &mut D::Conn,
        clock: &ManualClock,
        payload: impl Fn(usize) -> P,
    ) -> FourWebhooks {
        let lease = Duration::seconds(10);
        let relay = Relay::default()
            .clock(clock.source())
            .lease(lease)
            .max_attempts(2)
            .backoff(Duration::seconds(1), Duration::seconds(1))
            .retention(Duration::days(1));
        let ids = (0..4)
            .map(|i| outbox::enqueue(conn, "webhooks", &payload(i)).expect("enqueue"))
            .collect();
        FourWebhooks { relay, ids, lease }
    }

    /// The receiver: fails the second webhook with `error`, and lets the
    /// lease run out while it takes the third.
    pub fn handler<'a, E: Clone + 'a>(
        &'a self,
        clock: &'a ManualClock,
        error: E,
    ) -> impl Fn(&Message) -> Result<(), E> + 'a {
        move |message| {
            if message.id == self.ids[1] {
                return Err(error.clone());
            }
            if message.id == self.ids[2] {
                clock.advance(self.lease + Duration::seconds(1));
            }
            Ok(())
        }
    }
}
