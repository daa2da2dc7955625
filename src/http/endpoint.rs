//! What a key is bound to: the endpoint the request was sent to, captured
//! by the extractor, and the request value, fingerprinted together.

use serde::Serialize;
use serde::ser::{SerializeStruct, Serializer};

use crate::fingerprint;

/// The endpoint a key was sent to, as it is fingerprinted with the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(super) struct Endpoint {
    method: String,
    route: String,
    path: Vec<(String, String)>,
    /// A parameter without `=` has no value, which is not an empty one.
    query: Vec<(String, Option<String>)>,
}

impl Endpoint {
    /// The endpoint a request was sent to, as an adapter reads it: its
    /// `method`, the `route` that matched (the path where none did), the
    /// `path` parameters as the framework decodes them, and the raw
    /// `query`.
    pub(super) fn new(method: &str, route: String, mut path: Vec<(String, String)>, raw_query: Option<&str>) -> Self {
        path.sort();
        Endpoint {
            method: method.to_owned(),
            route,
            path,
            query: query(raw_query.unwrap_or("")),
        }
    }
}

impl Endpoint {
    /// The path parameters, sorted by name.
    pub(super) fn path(&self) -> &[(String, String)] {
        &self.path
    }

    /// The hash that binds a record of a call at this endpoint to the
    /// lookups of `principal` (see [`caller_hash`]).
    pub(super) fn caller_hash(&self, principal: &str) -> String {
        let route = Route {
            method: &self.method,
            route: &self.route,
            path: &self.path,
        };
        caller_hash(principal, Some(route))
    }
}

/// Who may look up a record, and where: the principal and the endpoint of
/// the call (its method, matched route and path parameters; `None` for a
/// key across endpoints), the query left out, since a lookup is a request
/// of its own. Its fingerprint is what the record stores as its caller
/// hash, and what a lookup computes for each endpoint it answers for.
#[derive(Serialize)]
struct Audience<'a> {
    principal: &'a str,
    endpoint: Option<Route<'a>>,
}

/// An endpoint without its query: its method, matched route and path
/// parameters, sorted by name.
#[derive(Serialize)]
pub(super) struct Route<'a> {
    pub(super) method: &'a str,
    pub(super) route: &'a str,
    pub(super) path: &'a [(String, String)],
}

/// The caller hash of `principal` at `endpoint`, or across endpoints.
pub(super) fn caller_hash(principal: &str, endpoint: Option<Route<'_>>) -> String {
    let audience = Audience { principal, endpoint };
    fingerprint::of(&audience).expect("strings have a fingerprint")
}

/// What a key is bound to: the request value, with the endpoint it was
/// sent to unless the key spans endpoints, and the principal where it is
/// not the scope. Without an endpoint and a principal it is the request
/// value itself, so the fingerprint is the one the request alone has.
pub(super) struct BoundRequest<Q> {
    endpoint: Option<Endpoint>,
    /// The caller's principal, where it differs from the scope: two users
    /// of one tenant's scope never share a fingerprint. Left out where the
    /// scope is the principal, which tells them apart already, so that the
    /// records written before the principal was bound keep their
    /// fingerprints.
    principal: Option<String>,
    request: Q,
}

impl<Q> BoundRequest<Q> {
    pub(super) fn new(endpoint: Option<Endpoint>, principal: Option<String>, request: Q) -> Self {
        BoundRequest {
            endpoint,
            principal,
            request,
        }
    }

    /// The request value.
    pub(super) fn request(&self) -> &Q {
        &self.request
    }
}

impl<Q: Serialize> Serialize for BoundRequest<Q> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.endpoint.is_none() && self.principal.is_none() {
            return self.request.serialize(serializer);
        }
        let mut bound = serializer.serialize_struct("BoundRequest", 3)?;
        if let Some(endpoint) = &self.endpoint {
            bound.serialize_field("endpoint", endpoint)?;
        }
        if let Some(principal) = &self.principal {
            bound.serialize_field("principal", principal)?;
        }
        bound.serialize_field("request", &self.request)?;
        bound.end()
    }
}

/// The parameters of `query` as they are bound: each name and value in its
/// [canonical](canonical) spelling (a parameter without `=` has no value,
/// which is not an empty one), empty parameters dropped, sorted stably by
/// [what their names decode to](decoded_alike).
fn query(query: &str) -> Vec<(String, Option<String>)> {
    let mut query: Vec<(String, Option<String>)> = query
        .split('&')
        .filter(|parameter| !parameter.is_empty())
        .map(|parameter| match parameter.split_once('=') {
            Some((name, value)) => (canonical(name), Some(canonical(value))),
            None => (canonical(parameter), None),
        })
        .collect();
    // Stable, by a key that every decoding which reads two names alike
    // gives them both: the values of one name, as any application reads
    // it, keep their order, which may mean something to it.
    query.sort_by_cached_key(|(name, _)| decoded_alike(name));
    query
}

/// The canonical spelling of `component` of a query, from which every
/// application's decoding of it follows: the escapes of unreserved
/// characters decoded (RFC 3986, §6.2.2), the others in upper case, and a
/// `%` that begins no escape written as `%25`, so that it never forms one
/// with what follows (`%%32%30` is `%2520`, never `%20`). Nothing else is
/// decoded: parsers disagree on what `+` means, so `+`, `%20` and `%2B`
/// stay three spellings, and a literal reserved character stays apart from
/// its escape (`/` and `%2F`), which a parser splitting on it reads apart.
///
/// The result reads back as one sequence of bytes and literal `+`s
/// (`%XX` is always an escape, `%` nothing else), and the decodings
/// applications use (`application/x-www-form-urlencoded`, plain
/// percent-decoding) are functions of that sequence: two components with one
/// canonical spelling are read alike by every one of them.
fn canonical(component: &str) -> String {
    let mut out = String::with_capacity(component.len());
    let mut rest = component;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        match escaped(&rest.as_bytes()[at..]) {
            Some(byte) if is_unreserved(byte) => out.push(char::from(byte)),
            Some(byte) => out.push_str(&format!("%{byte:02X}")),
            None => {
                out.push_str("%25");
                rest = &rest[at + 1..];
                continue;
            }
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    out
}

/// The byte of the escape `%XX` that `text` begins with, if it does.
fn escaped(text: &[u8]) -> Option<u8> {
    let digit = |byte: u8| char::from(byte).to_digit(16).and_then(|digit| u8::try_from(digit).ok());
    match text {
        [b'%', high, low, ..] => Some(digit(*high)? << 4 | digit(*low)?),
        _ => None,
    }
}

/// RFC 3986 §2.3.
fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~".contains(&byte)
}

/// What a [canonical](canonical) name is to the coarsest decoding an
/// application may apply: percent-decoded, `+` and space alike (a form
/// decodes `+` to a space, a plain percent-decoding `%2B` to a `+`), bytes
/// that are not UTF-8 replaced as a lossy decoding replaces them. Every
/// decoding that reads two names alike gives them one such key, so a stable
/// sort by it keeps the order of the values that any application reads as
/// one name's.
fn decoded_alike(name: &str) -> String {
    let mut bytes = Vec::with_capacity(name.len());
    let mut rest = name.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        let byte = match escaped(rest) {
            Some(byte) => {
                rest = &rest[3..];
                byte
            }
            None => {
                rest = tail;
                first
            }
        };
        bytes.push(if byte == b'+' { b' ' } else { byte });
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{canonical, decoded_alike, query};
    use crate::property::{cases, random_below};

    fn some(pairs: &[(&str, &str)]) -> Vec<(String, Option<String>)> {
        pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), Some((*value).to_owned())))
            .collect()
    }

    #[test]
    fn a_query_is_normalized_as_rfc_3986_says_and_no_further() {
        assert_eq!(canonical("%65ur%7e"), "eur~");
        assert_eq!(canonical("a%2fb%2F"), "a%2Fb%2F");
        for spelling in ["a+b", "a%20b", "a%2Bb", "a/b", "a;b", "caf%C3%A9"] {
            assert_eq!(canonical(spelling), spelling);
        }
    }

    #[test]
    fn a_percent_that_begins_no_escape_never_forms_one() {
        assert_eq!(canonical("100%"), "100%25");
        assert_eq!(canonical("%g1%+1"), "%25g1%25+1");
        // Decoding `%32%30` behind a stray `%` leaves `%20`, which a
        // normalization that kept the `%` would read as a space.
        for (decoded, stray) in [("%20", "%%32%30"), ("%2F", "%%32F"), ("%AA", "%%41%41")] {
            assert_ne!(canonical(decoded), canonical(stray), "{stray}");
        }
        assert_eq!(canonical("%%32%30"), "%2520");
    }

    #[test]
    fn names_that_decode_alike_keep_their_order_and_others_are_sorted() {
        assert_eq!(query("a%20b=1&a+b=2"), some(&[("a%20b", "1"), ("a+b", "2")]));
        assert_eq!(query("a+b=2&a%20b=1"), some(&[("a+b", "2"), ("a%20b", "1")]));
        assert_ne!(query("a%20b=1&a+b=2"), query("a+b=2&a%20b=1"));
        assert_ne!(query("a%2Bb=1&a+b=2"), query("a+b=2&a%2Bb=1"));
        assert_ne!(query("%AA=1&%BB=2"), query("%BB=2&%AA=1"), "both read as U+FFFD");
        assert_eq!(query("b=2&a=1&b=3"), query("a=1&b=2&b=3"));
        assert_eq!(query("%C3%A9=1&z=2"), query("z=2&%c3%a9=1"));
    }

    /// The pairs an application reading the query as a form sees (axum's
    /// `Query`, through `form_urlencoded`), sorted stably by name: the
    /// order of one name's values kept, as the binding promises.
    fn form(query: &str) -> Vec<(String, String)> {
        let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs
    }

    /// The pairs an application that percent-decodes the raw query sees,
    /// `+` a plus, bytes as they are, sorted stably by name: written
    /// here apart from the code under test.
    fn percent_decoded(query: &str) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let decode = |text: &str| {
            let bytes = text.as_bytes();
            let mut out = Vec::new();
            let mut at = 0;
            while at < bytes.len() {
                // `from_str_radix` alone would take `+1` for a number.
                let hex = bytes
                    .get(at + 1..at + 3)
                    .filter(|hex| bytes[at] == b'%' && hex.iter().all(u8::is_ascii_hexdigit));
                match hex.and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()) {
                    Some(byte) => {
                        out.push(byte);
                        at += 3;
                    }
                    _ => {
                        out.push(bytes[at]);
                        at += 1;
                    }
                }
            }
            out
        };
        let mut pairs: Vec<_> = query
            .split('&')
            .filter(|parameter| !parameter.is_empty())
            .map(|parameter| match parameter.split_once('=') {
                Some((name, value)) => (decode(name), Some(decode(value))),
                None => (decode(parameter), None),
            })
            .collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs
    }

    /// The pieces queries are made of here: every character that matters to
    /// a query's parsing, and escapes of unreserved (`%41`, `%61`), reserved
    /// (`%20`, `%2B` in both cases) and non-UTF-8 (`%B0`) bytes; with `%`,
    /// `2` and `1` beside each other they form more (`%%32%30`, `%21`).
    const PIECES: &[&str] = &[
        "a", "1", "2", "%", "+", "=", "&", "%20", "%2B", "%2b", "%41", "%B0", "%61",
    ];

    /// Every query of up to 4 [`PIECES`] (more, until there are at least
    /// [`cases`] of them): two that are bound alike are read alike, as a
    /// form and as percent-decoded text.
    #[test]
    fn queries_bound_alike_are_read_alike_by_every_decoding() {
        let mut length = 4;
        while PIECES.len().pow(length) < cases(10_000) {
            length += 1;
        }
        let mut seen: HashMap<Vec<(String, Option<String>)>, String> = HashMap::new();
        let mut candidate = String::new();
        for len in 0..=length {
            for mut index in 0..PIECES.len().pow(len) {
                candidate.clear();
                for _ in 0..len {
                    candidate.push_str(PIECES[index % PIECES.len()]);
                    index /= PIECES.len();
                }
                let earlier = seen.entry(query(&candidate)).or_insert_with(|| candidate.clone());
                assert_eq!(form(earlier), form(&candidate), "{earlier} and {candidate}");
                assert_eq!(
                    percent_decoded(earlier),
                    percent_decoded(&candidate),
                    "{earlier} and {candidate}"
                );
            }
        }
        // Spellings meet: `a=1&2=1` and `2=1&a=1`, `%61` and `a`.
        assert!(seen.len() < PIECES.len().pow(length), "some queries were bound alike");
    }

    /// The positions of the characters of `text` that are not part of an
    /// escape.
    fn literals(text: &str) -> impl Iterator<Item = usize> + '_ {
        let bytes = text.as_bytes();
        let mut at = 0;
        std::iter::from_fn(move || {
            while at < bytes.len() {
                let escape = bytes[at] == b'%'
                    && bytes
                        .get(at + 1..at + 3)
                        .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit));
                if !escape {
                    at += 1;
                    return Some(at - 1);
                }
                at += 3;
            }
            None
        })
    }

    /// Longer random queries, respelled as the binding documents to be the
    /// same request (an unreserved character as its escape, an escape's
    /// hex digits in the other case, parameters of names no decoding reads
    /// alike swapped, an empty parameter added): bound alike, and read
    /// alike as the first test checks.
    #[test]
    fn respelled_and_reordered_queries_are_bound_alike() {
        let mut next = random_below(0x5eed_0001);
        for _ in 0..cases(10_000) {
            let original: String = (0..next(12)).map(|_| PIECES[next(PIECES.len())]).collect();
            let mut parameters: Vec<String> = original.split('&').map(str::to_owned).collect();
            for _ in 0..next(4) {
                let at = next(parameters.len());
                let parameter = &mut parameters[at];
                match next(4) {
                    // A literal unreserved character as its escape.
                    0 => {
                        let found = literals(parameter).find(|&i| parameter.as_bytes()[i].is_ascii_alphanumeric());
                        if let Some(i) = found {
                            let hex = format!("%{:02x}", parameter.as_bytes()[i]);
                            let hex = if next(2) == 0 { hex.to_ascii_uppercase() } else { hex };
                            parameter.replace_range(i..=i, &hex);
                        }
                    }
                    // An escape's hex digits in the other case.
                    1 => {
                        let found = (0..parameter.len()).find(|&i| !literals(parameter).any(|j| j == i));
                        if let Some(i) = found {
                            let at = i + 1..i + 3;
                            let flipped = parameter[at.clone()].chars().map(|c| {
                                if c.is_ascii_uppercase() {
                                    c.to_ascii_lowercase()
                                } else {
                                    c.to_ascii_uppercase()
                                }
                            });
                            parameter.replace_range(at, &flipped.collect::<String>());
                        }
                    }
                    // Two neighbours whose names no decoding reads alike.
                    2 if at + 1 < parameters.len() => {
                        let name = |parameter: &str| {
                            decoded_alike(&canonical(
                                parameter.split_once('=').map_or(parameter, |(name, _)| name),
                            ))
                        };
                        if !parameters[at].is_empty()
                            && !parameters[at + 1].is_empty()
                            && name(&parameters[at]) != name(&parameters[at + 1])
                        {
                            parameters.swap(at, at + 1);
                        }
                    }
                    _ => parameters.insert(at, String::new()),
                }
            }
            let respelled = parameters.join("&");
            assert_eq!(query(&original), query(&respelled), "{original} and {respelled}");
        }
    }
}
