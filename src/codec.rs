//! JSON as this crate stores it: only values that come back as they went in.
//!
//! serde_json writes NaN and the infinities as `null`, and reads back at most
//! 128 levels of nesting. A value that relies on either would be stored
//! without complaint and then never decode again (or decode as something
//! else), so every value the crate stores, and every request it
//! fingerprints, is checked here first. Floats are parsed with serde_json's
//! `float_roundtrip`, so a finite `f64` comes back bit for bit.

use serde::de::DeserializeOwned;
use serde::ser::{self, Serialize};

/// Serializes `value` to JSON text.
///
/// # Errors
///
/// When `value` fails to serialize or holds a non-finite float.
pub(crate) fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    value.serialize(FiniteFloats)?;
    serde_json::to_string(value)
}

/// Serializes `value` to a JSON value, as [`to_json`] checks it.
pub(crate) fn to_value<T: Serialize + ?Sized>(value: &T) -> Result<serde_json::Value, serde_json::Error> {
    value.serialize(FiniteFloats)?;
    serde_json::to_value(value)
}

/// Serializes a result that will be replayed as an `R`: the text must decode
/// into `R` again.
pub(crate) fn to_replayable_json<R: Serialize + DeserializeOwned>(value: &R) -> Result<String, serde_json::Error> {
    let json = to_json(value)?;
    serde_json::from_str::<R>(&json)?;
    Ok(json)
}

/// Serializes a value whose reader's type is not known here (an outbox
/// payload): the text must at least parse as JSON again. (Parsed into a
/// `Value`, because serde_json skips ignored input without its nesting
/// limit, which every typed reader does enforce.)
pub(crate) fn to_readable_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let json = to_json(value)?;
    serde_json::from_str::<serde_json::Value>(&json)?;
    Ok(json)
}

fn non_finite() -> serde_json::Error {
    ser::Error::custom("a float is nan or infinite, which json cannot represent")
}

/// A serializer that writes nothing and fails on the first non-finite float.
struct FiniteFloats;

type Checked = Result<(), serde_json::Error>;

impl ser::Serializer for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn serialize_f32(self, v: f32) -> Checked {
        if v.is_finite() { Ok(()) } else { Err(non_finite()) }
    }

    fn serialize_f64(self, v: f64) -> Checked {
        if v.is_finite() { Ok(()) } else { Err(non_finite()) }
    }

    fn serialize_bool(self, _: bool) -> Checked {
        Ok(())
    }

    fn serialize_i8(self, _: i8) -> Checked {
        Ok(())
    }

    fn serialize_i16(self, _: i16) -> Checked {
        Ok(())
    }

    fn serialize_i32(self, _: i32) -> Checked {
        Ok(())
    }

    fn serialize_i64(self, _: i64) -> Checked {
        Ok(())
    }

    fn serialize_i128(self, _: i128) -> Checked {
        Ok(())
    }

    fn serialize_u8(self, _: u8) -> Checked {
        Ok(())
    }

    fn serialize_u16(self, _: u16) -> Checked {
        Ok(())
    }

    fn serialize_u32(self, _: u32) -> Checked {
        Ok(())
    }

    fn serialize_u64(self, _: u64) -> Checked {
        Ok(())
    }

    fn serialize_u128(self, _: u128) -> Checked {
        Ok(())
    }

    fn serialize_char(self, _: char) -> Checked {
        Ok(())
    }

    fn serialize_str(self, _: &str) -> Checked {
        Ok(())
    }

    fn serialize_bytes(self, _: &[u8]) -> Checked {
        Ok(())
    }

    fn serialize_none(self) -> Checked {
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Checked {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Checked {
        Ok(())
    }

    fn serialize_unit_struct(self, _: &'static str) -> Checked {
        Ok(())
    }

    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Checked {
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Checked {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Checked {
        value.serialize(self)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_tuple(self, _: usize) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, serde_json::Error> {
        Ok(self)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, serde_json::Error> {
        Ok(self)
    }
}

impl ser::SerializeSeq for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeTuple for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeMap for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Checked {
        key.serialize(FiniteFloats)
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeStruct for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

impl ser::SerializeStructVariant for FiniteFloats {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> Checked {
        value.serialize(FiniteFloats)
    }

    fn end(self) -> Checked {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn non_finite_floats_are_refused_wherever_they_hide() {
        let nested = vec![Some(BTreeMap::from([("x", (1, f64::NAN))]))];
        for error in [
            to_json(&f64::NAN),
            to_json(&f32::INFINITY),
            to_json(&-f64::INFINITY),
            to_json(&nested),
        ] {
            let message = error.expect_err("refused").to_string();
            assert!(message.contains("nan or infinite"), "{message}");
        }
        assert_eq!(to_json(&[1.5, -0.0]).expect("finite floats"), "[1.5,-0.0]");
    }

    #[test]
    fn results_too_deep_to_read_back_are_refused() {
        let mut deep = serde_json::Value::Null;
        for _ in 0..200 {
            deep = serde_json::Value::Array(vec![deep]);
        }
        assert!(to_json(&deep).is_ok(), "serde_json writes it");
        assert!(to_replayable_json(&deep).is_err(), "but cannot read it back");
        assert!(to_readable_json(&deep).is_err());
    }

    #[test]
    fn finite_floats_come_back_bit_for_bit() {
        let values = [
            0.1 + 0.2,
            1e-300,
            5e-324,
            f64::MAX,
            f64::MIN_POSITIVE,
            2.0f64.sqrt(),
            -123.456e78,
        ];
        let json = to_replayable_json(&values.to_vec()).expect("stored");
        let back: Vec<f64> = serde_json::from_str(&json).expect("read back");
        let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&values));
    }
}
