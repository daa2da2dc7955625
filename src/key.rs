//! Idempotency keys: the rules a key and a scope must follow, and stable keys
//! derived from parts for batch jobs.

use sha2::{Digest, Sha256};

use crate::error::KeyError;

/// A stable idempotency key built from `parts`, such as a job id and an item
/// id, so that a rerun of a batch job presents the same key for the same item.
///
/// The result is the hex SHA-256 of the parts, each prefixed with its length,
/// so `["ab", "c"]` and `["a", "bc"]` give different keys. It is 64 visible
/// ASCII characters and therefore a valid key, whatever the parts contain,
/// under any [`max_key_len`](crate::Config::max_key_len) of 64 or more (the
/// default is 255); it reveals nothing about them.
///
/// ```
/// let key = idempotency::key::derive(&["nightly-invoices-2026-11-29", "customer-42"]);
/// assert_eq!(key.len(), 64);
/// assert_eq!(key, idempotency::key::derive(&["nightly-invoices-2026-11-29", "customer-42"]));
/// assert_ne!(key, idempotency::key::derive(&["nightly-invoices-2026-11-29", "customer-43"]));
/// ```
pub fn derive(parts: &[&str]) -> String {
    hex(&digest(parts))
}

/// The SHA-256 behind [`derive`]: of the parts, each prefixed with its
/// length. The backends' key locks are named by it as well, so it may never
/// change.
pub(crate) fn digest(parts: &[&str]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 0x0f)] as char);
    }
    out
}

/// Checks an idempotency key: the scope rules plus the card number check.
pub(crate) fn validate_key(key: &str, max_len: usize) -> Result<(), KeyError> {
    check_length(key, max_len)?;
    // Before the character check, so that "4111 1111 1111 1111" is reported
    // as what it is rather than as a key with spaces.
    if looks_like_card_number(key) {
        return Err(KeyError::LooksLikeCardNumber);
    }
    check_characters(key)
}

/// Checks a scope: non-empty, at most `max_len` bytes, visible ASCII only.
pub(crate) fn validate_scope(scope: &str, max_len: usize) -> Result<(), KeyError> {
    check_length(scope, max_len)?;
    check_characters(scope)
}

fn check_length(value: &str, max: usize) -> Result<(), KeyError> {
    match value.len() {
        0 => Err(KeyError::Empty),
        len if len > max => Err(KeyError::TooLong { len, max }),
        _ => Ok(()),
    }
}

fn check_characters(value: &str) -> Result<(), KeyError> {
    match value.bytes().position(|b| !b.is_ascii_graphic()) {
        Some(position) => Err(KeyError::InvalidCharacter { position }),
        None => Ok(()),
    }
}

fn looks_like_card_number(key: &str) -> bool {
    if !key.bytes().all(|b| b.is_ascii_digit() || b == b' ' || b == b'-') {
        return false;
    }
    let digits: Vec<u32> = key
        .bytes()
        .filter(u8::is_ascii_digit)
        .map(|b| u32::from(b - b'0'))
        .collect();
    (13..=19).contains(&digits.len()) && luhn_valid(&digits)
}

fn luhn_valid(digits: &[u32]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| match (i % 2 == 1, d * 2) {
            (true, doubled) if doubled > 9 => doubled - 9,
            (true, doubled) => doubled,
            (false, _) => d,
        })
        .sum();
    sum % 10 == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luhn_accepts_known_test_card_numbers() {
        for number in [
            "4111111111111111",
            "5500005555555559",
            "378282246310005",
            "6011111111111117",
        ] {
            assert!(looks_like_card_number(number), "{number}");
        }
    }

    #[test]
    fn luhn_rejects_a_changed_digit() {
        assert!(!looks_like_card_number("4111111111111112"));
    }

    #[test]
    fn digit_runs_outside_card_lengths_are_keys() {
        // 12 and 20 Luhn-valid digits.
        assert!(!looks_like_card_number("000000000000"));
        assert!(!looks_like_card_number("00000000000000000000"));
        assert!(looks_like_card_number("0000000000000"));
    }

    #[test]
    fn hex_encodes_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
