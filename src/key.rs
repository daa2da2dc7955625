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

/// Checks an idempotency key: non-empty, at most `max_len` bytes, no card
/// number, visible ASCII only.
pub(crate) fn validate_key(key: &str, max_len: usize) -> Result<(), KeyError> {
    validate(key, max_len)
}

/// Checks a scope: the same rules as a key's.
pub(crate) fn validate_scope(scope: &str, max_len: usize) -> Result<(), KeyError> {
    validate(scope, max_len)
}

fn validate(value: &str, max_len: usize) -> Result<(), KeyError> {
    check_length(value, max_len)?;
    // Before the character check, so that "4111 1111 1111 1111" is reported
    // as what it is rather than as a value with spaces.
    if holds_card_number(value) {
        return Err(KeyError::LooksLikeCardNumber);
    }
    check_characters(value)
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

/// What may stand between two groups of a card number's digits.
const CARD_SEPARATORS: &[u8] = b" -.";

/// Whether `value` holds a payment card number: 13 to 19 digits that begin
/// with 2 to 6 (the industries of the card networks: Mastercard, Amex,
/// Diners, JCB, Visa, Discover, UnionPay, Maestro) and pass the Luhn check,
/// standing apart (the characters around them are neither
/// letters nor digits, or the ends of `value`), either as one run of
/// digits or in the groups cards are written in (fours with a last group
/// of one to four, or 4-6-5 and 4-6-4), a single space, `-` or `.` between
/// two groups. A value of digits and separators alone is one number
/// however it is grouped.
///
/// Digits glued to letters are not looked at: a hex string (a UUID, a
/// [`derive`]d key) holds runs of 13 or more digits often enough (about one
/// derived key in 250 would be refused) and never holds one standing apart,
/// and digit groups laid out otherwise (dates, times) would be refused one
/// time in ten. Millisecond and microsecond timestamps and snowflake ids
/// begin with 1 for decades to come, so `order-1700000000004` is a key.
fn holds_card_number(value: &str) -> bool {
    let bytes = value.as_bytes();
    let apart = |start: usize, end: usize| {
        (start == 0 || !bytes[start - 1].is_ascii_alphanumeric())
            && bytes.get(end).is_none_or(|b| !b.is_ascii_alphanumeric())
    };
    let mut at = 0;
    while at < bytes.len() {
        if !bytes[at].is_ascii_digit() {
            at += 1;
            continue;
        }
        // A chain of digit groups, one separator between two of them.
        let start = at;
        let mut groups = Vec::new();
        loop {
            let group = at;
            while bytes.get(at).is_some_and(u8::is_ascii_digit) {
                at += 1;
            }
            groups.push(group..at);
            match (bytes.get(at), bytes.get(at + 1)) {
                (Some(separator), Some(next)) if CARD_SEPARATORS.contains(separator) && next.is_ascii_digit() => {
                    at += 1
                }
                _ => break,
            }
        }
        let digits = |ranges: &[std::ops::Range<usize>]| -> Vec<u32> {
            ranges
                .iter()
                .flat_map(|range| bytes[range.clone()].iter().map(|b| u32::from(b - b'0')))
                .collect()
        };
        let is_card =
            |digits: &[u32]| (13..=19).contains(&digits.len()) && (2..=6).contains(&digits[0]) && luhn_valid(digits);
        if groups
            .iter()
            .any(|group| apart(group.start, group.end) && is_card(&digits(std::slice::from_ref(group))))
        {
            return true;
        }
        let whole = start == 0 && at == bytes.len();
        if groups.len() > 1 && apart(start, at) && (whole || card_layout(&groups)) && is_card(&digits(&groups)) {
            return true;
        }
    }
    false
}

/// Whether digit groups of these lengths are laid out as card numbers are
/// written: fours with a last group of one to four, or 4-6-5 and 4-6-4.
fn card_layout(groups: &[std::ops::Range<usize>]) -> bool {
    let lengths: Vec<usize> = groups.iter().map(ExactSizeIterator::len).collect();
    match lengths.as_slice() {
        [4, 6, 5] | [4, 6, 4] => true,
        [fours @ .., last] => fours.iter().all(|&len| len == 4) && (1..=4).contains(last),
        [] => false,
    }
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
            assert!(holds_card_number(number), "{number}");
        }
    }

    #[test]
    fn luhn_rejects_a_changed_digit() {
        assert!(!holds_card_number("4111111111111112"));
    }

    #[test]
    fn digit_runs_outside_card_lengths_are_keys() {
        // 12 and 20 Luhn-valid digits.
        assert!(!holds_card_number("400000000002"));
        assert!(!holds_card_number("40000000000000000002"));
        assert!(holds_card_number("4000000000006"));
    }

    #[test]
    fn luhn_valid_numbers_outside_the_card_industries_are_keys() {
        // A millisecond timestamp, a snowflake id, zeros: Luhn-valid, not
        // beginning with 2 to 6.
        for value in [
            "1700000000004",
            "order-1800000000000000002",
            "0000000000000",
            "9000000000000000001",
        ] {
            assert!(!holds_card_number(value), "{value}");
        }
    }

    #[test]
    fn card_numbers_standing_apart_within_a_value_are_found() {
        for value in [
            "pay-4111111111111111",
            "4111111111111111_1",
            "4111.1111.1111.1111",
            "order:4111-1111-1111-1111:retry",
            "amex/3782-822463-10005",
            "4222-2222-2222-2",
        ] {
            assert!(holds_card_number(value), "{value}");
        }
        for value in [
            "pay4111111111111111",
            "4111111111111111a",
            "order-2026-12-01-00006",
            "1700000000.000001",
            "4111--1111-1111-1111",
        ] {
            assert!(!holds_card_number(value), "{value}");
        }
    }

    /// Random bytes, without a dependency: SplitMix64.
    fn random_words(seed: u64) -> impl Iterator<Item = u64> {
        let mut state = seed;
        std::iter::repeat_with(move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
    }

    fn uuid_v4(high: u64, low: u64) -> String {
        let high = (high & !0xf000) | 0x4000;
        let low = (low & !(0xc << 60)) | (0x8 << 60);
        let hex = hex(&[high.to_be_bytes(), low.to_be_bytes()].concat());
        format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    }

    #[test]
    fn uuids_and_derived_keys_are_never_taken_for_card_numbers() {
        let mut words = random_words(0x1d3e_5c07);
        for _ in 0..200_000 {
            let uuid = uuid_v4(words.next().unwrap_or_default(), words.next().unwrap_or_default());
            assert!(!holds_card_number(&uuid), "{uuid}");
            assert!(!holds_card_number(&uuid.replace('-', "")), "{uuid}");
        }
        for item in 0..100_000 {
            let key = derive(&["job", &item.to_string()]);
            assert!(!holds_card_number(&key), "{key}");
        }
    }

    #[test]
    fn hex_encodes_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
