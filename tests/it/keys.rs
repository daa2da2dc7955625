//! Key and scope validation: every kind of bad input is refused with a typed
//! error before anything is read or written.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency::{Error, KeyError, run_idempotent};

use crate::common::TestDb;

crate::common::backend_tests!(
    empty_key_is_refused,
    key_over_the_limit_is_refused,
    key_at_the_limit_is_accepted,
    white_space_in_key_is_refused,
    control_bytes_and_nul_in_key_are_refused,
    non_ascii_key_is_refused,
    card_number_like_keys_are_refused,
    digit_keys_that_are_not_card_numbers_are_accepted,
    invalid_scopes_are_refused,
    card_numbers_in_scopes_are_refused,
    derived_keys_are_always_valid,
);

/// Runs a call that would insert an order and returns its error, after
/// checking that nothing ran and nothing was written.
fn refused<D: TestDb>(scope: &str, key: &str) -> Error<diesel::result::Error> {
    let db = D::new();
    let mut conn = db.conn();
    let calls = AtomicUsize::new(0);
    let result = run_idempotent(&mut conn, scope, key, &"request", |tx| {
        calls.fetch_add(1, Ordering::SeqCst);
        D::place_order(tx, "book", 1)
    });
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the operation must not run");
    assert_eq!(D::order_count(&mut conn), 0);
    assert_eq!(D::key_count(&mut conn), 0);
    result.expect_err("the call must be refused")
}

fn refused_key<D: TestDb>(key: &str) -> KeyError {
    match refused::<D>("scope", key) {
        Error::InvalidKey(reason) => reason,
        other => panic!("expected InvalidKey for {key:?}, got {other:?}"),
    }
}

fn refused_scope<D: TestDb>(scope: &str) -> KeyError {
    match refused::<D>(scope, "key") {
        Error::InvalidScope(reason) => reason,
        other => panic!("expected InvalidScope for {scope:?}, got {other:?}"),
    }
}

fn empty_key_is_refused<D: TestDb>() {
    assert_eq!(refused_key::<D>(""), KeyError::Empty);
}

fn key_over_the_limit_is_refused<D: TestDb>() {
    assert_eq!(
        refused_key::<D>(&"k".repeat(256)),
        KeyError::TooLong { len: 256, max: 255 }
    );
}

fn key_at_the_limit_is_accepted<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let key = "k".repeat(255);
    let outcome = run_idempotent(&mut conn, "scope", &key, &1, |tx| D::place_order(tx, "book", 1));
    assert!(!outcome.expect("a 255-byte key is valid").is_replayed());
    assert_eq!(D::key_count(&mut conn), 1);
}

fn white_space_in_key_is_refused<D: TestDb>() {
    for (key, position) in [
        (" lead", 0),
        ("trail ", 5),
        ("in side", 2),
        ("tab\there", 3),
        ("new\nline", 3),
    ] {
        assert_eq!(
            refused_key::<D>(key),
            KeyError::InvalidCharacter { position },
            "{key:?}"
        );
    }
}

fn control_bytes_and_nul_in_key_are_refused<D: TestDb>() {
    assert_eq!(refused_key::<D>("a\u{0}b"), KeyError::InvalidCharacter { position: 1 });
    assert_eq!(
        refused_key::<D>("a\u{1b}[31m"),
        KeyError::InvalidCharacter { position: 1 }
    );
    assert_eq!(
        refused_key::<D>("del\u{7f}"),
        KeyError::InvalidCharacter { position: 3 }
    );
}

fn non_ascii_key_is_refused<D: TestDb>() {
    assert_eq!(refused_key::<D>("café"), KeyError::InvalidCharacter { position: 3 });
    assert_eq!(refused_key::<D>("ключ"), KeyError::InvalidCharacter { position: 0 });
    assert_eq!(
        refused_key::<D>("key\u{200b}"),
        KeyError::InvalidCharacter { position: 3 }
    );
}

fn card_number_like_keys_are_refused<D: TestDb>() {
    for key in [
        "4111111111111111",
        "4111-1111-1111-1111",
        "4111 1111 1111 1111",
        "378282246310005",
        "6011111111111117",
        "4222222222222",
        "6304000000000000000",
        // Within a key, standing apart from letters and other digits.
        "pay-4111111111111111",
        "4111111111111111_1",
        "order:4111-1111-1111-1111",
        "4111.1111.1111.1111",
        "ref/3782-822463-10005",
        "a.4111 1111 1111 1111",
        "x_6011111111111117_y",
        "4111111111111111-4111",
        // In their layouts inside longer chains of digit groups.
        "order-7-4111-1111-1111-1111",
        "ref.2223.0031.2200.3222.0",
        "4111-111141-11121-1112-4105\"abc",
        "50-2110-2150-215010-2150-",
    ] {
        assert_eq!(refused_key::<D>(key), KeyError::LooksLikeCardNumber, "{key:?}");
    }
}

fn digit_keys_that_are_not_card_numbers_are_accepted<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // Luhn-invalid, too short, too long, glued to letters, or digits
    // grouped as dates and times rather than as cards are written (each of
    // those Luhn-valid once its groups are joined).
    let keys = [
        "4111111111111112",
        "411111111111",
        "41111111111111111111",
        "order4111111111111111",
        "4111111111111111x",
        "order-2026-12-01-00006",
        "job-1700000000.000001",
        "order-1700000000004",
        "0f8fad5b-d9cb-469f-a165-70867728950e",
    ];
    for key in keys {
        let outcome = run_idempotent(&mut conn, "scope", key, &1, |tx| D::place_order(tx, "book", 1));
        assert!(outcome.is_ok(), "{key:?}: {outcome:?}");
    }
    assert_eq!(D::order_count(&mut conn), 9);
}

fn invalid_scopes_are_refused<D: TestDb>() {
    assert_eq!(refused_scope::<D>(""), KeyError::Empty);
    assert_eq!(
        refused_scope::<D>(&"s".repeat(256)),
        KeyError::TooLong { len: 256, max: 255 }
    );
    assert_eq!(
        refused_scope::<D>("ten ant"),
        KeyError::InvalidCharacter { position: 3 }
    );
    assert_eq!(refused_scope::<D>("t\u{0}"), KeyError::InvalidCharacter { position: 1 });
    assert_eq!(refused_scope::<D>("tenänt"), KeyError::InvalidCharacter { position: 3 });
}

fn card_numbers_in_scopes_are_refused<D: TestDb>() {
    for scope in [
        "4111111111111111",
        "tenant-4111-1111-1111-1111",
        "4111111111111111:alice",
        "tenant-7-4111-1111-1111-1111",
    ] {
        assert_eq!(refused_scope::<D>(scope), KeyError::LooksLikeCardNumber, "{scope:?}");
    }
}

fn derived_keys_are_always_valid<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let key = idempotency::key::derive(&["job with spaces", "ïtem\u{0}"]);
    let outcome = run_idempotent(&mut conn, "batch", &key, &1, |tx| D::place_order(tx, "book", 1));
    assert!(outcome.is_ok(), "{outcome:?}");
}

#[test]
fn key_errors_say_what_is_wrong_without_repeating_the_key() {
    let error: Error = Error::InvalidKey(KeyError::LooksLikeCardNumber);
    assert_eq!(
        error.to_string(),
        "invalid idempotency key: looks like a payment card number"
    );
    assert_eq!(error.status_code(), 400);
    let error: Error = Error::InvalidScope(KeyError::TooLong { len: 300, max: 255 });
    assert_eq!(
        error.to_string(),
        "invalid idempotency scope: is 300 bytes long, the limit is 255"
    );
    assert_eq!(
        KeyError::InvalidCharacter { position: 4 }.to_string(),
        "byte 4 is not visible ascii"
    );
    assert_eq!(KeyError::Empty.to_string(), "must not be empty");
}

#[test]
fn derived_keys_separate_their_parts() {
    use idempotency::key::derive;
    assert_ne!(derive(&["ab", "c"]), derive(&["a", "bc"]));
    assert_ne!(derive(&["a"]), derive(&["a", ""]));
    assert!(derive(&[]).bytes().all(|b| b.is_ascii_hexdigit()));
    // Pinned, so that a batch job rerun after an upgrade finds its keys.
    assert_eq!(
        derive(&["job-1", "item-1"]),
        "9d1fc7f862d98b9e6390353cb4f1ad636932fd1ebf141e63e47876087e037c24"
    );
}
