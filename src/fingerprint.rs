//! The request fingerprint: SHA-256 of a canonical JSON form.
//!
//! Canonical means object keys sorted by their UTF-8 bytes at every depth and
//! no white space, so the fingerprint depends neither on a map's iteration
//! order nor on serde_json's `preserve_order` feature. Every number is
//! written as the `u64`, `i64` or `f64` that serde_json without
//! `arbitrary_precision` reads it as: with that feature a
//! `serde_json::Value` keeps a number's text as it came (`1.00`, `1e2`), and
//! the fingerprint must not depend on which build parsed the request.
//! A `u128` or `i128` beyond 64 bits, which serde_json turns into a `Value`
//! only with the feature, is refused, as are NaN and the infinities, which
//! serde_json
//! would write as `null` (so that a request holding one would pass for the
//! same request holding `null`).

use serde::Serialize;
use serde::ser::Error as _;
use serde_json::{Number, Value};
use sha2::{Digest, Sha256};

use crate::key::hex;

/// The hex SHA-256 of the canonical JSON form of `request`.
///
/// # Errors
///
/// When `request` does not serialize or holds a non-finite float or an
/// integer beyond 64 bits.
pub(crate) fn of<T: Serialize + ?Sized>(request: &T) -> Result<String, serde_json::Error> {
    let value = crate::codec::to_value(request)?;
    let mut canonical = Vec::with_capacity(128);
    write_canonical(&value, &mut canonical)?;
    Ok(hex(&Sha256::digest(&canonical)))
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    match value {
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write_canonical(item, out)?;
            }
            out.push(b'}');
        }
        Value::Number(number) => write_number(number, out)?,
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

/// Writes `number` as serde_json without `arbitrary_precision` reads it: an
/// integer as a `u64` or an `i64` where it fits, anything else (a fraction,
/// an exponent, `-0`, an integer too large) as an `f64`.
fn write_number(number: &Number, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    if let Some(unsigned) = number.as_u64() {
        return serde_json::to_writer(out, &unsigned);
    }
    // `-0` is an integer to `as_i64` under `arbitrary_precision`, but reads
    // as the float -0.0 without it.
    if let Some(signed) = number.as_i64().filter(|signed| *signed != 0) {
        return serde_json::to_writer(out, &signed);
    }
    match number.as_f64() {
        Some(float) if float.is_finite() => serde_json::to_writer(out, &float),
        _ => Err(serde_json::Error::custom(format!(
            "the number {number} is beyond the range of a 64-bit float"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn canonical(value: &Value) -> String {
        let mut out = Vec::new();
        write_canonical(value, &mut out).expect("canonical form");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn canonical_form_sorts_keys_at_every_depth() {
        let value = json!({"b": 1, "a": {"z": [true, null], "y": "x"}});
        assert_eq!(canonical(&value), r#"{"a":{"y":"x","z":[true,null]},"b":1}"#);
    }

    #[test]
    fn canonical_form_escapes_strings_like_json() {
        let value = json!({"k\"ey": "line\nbreak \u{0}"});
        assert_eq!(canonical(&value), r#"{"k\"ey":"line\nbreak \u0000"}"#);
    }

    #[test]
    fn numbers_are_written_as_serde_json_reads_them_without_arbitrary_precision() {
        // The texts a `Value` keeps under `arbitrary_precision`, as the build
        // without the feature reads them.
        let parsed: Value = serde_json::from_str(
            "[1.00, 1e2, -0, 0, 7, -7, 18446744073709551616, -9223372036854775809, 0.10000000000000001, -0.0, 5e-324]",
        )
        .expect("json");
        let read: Value = json!([
            1.0,
            100.0,
            -0.0,
            0,
            7,
            -7,
            18_446_744_073_709_551_616.0,
            -9_223_372_036_854_775_809.0,
            0.1,
            -0.0,
            5e-324
        ]);
        assert_eq!(canonical(&parsed), canonical(&read));
        assert_eq!(of(&parsed).expect("fingerprint"), of(&read).expect("fingerprint"));
        let one = |text: &str| of(&serde_json::from_str::<Value>(text).expect("json")).expect("fingerprint");
        assert_eq!(one("1.0"), one("1.00"));
        assert_ne!(one("1"), one("1.0"), "an integer and a float are different requests");
    }

    #[test]
    fn integers_beyond_64_bits_are_refused() {
        for refused in [of(&u128::MAX), of(&(u128::from(u64::MAX) + 1)), of(&i128::MIN)] {
            let message = refused.expect_err("refused").to_string();
            assert!(message.contains("beyond 64 bits"), "{message}");
        }
        assert_eq!(
            of(&u128::from(u64::MAX)).expect("fits"),
            of(&u64::MAX).expect("fingerprint")
        );
        assert_eq!(of(&-5_i128).expect("fits"), of(&-5_i64).expect("fingerprint"));
    }

    #[test]
    fn fingerprint_is_a_pinned_sha256() {
        // Changing the canonical form would turn every retry across an
        // upgrade into a mismatch, so the exact digest is pinned.
        assert_eq!(
            of(&json!({"b": [1, 2.5], "a": "x"})).expect("fingerprint"),
            "66efddae6a97500318e4c6cdc4bc04149f340a165a7ef2d830393048b67b7a31"
        );
    }
}
