//! What a key is bound to: the endpoint the request was sent to, captured
//! by the extractor, and the request value, fingerprinted together.

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
use axum::http::request::Parts;
use serde::Serialize;
use serde::ser::{SerializeStruct, Serializer};

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
    /// The endpoint of the request in `parts`.
    ///
    /// # Errors
    ///
    /// axum's rejection of path parameters it cannot decode, as `Path`
    /// refuses them.
    pub(super) async fn of(parts: &mut Parts) -> Result<Endpoint, RawPathParamsRejection> {
        let route = match parts.extensions.get::<MatchedPath>() {
            Some(matched) => matched.as_str().to_owned(),
            None => parts.uri.path().to_owned(),
        };
        let mut path: Vec<(String, String)> = match RawPathParams::from_request_parts(parts, &()).await {
            Ok(params) => params
                .iter()
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .collect(),
            // A route without parameters, or no router at all.
            Err(RawPathParamsRejection::MissingPathParams(_)) => Vec::new(),
            Err(rejection) => return Err(rejection),
        };
        path.sort();
        let mut query: Vec<(String, Option<String>)> = parts
            .uri
            .query()
            .unwrap_or("")
            .split('&')
            .filter(|parameter| !parameter.is_empty())
            .map(|parameter| match parameter.split_once('=') {
                Some((name, value)) => (normalized(name), Some(normalized(value))),
                None => (normalized(parameter), None),
            })
            .collect();
        // Stable: the values of one name keep their order, which may mean
        // something to the application.
        query.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Endpoint {
            method: parts.method.as_str().to_owned(),
            route,
            path,
            query,
        })
    }
}

/// What a key is bound to: the request value, with the endpoint it was
/// sent to unless the key spans endpoints. Without an endpoint it is the
/// request value itself, so the fingerprint is the one the request alone
/// has.
pub(super) struct Bound<Q> {
    endpoint: Option<Endpoint>,
    request: Q,
}

impl<Q> Bound<Q> {
    pub(super) fn new(endpoint: Option<Endpoint>, request: Q) -> Self {
        Bound { endpoint, request }
    }

    /// The request value.
    pub(super) fn request(&self) -> &Q {
        &self.request
    }
}

impl<Q: Serialize> Serialize for Bound<Q> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Some(endpoint) = &self.endpoint else {
            return self.request.serialize(serializer);
        };
        let mut bound = serializer.serialize_struct("Bound", 2)?;
        bound.serialize_field("endpoint", endpoint)?;
        bound.serialize_field("request", &self.request)?;
        bound.end()
    }
}

/// `component` of a query as RFC 3986 (§6.2.2) normalizes it: the escapes
/// of unreserved characters decoded, the others in upper case. Nothing
/// else is decoded: parsers disagree on what `+` means, so `+`, `%20` and
/// `%2B` stay three spellings.
fn normalized(component: &str) -> String {
    let mut out = String::with_capacity(component.len());
    let mut rest = component;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let hex = rest
            .get(at + 1..at + 3)
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()));
        match hex.and_then(|hex| u8::from_str_radix(hex, 16).ok()) {
            Some(byte) if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 3..];
            }
            Some(_) => {
                out.push('%');
                out.push_str(&rest[at + 1..at + 3].to_ascii_uppercase());
                rest = &rest[at + 3..];
            }
            None => {
                out.push('%');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::normalized;

    #[test]
    fn a_query_is_normalized_as_rfc_3986_says_and_no_further() {
        assert_eq!(normalized("%65ur%7e"), "eur~");
        assert_eq!(normalized("a%2fb%2F"), "a%2Fb%2F");
        for spelling in ["a+b", "a%20b", "a%2Bb"] {
            assert_eq!(normalized(spelling), spelling);
        }
        assert_eq!(normalized("100%"), "100%");
        assert_eq!(normalized("%g1%+1"), "%g1%+1");
        assert_eq!(normalized("caf%C3%A9"), "caf%C3%A9");
    }
}
