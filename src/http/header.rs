//! Reading the `Idempotency-Key` request header: one field, holding an
//! RFC 8941 sf-string (the IETF draft, §2.1) or the bare token that most
//! clients send.

use std::fmt;

use axum::http::HeaderMap;

use super::IDEMPOTENCY_KEY;

/// Why the `Idempotency-Key` header could not be read. The message never
/// repeats the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// More than one `Idempotency-Key` field.
    Repeated,
    /// A value starting with `"` that is not an sf-string with optional
    /// parameters.
    NotAnSfString,
    /// A byte outside visible ASCII in a value that is not quoted.
    NotAToken,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Repeated => f.write_str("the request has more than one Idempotency-Key header"),
            HeaderError::NotAnSfString => {
                f.write_str("the Idempotency-Key header is not a valid structured field string")
            }
            HeaderError::NotAToken => f.write_str("the Idempotency-Key header holds bytes other than visible ascii"),
        }
    }
}

/// The key of the request's `Idempotency-Key` header; `None` when there is
/// no such header.
pub(crate) fn read_key(headers: &HeaderMap) -> Result<Option<String>, HeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(HeaderError::Repeated);
    }
    parse_key(value.as_bytes()).map(Some)
}

/// The key in one field value: an sf-string, unescaped, or else the value as
/// it is when it is all visible ASCII. Surrounding spaces and tabs are not
/// part of the value (RFC 9110 §5.5).
pub(crate) fn parse_key(value: &[u8]) -> Result<String, HeaderError> {
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
    if value.iter().all(u8::is_ascii_graphic) {
        // Visible ASCII is valid UTF-8.
        Ok(String::from_utf8_lossy(value).into_owned())
    } else {
        Err(HeaderError::NotAToken)
    }
}

/// A cursor over a field value, parsing the parts of RFC 8941 §4.2 that an
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

    /// §4.2.3.1: integer or decimal, string, token, byte sequence, boolean.
    fn bare_item(&mut self) -> Option<()> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => self.number(),
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

    /// §4.2.4: an optional `-`, at most 15 digits, or a decimal of at most
    /// 12 integer and 1 to 3 fractional digits.
    fn number(&mut self) -> Option<()> {
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
            return (integer_digits <= 15).then_some(());
        }
        self.at += 1;
        let start = self.at;
        self.take_while(|b| b.is_ascii_digit());
        let fraction_digits = self.at - start;
        (integer_digits <= 12 && (1..=3).contains(&fraction_digits)).then_some(())
    }
}

/// RFC 9110 §5.6.2 `tchar`.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn key(value: &str) -> Result<String, HeaderError> {
        parse_key(value.as_bytes())
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
        assert_eq!(parse_key(b"\"a\tb\""), Err(HeaderError::NotAnSfString));
        assert_eq!(parse_key(b"\"a\x7fb\""), Err(HeaderError::NotAnSfString));
        assert_eq!(parse_key("\"caf\u{e9}\"".as_bytes()), Err(HeaderError::NotAnSfString));
    }

    #[test]
    fn spaces_inside_a_string_are_the_key_rules_concern() {
        // RFC 8941 allows them; the key rules of `Config::run` refuse them.
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
    fn bare_values_with_spaces_or_non_ascii_are_refused() {
        assert_eq!(key("a b"), Err(HeaderError::NotAToken));
        assert_eq!(parse_key(b"caf\xe9"), Err(HeaderError::NotAToken));
    }

    #[test]
    fn a_second_header_is_refused() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(read_key(&headers), Ok(Some("a".to_owned())));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(read_key(&headers), Err(HeaderError::Repeated));
    }

    #[test]
    fn a_missing_header_is_no_key() {
        assert_eq!(read_key(&HeaderMap::new()), Ok(None));
    }
}
