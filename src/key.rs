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

/// The 16 bytes of a UUID in its text form: hex digits in groups of 8, 4,
/// 4, 4 and 12.
pub(crate) fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex = hex(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
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

/// Checks an outbox message's topic: the same rules as a key's.
pub(crate) fn validate_topic(topic: &str, max_len: usize) -> Result<(), KeyError> {
    validate(topic, max_len)
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
/// two groups, wherever such a run of groups stands in a longer chain of
/// them (`order-7-4111-1111-1111-1111`, `ref.2223.0031.2200.3222.0`). A
/// value of digits and separators alone is one number however it is
/// grouped.
///
/// Digits glued to letters are not looked at: a hex string (a UUID, a
/// [`derive`]d key) holds a card-like run of digits often enough (about one
/// derived key in 100 would be refused) and never holds one standing apart,
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
        // Every run of consecutive groups, so that a card in its layout is
        // found inside a longer chain (`order-7-4111-1111-1111-1111`): one
        // group is a card as one run of digits, several in a card's layout,
        // which spans at most five groups (fours and a last of three make 19
        // digits). A run inside the chain stands apart, a separator on
        // either side.
        for first in 0..groups.len() {
            for len in 1..=5.min(groups.len() - first) {
                let run = &groups[first..first + len];
                let (run_start, run_end) = (run[0].start, run[len - 1].end);
                if apart(run_start, run_end) && (len == 1 || card_layout(run)) && is_card(&digits(run)) {
                    return true;
                }
            }
        }
        let whole = start == 0 && at == bytes.len();
        if groups.len() > 1 && whole && is_card(&digits(&groups)) {
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
    sum.is_multiple_of(10)
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
    fn cards_in_their_layouts_inside_longer_chains_of_groups_are_found() {
        for value in [
            "order-7-4111-1111-1111-1111",
            "ref.2223.0031.2200.3222.0",
            // Amex's 4-6-5 at the start of a chain, Diners' 4-6-4 inside one.
            "4111-111141-11121-1112-4105\"abc",
            "50-2110-2150-215010-2150-",
            "7 4111 1111 1111 1111 7",
            "2026.4111.1111.1111.1111",
            "x-1-2-3-4111-1111-1111-1111-4-5",
        ] {
            assert!(holds_card_number(value), "{value}");
        }
        for value in [
            // Glued to a letter, a chain is not looked into.
            "order7-4111-1111-1111-1111x",
            // A group of five breaks the layout.
            "order-7-41111-1111-1111-111",
            "v1.2.3-2026.12.01-0004",
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

    use crate::property::{cases, random_below, random_words};

    fn uuid_v4(high: u64, low: u64) -> String {
        let high = (high & !0xf000) | 0x4000;
        let low = (low & !(0xc << 60)) | (0x8 << 60);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&high.to_be_bytes());
        bytes[8..].copy_from_slice(&low.to_be_bytes());
        uuid_text(&bytes)
    }

    /// A random card number of `len` digits, beginning with 2 to 6, that
    /// passes the Luhn check.
    fn card(len: usize, next: &mut impl FnMut(usize) -> usize) -> Vec<u32> {
        let mut digits: Vec<u32> = (0..len).map(|_| u32::try_from(next(10)).unwrap_or_default()).collect();
        digits[0] = 2 + u32::try_from(next(5)).unwrap_or_default();
        digits[len - 1] = 0;
        let sum: u32 = digits
            .iter()
            .rev()
            .enumerate()
            .map(|(i, &d)| if i % 2 == 1 { (d * 2) % 10 + d * 2 / 10 } else { d })
            .sum();
        digits[len - 1] = (10 - sum % 10) % 10;
        assert!(luhn_valid(&digits));
        digits
    }

    /// Random digit groups, each of one to six digits.
    fn groups(count: usize, next: &mut impl FnMut(usize) -> usize) -> Vec<String> {
        (0..count)
            .map(|_| {
                (0..1 + next(6))
                    .map(|_| char::from(b'0' + u8::try_from(next(10)).unwrap_or(0)))
                    .collect()
            })
            .collect()
    }

    /// Cards of every length in every layout they are written in, each
    /// inside a chain of random digit groups, behind a prefix and before a
    /// suffix that stand apart from it: refused, wherever they stand.
    #[test]
    fn generated_cards_in_their_layouts_anywhere_in_a_chain_are_refused() {
        let mut next = random_below(0xca4d_0001);
        for _ in 0..cases(20_000) {
            let layout: Vec<usize> = match next(4) {
                0 => vec![4, 6, 5],
                1 => vec![4, 6, 4],
                2 => vec![13 + next(7)],
                _ => {
                    let mut layout = vec![4; 3 + next(2)];
                    layout.push(1 + next(4));
                    layout
                }
            };
            let len: usize = layout.iter().sum();
            if !(13..=19).contains(&len) {
                continue;
            }
            let digits = card(len, &mut next);
            let mut card_groups = Vec::new();
            let mut rest = digits.as_slice();
            for group in &layout {
                let (head, tail) = rest.split_at(*group);
                card_groups.push(
                    head.iter()
                        .map(|d| char::from_digit(*d, 10).unwrap_or('0'))
                        .collect::<String>(),
                );
                rest = tail;
            }
            let separator = [" ", "-", "."][next(3)];
            let mut chain = groups(next(4), &mut next);
            chain.extend(card_groups);
            chain.extend(groups(next(4), &mut next));
            let prefix = ["", "order-", "ref.", "x/", "pay:"][next(5)];
            let suffix = ["", "-", "\"abc", "_retry", "/x", "-"][next(6)];
            let value = format!("{prefix}{}{suffix}", chain.join(separator));
            assert!(holds_card_number(&value), "{value}");
        }
    }

    /// UUIDs with and without hyphens, hex SHA-256 digests and derived
    /// keys are never refused (`IDEMPOTENCY_PROPERTY_CASES=1000000` for a
    /// million of each). Printed beside: how many hold 13 to 19 digits in a
    /// row, glued to letters, that begin with 2 to 6 and pass the Luhn
    /// check, which a check looking at glued digits would refuse.
    #[test]
    fn uuids_hex_digests_and_derived_keys_are_never_taken_for_card_numbers() {
        let samples = cases(20_000);
        let mut words = random_words(0x1d3e_5c07);
        let glued_card = |value: &str| {
            let digits: Vec<u32> = value.chars().map(|c| c.to_digit(10).unwrap_or(u32::MAX)).collect();
            (0..digits.len()).any(|start| {
                (13..=19).any(|len| {
                    digits
                        .get(start..start + len)
                        .is_some_and(|run| run.iter().all(|d| *d < 10) && (2..=6).contains(&run[0]) && luhn_valid(run))
                })
            })
        };
        let mut glued = [0_usize; 4];
        for item in 0..samples {
            let uuid = uuid_v4(words.next().unwrap_or_default(), words.next().unwrap_or_default());
            let digest = hex(&Sha256::digest(item.to_be_bytes()));
            let derived = derive(&["job", &item.to_string()]);
            for (value, glued) in [&uuid, &uuid.replace('-', ""), &digest, &derived]
                .into_iter()
                .zip(&mut glued)
            {
                assert!(!holds_card_number(value), "{value}");
                *glued += usize::from(glued_card(value));
            }
        }
        println!(
            "of {samples} each, holding glued digits a check looking at them would refuse: UUIDs {}, UUIDs without hyphens {}, SHA-256 digests {}, derived keys {}",
            glued[0], glued[1], glued[2], glued[3]
        );
    }

    #[test]
    fn hex_encodes_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
