//! What a key is bound to: the endpoint the request was sent to, captured
//! by the extractor, and the request value, fingerprinted together.

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
use axum::http::request::Parts;
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
pub(super) struct Bound<Q> {
    endpoint: Option<Endpoint>,
    /// The caller's principal, where it differs from the scope: two users
    /// of one tenant's scope never share a fingerprint. Left out where the
    /// scope is the principal, which tells them apart already, so that the
    /// records written before the principal was bound keep their
    /// fingerprints.
    principal: Option<String>,
    request: Q,
}

impl<Q> Bound<Q> {
    pub(super) fn new(endpoint: Option<Endpoint>, principal: Option<String>, request: Q) -> Self {
        Bound {
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

impl<Q: Serialize> Serialize for Bound<Q> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.endpoint.is_none() && self.principal.is_none() {
            return self.request.serialize(serializer);
        }
        let mut bound = serializer.serialize_struct("Bound", 3)?;
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
