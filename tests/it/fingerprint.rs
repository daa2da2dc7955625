//! The request fingerprint: independent of map order, sensitive to content.

use std::collections::{BTreeMap, HashMap};

use idempotency::{Error, run_idempotent};
use serde::Serialize;

use crate::common::{Tagged, TestDb, tagged_body};

#[derive(Serialize)]
struct Order {
    lines: HashMap<String, u32>,
    note: Option<String>,
}

/// Builds the same map with the keys inserted in `order`; the `HashMap`s
/// also get different random hash seeds, so their iteration orders differ.
fn lines(order: &[&str]) -> HashMap<String, u32> {
    let mut map = HashMap::new();
    for item in order {
        map.insert((*item).to_owned(), u32::try_from(item.len()).expect("short item names"));
    }
    map
}

crate::common::backend_tests!(
    fingerprint_is_sha256_of_the_canonical_json,
    maps_built_in_different_orders_match,
    a_struct_and_a_map_with_the_same_json_match,
    any_changed_value_is_a_mismatch,
    numbers_the_fingerprint_cannot_tell_apart_are_refused_and_nothing_is_written,
    a_request_with_hash_sets_read_twice_from_the_same_body_is_replayed,
);

/// The stored fingerprint is the SHA-256 of the canonical form written
/// out by hand here. The tests build serde_json with `preserve_order` and
/// `arbitrary_precision` (see the dev-dependencies), the two features
/// that change how maps and numbers are held, so this proves that neither
/// changes the fingerprint.
fn fingerprint_is_sha256_of_the_canonical_json<D: TestDb>() {
    use sha2::{Digest, Sha256};
    let db = D::new();
    let mut conn = db.conn();
    let request = serde_json::json!({"z": {"y": 2.5, "x": [true, null]}, "a": u64::MAX, "m": "é\n"});
    run_idempotent(&mut conn, "shop", "k-hash", &request, |tx| {
        D::place_order(tx, "book", 1)
    })
    .expect("call");

    let canonical = r#"{"a":18446744073709551615,"m":"é\n","z":{"x":[true,null],"y":2.5}}"#;
    let expected: String = Sha256::digest(canonical.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(D::request_hashes(&mut conn), [expected]);
}

fn maps_built_in_different_orders_match<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let items: Vec<String> = (0..64).map(|i| format!("item-{i}")).collect();
    let forward: Vec<&str> = items.iter().map(String::as_str).collect();
    let backward: Vec<&str> = forward.iter().rev().copied().collect();

    let first = Order {
        lines: lines(&forward),
        note: None,
    };
    let retry = Order {
        lines: lines(&backward),
        note: None,
    };
    let a = run_idempotent(&mut conn, "shop", "k-map", &first, |tx| D::place_order(tx, "book", 1)).expect("first");
    let b = run_idempotent(&mut conn, "shop", "k-map", &retry, |tx| D::place_order(tx, "book", 1)).expect("retry");
    assert!(!a.is_replayed());
    assert!(b.is_replayed(), "the same content in another order is the same request");
    assert_eq!(D::order_count(&mut conn), 1);
}

fn a_struct_and_a_map_with_the_same_json_match<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    #[derive(Serialize)]
    struct Request {
        b: u32,
        a: &'static str,
    }
    let mut map = BTreeMap::new();
    map.insert("a", serde_json::json!("x"));
    map.insert("b", serde_json::json!(1));
    run_idempotent(&mut conn, "shop", "k-shape", &Request { b: 1, a: "x" }, |tx| {
        D::place_order(tx, "book", 1)
    })
    .expect("first");
    let retry = run_idempotent(&mut conn, "shop", "k-shape", &map, |tx| D::place_order(tx, "book", 1)).expect("retry");
    assert!(retry.is_replayed());
}

fn any_changed_value_is_a_mismatch<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let base = serde_json::json!({"item": "book", "quantity": 1, "tags": ["a", "b"], "note": null});
    run_idempotent(&mut conn, "shop", "k-change", &base, |tx| D::place_order(tx, "book", 1)).expect("first");
    for changed in [
        serde_json::json!({"item": "book", "quantity": 2, "tags": ["a", "b"], "note": null}),
        serde_json::json!({"item": "book", "quantity": 1, "tags": ["b", "a"], "note": null}),
        serde_json::json!({"item": "book", "quantity": 1, "tags": ["a", "b"]}),
        serde_json::json!({"item": "book", "quantity": 1.0, "tags": ["a", "b"], "note": null}),
        serde_json::json!({"item": "Book", "quantity": 1, "tags": ["a", "b"], "note": null}),
    ] {
        let result = run_idempotent(&mut conn, "shop", "k-change", &changed, |tx| {
            D::place_order(tx, "book", 1)
        });
        assert!(matches!(result, Err(Error::Mismatch)), "{changed}: {result:?}");
    }
    assert_eq!(D::order_count(&mut conn), 1);
}

/// Wei-style amounts that only differ past a float's precision, and an
/// integer past 64 bits, as the `arbitrary_precision` build keeps them:
/// refused, or the second would be answered with the first's result.
fn numbers_the_fingerprint_cannot_tell_apart_are_refused_and_nothing_is_written<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    for (key, text) in [
        ("k-wei-1", r#"{"amount": 1.000000000000000001}"#),
        ("k-wei-1", r#"{"amount": 1.000000000000000002}"#),
        ("k-big", r#"{"amount": 18446744073709551617}"#),
        ("k-wide", r#"{"amount": 170141183460469231731687303715884105727}"#),
    ] {
        let request: serde_json::Value = serde_json::from_str(text).expect("json");
        let result = run_idempotent(&mut conn, "shop", key, &request, |tx| D::place_order(tx, "book", 1));
        match result {
            Err(Error::Codec(error)) => assert!(error.to_string().contains("64-bit float"), "{error}"),
            other => panic!("{text}: {other:?}"),
        }
    }
    assert_eq!(D::order_count(&mut conn), 0, "the operation never ran");
    assert!(D::request_hashes(&mut conn).is_empty(), "no record written");
    let plain: serde_json::Value = serde_json::from_str(r#"{"amount": 1.5, "fee": 0.1}"#).expect("json");
    let placed = run_idempotent(&mut conn, "shop", "k-plain", &plain, |tx| D::place_order(tx, "book", 1));
    assert!(!placed.expect("a float a request may hold").is_replayed());
}

/// A request type with hash sets, at the top and nested, deserialized
/// from the same body for each call: every call sees the sets in another
/// order, and every retry is still the same request.
fn a_request_with_hash_sets_read_twice_from_the_same_body_is_replayed<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let body = tagged_body();
    for attempt in 0..10 {
        let request: Tagged = serde_json::from_str(&body).expect("json");
        let outcome = run_idempotent(&mut conn, "shop", "k-sets", &request, |tx| {
            D::place_order(tx, "book", 1)
        })
        .unwrap_or_else(|error| panic!("attempt {attempt}: {error:?}"));
        assert_eq!(outcome.is_replayed(), attempt > 0, "attempt {attempt}");
    }
    assert_eq!(D::order_count(&mut conn), 1);
}

/// Random JSON trees through `Config::run`, on in-memory SQLite.
#[cfg(feature = "sqlite")]
mod trees {
    use super::*;
    use crate::common::property::{Prng, cases};

    /// A random JSON tree of at most `depth` levels: every kind of value, keys
    /// that differ in one character.
    fn tree(prng: &mut Prng, depth: usize) -> serde_json::Value {
        use serde_json::Value;
        match prng.below(if depth == 0 { 5 } else { 7 }) {
            0 => Value::Null,
            1 => Value::Bool(prng.below(2) == 0),
            2 => Value::from(prng.next() as i64 >> prng.below(64)),
            3 => Value::from((prng.below(2_000_000) as f64 - 1_000_000.0) / 64.0),
            4 => Value::from(["", "a", "b", "ab", "é", "\u{0}"][prng.below(6)]),
            5 => Value::Array((0..prng.below(4)).map(|_| tree(prng, depth - 1)).collect()),
            _ => Value::Object(
                (0..prng.below(4))
                    .map(|i| (format!("k{}{i}", ["", "a", "é"][prng.below(3)]), tree(prng, depth - 1)))
                    .collect(),
            ),
        }
    }

    /// `value` with every object's keys inserted in another order (which the
    /// tests' serde_json, with `preserve_order`, keeps).
    fn shuffled(value: &serde_json::Value, prng: &mut Prng) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::Array(items) => Value::Array(items.iter().map(|item| shuffled(item, prng)).collect()),
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                for i in (1..entries.len()).rev() {
                    entries.swap(i, prng.below(i + 1));
                }
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), shuffled(v, prng)))
                        .collect(),
                )
            }
            leaf => leaf.clone(),
        }
    }

    /// `value` with one leaf (or an empty array or object) changed.
    fn changed(value: &serde_json::Value, prng: &mut Prng) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::Array(items) if !items.is_empty() => {
                let at = prng.below(items.len());
                let mut items = items.clone();
                items[at] = changed(&items[at], prng);
                Value::Array(items)
            }
            Value::Object(map) if !map.is_empty() => {
                let at = prng.below(map.len());
                let mut map = map.clone();
                let key = map.keys().nth(at).expect("in range").clone();
                let replaced = changed(&map[&key], prng);
                map.insert(key, replaced);
                Value::Object(map)
            }
            Value::Array(_) => Value::Array(vec![Value::Null]),
            Value::Object(_) => serde_json::json!({"k": null}),
            Value::Null => Value::from(0),
            Value::Bool(b) => Value::Bool(!b),
            Value::Number(n) if n.is_f64() => Value::from(n.as_f64().expect("a float") + 1.0),
            Value::Number(n) => match n.as_i64() {
                Some(i) => Value::from(i.wrapping_add(1)),
                None => Value::from(0),
            },
            Value::String(s) => Value::from(format!("{s}x")),
        }
    }

    /// Random JSON trees through `Config::run`: the same tree with its keys in
    /// another order is replayed, one with a leaf changed is a mismatch.
    #[test]
    fn random_trees_replay_with_keys_reordered_and_mismatch_with_a_leaf_changed() {
        let mut conn = idempotency::testing::sqlite_memory();
        let mut prng = Prng(0xf1e1_d001);
        for case in 0..cases(500) {
            let request = tree(&mut prng, 4);
            let key = format!("tree-{case}");
            let run = |conn: &mut diesel::SqliteConnection, request: &serde_json::Value| {
                run_idempotent(conn, "trees", &key, request, |_| {
                    Ok::<_, std::convert::Infallible>(case)
                })
            };
            assert!(!run(&mut conn, &request).expect("first").is_replayed(), "{request}");
            let reordered = shuffled(&request, &mut prng);
            assert!(
                run(&mut conn, &reordered).expect("reordered").is_replayed(),
                "{request} as {reordered}"
            );
            let other = changed(&request, &mut prng);
            assert!(
                matches!(run(&mut conn, &other), Err(Error::Mismatch)),
                "{request} then {other}"
            );
        }
    }
}
