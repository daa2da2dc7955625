//! JSON as this crate stores it: only values that come back as they went in.
//!
//! serde_json writes NaN and the infinities as `null`, and reads back at most
//! 128 levels of nesting. A value that relies on either would be stored
//! without complaint and then never decode again (or decode as something
//! else), so every value the crate stores, and every request it
//! fingerprints, is checked here first. Floats are parsed with serde_json's
//! `float_roundtrip`, so a finite `f64` comes back bit for bit.
//!
//! A result is also decoded into its type and written again, and must give
//! the same JSON: a type whose reading picks another value for the same text
//! (an untagged enum reading `5` as a float) is refused. What JSON cannot
//! tell apart at all is refused before that: a `Some` of a value written as
//! `null` (`Some(())`, `Some(None)`) reads back as `None`.

use serde::de::DeserializeOwned;
use serde::ser::{self, Serialize};
use serde_json::Value;

/// Serializes `value` to JSON text.
///
/// # Errors
///
/// When `value` fails to serialize or holds a non-finite float.
pub(crate) fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    value.serialize(Check::FLOATS)?;
    serde_json::to_string(value)
}

/// Serializes a request to a JSON value, as [`to_json`] checks it, and
/// refuses integers beyond 64 bits (which serde_json turns into a value only
/// with its `arbitrary_precision` feature).
pub(crate) fn to_value<T: Serialize + ?Sized>(value: &T) -> Result<Value, serde_json::Error> {
    value.serialize(Check::REQUEST)?;
    serde_json::to_value(value)
}

/// Serializes a result that will be replayed as an `R`: the text must decode
/// into an `R` that writes the same JSON again.
pub(crate) fn to_replayable_json<R: Serialize + DeserializeOwned>(value: &R) -> Result<String, serde_json::Error> {
    value.serialize(Check::STORED)?;
    let json = serde_json::to_string(value)?;
    let again = serde_json::to_string(&serde_json::from_str::<R>(&json)?)?;
    // Texts that differ may still hold the same value: a map or a set
    // decoded into a hash map or set writes its entries in another order.
    if again != json && !same(&serde_json::from_str(&json)?, &serde_json::from_str(&again)?) {
        return Err(ser::Error::custom(
            "the value reads back from json as another value of its type",
        ));
    }
    Ok(json)
}

/// Serializes a value whose reader's type is not known here (an outbox
/// payload): the text must at least parse as JSON again. (Parsed into a
/// `Value`, because serde_json skips ignored input without its nesting
/// limit, which every typed reader does enforce.)
pub(crate) fn to_readable_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let json = to_json(value)?;
    serde_json::from_str::<Value>(&json)?;
    Ok(json)
}

/// Whether `a` and `b` hold the same value, taking arrays whose elements
/// come in another order for the same (the order a hash set writes in
/// differs from one instance to the next).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len()
                && (a.iter().zip(b).all(|(a, b)| same(a, b)) || {
                    let sorted = |items: &[Value]| {
                        let mut texts: Vec<String> = items.iter().map(unordered_text).collect();
                        texts.sort_unstable();
                        texts
                    };
                    sorted(a) == sorted(b)
                })
        }
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len() && a.iter().all(|(key, a)| b.get(key).is_some_and(|b| same(a, b)))
        }
        (a, b) => a == b,
    }
}

/// A text of `value` that is the same for every order of its objects' keys
/// and of its arrays' elements.
fn unordered_text(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            let mut texts: Vec<String> = items.iter().map(unordered_text).collect();
            texts.sort_unstable();
            format!("[{}]", texts.join(","))
        }
        Value::Object(map) => {
            let mut texts: Vec<String> = map
                .iter()
                .map(|(key, item)| format!("{}:{}", Value::String(key.clone()), unordered_text(item)))
                .collect();
            texts.sort_unstable();
            format!("{{{}}}", texts.join(","))
        }
        scalar => scalar.to_string(),
    }
}

fn non_finite() -> serde_json::Error {
    ser::Error::custom("a float is nan or infinite, which json cannot represent")
}

fn null_in_some() -> serde_json::Error {
    ser::Error::custom("a some holds a value that json writes as null, which reads back as none")
}

fn wide_integer() -> serde_json::Error {
    ser::Error::custom("an integer is beyond 64 bits, which a request may not hold")
}

/// A serializer that writes nothing and fails on the first value JSON cannot
/// give back: a non-finite float; where `options` is set, a `Some` of a
/// value written as `null`; where `narrow` is set, an integer beyond 64 bits.
#[derive(Clone, Copy)]
struct Check {
    /// Refuse a `Some` of a value written as `null`.
    options: bool,
    /// Refuse a `u128` or `i128` that does not fit 64 bits.
    narrow: bool,
    /// The value at hand is the content of a `Some`.
    in_some: bool,
}

impl Check {
    /// Non-finite floats only: for payloads.
    const FLOATS: Check = Check {
        options: false,
        narrow: false,
        in_some: false,
    };
    /// What a request's fingerprint needs.
    const REQUEST: Check = Check {
        narrow: true,
        ..Check::FLOATS
    };
    /// Everything a result must pass to be replayed as itself.
    const STORED: Check = Check {
        options: true,
        ..Check::FLOATS
    };

    /// The check for the parts of a value, which are not a `Some`'s content.
    fn nested(self) -> Check {
        Check { in_some: false, ..self }
    }

    fn null(self) -> Checked {
        if self.in_some { Err(null_in_some()) } else { Ok(()) }
    }
}

type Checked = Result<(), serde_json::Error>;

// Serializer methods for values with nothing to refuse.
macro_rules! accept {
    ($($method:ident($($ty:ty),+)),* $(,)?) => {$(
        fn $method(self, $(_: $ty),+) -> Checked {
            Ok(())
        }
    )*};
}

// Serializer methods that start a compound value: its parts are checked one
// by one, none of them as a `Some`'s content.
macro_rules! nest {
    ($($method:ident($($ty:ty),+)),* $(,)?) => {$(
        fn $method(self, $(_: $ty),+) -> Result<Self, serde_json::Error> {
            Ok(self.nested())
        }
    )*};
}

impl ser::Serializer for Check {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    accept! {
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_variant(&'static str, u32, &'static str),
    }

    nest! {
        serialize_seq(Option<usize>),
        serialize_tuple(usize),
        serialize_tuple_struct(&'static str, usize),
        serialize_tuple_variant(&'static str, u32, &'static str, usize),
        serialize_map(Option<usize>),
        serialize_struct(&'static str, usize),
        serialize_struct_variant(&'static str, u32, &'static str, usize),
    }

    fn serialize_f32(self, v: f32) -> Checked {
        if v.is_finite() { Ok(()) } else { Err(non_finite()) }
    }

    fn serialize_f64(self, v: f64) -> Checked {
        if v.is_finite() { Ok(()) } else { Err(non_finite()) }
    }

    fn serialize_i128(self, v: i128) -> Checked {
        if self.narrow && i64::try_from(v).is_err() {
            Err(wide_integer())
        } else {
            Ok(())
        }
    }

    fn serialize_u128(self, v: u128) -> Checked {
        if self.narrow && u64::try_from(v).is_err() {
            Err(wide_integer())
        } else {
            Ok(())
        }
    }

    fn serialize_none(self) -> Checked {
        self.null()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Checked {
        value.serialize(Check {
            in_some: self.options,
            ..self
        })
    }

    fn serialize_unit(self) -> Checked {
        self.null()
    }

    fn serialize_unit_struct(self, _: &'static str) -> Checked {
        self.null()
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
        value.serialize(self.nested())
    }
}

// The seven compound serializers differ only in the names serde gives their
// methods: each part is checked as a value of its own.
macro_rules! check_parts {
    ($($compound:ident { $($method:ident($($name:ty)?)),+ })*) => {$(
        impl ser::$compound for Check {
            type Ok = ();
            type Error = serde_json::Error;

            $(fn $method<T: Serialize + ?Sized>(&mut self, $(_: $name,)? value: &T) -> Checked {
                value.serialize(*self)
            })+

            fn end(self) -> Checked {
                Ok(())
            }
        }
    )*};
}

check_parts! {
    SerializeSeq { serialize_element() }
    SerializeTuple { serialize_element() }
    SerializeTupleStruct { serialize_field() }
    SerializeTupleVariant { serialize_field() }
    SerializeMap { serialize_key(), serialize_value() }
    SerializeStruct { serialize_field(&'static str) }
    SerializeStructVariant { serialize_field(&'static str) }
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
    fn some_of_a_null_is_refused_where_it_is_read_back_typed() {
        for refused in [
            to_replayable_json(&Some(())),
            to_replayable_json(&vec![Some(Some(1)), Some(None)]),
            to_replayable_json(&Some(serde_json::Value::Null)),
        ] {
            let message = refused.expect_err("refused").to_string();
            assert!(message.contains("reads back as none"), "{message}");
        }
        assert_eq!(
            to_replayable_json(&vec![Some(Some(1)), None]).expect("stored"),
            "[1,null]"
        );
        // A request is identified by its JSON alone.
        assert_eq!(to_json(&Some(())).expect("written"), "null");
    }

    #[test]
    fn hash_sets_read_back_in_another_order_are_the_same_result() {
        let set: std::collections::HashSet<i64> = (0..500).collect();
        let map: std::collections::HashMap<String, Vec<i64>> = (0..100).map(|n| (n.to_string(), vec![n, -n])).collect();
        assert!(to_replayable_json(&set).is_ok());
        assert!(to_replayable_json(&map).is_ok());
        assert!(same(
            &serde_json::json!([[1, 2], {"a": [3, 4]}]),
            &serde_json::json!([{"a": [4, 3]}, [2, 1]])
        ));
        assert!(!same(&serde_json::json!([1, 2]), &serde_json::json!([1, 3])));
        assert!(!same(&serde_json::json!({"a": 5}), &serde_json::json!({"a": 5.0})));
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
