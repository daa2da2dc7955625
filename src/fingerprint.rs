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
//! only with the feature, is refused, as is any number that feature keeps
//! and the `f64` does not hold exactly (`18446744073709551617`,
//! `1.000000000000000001`): read as their nearest `f64`, two requests that
//! differ would be one. So are NaN and the infinities, which serde_json
//! would write as `null` (so that a request holding one would pass for the
//! same request holding `null`).
//!
//! A hash set (std's, hashbrown's, and the wrappers that serialize through
//! them) writes its elements in an order of its own, which differs between
//! two sets of the same elements: the same body deserialized twice would be
//! two requests. Its elements are written sorted by their canonical form,
//! at every depth ([`Sorted`]). An array's order is otherwise kept: it may
//! mean something to the application.

use std::any::type_name;

use serde::Serialize;
use serde::ser::{self, Error as _, Serializer};
use serde_json::{Number, Value};
use sha2::{Digest, Sha256};

use crate::key::hex;

/// The hex SHA-256 of the canonical JSON form of `request`.
///
/// # Errors
///
/// When `request` does not serialize or holds a non-finite float, an
/// integer beyond 64 bits or a number an `f64` does not hold exactly.
pub(crate) fn of<T: Serialize + ?Sized>(request: &T) -> Result<String, serde_json::Error> {
    Ok(hex(&Sha256::digest(canonical(request)?)))
}

/// The canonical JSON form of `value`.
fn canonical<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = crate::codec::to_value(&Sorted(value))?;
    let mut canonical = Vec::with_capacity(128);
    write_canonical(&value, &mut canonical)?;
    Ok(canonical)
}

/// Whether a sequence serialized from a value of the type named `name` is
/// an unordered set: serde serializes a hash set with
/// [`Serializer::collect_seq`] over a reference to it, and the wrappers
/// of other crates (`AHashSet`, an `FxHashSet` alias) through std's or
/// hashbrown's set. An iterator of a hash set counts as well, for a field
/// serialized with `collect_seq(set.iter())`.
fn is_unordered_set(name: &str) -> bool {
    let path = name.trim_start_matches(['&', ' ']).trim_start_matches("mut ");
    let path = path.split('<').next().unwrap_or(path);
    let last = path.rsplit("::").next().unwrap_or(path);
    last.ends_with("HashSet")
        || path.contains("::hash::set::")
        || path.contains("::hash_set::")
        || path.starts_with("hashbrown::set::")
}

/// A value serialized with the elements of every hash set in it sorted by
/// their canonical form, so that two sets of the same elements, whatever
/// their iteration order, fingerprint alike. Sorting never makes two
/// requests one that the application reads apart: a set's order means
/// nothing to it.
///
/// It wraps the serializer rather than the value's JSON because only the
/// serializer sees the type: in the JSON a set is an array like a `Vec`,
/// whose order may mean something.
struct Sorted<T>(T);

impl<T: Serialize> Serialize for Sorted<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(Sorting(serializer))
    }
}

/// The serializer behind [`Sorted`]: the inner one, with every value it is
/// handed wrapped again, so the rule holds at every depth.
struct Sorting<S>(S);

// Serializer methods that pass a value on as it is.
macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method(self, $($arg: $ty),*) -> Result<S::Ok, S::Error> {
            self.0.$method($($arg),*)
        }
    )*};
}

// Serializer methods that start a compound value, whose parts are wrapped.
macro_rules! forward_compound {
    ($($method:ident($($arg:ident: $ty:ty),*) -> $compound:ident),* $(,)?) => {$(
        fn $method(self, $($arg: $ty),*) -> Result<Sorting<S::$compound>, S::Error> {
            self.0.$method($($arg),*).map(Sorting)
        }
    )*};
}

impl<S: Serializer> Serializer for Sorting<S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Sorting<S::SerializeSeq>;
    type SerializeTuple = Sorting<S::SerializeTuple>;
    type SerializeTupleStruct = Sorting<S::SerializeTupleStruct>;
    type SerializeTupleVariant = Sorting<S::SerializeTupleVariant>;
    type SerializeMap = Sorting<S::SerializeMap>;
    type SerializeStruct = Sorting<S::SerializeStruct>;
    type SerializeStructVariant = Sorting<S::SerializeStructVariant>;

    forward! {
        serialize_bool(v: bool),
        serialize_i8(v: i8),
        serialize_i16(v: i16),
        serialize_i32(v: i32),
        serialize_i64(v: i64),
        serialize_i128(v: i128),
        serialize_u8(v: u8),
        serialize_u16(v: u16),
        serialize_u32(v: u32),
        serialize_u64(v: u64),
        serialize_u128(v: u128),
        serialize_f32(v: f32),
        serialize_f64(v: f64),
        serialize_char(v: char),
        serialize_str(v: &str),
        serialize_bytes(v: &[u8]),
        serialize_none(),
        serialize_unit(),
        serialize_unit_struct(name: &'static str),
        serialize_unit_variant(name: &'static str, index: u32, variant: &'static str),
    }

    forward_compound! {
        serialize_seq(len: Option<usize>) -> SerializeSeq,
        serialize_tuple(len: usize) -> SerializeTuple,
        serialize_tuple_struct(name: &'static str, len: usize) -> SerializeTupleStruct,
        serialize_tuple_variant(name: &'static str, index: u32, variant: &'static str, len: usize) -> SerializeTupleVariant,
        serialize_map(len: Option<usize>) -> SerializeMap,
        serialize_struct(name: &'static str, len: usize) -> SerializeStruct,
        serialize_struct_variant(name: &'static str, index: u32, variant: &'static str, len: usize) -> SerializeStructVariant,
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.0.serialize_some(&Sorted(value))
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, name: &'static str, value: &T) -> Result<S::Ok, S::Error> {
        self.0.serialize_newtype_struct(name, &Sorted(value))
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        self.0.serialize_newtype_variant(name, index, variant, &Sorted(value))
    }

    fn collect_seq<I>(self, iter: I) -> Result<S::Ok, S::Error>
    where
        I: IntoIterator,
        I::Item: Serialize,
    {
        if !is_unordered_set(type_name::<I>()) {
            return self.0.collect_seq(iter.into_iter().map(Sorted));
        }
        let mut elements = iter
            .into_iter()
            .map(|element| Ok((canonical(&element).map_err(S::Error::custom)?, element)))
            .collect::<Result<Vec<_>, S::Error>>()?;
        elements.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        self.0
            .collect_seq(elements.into_iter().map(|(_, element)| Sorted(element)))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

// The compound serializers differ only in the names serde gives their
// methods: each part is wrapped.
macro_rules! sort_parts {
    ($($compound:ident { $($method:ident($($name:ident: $ty:ty)?)),+ })*) => {$(
        impl<C: ser::$compound> ser::$compound for Sorting<C> {
            type Ok = C::Ok;
            type Error = C::Error;

            $(fn $method<T: Serialize + ?Sized>(&mut self, $($name: $ty,)? value: &T) -> Result<(), C::Error> {
                self.0.$method($($name,)? &Sorted(value))
            })+

            fn end(self) -> Result<C::Ok, C::Error> {
                self.0.end()
            }
        }
    )*};
}

sort_parts! {
    SerializeSeq { serialize_element() }
    SerializeTuple { serialize_element() }
    SerializeTupleStruct { serialize_field() }
    SerializeTupleVariant { serialize_field() }
    SerializeMap { serialize_key(), serialize_value() }
    SerializeStruct { serialize_field(key: &'static str) }
    SerializeStructVariant { serialize_field(key: &'static str) }
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
/// an exponent, `-0`) as an `f64`, provided the `f64` is the number the
/// text names.
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
        Some(float) if float.is_finite() && names_exactly(number, float)? => serde_json::to_writer(out, &float),
        // The number is not quoted: it is part of the request.
        _ => Err(serde_json::Error::custom(
            "a number is beyond what a 64-bit float holds exactly, which a request may not hold",
        )),
    }
}

/// Whether the text of `number` names the same decimal as the shortest text
/// of `float`, the one float it reads as. Every float then stands for one
/// decimal, so requests whose numbers differ (`1.000000000000000001` and
/// `...002`, or `18446744073709551617` and `...616`, each read as one float)
/// never share a fingerprint; one of them at most is accepted. Only
/// `arbitrary_precision` keeps a text other than the shortest (`1.50`,
/// `15e-1` are accepted as the decimal 1.5); without it every float's text
/// is its shortest.
fn names_exactly(number: &Number, float: f64) -> Result<bool, serde_json::Error> {
    let shortest = serde_json::to_string(&float)?;
    Ok(decimal(&number.to_string()).is_some_and(|named| Some(named) == decimal(&shortest)))
}

/// The decimal a JSON number's text names: its sign, its digits without
/// leading or trailing zeros (none for zero) and the power of ten of the
/// last one (0 for zero). `None` for an exponent beyond 128 bits.
fn decimal(text: &str) -> Option<(bool, String, i128)> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(unsigned) => (true, unsigned),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.strip_prefix('+').unwrap_or(exponent).parse().ok()?),
        None => (unsigned, 0_i128),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let significant = digits.trim_start_matches('0');
    let trimmed = significant.trim_end_matches('0');
    if trimmed.is_empty() {
        return Some((negative, String::new(), 0));
    }
    let trailing_zeros = i128::try_from(significant.len() - trimmed.len()).ok()?;
    let fraction_len = i128::try_from(fraction.len()).ok()?;
    let power = exponent.checked_sub(fraction_len)?.checked_add(trailing_zeros)?;
    Some((negative, trimmed.to_owned(), power))
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
            "[1.00, 1e2, -0, 0, 7, -7, 1.8446744073709552e19, -9.223372036854776e18, 0.100, -0.0, 5e-324, 1.5, 0.30000000000000004]",
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
            -9_223_372_036_854_775_808.0,
            0.1,
            -0.0,
            5e-324,
            1.5,
            0.1 + 0.2
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
    fn numbers_beyond_what_a_float_holds_exactly_are_refused() {
        // Each names a number that no `f64` is the shortest form of: read
        // as the nearest float, it would share its fingerprint with another
        // request (`...617` with `...616`, `...001` with `...002`, `0.1`
        // with `0.10000000000000001`).
        for text in [
            "18446744073709551617",
            "18446744073709551616",
            "-9223372036854775809",
            "1.000000000000000001",
            "1.000000000000000002",
            "0.10000000000000001",
            "1e-400",
            "123456789012345678901234567890e-10",
        ] {
            let value: Value = serde_json::from_str(text).expect("json");
            let message = of(&json!({"amount": value})).expect_err(text).to_string();
            assert!(
                message.contains("beyond what a 64-bit float holds exactly"),
                "{text}: {message}"
            );
            assert!(!message.contains(text), "the number is not quoted: {message}");
        }
    }

    #[test]
    fn numbers_a_float_holds_exactly_fingerprint_as_that_float() {
        for (text, float) in [
            ("1.5", 1.5),
            ("0.1", 0.1),
            ("1.50", 1.5),
            ("15e-1", 1.5),
            ("0.30000000000000004", 0.1 + 0.2),
            ("1.7976931348623157e308", f64::MAX),
            ("-2.5E+3", -2500.0),
            ("0e999999999999999999999", 0.0),
        ] {
            let value: Value = serde_json::from_str(text).expect("json");
            assert_eq!(of(&value).expect(text), of(&float).expect("a float"), "{text}");
        }
    }

    /// The same JSON body, deserialized twice: hash sets come out with
    /// their elements in two orders (a fresh random seed each).
    fn twice<T: serde::de::DeserializeOwned + Serialize>(json: &str) -> (String, String) {
        let read = || of(&serde_json::from_str::<T>(json).expect("request")).expect("fingerprint");
        (read(), read())
    }

    #[test]
    fn hash_sets_fingerprint_alike_whatever_their_order_at_every_depth() {
        use std::collections::{BTreeSet, HashMap, HashSet};

        #[derive(serde::Deserialize, Serialize)]
        struct Request {
            tags: Option<HashSet<String>>,
            groups: Vec<HashSet<u32>>,
            by_name: HashMap<String, HashSet<String>>,
            nested: Vec<Option<hashbrown::HashSet<String>>>,
            sets_of_sets: Vec<HashSet<Vec<String>>>,
        }
        let items: Vec<String> = (0..16).map(|i| format!("\"item-{i}\"")).collect();
        let set = format!("[{}]", items.join(","));
        let json = format!(
            r#"{{"tags": {set}, "groups": [[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]], "by_name": {{"a": {set}}}, "nested": [null, {set}], "sets_of_sets": [[["a","b"],["b","a"],["c"],[],["d","e"]]]}}"#
        );
        // Many reads, so that an order leaking through would show.
        for _ in 0..20 {
            let (first, second) = twice::<Request>(&json);
            assert_eq!(first, second);
        }
        let (first, _) = twice::<HashSet<String>>(&set);
        assert_eq!(
            first,
            twice::<BTreeSet<String>>(&set).0,
            "a set reads as its sorted elements"
        );
        assert_eq!(first, twice::<hashbrown::HashSet<String>>(&set).0);
        // An array keeps its order, which may mean something.
        assert_ne!(
            of(&vec![1, 2]).expect("fingerprint"),
            of(&vec![2, 1]).expect("fingerprint")
        );
        assert_ne!(
            twice::<Vec<HashSet<u32>>>("[[1], [2]]").0,
            twice::<Vec<HashSet<u32>>>("[[2], [1]]").0
        );
    }

    #[test]
    fn a_value_in_a_set_the_fingerprint_refuses_is_refused() {
        let set: std::collections::HashSet<u128> = [1, u128::MAX].into();
        let message = of(&set).expect_err("refused").to_string();
        assert!(message.contains("beyond 64 bits"), "{message}");
    }

    #[test]
    fn the_sets_serde_writes_are_recognised_by_their_type_names() {
        use std::collections::{BTreeSet, HashMap, HashSet, hash_set};
        // A compiler that named these types otherwise fails here, rather
        // than turning retries into mismatches.
        fn name_of<T>(_: &T) -> &'static str {
            type_name::<T>()
        }
        let std_set: HashSet<u8> = HashSet::new();
        let brown: hashbrown::HashSet<u8> = hashbrown::HashSet::new();
        let iter: hash_set::Iter<'_, u8> = std_set.iter();
        for set in [
            name_of(&&std_set),
            name_of(&&brown),
            name_of(&iter),
            name_of(&brown.iter()),
        ] {
            assert!(is_unordered_set(set), "{set}");
        }
        let vec: Vec<HashSet<u8>> = Vec::new();
        let map: HashMap<u8, u8> = HashMap::new();
        for ordered in [
            name_of(&&vec),
            name_of(&&BTreeSet::<u8>::new()),
            name_of(&&map),
            name_of(&&[0_u8; 2]),
            name_of(&vec.iter()),
        ] {
            assert!(!is_unordered_set(ordered), "{ordered}");
        }
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
