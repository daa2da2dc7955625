//! What the crate stores must come back as it went in: results that would
//! not replay, requests that would pass for others, payloads a receiver
//! could not read are refused before anything commits; and a call writes
//! its key record once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use diesel::connection::{Connection, Instrumentation, InstrumentationEvent};
use idempotency::outbox::{self, Relay};
use idempotency::{Error, Outcome, run_idempotent};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::common::TestDb;

crate::common::backend_tests!(
    non_finite_result_is_refused_and_leaves_the_key_free,
    result_too_deep_to_read_back_is_refused_and_leaves_the_key_free,
    non_finite_float_inside_an_option_is_refused_not_stored_as_none,
    some_of_a_null_is_refused_not_replayed_as_none,
    result_that_reads_back_as_another_value_is_refused_and_leaves_the_key_free,
    hash_sets_and_maps_replay_in_any_order,
    non_finite_numbers_in_a_request_are_refused_before_anything_is_written,
    a_request_with_null_is_not_replayed_for_one_with_nan,
    floats_replay_bit_for_bit,
    payload_that_would_not_read_back_is_refused_and_writes_nothing,
    fresh_call_writes_its_key_record_once_or_claims_and_completes_it,
);

/// A value nested `depth` arrays deep.
fn nested(depth: usize) -> Value {
    (0..depth).fold(Value::Null, |inner, _| Value::Array(vec![inner]))
}

fn assert_codec<R: std::fmt::Debug, E: std::fmt::Debug>(result: Result<Outcome<R>, Error<E>>, what: &str) {
    assert!(matches!(result, Err(Error::Codec(_))), "{what}: {result:?}");
}

fn non_finite_result_is_refused_and_leaves_the_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    for (key, value) in [
        ("nan", f64::NAN),
        ("inf", f64::INFINITY),
        ("neg-inf", f64::NEG_INFINITY),
    ] {
        let refused = run_idempotent(&mut conn, "shop", key, &1, |tx| {
            D::place_order(tx, key, 1)?;
            Ok::<_, diesel::result::Error>(value)
        });
        assert_codec(refused, key);
    }
    assert_eq!(D::order_count(&mut conn), 0, "the orders rolled back");
    assert_eq!(D::key_count(&mut conn), 0, "no record was stored");

    // The key is free: the same request with a result that replays executes.
    let retried = run_idempotent(&mut conn, "shop", "nan", &1, |tx| {
        D::place_order(tx, "nan", 1)?;
        Ok::<_, diesel::result::Error>(0.5)
    });
    assert_eq!(retried.expect("the retry executes"), Outcome::Executed(0.5));
    let replayed = run_idempotent(&mut conn, "shop", "nan", &1, |_| Ok::<_, diesel::result::Error>(9.0));
    assert_eq!(replayed.expect("the retry replays"), Outcome::Replayed(0.5));
}

fn result_too_deep_to_read_back_is_refused_and_leaves_the_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let refused = run_idempotent(&mut conn, "shop", "deep", &1, |tx| {
        D::place_order(tx, "deep", 1)?;
        Ok::<_, diesel::result::Error>(nested(200))
    });
    assert_codec(refused, "200 levels");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);

    // Within serde_json's limit of 128 it is stored and replayed.
    let shallow = nested(100);
    let stored = run_idempotent(&mut conn, "shop", "deep", &1, |_| {
        Ok::<_, diesel::result::Error>(shallow.clone())
    });
    assert_eq!(stored.expect("100 levels execute"), Outcome::Executed(shallow.clone()));
    let replayed = run_idempotent(&mut conn, "shop", "deep", &1, |_| {
        Ok::<_, diesel::result::Error>(Value::Null)
    });
    assert_eq!(replayed.expect("and replay"), Outcome::Replayed(shallow));
}

fn non_finite_float_inside_an_option_is_refused_not_stored_as_none<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // serde_json would write `null`, which reads back as `None`: a replay
    // that differs from the result.
    let refused = run_idempotent(&mut conn, "shop", "opt", &1, |_| {
        Ok::<_, diesel::result::Error>(vec![Some(1.0), Some(f64::NAN)])
    });
    assert_codec(refused, "Some(NaN)");
    assert_eq!(D::key_count(&mut conn), 0);
}

fn some_of_a_null_is_refused_not_replayed_as_none<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // Each is written as `null`, which reads back as `None`.
    assert_codec(
        run_idempotent(&mut conn, "shop", "unit", &1, |_| {
            Ok::<_, diesel::result::Error>(Some(()))
        }),
        "Some(())",
    );
    assert_codec(
        run_idempotent(&mut conn, "shop", "none", &1, |_| {
            Ok::<_, diesel::result::Error>(vec![Some(None::<i32>)])
        }),
        "Some(None)",
    );
    assert_codec(
        run_idempotent(&mut conn, "shop", "value", &1, |tx| {
            D::place_order(tx, "value", 1)?;
            Ok::<_, diesel::result::Error>(HashMap::from([(String::from("data"), Some(Value::Null))]))
        }),
        "Some(Value::Null)",
    );
    assert_eq!(D::order_count(&mut conn), 0, "the order rolled back");
    assert_eq!(D::key_count(&mut conn), 0, "no record was stored");

    // What JSON tells apart is stored and replayed as it was.
    let nested = vec![Some(Some(5)), Some(None), None];
    let refused = run_idempotent(&mut conn, "shop", "kept", &1, |_| {
        Ok::<_, diesel::result::Error>(nested.clone())
    });
    assert_codec(refused, "Some(None) inside a list");
    let kept = vec![Some(Some(5)), None];
    run_idempotent(&mut conn, "shop", "kept", &1, |_| {
        Ok::<_, diesel::result::Error>(kept.clone())
    })
    .expect("executes");
    let replayed = run_idempotent(&mut conn, "shop", "kept", &1, |_| {
        Ok::<_, diesel::result::Error>(Vec::new())
    });
    assert_eq!(replayed.expect("replays"), Outcome::Replayed(kept));
}

/// A receipt whose reader drops a field its writer writes: stored, it
/// would replay without the note.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    order: i64,
    #[serde(skip_deserializing, skip_serializing_if = "String::is_empty")]
    note: String,
}

fn result_that_reads_back_as_another_value_is_refused_and_leaves_the_key_free<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let noted = Receipt {
        order: 7,
        note: String::from("gift wrap"),
    };
    let refused = run_idempotent(&mut conn, "shop", "receipt", &1, |tx| {
        D::place_order(tx, "receipt", 1)?;
        Ok::<_, diesel::result::Error>(noted.clone())
    });
    assert_codec(refused, "a receipt that reads back without its note");
    assert_eq!(D::order_count(&mut conn), 0, "the order rolled back");
    assert_eq!(D::key_count(&mut conn), 0, "no record was stored");

    let plain = Receipt {
        order: 7,
        note: String::new(),
    };
    let stored = run_idempotent(&mut conn, "shop", "receipt", &1, |_| {
        Ok::<_, diesel::result::Error>(plain.clone())
    });
    assert_eq!(stored.expect("the key is free"), Outcome::Executed(plain.clone()));
    let replayed = run_idempotent(&mut conn, "shop", "receipt", &1, |_| {
        Ok::<_, diesel::result::Error>(noted.clone())
    });
    assert_eq!(replayed.expect("replays"), Outcome::Replayed(plain));
}

fn hash_sets_and_maps_replay_in_any_order<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // A hash set or map decoded again writes its entries in another order;
    // the result is still the same value.
    let tags: HashMap<String, HashSet<i64>> = (0..20)
        .map(|group| (format!("group-{group}"), (0..50).map(|tag| group * 100 + tag).collect()))
        .collect();
    let stored = run_idempotent(&mut conn, "shop", "tags", &1, |_| {
        Ok::<_, diesel::result::Error>(tags.clone())
    });
    assert_eq!(stored.expect("executes"), Outcome::Executed(tags.clone()));
    let replayed = run_idempotent(&mut conn, "shop", "tags", &1, |_| {
        Ok::<_, diesel::result::Error>(HashMap::new())
    });
    assert_eq!(replayed.expect("replays"), Outcome::Replayed(tags));
}

fn non_finite_numbers_in_a_request_are_refused_before_anything_is_written<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let mut calls = 0;
    for (key, amount) in [
        ("nan", f64::NAN),
        ("inf", f64::INFINITY),
        ("neg-inf", f64::NEG_INFINITY),
    ] {
        let request = (String::from("book"), amount);
        let refused = run_idempotent(&mut conn, "shop", key, &request, |_| {
            calls += 1;
            Ok::<_, diesel::result::Error>(1)
        });
        assert_codec(refused, key);
    }
    assert_eq!(calls, 0, "the operation never ran");
    assert_eq!(D::key_count(&mut conn), 0, "nothing was written");
}

fn a_request_with_null_is_not_replayed_for_one_with_nan<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let first = run_idempotent(&mut conn, "shop", "k", &(String::from("book"), None::<f64>), |_| {
        Ok::<_, diesel::result::Error>(1)
    });
    assert_eq!(first.expect("null executes"), Outcome::Executed(1));
    // Before, NaN fingerprinted as null and replayed the first result.
    let other = run_idempotent(&mut conn, "shop", "k", &(String::from("book"), Some(f64::NAN)), |_| {
        Ok::<_, diesel::result::Error>(2)
    });
    assert_codec(other, "NaN under a key bound to null");
    let different = run_idempotent(&mut conn, "shop", "k", &(String::from("book"), Some(0.0)), |_| {
        Ok::<_, diesel::result::Error>(3)
    });
    assert!(matches!(different, Err(Error::Mismatch)), "{different:?}");
}

fn floats_replay_bit_for_bit<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let values = vec![
        0.1 + 0.2,
        1e-300,
        5e-324,
        f64::MAX,
        f64::MIN_POSITIVE,
        -0.0,
        2.0f64.sqrt(),
        123_456_789.123_456_79,
    ];
    let first = run_idempotent(&mut conn, "shop", "floats", &1, |_| Ok::<_, Error>(values.clone()));
    assert!(!first.expect("executes").is_replayed());
    let replayed = run_idempotent(&mut conn, "shop", "floats", &1, |_| Ok::<_, Error>(Vec::<f64>::new()))
        .expect("replays")
        .into_inner();
    let bits = |floats: &[f64]| floats.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&replayed), bits(&values));
}

fn payload_that_would_not_read_back_is_refused_and_writes_nothing<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let non_finite = outbox::enqueue(&mut conn, "receipts", &(json!({ "order": 1 }), f64::NAN));
    assert!(matches!(non_finite, Err(outbox::Error::Codec(_))), "{non_finite:?}");
    let too_deep = outbox::enqueue(&mut conn, "receipts", &nested(200));
    assert!(matches!(too_deep, Err(outbox::Error::Codec(_))), "{too_deep:?}");
    // Refused inside a call, the call rolls back with it.
    let call = run_idempotent(&mut conn, "shop", "order-1", &1, |tx| {
        D::place_order(tx, "book", 1).map_err(outbox::Error::Storage)?;
        outbox::enqueue(tx, "receipts", &nested(129))?;
        Ok::<_, outbox::Error>(1)
    });
    assert!(
        matches!(call, Err(Error::Operation(outbox::Error::Codec(_)))),
        "{call:?}"
    );
    assert!(D::outbox_messages(&mut conn).is_empty(), "no message was written");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);
    let report = Relay::default()
        .run_once(&mut conn, |_| Ok::<_, std::convert::Infallible>(()))
        .expect("relay");
    assert_eq!(report.claimed, 0);
}

/// Records the statements a connection sends.
#[derive(Clone, Default)]
struct Statements(Arc<Mutex<Vec<String>>>);

impl Statements {
    fn instrumentation(&self) -> impl Instrumentation {
        let statements = self.0.clone();
        move |event: InstrumentationEvent<'_>| {
            if let InstrumentationEvent::StartQuery { query, .. } = event {
                statements
                    .lock()
                    .expect("no panic while locked")
                    .push(query.to_string());
            }
        }
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().expect("no panic while locked"))
    }
}

fn fresh_call_writes_its_key_record_once_or_claims_and_completes_it<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let statements = Statements::default();
    conn.set_instrumentation(statements.instrumentation());
    let writes_to_keys = |statements: &[String]| -> Vec<String> {
        // A statement of several (PostgreSQL's claim rides with the lock)
        // is looked at part by part.
        statements
            .iter()
            .flat_map(|sql| sql.split(';'))
            .map(|sql| sql.trim().to_lowercase())
            .filter(|sql| {
                (sql.starts_with("insert") || sql.starts_with("update") || sql.starts_with("delete"))
                    && sql.contains("idempotency_keys")
            })
            .collect()
    };

    let first = run_idempotent(&mut conn, "shop", "once", &1, |tx| D::place_order(tx, "book", 1));
    assert!(!first.expect("executes").is_replayed());
    let writes: Vec<String> = writes_to_keys(&statements.take())
        .iter()
        .map(|sql| sql.split_whitespace().next().unwrap_or_default().to_lowercase())
        .collect();
    if D::WRITES_KEY_RECORD_ONCE {
        assert_eq!(writes, ["insert"], "one write of the key record");
    } else {
        assert_eq!(writes, ["insert", "update"], "a claim, completed after the operation");
    }

    let replay = run_idempotent(&mut conn, "shop", "once", &1, |tx| D::place_order(tx, "book", 1));
    assert!(replay.expect("replays").is_replayed());
    let sent = statements.take();
    assert!(
        !writes_to_keys(&sent).iter().any(|sql| sql.starts_with("update")),
        "a replay completes nothing: {sent:?}"
    );

    let reading_first = idempotency::Config::default().read_before_transaction(true);
    let replay = reading_first.run(&mut conn, "shop", "once", &1, |tx| D::place_order(tx, "book", 1));
    assert!(replay.expect("replays").is_replayed());
    let sent = statements.take();
    assert_eq!(sent.len(), 1, "a replay that reads first is one read: {sent:?}");
}
