//! Reading the `Idempotency-Key` request header: one field, holding an
//! RFC 9651 sf-string (the IETF draft, §2.1) or, unless the syntax is
//! strict, the bare token that most clients send.

use std::fmt;

use http::{HeaderMap, HeaderName, HeaderValue};

/// Why the `Idempotency-Key` header could not be read. The message never
/// repeats the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// More than one field among the names accepted.
    Repeated,
    /// A value starting with `"` that is not an sf-string with optional
    /// parameters.
    NotAnSfString,
    /// A byte outside visible ASCII in a value that is not quoted.
    NotAToken,
    /// A comma in a value that is not quoted: two fields a proxy joined
    /// into one (`abc,def`), whose keys cannot be told apart.
    Joined,
    /// A value that is not quoted, where the syntax is strict.
    NotQuoted,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Repeated => f.write_str("the request has more than one idempotency key header"),
            HeaderError::NotAnSfString => {
                f.write_str("the Idempotency-Key header is not a valid structured field string")
            }
            HeaderError::NotAToken => f.write_str("the Idempotency-Key header holds bytes other than visible ascii"),
            HeaderError::Joined => f.write_str(
                "the Idempotency-Key header holds a comma outside quotes, as two fields joined into one would",
            ),
            HeaderError::NotQuoted => {
                f.write_str("the Idempotency-Key header must be a structured field string: the key in double quotes")
            }
        }
    }
}

/// Which values of the header are keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Syntax {
    /// An sf-string, or a bare value of visible ASCII taken as it is.
    Lenient,
    /// An sf-string only, as the draft requires.
    Strict,
}

/// The key of the request's one field among `names`; `None` when there is
/// none. Two fields, of one name or of two, are two keys: which one the
/// client meant cannot be told, so neither is taken.
pub(crate) fn read_key(
    fields: &impl HeaderFields,
    names: &[HeaderName],
    syntax: Syntax,
) -> Result<Option<String>, HeaderError> {
    let mut values = names.iter().flat_map(|name| fields.values(name));
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(HeaderError::Repeated);
    }
    parse_key(value, syntax).map(Some)
}

/// A request's header fields as an adapter holds them: the `http` crate's
/// map (axum), or the framework's own (actix-web's).
pub(crate) trait HeaderFields {
    /// The values of the fields named `name`, in order.
    fn values<'a>(&'a self, name: &HeaderName) -> impl Iterator<Item = &'a [u8]>;
}

impl HeaderFields for HeaderMap {
    fn values<'a>(&'a self, name: &HeaderName) -> impl Iterator<Item = &'a [u8]> {
        self.get_all(name).iter().map(HeaderValue::as_bytes)
    }
}

/// The key in one field value: an sf-string, unescaped, or else, with the
/// lenient syntax, the value as it is when it is all visible ASCII and
/// holds no comma (a comma joins two fields of one name into one value,
/// RFC 9110 §5.3, so `abc,def` may be two keys).
/// Surrounding spaces and tabs are not part of the value (RFC 9110 §5.5).
pub(crate) fn parse_key(value: &[u8], syntax: Syntax) -> Result<String, HeaderError> {
    let value = value.trim_ascii();
    if value.first() == Some(&b'"') {
        let mut input = Input { bytes: value, at: 0 };
        let key = input.sf_string().ok_or(HeaderError::NotAnSfString)?;
        input.parameters().ok_or(HeaderError::NotAnSfString)?;
        return if input.at == value.len() {
            Ok(key)
        } else {
            Err(HeaderError::NotAnSfString)
        };
    }
    if syntax == Syntax::Strict {
        return Err(HeaderError::NotQuoted);
    }
    if value.contains(&b',') {
        Err(HeaderError::Joined)
    } else if value.iter().all(u8::is_ascii_graphic) {
        // Visible ASCII is valid UTF-8.
        Ok(String::from_utf8_lossy(value).into_owned())
    } else {
        Err(HeaderError::NotAToken)
    }
}

/// A cursor over a field value, parsing the parts of RFC 9651 §4.2 that an
/// sf-string item with parameters can contain.
struct Input<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn take_while(&mut self, accept: impl Fn(u8) -> bool) {
        while self.peek().is_some_and(&accept) {
            self.at += 1;
        }
    }

    /// §4.2.5: `"`, then printable ASCII where `"` and `\` are escaped with
    /// `\`, then `"`.
    fn sf_string(&mut self) -> Option<String> {
        if self.next()? != b'"' {
            return None;
        }
        let mut out = String::new();
        loop {
            match self.next()? {
                b'\\' => match self.next()? {
                    escaped @ (b'"' | b'\\') => out.push(char::from(escaped)),
                    _ => return None,
                },
                b'"' => return Some(out),
                byte @ 0x20..=0x7e => out.push(char::from(byte)),
                _ => return None,
            }
        }
    }

    /// §4.2.3.2: `*( ";" *SP key [ "=" bare-item ] )`. Parameters carry
    /// nothing the key needs; they are checked for syntax and dropped.
    fn parameters(&mut self) -> Option<()> {
        while self.peek() == Some(b';') {
            self.at += 1;
            self.take_while(|b| b == b' ');
            self.parameter_key()?;
            if self.peek() == Some(b'=') {
                self.at += 1;
                self.bare_item()?;
            }
        }
        Some(())
    }

    /// §4.2.3.3: lowercase letter or `*`, then lowercase letters, digits,
    /// `_`, `-`, `.`, `*`.
    fn parameter_key(&mut self) -> Option<()> {
        if !matches!(self.next()?, b'a'..=b'z' | b'*') {
            return None;
        }
        self.take_while(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'));
        Some(())
    }

    /// §4.2.3.1: integer or decimal, string, token, byte sequence, boolean,
    /// and RFC 9651's date and display string.
    fn bare_item(&mut self) -> Option<()> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => self.number().map(drop),
            b'@' => {
                self.at += 1;
                // §4.2.9: an integer, never a decimal.
                (self.number()? == Number::Integer).then_some(())
            }
            b'%' => self.display_string(),
            b'"' => self.sf_string().map(drop),
            b'A'..=b'Z' | b'a'..=b'z' | b'*' => {
                self.at += 1;
                self.take_while(|b| is_tchar(b) || b == b':' || b == b'/');
                Some(())
            }
            b':' => {
                self.at += 1;
                self.take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
                (self.next()? == b':').then_some(())
            }
            b'?' => {
                self.at += 1;
                matches!(self.next()?, b'0' | b'1').then_some(())
            }
            _ => None,
        }
    }

    /// §4.2.10: `%"`, then printable ASCII but `"` and `%`, and `%` with two
    /// lowercase hex digits for each byte of UTF-8 beyond it, then `"`; the
    /// bytes must be UTF-8.
    fn display_string(&mut self) -> Option<()> {
        if (self.next()?, self.next()?) != (b'%', b'"') {
            return None;
        }
        let mut bytes = Vec::new();
        loop {
            match self.next()? {
                b'%' => {
                    let hex = |byte: u8| match byte {
                        b'0'..=b'9' => Some(byte - b'0'),
                        b'a'..=b'f' => Some(byte - b'a' + 10),
                        _ => None,
                    };
                    let high = hex(self.next()?)?;
                    let low = hex(self.next()?)?;
                    bytes.push(high << 4 | low);
                }
                b'"' => return std::str::from_utf8(&bytes).is_ok().then_some(()),
                byte @ 0x20..=0x7e => bytes.push(byte),
                _ => return None,
            }
        }
    }

    /// §4.2.4: an optional `-`, at most 15 digits, or a decimal of at most
    /// 12 integer and 1 to 3 fractional digits.
    fn number(&mut self) -> Option<Number> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        let start = self.at;
        self.take_while(|b| b.is_ascii_digit());
        let integer_digits = self.at - start;
        if integer_digits == 0 {
            return None;
        }
        if self.peek() != Some(b'.') {
            return (integer_digits <= 15).then_some(Number::Integer);
        }
        self.at += 1;
        let start = self.at;
        self.take_while(|b| b.is_ascii_digit());
        let fraction_digits = self.at - start;
        (integer_digits <= 12 && (1..=3).contains(&fraction_digits)).then_some(Number::Decimal)
    }
}

/// What [`Input::number`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    Integer,
    Decimal,
}

/// RFC 9110 §5.6.2 `tchar`.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;
    use crate::http::IDEMPOTENCY_KEY;

    fn key(value: &str) -> Result<String, HeaderError> {
        parse_key(value.as_bytes(), Syntax::Lenient)
    }

    fn strict(value: &str) -> Result<String, HeaderError> {
        parse_key(value.as_bytes(), Syntax::Strict)
    }

    #[test]
    fn sf_string_is_unquoted() {
        assert_eq!(
            key(r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#).as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
    }

    #[test]
    fn bare_token_is_taken_as_it_is() {
        assert_eq!(
            key("8e03978e-40d5-43e8-bc93-6894a57f9324").as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(key("order:7/a=b").as_deref(), Ok("order:7/a=b"));
    }

    #[test]
    fn surrounding_white_space_is_not_part_of_the_key() {
        assert_eq!(key(" \t\"abc\" ").as_deref(), Ok("abc"));
        assert_eq!(key(" abc\t").as_deref(), Ok("abc"));
    }

    #[test]
    fn escapes_are_resolved() {
        assert_eq!(key(r#""a\"b\\c""#).as_deref(), Ok(r#"a"b\c"#));
    }

    #[test]
    fn other_escapes_are_refused() {
        assert_eq!(key(r#""a\nb""#), Err(HeaderError::NotAnSfString));
        assert_eq!(key(r#""a\""#), Err(HeaderError::NotAnSfString));
    }

    #[test]
    fn unterminated_string_is_refused() {
        assert_eq!(key(r#""abc"#), Err(HeaderError::NotAnSfString));
        assert_eq!(key(r#"""#), Err(HeaderError::NotAnSfString));
    }

    #[test]
    fn control_and_non_ascii_bytes_are_refused_in_strings() {
        assert_eq!(key("\"a\tb\""), Err(HeaderError::NotAnSfString));
        assert_eq!(key("\"a\x7fb\""), Err(HeaderError::NotAnSfString));
        assert_eq!(key("\"caf\u{e9}\""), Err(HeaderError::NotAnSfString));
    }

    #[test]
    fn spaces_inside_a_string_are_the_key_rules_concern() {
        // RFC 9651 allows them; the key rules of `Config::run` refuse them.
        assert_eq!(key(r#""a b""#).as_deref(), Ok("a b"));
        assert_eq!(key(r#""""#).as_deref(), Ok(""));
    }

    #[test]
    fn parameters_are_checked_and_dropped() {
        for value in [
            r#""abc";a=1"#,
            r#""abc"; a=1;b;c=?0"#,
            r#""abc";x=-1.25;y="q\"s";z=tok/en:1;w=:aGVsbG8=:;*k=*"#,
        ] {
            assert_eq!(key(value).as_deref(), Ok("abc"), "{value}");
        }
    }

    #[test]
    fn malformed_parameters_and_trailing_bytes_are_refused() {
        for value in [
            r#""abc";"#,
            r#""abc";A=1"#,
            r#""abc";a="#,
            r#""abc";a=1.2345"#,
            r#""abc";a=1234567890123456"#,
            r#""abc";a=?2"#,
            r#""abc";a=:abc"#,
            r#""abc" x"#,
            r#""abc", "def""#,
            r#""abc"def"#,
        ] {
            assert_eq!(key(value), Err(HeaderError::NotAnSfString), "{value}");
        }
    }

    #[test]
    fn two_fields_joined_into_one_are_refused_in_both_syntaxes() {
        assert_eq!(key("abc,def"), Err(HeaderError::Joined));
        assert_eq!(key("abc, def"), Err(HeaderError::Joined));
        assert_eq!(key(",abc"), Err(HeaderError::Joined));
        assert_eq!(strict("abc,def"), Err(HeaderError::NotQuoted));
        assert_eq!(key(r#""abc","def""#), Err(HeaderError::NotAnSfString));
        assert_eq!(strict(r#""abc","def""#), Err(HeaderError::NotAnSfString));
        // Inside quotes a comma is part of the key.
        assert_eq!(key(r#""abc,def""#).as_deref(), Ok("abc,def"));
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("abc,def"));
        for syntax in [Syntax::Lenient, Syntax::Strict] {
            assert!(read_key(&headers, &[IDEMPOTENCY_KEY], syntax).is_err(), "{syntax:?}");
        }
    }

    #[test]
    fn bare_values_with_spaces_or_non_ascii_are_refused() {
        assert_eq!(key("a b"), Err(HeaderError::NotAToken));
        assert_eq!(parse_key(b"caf\xe9", Syntax::Lenient), Err(HeaderError::NotAToken));
    }

    #[test]
    fn a_second_header_is_refused() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(
            read_key(&headers, &[IDEMPOTENCY_KEY], Syntax::Lenient),
            Ok(Some("a".to_owned()))
        );
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(
            read_key(&headers, &[IDEMPOTENCY_KEY], Syntax::Lenient),
            Err(HeaderError::Repeated)
        );
    }

    #[test]
    fn one_field_of_each_of_two_names_is_two_keys() {
        let x_key = HeaderName::from_static("x-idempotency-key");
        let names = [IDEMPOTENCY_KEY, x_key.clone()];
        let mut headers = HeaderMap::new();
        headers.append(x_key.clone(), HeaderValue::from_static("a"));
        assert_eq!(read_key(&headers, &names, Syntax::Lenient), Ok(Some("a".to_owned())));
        assert_eq!(read_key(&headers, &[IDEMPOTENCY_KEY], Syntax::Lenient), Ok(None));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(read_key(&headers, &names, Syntax::Lenient), Err(HeaderError::Repeated));
    }

    #[test]
    fn a_missing_header_is_no_key() {
        assert_eq!(
            read_key(&HeaderMap::new(), &[IDEMPOTENCY_KEY], Syntax::Lenient),
            Ok(None)
        );
        assert_eq!(
            read_key(&HeaderMap::new(), &[IDEMPOTENCY_KEY], Syntax::Strict),
            Ok(None)
        );
    }

    #[test]
    fn a_parameter_may_hold_every_bare_item_of_rfc_9651() {
        for (item, value) in [
            ("integer", r#""abc";p=-999999999999999"#),
            ("decimal", r#""abc";p=123456789012.125"#),
            ("string", r#""abc";p="a \"b\" c""#),
            ("token", r#""abc";p=*tok:en/1!#"#),
            ("byte sequence", r#""abc";p=:cHJldGVuZCB0aGlzIGlzIGJpbmFyeQ==:"#),
            ("boolean", r#""abc";p=?1;q"#),
            ("date", r#""abc";d=@1700000000"#),
            ("negative date", r#""abc";d=@-62135596800"#),
            ("display string", r#""abc";t=%"f%c3%bcr 100%25 %22sure%22""#),
            ("empty display string", r#""abc";t=%"""#),
            ("all of them", r#""abc";d=@0;t=%"x";i=1;s="s";b=?0"#),
        ] {
            assert_eq!(key(value).as_deref(), Ok("abc"), "{item}: {value}");
            assert_eq!(strict(value).as_deref(), Ok("abc"), "{item}, strict: {value}");
        }
    }

    #[test]
    fn broken_dates_and_display_strings_are_refused() {
        for (case, value) in [
            ("a date without digits", r#""abc";d=@"#),
            ("a decimal date", r#""abc";d=@1700000000.5"#),
            ("a date of 16 digits", r#""abc";d=@1234567890123456"#),
            ("a date of letters", r#""abc";d=@x"#),
            ("a display string without its quote", r#""abc";t=%abc"#),
            ("an unterminated display string", r#""abc";t=%"abc"#),
            ("upper-case hex", r#""abc";t=%"%C3%BC""#),
            ("a percent without two digits", r#""abc";t=%"%c""#),
            ("a percent with a non-hex digit", r#""abc";t=%"%g0""#),
            ("bytes that are not UTF-8", r#""abc";t=%"%c3""#),
            ("a control byte", "\"abc\";t=%\"a\tb\""),
            ("bytes after the display string", r#""abc";t=%"a"b"#),
        ] {
            assert_eq!(key(value), Err(HeaderError::NotAnSfString), "{case}: {value}");
        }
        assert_eq!(
            parse_key("\"abc\";t=%\"\u{fc}\"".as_bytes(), Syntax::Lenient),
            Err(HeaderError::NotAnSfString)
        );
    }

    #[test]
    fn the_strict_syntax_takes_only_an_sf_string() {
        assert_eq!(strict(r#""8e03978e""#).as_deref(), Ok("8e03978e"));
        assert_eq!(strict(" \"8e03978e\";v=1 ").as_deref(), Ok("8e03978e"));
        assert_eq!(strict("8e03978e"), Err(HeaderError::NotQuoted));
        assert_eq!(strict("a b"), Err(HeaderError::NotQuoted));
        assert_eq!(strict(r#""8e03978e"#), Err(HeaderError::NotAnSfString));
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("8e03978e"));
        assert_eq!(
            read_key(&headers, &[IDEMPOTENCY_KEY], Syntax::Strict),
            Err(HeaderError::NotQuoted)
        );
        assert_eq!(
            read_key(&headers, &[IDEMPOTENCY_KEY], Syntax::Lenient),
            Ok(Some("8e03978e".to_owned()))
        );
    }

    /// An RFC 9651 parser of an item with parameters, written apart from
    /// the one under test after the RFC's algorithms (§4.2.3 to §4.2.10), in
    /// another style: each step takes the input and returns what is left.
    /// `Some(Some(key))` for an sf-string item, `Some(None)` for an item of
    /// another type, `None` for no item.
    mod rfc9651 {
        type Rest<'a> = Option<&'a [u8]>;

        pub fn item(field: &[u8]) -> Option<Option<String>> {
            let field = trim(field);
            let (string, rest) = match field.first()? {
                b'"' => {
                    let (string, rest) = string(field)?;
                    (Some(string), rest)
                }
                _ => (None, bare_item(field)?),
            };
            parameters(rest).filter(|rest| rest.is_empty())?;
            Some(string)
        }

        fn trim(mut field: &[u8]) -> &[u8] {
            while let [b' ' | b'\t', rest @ ..] = field {
                field = rest;
            }
            while let [rest @ .., b' ' | b'\t'] = field {
                field = rest;
            }
            field
        }

        fn string(input: &[u8]) -> Option<(String, &[u8])> {
            let mut rest = input.strip_prefix(b"\"")?;
            let mut out = String::new();
            loop {
                match rest {
                    [b'\\', escaped @ (b'"' | b'\\'), tail @ ..] => {
                        out.push(char::from(*escaped));
                        rest = tail;
                    }
                    [b'"', tail @ ..] => return Some((out, tail)),
                    [c @ 0x20..=0x7e, tail @ ..] if *c != b'\\' => {
                        out.push(char::from(*c));
                        rest = tail;
                    }
                    _ => return None,
                }
            }
        }

        fn bare_item(input: &[u8]) -> Rest<'_> {
            match input.first()? {
                b'-' | b'0'..=b'9' => number(input).map(|(rest, _)| rest),
                b'"' => string(input).map(|(_, rest)| rest),
                b':' => {
                    let body = &input[1..];
                    let end = body
                        .iter()
                        .position(|c| !(c.is_ascii_alphanumeric() || b"+/=".contains(c)))?;
                    (body[end] == b':').then(|| &body[end + 1..])
                }
                b'?' => match input {
                    [b'?', b'0' | b'1', rest @ ..] => Some(rest),
                    _ => None,
                },
                b'@' => match number(&input[1..])? {
                    (rest, false) => Some(rest),
                    (_, true) => None,
                },
                b'%' => display_string(input),
                c if c.is_ascii_alphabetic() || *c == b'*' => {
                    let tchar = |c: &u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(c);
                    let end = input[1..]
                        .iter()
                        .position(|c| !tchar(c))
                        .map_or(input.len(), |at| at + 1);
                    Some(&input[end..])
                }
                _ => None,
            }
        }

        /// The rest, and whether the number was a decimal.
        fn number(input: &[u8]) -> Option<(&[u8], bool)> {
            let unsigned = input.strip_prefix(b"-").unwrap_or(input);
            let whole = unsigned.iter().take_while(|c| c.is_ascii_digit()).count();
            let after = &unsigned[whole..];
            match after.strip_prefix(b".") {
                Some(fraction) => {
                    let digits = fraction.iter().take_while(|c| c.is_ascii_digit()).count();
                    ((1..=12).contains(&whole) && (1..=3).contains(&digits)).then(|| (&fraction[digits..], true))
                }
                None => (1..=15).contains(&whole).then_some((after, false)),
            }
        }

        fn display_string(input: &[u8]) -> Rest<'_> {
            let mut rest = input.strip_prefix(b"%\"")?;
            let mut bytes = Vec::new();
            loop {
                match rest {
                    [b'%', high, low, tail @ ..] => {
                        let hex = |c: &u8| matches!(c, b'0'..=b'9' | b'a'..=b'f');
                        if !hex(high) || !hex(low) {
                            return None;
                        }
                        bytes.push(u8::from_str_radix(std::str::from_utf8(&[*high, *low]).ok()?, 16).ok()?);
                        rest = tail;
                    }
                    [b'"', tail @ ..] => return String::from_utf8(bytes).ok().map(|_| tail),
                    [c @ 0x20..=0x7e, tail @ ..] if *c != b'%' => {
                        bytes.push(*c);
                        rest = tail;
                    }
                    _ => return None,
                }
            }
        }

        fn parameters(mut rest: &[u8]) -> Rest<'_> {
            while let [b';', tail @ ..] = rest {
                rest = tail;
                while let [b' ', tail @ ..] = rest {
                    rest = tail;
                }
                match rest.first()? {
                    b'a'..=b'z' | b'*' => {}
                    _ => return None,
                }
                let key = rest
                    .iter()
                    .take_while(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
                    .count();
                rest = &rest[key..];
                if let [b'=', tail @ ..] = rest {
                    rest = bare_item(tail)?;
                }
            }
            Some(rest)
        }
    }

    /// Random field values of the pieces RFC 9651 is made of, read in both
    /// syntaxes and by the parser above: an sf-string item with parameters
    /// is its string in both; any other value is refused by the strict
    /// syntax and, by the lenient one, taken as it is when it is visible
    /// ASCII without a comma (a bare key), refused otherwise.
    #[test]
    fn both_syntaxes_read_a_field_as_rfc_9651_and_the_lenient_rule_say() {
        const PIECES: &[&[u8]] = &[
            b"\"",
            b"\\",
            b"a",
            b"Z",
            b"1",
            b"12.5",
            b";",
            b"=",
            b",",
            b" ",
            b"\t",
            b":",
            b"?",
            b"@",
            b"%",
            b"*",
            b"-",
            b"/",
            b"%\"",
            b"%c3%bc",
            b";k=",
            b"\x7f",
            b"\xc3\xa9",
            b"\"ab\"",
        ];
        let mut next = crate::property::random_below(0x4ead_e001);
        let mut strings = 0;
        for _ in 0..crate::property::cases(20_000) {
            let value: Vec<u8> = (0..next(10))
                .flat_map(|_| PIECES[next(PIECES.len())].iter().copied())
                .collect();
            let expected = match rfc9651::item(&value) {
                Some(Some(key)) => {
                    strings += 1;
                    (Some(key.clone()), Some(key))
                }
                _ if value.trim_ascii().first() == Some(&b'"') => (None, None),
                _ => {
                    let bare = value.trim_ascii();
                    let taken = bare.iter().all(u8::is_ascii_graphic) && !bare.contains(&b',');
                    (taken.then(|| String::from_utf8_lossy(bare).into_owned()), None)
                }
            };
            let read = (
                parse_key(&value, Syntax::Lenient).ok(),
                parse_key(&value, Syntax::Strict).ok(),
            );
            assert_eq!(read, expected, "{:?}", String::from_utf8_lossy(&value));
        }
        assert!(strings > 0, "some values were sf-strings");
    }
}
