//! The request fingerprint: SHA-256 of a canonical JSON form.
//!
//! Canonical means object keys sorted by their UTF-8 bytes at every depth and
//! no white space, so the fingerprint depends neither on a map's iteration
//! order nor on serde_json's `preserve_order` feature. Numbers are written by
//! serde_json's own formatter, which `arbitrary_precision` does not change for
//! values that came from Rust integers and floats. NaN and the infinities,
//! which serde_json would write as `null` (so that a request holding one
//! would pass for the same request holding `null`), are refused.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::key::hex;

/// The hex SHA-256 of the canonical JSON form of `request`.
///
/// # Errors
///
/// When `request` does not serialize or holds a non-finite float.
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
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
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
    fn fingerprint_is_a_pinned_sha256() {
        // Changing the canonical form would turn every retry across an
        // upgrade into a mismatch, so the exact digest is pinned.
        assert_eq!(
            of(&json!({"b": [1, 2.5], "a": "x"})).expect("fingerprint"),
            "66efddae6a97500318e4c6cdc4bc04149f340a165a7ef2d830393048b67b7a31"
        );
    }
}
