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
    scope_is_not_checked_for_card_numbers,
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
    ] {
        assert_eq!(refused_key::<D>(key), KeyError::LooksLikeCardNumber, "{key:?}");
    }
}

fn digit_keys_that_are_not_card_numbers_are_accepted<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    // Luhn-invalid, too short, too long, or mixed with letters.
    for key in [
        "4111111111111112",
        "411111111111",
        "41111111111111111111",
        "order-4111111111111111",
    ] {
        let outcome = run_idempotent(&mut conn, "scope", key, &1, |tx| D::place_order(tx, "book", 1));
        assert!(outcome.is_ok(), "{key:?}: {outcome:?}");
    }
    assert_eq!(D::order_count(&mut conn), 4);
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

fn scope_is_not_checked_for_card_numbers<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let outcome = run_idempotent(&mut conn, "4111111111111111", "key", &1, |tx| {
        D::place_order(tx, "book", 1)
    });
    assert!(outcome.is_ok(), "{outcome:?}");
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
