//! The transactional outbox: atomic enqueue, relays, leases, backoff, dead
//! letters, purging, and a consumer that absorbs redeliveries.

use std::collections::{HashMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use chrono::{Duration, Utc};
use diesel::Connection;
use idempotency::outbox::{self, Message, Relay};
use idempotency::testing::ManualClock;
use idempotency::{Error, Outcome, run_idempotent};

use crate::common::TestDb;
use crate::common::child::{Child, parent_database, report_and_wait_for_the_kill};
use crate::common::outbox::{
    deliver_receipts_and_a_poison, enqueue_and_roll_back, refusing_poison, relay_keeping_delivered_for,
};
use crate::common::wait::{self, Barrier};

/// What the child relay prints once its consumer has committed the effect.
const DELIVERING: &str = "outbox-child-delivering:";

/// The consumer's name, which is its idempotency scope.
const MAILER: &str = "receipt-mailer";

crate::common::backend_tests!(
    relay_beside_live_writers_sees_no_errors_and_delivers_each_message_once,
    message_commits_with_the_domain_write_and_a_replay_enqueues_nothing,
    failed_operation_leaves_no_message,
    handler_error_text_with_a_nul_is_stored_and_the_batch_goes_on,
    message_for_the_far_future_waits_and_one_for_the_far_past_is_due,
    panicking_operation_leaves_no_message,
    rolled_back_transaction_takes_its_messages_along,
    invalid_topic_or_payload_is_refused_and_writes_nothing,
    one_relay_delivers_in_enqueue_order_per_topic,
    failed_delivery_is_retried_with_exponential_backoff,
    poison_message_goes_dead_after_max_attempts_while_the_rest_flow,
    expired_lease_redelivers_with_the_same_key,
    messages_reached_after_the_lease_ran_out_are_not_handed_over,
    relay_whose_lease_was_taken_over_cannot_settle_the_message,
    message_whose_relay_keeps_dying_is_parked_without_another_delivery,
    redelivered_message_is_absorbed_by_the_idempotent_consumer,
    relay_killed_mid_delivery_is_redelivered_and_consumed_once,
    concurrent_relays_deliver_every_message_once_and_never_twice_at_a_time,
    delivered_messages_are_purged_after_retention_in_batches,
    messages_carry_the_scope_of_the_call_that_enqueued_them,
    permanent_failure_parks_the_message_at_once_with_its_reason,
    handler_sees_the_headers_ordering_key_and_trace_context_it_was_enqueued_with,
    invalid_headers_ordering_key_or_trace_context_are_refused_and_write_nothing,
    only_the_head_of_each_ordering_key_is_claimed_and_a_dead_head_releases_its_key,
    concurrent_relays_hand_over_each_key_in_enqueue_order_and_a_failing_key_holds_back_only_itself,
);

fn status_count<D: TestDb>(conn: &mut D::Conn, status: &str) -> usize {
    D::outbox_messages(conn).iter().filter(|m| m.2 == status).count()
}

/// A database of the test's own, a connection to it, and a relay on a
/// manual clock whose leases last `lease`, with the clock.
fn leasing_for<D: TestDb>(lease: Duration) -> (D, D::Conn, ManualClock, Relay) {
    let db = D::new();
    let conn = db.conn();
    let clock = ManualClock::new();
    let relay = Relay::default().clock(clock.source()).lease(lease);
    (db, conn, clock, relay)
}

/// One pass of `relay` that delivers every message it hands over: the key
/// and the attempt of each, in the order handed.
fn delivering_all<D: TestDb>(relay: &Relay, conn: &mut D::Conn, pass: &str) -> Vec<(String, u32)> {
    let mut handed = Vec::new();
    relay
        .run_once(conn, |message| {
            handed.push((message.key.clone(), message.attempt));
            Ok::<_, String>(())
        })
        .expect(pass);
    handed
}

fn item_count<D: TestDb>(conn: &mut D::Conn, item: &str) -> usize {
    D::order_items(conn).iter().filter(|i| *i == item).count()
}

/// The receiving side: sends a receipt (a domain row) at most once per
/// message, however often the message arrives.
fn send_receipt<D: TestDb>(
    conn: &mut D::Conn,
    message: &Message,
) -> Result<Outcome<i64>, Error<diesel::result::Error>> {
    run_idempotent(conn, MAILER, &message.key, &message.payload_json, |tx| {
        D::place_order(tx, "receipt", 1)
    })
}

/// Places an order and enqueues its receipt in the same idempotent call.
fn place_with_receipt<D: TestDb>(conn: &mut D::Conn, key: &str) -> Result<Outcome<i64>, Error<anyhow::Error>> {
    run_idempotent(conn, "shop", key, &"one book", |tx| {
        let order = D::place_order(tx, "book", 1)?;
        outbox::enqueue(tx, "receipts", &order)?;
        Ok(order)
    })
}

fn ok(_: &Message) -> Result<(), String> {
    Ok(())
}

fn message_commits_with_the_domain_write_and_a_replay_enqueues_nothing<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let first = place_with_receipt::<D>(&mut conn, "order-1").expect("place the order");
    assert!(!first.is_replayed());
    assert_eq!(D::outbox_messages(&mut conn).len(), 1);
    let replay = place_with_receipt::<D>(&mut conn, "order-1").expect("retry");
    assert!(replay.is_replayed());
    assert_eq!(D::order_count(&mut conn), 1);
    let all = D::outbox_messages(&mut conn);
    assert_eq!(all.len(), 1, "the replay enqueued nothing");
    assert_eq!(
        (all[0].1.as_str(), all[0].2.as_str(), all[0].3),
        ("receipts", "pending", 0)
    );
}

fn failed_operation_leaves_no_message<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let failed = run_idempotent(&mut conn, "shop", "order-err", &"one book", |tx| {
        let order = D::place_order(tx, "book", 1)?;
        outbox::enqueue(tx, "receipts", &order)?;
        Err::<i64, anyhow::Error>(anyhow::anyhow!("out of stock"))
    });
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    assert_eq!(D::order_count(&mut conn), 0);
    assert!(D::outbox_messages(&mut conn).is_empty());
    assert_eq!(D::key_count(&mut conn), 0);
}

fn panicking_operation_leaves_no_message<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let panicked = panic::catch_unwind(AssertUnwindSafe(|| {
        let _ = run_idempotent(&mut conn, "shop", "order-panic", &"one book", |tx| {
            let order = D::place_order(tx, "book", 1)?;
            outbox::enqueue(tx, "receipts", &order)?;
            panic!("worker crashed after enqueueing");
            #[allow(unreachable_code)]
            Ok::<i64, anyhow::Error>(order)
        });
    }));
    assert_eq!(
        crate::common::panic_message(panicked),
        "worker crashed after enqueueing"
    );
    assert_eq!(D::order_count(&mut conn), 0);
    assert!(D::outbox_messages(&mut conn).is_empty());
    // The key is free: the retry places the order and its receipt.
    assert!(
        !place_with_receipt::<D>(&mut conn, "order-panic")
            .expect("retry")
            .is_replayed()
    );
    assert_eq!(D::outbox_messages(&mut conn).len(), 1);
}

fn rolled_back_transaction_takes_its_messages_along<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    enqueue_and_roll_back(&mut conn, |tx| {
        outbox::enqueue(tx, "receipts", &1)?;
        outbox::enqueue(tx, "invoices", &1)
    });
    assert!(D::outbox_messages(&mut conn).is_empty());
}

fn invalid_topic_or_payload_is_refused_and_writes_nothing<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    for topic in ["", "has space", "naïve", &"t".repeat(256)] {
        let refused = outbox::enqueue(&mut conn, topic, &1);
        assert!(
            matches!(refused, Err(outbox::Error::InvalidTopic(_))),
            "{topic:?}: {refused:?}"
        );
    }
    let mut unserializable = HashMap::new();
    unserializable.insert((1, 2), "tuple keys are not json object keys");
    let refused = outbox::enqueue(&mut conn, "receipts", &unserializable);
    assert!(matches!(refused, Err(outbox::Error::Codec(_))), "{refused:?}");
    assert!(D::outbox_messages(&mut conn).is_empty());
    assert_eq!(
        outbox::enqueue(&mut conn, "receipts", &1)
            .map(|id| id.len())
            .expect("valid message"),
        36
    );
}

fn one_relay_delivers_in_enqueue_order_per_topic<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut enqueued: HashMap<&str, Vec<String>> = HashMap::new();
    for i in 0..6 {
        let topic = if i % 3 == 0 { "invoices" } else { "receipts" };
        enqueued
            .entry(topic)
            .or_default()
            .push(outbox::enqueue(&mut conn, topic, &i).expect("enqueue"));
    }
    conn.transaction(|tx| {
        for i in 6..12 {
            let topic = if i % 2 == 0 { "invoices" } else { "receipts" };
            enqueued.entry(topic).or_default().push(outbox::enqueue(tx, topic, &i)?);
        }
        Ok::<_, outbox::Error>(())
    })
    .expect("enqueue in one transaction");

    let relay = Relay::default().batch_size(4);
    let mut delivered: HashMap<String, Vec<String>> = HashMap::new();
    let mut payloads = Vec::new();
    loop {
        let batch = relay
            .run_once(&mut conn, |message| {
                assert_eq!(message.key, message.id, "the key is the message id");
                assert_eq!(message.attempt, 1);
                payloads.push(message.payload::<i32>().map_err(|e| e.to_string())?);
                delivered
                    .entry(message.topic.clone())
                    .or_default()
                    .push(message.id.clone());
                Ok::<_, String>(())
            })
            .expect("relay");
        if batch.claimed == 0 {
            break;
        }
    }
    assert_eq!(delivered["invoices"], enqueued["invoices"]);
    assert_eq!(delivered["receipts"], enqueued["receipts"]);
    assert_eq!(
        payloads,
        (0..12).collect::<Vec<_>>(),
        "one relay delivers all topics in enqueue order too"
    );
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 12);
}

fn failed_delivery_is_retried_with_exponential_backoff<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let relay = Relay::default()
        .clock(clock.source())
        .max_attempts(6)
        .backoff(Duration::seconds(10), Duration::seconds(25));
    let id = outbox::enqueue(&mut conn, "payments", &"capture").expect("enqueue");
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let fail = |message: &Message| {
        attempts.lock().unwrap().push(message.attempt);
        Err(format!("gateway returned 503 on attempt {}", message.attempt))
    };

    assert_eq!(relay.run_once(&mut conn, fail).expect("attempt 1").retried, 1);
    // Waits of 10 s, 20 s, then 40 s capped at 25 s: each is due exactly
    // when its wait has passed and not a moment before.
    for (attempt, wait) in [(2, 10), (3, 20), (4, 25), (5, 25)] {
        clock.advance(Duration::seconds(wait) - Duration::milliseconds(1));
        assert_eq!(
            relay.run_once(&mut conn, fail).expect("early run").claimed,
            0,
            "before attempt {attempt}"
        );
        clock.advance(Duration::milliseconds(1));
        assert_eq!(
            relay.run_once(&mut conn, fail).expect("due run").retried,
            1,
            "attempt {attempt}"
        );
    }
    assert_eq!(*attempts.lock().unwrap(), [1, 2, 3, 4, 5]);
    let stored = &D::outbox_messages(&mut conn)[0];
    assert_eq!(
        (stored.0.as_str(), stored.2.as_str(), stored.3),
        (id.as_str(), "pending", 5)
    );
    assert_eq!(stored.4.as_deref(), Some("gateway returned 503 on attempt 5"));

    clock.advance(Duration::seconds(25));
    let last = relay
        .run_once(&mut conn, |_: &Message| Ok::<_, String>(()))
        .expect("attempt 6");
    assert_eq!(last.delivered, 1);
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 1);
}

/// PostgreSQL's text refuses NUL: a handler's error text holding one is
/// stored with U+FFFD in its place, on every backend alike, and the rest of
/// the batch is delivered.
fn handler_error_text_with_a_nul_is_stored_and_the_batch_goes_on<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let relay = Relay::default().max_attempts(1);
    let failing = outbox::enqueue(&mut conn, "webhooks", &"failing").expect("enqueue");
    outbox::enqueue(&mut conn, "webhooks", &"fine").expect("enqueue");

    let batch = relay
        .run_once(&mut conn, |message: &Message| {
            if message.id == failing {
                Err(String::from("upstream said \0 and hung up"))
            } else {
                Ok(())
            }
        })
        .expect("the relay settles both messages");
    assert_eq!((batch.claimed, batch.delivered, batch.dead), (2, 1, 1));
    let letters = relay.dead_letters(&mut conn, 10).expect("dead letters");
    assert_eq!(
        (letters[0].id.as_str(), letters[0].last_error.as_deref()),
        (failing.as_str(), Some("upstream said \u{fffd} and hung up"))
    );
}

/// Times beyond what a backend's time column holds (MySQL's `DATETIME`
/// ends with the year 9999) keep their meaning: a message meant for the far
/// future is not due, one meant for the far past is.
fn message_for_the_far_future_waits_and_one_for_the_far_past_is_due<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let relay = Relay::default();
    outbox::enqueue_at(
        &mut conn,
        "reminders",
        &"never",
        Utc::now() + Duration::days(365 * 8_000),
    )
    .expect("enqueue");
    let far_past = "0500-01-01T00:00:00Z".parse().expect("a time");
    let past = outbox::enqueue_at(&mut conn, "reminders", &"long ago", far_past).expect("enqueue");

    let stats = relay.stats(&mut conn).expect("stats");
    assert_eq!((stats.pending, stats.due_now), (2, 1), "{stats:?}");
    let delivered = Mutex::new(Vec::new());
    let batch = relay
        .run_once(&mut conn, |message: &Message| {
            delivered.lock().expect("not poisoned").push(message.id.clone());
            Ok::<_, String>(())
        })
        .expect("relay");
    assert_eq!((batch.claimed, batch.delivered), (1, 1));
    assert_eq!(delivered.into_inner().expect("not poisoned"), [past]);
}

fn poison_message_goes_dead_after_max_attempts_while_the_rest_flow<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let relay = Relay::default().clock(clock.source()).max_attempts(3).batch_size(2);
    let ids: Vec<String> = ["a", "b", "poison", "c", "d"]
        .iter()
        .map(|payload| outbox::enqueue(&mut conn, "webhooks", payload).expect("enqueue"))
        .collect();
    let poison_calls = AtomicUsize::new(0);
    let delivered = Mutex::new(Vec::new());
    let mut handler = |message: &Message| {
        let payload: String = message.payload().map_err(|e| e.to_string())?;
        if payload == "poison" {
            poison_calls.fetch_add(1, Ordering::Relaxed);
            return Err(String::from("receiver answered 422 unprocessable entity"));
        }
        delivered.lock().unwrap().push(payload);
        Ok(())
    };

    let mut dead = 0;
    for _ in 0..20 {
        let batch = relay.run_once(&mut conn, &mut handler).expect("relay");
        dead += batch.dead;
        if batch.claimed == 0 && status_count::<D>(&mut conn, "pending") == 0 {
            break;
        }
        clock.advance(Duration::minutes(1));
    }
    assert_eq!(
        *delivered.lock().unwrap(),
        ["a", "b", "c", "d"],
        "the others flowed past the poison message, each once"
    );
    assert_eq!(poison_calls.load(Ordering::Relaxed), 3);
    assert_eq!(dead, 1);
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 4);

    let letters = relay.dead_letters(&mut conn, 10).expect("list dead letters");
    assert_eq!(letters.len(), 1);
    assert_eq!(
        (letters[0].id.as_str(), letters[0].topic.as_str()),
        (ids[2].as_str(), "webhooks")
    );
    assert_eq!(letters[0].payload_json, "\"poison\"");
    assert_eq!(letters[0].attempts, 3);
    assert_eq!(
        letters[0].last_error.as_deref(),
        Some("receiver answered 422 unprocessable entity")
    );

    // A dead message stays parked: relays pass it by.
    clock.advance(Duration::days(1));
    assert_eq!(relay.run_once(&mut conn, &mut handler).expect("relay").claimed, 0);

    // Requeued once the receiver is fixed: delivered with the same key
    // and a fresh count of attempts.
    assert!(relay.requeue(&mut conn, &ids[2]).expect("requeue"));
    assert!(
        !relay.requeue(&mut conn, &ids[0]).expect("requeue a delivered message"),
        "only dead messages"
    );
    assert!(
        !relay
            .requeue(&mut conn, "no-such-message")
            .expect("requeue an unknown id")
    );
    assert_eq!(
        delivering_all::<D>(&relay, &mut conn, "relay after requeue"),
        [(ids[2].clone(), 1)]
    );
    assert!(relay.dead_letters(&mut conn, 10).expect("list").is_empty());
}

fn expired_lease_redelivers_with_the_same_key<D: TestDb>() {
    let (db, mut conn, clock, relay) = leasing_for::<D>(Duration::seconds(30));
    let id = outbox::enqueue(&mut conn, "receipts", &1).expect("enqueue");

    // The first relay's handler panics mid-delivery, as a crash would
    // end it: the message stays leased, not failed.
    let crashed = panic::catch_unwind(AssertUnwindSafe(|| {
        let _ = relay.run_once(&mut conn, |_: &Message| -> Result<(), String> {
            panic!("relay crashed")
        });
    }));
    assert_eq!(crate::common::panic_message(crashed), "relay crashed");
    let mut other = db.conn();
    clock.advance(Duration::seconds(29));
    assert_eq!(
        relay.run_once(&mut other, ok).expect("relay within the lease").claimed,
        0
    );

    clock.advance(Duration::seconds(1));
    assert_eq!(
        delivering_all::<D>(&relay, &mut other, "relay after the lease"),
        [(id, 2)]
    );
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 1);
}

fn messages_reached_after_the_lease_ran_out_are_not_handed_over<D: TestDb>() {
    let (_db, mut conn, clock, relay) = leasing_for::<D>(Duration::seconds(10));
    let first = outbox::enqueue(&mut conn, "receipts", &1).expect("enqueue");
    let second = outbox::enqueue(&mut conn, "receipts", &2).expect("enqueue");

    let mut handed = Vec::new();
    let batch = relay
        .run_once(&mut conn, |message| {
            handed.push(message.key.clone());
            // A slow handler: the lease of the whole batch runs out.
            clock.advance(Duration::seconds(10));
            Ok::<_, String>(())
        })
        .expect("relay");
    assert_eq!(handed, [first]);
    assert_eq!((batch.claimed, batch.delivered, batch.lost), (2, 1, 1));

    assert_eq!(delivering_all::<D>(&relay, &mut conn, "next relay run"), [(second, 2)]);
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 2);
}

fn relay_whose_lease_was_taken_over_cannot_settle_the_message<D: TestDb>() {
    let db = D::new();
    let clock = ManualClock::new();
    let relay = Relay::default().clock(clock.source()).lease(Duration::seconds(30));
    outbox::enqueue(&mut db.conn(), "payments", &"capture").expect("enqueue");
    std::thread::scope(|scope| {
        // Made in here, so that a failed assertion drops the senders and
        // the handlers waiting on them return instead of hanging.
        let (entered, in_handler) = mpsc::channel::<&str>();
        let (release_slow, slow_may_return) = mpsc::channel::<()>();
        let (release_fast, fast_may_return) = mpsc::channel::<()>();
        let (db, relay, entered_too) = (&db, &relay, entered.clone());
        let slow = scope.spawn(move || {
            let mut conn = db.conn();
            relay.run_once(&mut conn, |_| {
                entered_too.send("slow").unwrap();
                wait::recv(&slow_may_return, "the slow handler is released");
                Err("gateway timed out")
            })
        });
        assert_eq!(wait::recv(&in_handler, "a handler runs"), "slow");
        // The slow handler outlives its lease: another relay claims the
        // message and is delivering it when the slow one gives up.
        clock.advance(Duration::seconds(31));
        let fast = scope.spawn(move || {
            let mut conn = db.conn();
            relay.run_once(&mut conn, |message| {
                entered.send("fast").unwrap();
                wait::recv(&fast_may_return, "the fast handler is released");
                assert_eq!(message.attempt, 2);
                Ok::<_, &str>(())
            })
        });
        assert_eq!(wait::recv(&in_handler, "a handler runs"), "fast");
        release_slow.send(()).unwrap();
        let slow = slow.join().unwrap().expect("slow relay");
        assert_eq!(
            (slow.claimed, slow.retried, slow.lost),
            (1, 0, 1),
            "the stale failure was not recorded"
        );
        // Still leased to the fast relay: nobody else may claim it.
        assert_eq!(relay.run_once(&mut db.conn(), ok).expect("third relay").claimed, 0);
        release_fast.send(()).unwrap();
        let fast = fast.join().unwrap().expect("fast relay");
        assert_eq!((fast.claimed, fast.delivered, fast.lost), (1, 1, 0));
    });
    let stored = &D::outbox_messages(&mut db.conn())[0];
    assert_eq!(
        (stored.2.as_str(), stored.3, stored.4.as_deref()),
        ("delivered", 2, None)
    );
}

fn message_whose_relay_keeps_dying_is_parked_without_another_delivery<D: TestDb>() {
    let db = D::new();
    let clock = ManualClock::new();
    let relay = Relay::default()
        .clock(clock.source())
        .lease(Duration::seconds(30))
        .max_attempts(2);
    let mut conn = db.conn();
    outbox::enqueue(&mut conn, "reports", &"huge").expect("enqueue");
    let calls = AtomicUsize::new(0);
    for _ in 0..2 {
        let mut conn = db.conn();
        let crashed = panic::catch_unwind(AssertUnwindSafe(|| {
            let _ = relay.run_once(&mut conn, |_: &Message| -> Result<(), String> {
                calls.fetch_add(1, Ordering::Relaxed);
                panic!("out of memory")
            });
        }));
        assert_eq!(crate::common::panic_message(crashed), "out of memory");
        clock.advance(Duration::seconds(30));
    }
    let batch = relay
        .run_once(&mut conn, |_: &Message| -> Result<(), String> {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .expect("relay");
    assert_eq!((batch.claimed, batch.dead, batch.delivered), (1, 1, 0));
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    let letters = relay.dead_letters(&mut conn, 10).expect("dead letters");
    assert_eq!(letters[0].attempts, 2);
    assert_eq!(
        letters[0].last_error.as_deref(),
        Some("lease ran out during attempt 2 without an outcome")
    );
}

fn redelivered_message_is_absorbed_by_the_idempotent_consumer<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut mailer = db.conn();
    let clock = ManualClock::new();
    let relay = Relay::default().clock(clock.source());
    place_with_receipt::<D>(&mut conn, "order-7").expect("place the order");

    // The receipt is sent, but the acknowledgement is lost on the way
    // back: the relay records a failure and delivers again.
    let mut outcomes = Vec::new();
    let mut deliver = |message: &Message| {
        let sent = send_receipt::<D>(&mut mailer, message).map_err(|e| e.to_string())?;
        outcomes.push((message.attempt, sent.is_replayed()));
        if message.attempt == 1 {
            Err(String::from("connection reset before the answer"))
        } else {
            Ok(())
        }
    };
    assert_eq!(
        relay.run_once(&mut conn, &mut deliver).expect("first delivery").retried,
        1
    );
    clock.advance(Duration::seconds(1));
    assert_eq!(
        relay.run_once(&mut conn, &mut deliver).expect("redelivery").delivered,
        1
    );

    assert_eq!(outcomes, [(1, false), (2, true)]);
    assert_eq!(
        item_count::<D>(&mut conn, "receipt"),
        1,
        "one receipt for two deliveries"
    );
}

fn relay_killed_mid_delivery_is_redelivered_and_consumed_once<D: TestDb>() {
    let lease = Duration::seconds(60);
    if let Some(url) = parent_database() {
        // The child: a relay on the real clock whose consumer commits the
        // receipt, then the process hangs before the relay records the
        // delivery, until the parent kills it.
        let mut conn = D::Conn::establish(&url).expect("child connects");
        let mut mailer = D::Conn::establish(&url).expect("child connects the consumer");
        let _ = Relay::default().lease(lease).run_once(&mut conn, |message| {
            send_receipt::<D>(&mut mailer, message).expect("send the receipt");
            report_and_wait_for_the_kill(&format!("{DELIVERING}{}", message.key));
            #[allow(unreachable_code)]
            Ok::<_, String>(())
        });
        unreachable!("the child relay never finishes its delivery");
    }

    let db = D::new();
    let mut conn = db.conn();
    place_with_receipt::<D>(&mut conn, "order-9").expect("place the order");
    let test = crate::common::test_name::<D>(
        module_path!(),
        "relay_killed_mid_delivery_is_redelivered_and_consumed_once",
    );
    let mut child = Child::start(&test, db.url());
    let key = child.wait_for("the delivery", |line| {
        line.split_once(DELIVERING).map(|(_, key)| key.trim().to_owned())
    });
    let status = child.kill();
    assert!(!status.success());
    drop(child);

    assert_eq!(
        item_count::<D>(&mut conn, "receipt"),
        1,
        "the child's consumer committed the receipt"
    );
    assert_eq!(
        status_count::<D>(&mut conn, "pending"),
        1,
        "the killed relay recorded nothing"
    );

    // A second relay on a clock the lease has run out on.
    let relay = Relay::default()
        .lease(lease)
        .clock(move || Utc::now() + lease + Duration::seconds(1));
    let mut mailer = db.conn();
    let mut seen = Vec::new();
    let batch = relay
        .run_once(&mut conn, |message| {
            let sent = send_receipt::<D>(&mut mailer, message).map_err(|e| e.to_string())?;
            seen.push((message.key.clone(), message.attempt, sent.is_replayed()));
            Ok::<_, String>(())
        })
        .expect("second relay");
    assert_eq!(batch.delivered, 1);
    assert_eq!(
        seen,
        [(key, 2, true)],
        "redelivered with the same key and absorbed by the consumer"
    );
    assert_eq!(
        item_count::<D>(&mut conn, "receipt"),
        1,
        "the receipt was sent exactly once"
    );
    assert_eq!(status_count::<D>(&mut conn, "delivered"), 1);
}

fn concurrent_relays_deliver_every_message_once_and_never_twice_at_a_time<D: TestDb>() {
    const MESSAGES: usize = 2000;
    const RELAYS: usize = 4;
    let db = D::new();
    let mut conn = db.conn();
    let ids: HashSet<String> = conn
        .transaction(|tx| {
            (0..MESSAGES)
                .map(|i| outbox::enqueue(tx, "events", &i))
                .collect::<Result<_, _>>()
        })
        .expect("enqueue");

    let in_flight = Mutex::new(HashSet::new());
    let deliveries = Mutex::new(HashMap::<String, usize>::new());
    let overlaps = AtomicUsize::new(0);
    let barrier = Barrier::new(RELAYS);
    let relay = Relay::default().batch_size(25).lease(Duration::minutes(10));
    std::thread::scope(|scope| {
        for _ in 0..RELAYS {
            scope.spawn(|| {
                barrier.wait();
                let mut conn = db.conn();
                loop {
                    let batch = relay
                        .run_once(&mut conn, |message| {
                            if !in_flight.lock().unwrap().insert(message.id.clone()) {
                                overlaps.fetch_add(1, Ordering::Relaxed);
                            }
                            *deliveries.lock().unwrap().entry(message.id.clone()).or_default() += 1;
                            std::thread::yield_now();
                            in_flight.lock().unwrap().remove(&message.id);
                            Ok::<_, String>(())
                        })
                        .expect("relay");
                    if batch.claimed == 0 {
                        break;
                    }
                }
            });
        }
    });

    assert_eq!(
        overlaps.load(Ordering::Relaxed),
        0,
        "no message was in two handlers at once"
    );
    let deliveries = deliveries.into_inner().unwrap();
    assert_eq!(
        deliveries.keys().cloned().collect::<HashSet<_>>(),
        ids,
        "every message was delivered"
    );
    assert!(deliveries.values().all(|&n| n == 1), "no message was delivered twice");
    assert_eq!(status_count::<D>(&mut conn, "delivered"), MESSAGES);
}

fn delivered_messages_are_purged_after_retention_in_batches<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let relay = relay_keeping_delivered_for(&clock, Duration::days(2));
    deliver_receipts_and_a_poison::<D>(&mut conn, &relay, 5);
    clock.advance(Duration::days(1));
    outbox::enqueue(&mut conn, "receipts", &"later").expect("enqueue");
    relay
        .run_once(&mut conn, refusing_poison)
        .expect("deliver the later one");
    let pending = outbox::enqueue(&mut conn, "receipts", &"pending").expect("enqueue");

    clock.advance(Duration::days(1) - Duration::seconds(1));
    assert_eq!(relay.purge_delivered(&mut conn, 2).expect("purge before retention"), 0);
    clock.advance(Duration::seconds(1));
    assert_eq!(
        relay.purge_delivered(&mut conn, 2).expect("purge"),
        5,
        "three batches of at most 2"
    );
    let left: Vec<(String, String)> = D::outbox_messages(&mut conn).into_iter().map(|m| (m.1, m.2)).collect();
    assert_eq!(
        left,
        [
            ("poison".to_owned(), "dead".to_owned()),
            ("receipts".to_owned(), "delivered".to_owned()),
            ("receipts".to_owned(), "pending".to_owned()),
        ]
    );
    assert_eq!(D::outbox_messages(&mut conn)[2].0, pending);
}

/// A relay on a plain connection (SQLite's busy timeout is 0 on one) loops
/// beside writers whose calls hold the database's write lock in turn: every
/// claim and every settlement waits for the lock as calls do, so no pass
/// fails and no delivered message is delivered again.
fn relay_beside_live_writers_sees_no_errors_and_delivers_each_message_once<D: TestDb>() {
    const WRITERS: usize = 2;
    let run_for = std::time::Duration::from_secs(3);
    let db = D::new();
    let barrier = Barrier::new(WRITERS + 1);
    let enqueued = AtomicUsize::new(0);
    let deliveries: Mutex<HashMap<String, usize>> = Mutex::new(HashMap::new());
    let record = |message: &Message| {
        *deliveries
            .lock()
            .expect("no panic while locked")
            .entry(message.id.clone())
            .or_default() += 1;
        Ok::<_, std::convert::Infallible>(())
    };
    let relay = Relay::default();
    std::thread::scope(|s| {
        for writer in 0..WRITERS {
            let (barrier, enqueued, url) = (&barrier, &enqueued, db.url());
            s.spawn(move || {
                let mut conn = D::Conn::establish(url).expect("a plain connection");
                barrier.wait();
                let started = std::time::Instant::now();
                let mut n = 0;
                while started.elapsed() < run_for {
                    run_idempotent(&mut conn, "shop", &format!("w{writer}-{n}"), &n, |tx| {
                        D::place_order(tx, "book", 1).map_err(outbox::Error::Storage)?;
                        outbox::enqueue(tx, "receipts", &n)?;
                        Ok::<_, outbox::Error>(n)
                    })
                    .expect("no writer's call fails");
                    enqueued.fetch_add(1, Ordering::SeqCst);
                    n += 1;
                }
            });
        }
        let mut conn = D::Conn::establish(db.url()).expect("a plain connection");
        barrier.wait();
        let started = std::time::Instant::now();
        while started.elapsed() < run_for {
            relay.run_once(&mut conn, record).expect("no relay pass fails");
        }
    });
    let mut conn = db.conn();
    while relay.run_once(&mut conn, record).expect("the rest").claimed > 0 {}

    let deliveries = deliveries.into_inner().expect("no panic while locked");
    let enqueued = enqueued.into_inner();
    assert!(enqueued > 0, "the writers wrote");
    assert_eq!(deliveries.len(), enqueued, "every message delivered");
    let repeated: Vec<_> = deliveries.iter().filter(|(_, count)| **count > 1).collect();
    assert!(repeated.is_empty(), "delivered more than once: {repeated:?}");
    assert_eq!(status_count::<D>(&mut conn, "delivered"), enqueued);
}

/// Each message's scope: the innermost call executing on the connection that
/// enqueued it, also after a nested call returned or panicked, never a call
/// on another thread; empty outside a call.
fn messages_carry_the_scope_of_the_call_that_enqueued_them<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let enqueue = |conn: &mut D::Conn, payload: &str| -> Result<(), outbox::Error> {
        outbox::enqueue(conn, "notes", payload).map(drop)
    };
    enqueue(&mut conn, "outside").expect("enqueue outside a call");

    let barrier = Barrier::new(2);
    std::thread::scope(|threads| {
        let elsewhere = threads.spawn(|| {
            let mut other = db.conn();
            barrier.wait();
            // Waits for the call's commit on SQLite, whose write lock it holds.
            enqueue(&mut other, "another thread's connection").expect("enqueue beside the call");
        });
        run_idempotent(&mut conn, "tenant-a", "outer", &1, |tx| {
            enqueue(tx, "outer, before")?;
            run_idempotent(tx, "tenant-b", "inner", &2, |tx| enqueue(tx, "inner"))
                .map_err(|e| outbox::Error::Storage(storage(e)))?;
            let panicked = panic::catch_unwind(AssertUnwindSafe(|| {
                let _ = run_idempotent(tx, "tenant-c", "panics", &3, |tx| {
                    enqueue(tx, "rolled back with the panic")?;
                    panic!("the nested operation fails");
                    #[allow(unreachable_code)]
                    Ok::<(), outbox::Error>(())
                });
            }));
            assert_eq!(crate::common::panic_message(panicked), "the nested operation fails");
            barrier.wait();
            enqueue(tx, "outer, after")
        })
        .expect("the outer call");
        elsewhere.join().expect("the other thread does not panic");
    });
    idempotency::phased::Phased::new("note")
        .run(&mut conn, "tenant-d", "phased", &4, |s| {
            s.finish(|tx| enqueue(tx, "a phased step"))
        })
        .expect("the phased call");

    let mut scopes = HashMap::new();
    Relay::default()
        .run_once(&mut conn, |message| {
            let payload: String = message.payload().expect("a note");
            scopes.insert(payload, message.scope.clone());
            Ok::<_, String>(())
        })
        .expect("deliver the notes");
    let expected: HashMap<String, String> = [
        ("outside", ""),
        ("another thread's connection", ""),
        ("outer, before", "tenant-a"),
        ("inner", "tenant-b"),
        ("outer, after", "tenant-a"),
        ("a phased step", "tenant-d"),
    ]
    .into_iter()
    .map(|(payload, scope)| (payload.to_owned(), scope.to_owned()))
    .collect();
    assert_eq!(scopes, expected);
}

fn permanent_failure_parks_the_message_at_once_with_its_reason<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let gone = outbox::enqueue(&mut conn, "webhooks", &410).expect("enqueue");
    let busy = outbox::enqueue(&mut conn, "webhooks", &503).expect("enqueue");
    let relay = Relay::default().max_attempts(10);
    let handler = |message: &Message| -> Result<(), outbox::Failure> {
        match message.payload::<u16>()? {
            410 => Err(outbox::Permanent("410 gone"))?,
            status => Err(outbox::Failure::Retry(format!("answered {status}"))),
        }
    };

    let report = relay.run_once(&mut conn, &handler).expect("relay");
    assert_eq!((report.claimed, report.dead, report.retried), (2, 1, 1));
    let dead = relay.dead_letters(&mut conn, 10).expect("dead letters");
    assert_eq!(dead.len(), 1, "only the permanent failure is dead: {dead:?}");
    assert_eq!(
        (dead[0].id.as_str(), dead[0].attempts, dead[0].last_error.as_deref()),
        (gone.as_str(), 1, Some("410 gone")),
        "dead after its first attempt, with the reason"
    );
    assert_ne!(dead[0].id, busy);
    assert_eq!(
        status_count::<D>(&mut conn, "pending"),
        1,
        "the transient failure waits for its retry"
    );

    let report = relay
        .run_once(&mut conn, |_| Err::<(), _>(outbox::Permanent(String::from("never"))))
        .expect("relay");
    assert_eq!(report.claimed, 0, "a permanent failure is not retried");
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn handler_sees_the_headers_ordering_key_and_trace_context_it_was_enqueued_with<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let value = format!("ünïcode {}", "v".repeat(4000));
    let placed = run_idempotent(&mut conn, "tenant-a", "order-1", &"book", |tx| {
        outbox::Envelope::new("orders.placed", &"book")
            .header("content-type", "application/json")
            .header("X-Long", value.as_str())
            .header("x-empty", "")
            .ordering_key("order-1")
            .traceparent(TRACEPARENT)
            .tracestate("vendor=opaque,other=1")
            .enqueue(tx)
    })
    .expect("the call")
    .into_inner();
    let plain = outbox::enqueue(&mut conn, "orders.placed", &"pen").expect("enqueue");

    let mut seen = HashMap::new();
    Relay::default()
        .run_once(&mut conn, |message| {
            seen.insert(message.id.clone(), message.clone());
            Ok::<_, String>(())
        })
        .expect("relay");
    let message = &seen[&placed];
    assert_eq!(message.scope, "tenant-a");
    assert_eq!(message.headers().len(), 3);
    assert_eq!(message.header("content-type"), Some("application/json"));
    assert_eq!(message.header("X-Long"), Some(value.as_str()));
    assert_eq!(message.header("x-long"), None, "names are kept as given");
    assert_eq!(message.header("x-empty"), Some(""));
    assert_eq!(message.ordering_key(), Some("order-1"));
    assert_eq!(message.traceparent(), Some(TRACEPARENT));
    assert_eq!(message.tracestate(), Some("vendor=opaque,other=1"));
    let plain = &seen[&plain];
    assert!(plain.headers().is_empty());
    assert_eq!(
        (plain.ordering_key(), plain.traceparent(), plain.tracestate()),
        (None, None, None)
    );
}

fn invalid_headers_ordering_key_or_trace_context_are_refused_and_write_nothing<D: TestDb>() {
    use outbox::{Envelope, Error as OutboxError, HeaderError, TraceContextError};
    let db = D::new();
    let mut conn = db.conn();
    let message = || Envelope::new("receipts", &1);
    let many = (0..65).fold(message(), |m, i| m.header(format!("h{i}"), "v"));
    let refusals: Vec<(&str, Result<String, OutboxError>)> = vec![
        (
            "a header name with a colon",
            message().header("a:b", "v").enqueue(&mut conn),
        ),
        ("an empty header name", message().header("", "v").enqueue(&mut conn)),
        (
            "a line break in a value",
            message().header("x", "a\r\nb").enqueue(&mut conn),
        ),
        (
            "a value too long",
            message().header("x", "v".repeat(4097)).enqueue(&mut conn),
        ),
        ("65 headers", many.enqueue(&mut conn)),
        (
            "an ordering key with a space",
            message().ordering_key("order 1").enqueue(&mut conn),
        ),
        ("an empty ordering key", message().ordering_key("").enqueue(&mut conn)),
        (
            "an ordering key too long",
            message().ordering_key("k".repeat(256)).enqueue(&mut conn),
        ),
        (
            "a traceparent in upper case",
            message().traceparent(TRACEPARENT.to_uppercase()).enqueue(&mut conn),
        ),
        (
            "a tracestate with a control character",
            message()
                .traceparent(TRACEPARENT)
                .tracestate("a=\u{7}")
                .enqueue(&mut conn),
        ),
        ("a tracestate alone", message().tracestate("a=1").enqueue(&mut conn)),
    ];
    for (what, refused) in &refusals {
        let typed = matches!(
            refused,
            Err(OutboxError::InvalidHeader(
                HeaderError::InvalidName { .. } | HeaderError::InvalidValue { .. } | HeaderError::TooMany { count: 65 }
            )) | Err(OutboxError::InvalidOrderingKey(_))
                | Err(OutboxError::InvalidTraceContext(
                    TraceContextError::Traceparent
                        | TraceContextError::Tracestate
                        | TraceContextError::TracestateWithoutTraceparent
                ))
        );
        assert!(typed, "{what}: {refused:?}");
    }
    assert!(D::outbox_messages(&mut conn).is_empty(), "nothing was written");
}

fn only_the_head_of_each_ordering_key_is_claimed_and_a_dead_head_releases_its_key<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let keyed = |key: &str, n: i32| outbox::Envelope::new("events", &n).ordering_key(key);
    let a: Vec<String> = (0..3)
        .map(|n| keyed("a", n).enqueue(&mut conn).expect("enqueue"))
        .collect();
    let b0 = keyed("b", 10).enqueue(&mut conn).expect("enqueue");
    let free = outbox::enqueue(&mut conn, "events", &20).expect("enqueue");
    let clock = ManualClock::at(Utc::now() + Duration::seconds(1));
    let relay = Relay::default()
        .clock(clock.source())
        .max_attempts(2)
        .backoff(Duration::seconds(10), Duration::seconds(10));

    let mut handed = Vec::new();
    let first = relay
        .run_once(&mut conn, |message| {
            handed.push(message.id.clone());
            if message.id == a[0] { Err("broker down") } else { Ok(()) }
        })
        .expect("relay");
    assert_eq!(
        handed,
        [a[0].clone(), b0.clone(), free.clone()],
        "one head per key, and the free message"
    );
    assert_eq!((first.delivered, first.retried), (2, 1));

    // Backed off: its key waits for it, even though a[1] is due.
    clock.advance(Duration::seconds(5));
    assert_eq!(
        relay.run_once(&mut conn, |_| Ok::<_, &str>(())).expect("relay").claimed,
        0
    );

    // Its last attempt fails: dead, and the key goes on with the next.
    clock.advance(Duration::seconds(5));
    let mut handed = Vec::new();
    relay
        .run_once(&mut conn, |message| {
            handed.push(message.id.clone());
            Err("broker down")
        })
        .expect("relay");
    assert_eq!(handed, [a[0].clone()]);
    let mut handed = Vec::new();
    relay
        .run_once(&mut conn, |message| {
            handed.push(message.id.clone());
            if message.id == a[1] {
                Err(outbox::Permanent("malformed"))
            } else {
                Ok(())
            }
        })
        .expect("relay");
    assert_eq!(handed, [a[1].clone()], "the next of the key, once its head is dead");
    let mut handed = Vec::new();
    relay
        .run_once(&mut conn, |message| {
            handed.push(message.id.clone());
            Ok::<_, &str>(())
        })
        .expect("relay");
    assert_eq!(handed, [a[2].clone()], "a permanent failure releases the key too");
}

fn concurrent_relays_hand_over_each_key_in_enqueue_order_and_a_failing_key_holds_back_only_itself<D: TestDb>() {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    const KEYS: usize = 8;
    const PER_KEY: usize = 12;
    const RELAYS: usize = 4;
    /// The key whose head fails until every other message is delivered.
    const HELD: usize = 0;
    let db = D::new();
    let mut conn = db.conn();
    for n in 0..PER_KEY {
        for key in 0..KEYS {
            outbox::Envelope::new("events", &(key, n))
                .ordering_key(format!("key-{key}"))
                .enqueue(&mut conn)
                .expect("enqueue");
        }
        // Without a key: delivered in parallel, as before.
        outbox::enqueue(&mut conn, "events", &(usize::MAX, n)).expect("enqueue");
    }
    let total = (KEYS + 1) * PER_KEY;
    let others = total - PER_KEY;

    let delivered = Mutex::new(HashMap::<usize, Vec<usize>>::new());
    let in_flight = Mutex::new(HashSet::<usize>::new());
    let done = AtomicUsize::new(0);
    let others_done = AtomicUsize::new(0);
    let (overlaps, held_while_others_ran) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let barrier = Barrier::new(RELAYS);
    let relay = Relay::default()
        .batch_size(5)
        .lease(Duration::minutes(10))
        .max_attempts(10_000)
        .backoff(Duration::milliseconds(1), Duration::milliseconds(1));
    let handler = |message: &Message| -> Result<(), String> {
        let (key, n): (usize, usize) = message.payload().map_err(|e| e.to_string())?;
        let keyed = key != usize::MAX;
        if keyed && !in_flight.lock().unwrap().insert(key) {
            overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let mut hasher = DefaultHasher::new();
        (&message.id, message.attempt).hash(&mut hasher);
        let outcome = if key == HELD && others_done.load(Ordering::SeqCst) < others {
            held_while_others_ran.fetch_add(1, Ordering::SeqCst);
            Err(String::from("held"))
        } else if hasher.finish().is_multiple_of(3) {
            Err(String::from("random failure"))
        } else {
            if keyed {
                delivered.lock().unwrap().entry(key).or_default().push(n);
            }
            done.fetch_add(1, Ordering::SeqCst);
            if key != HELD {
                others_done.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
        };
        if keyed {
            in_flight.lock().unwrap().remove(&key);
        }
        outcome
    };
    std::thread::scope(|scope| {
        for _ in 0..RELAYS {
            scope.spawn(|| {
                barrier.wait();
                let mut conn = db.conn();
                while done.load(Ordering::SeqCst) < total {
                    let report = relay.run_once(&mut conn, &handler).expect("relay");
                    if report.claimed == 0 {
                        std::thread::yield_now();
                    }
                }
            });
        }
    });

    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "never two messages of one key at once"
    );
    assert!(
        held_while_others_ran.load(Ordering::SeqCst) > 0,
        "the held key failed while the others went on"
    );
    let delivered = delivered.into_inner().unwrap();
    for key in 0..KEYS {
        assert_eq!(
            delivered[&key],
            (0..PER_KEY).collect::<Vec<_>>(),
            "key {key}: each message once, in enqueue order"
        );
    }
    assert_eq!(status_count::<D>(&mut conn, "delivered"), total);
}

/// The database error inside a call's error, for an operation that returns
/// the outbox's.
fn storage(error: Error<outbox::Error>) -> diesel::result::Error {
    match error {
        Error::Storage(e) | Error::Operation(outbox::Error::Storage(e)) => e,
        other => panic!("the nested call failed: {other:?}"),
    }
}
