//! Responses as they are stored with a key and replayed: status, the
//! headers that matter and a JSON body.

use std::fmt;
use std::marker::PhantomData;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, Visitor};
use serde::ser::{self, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};

/// An HTTP response as it is stored with its key: the status, the headers
/// the application set on it, and a body that is JSON.
///
/// An operation returns it, so the stored result is the response and a
/// replay answers exactly as the first call did: a `201 Created` with its
/// `Location` replays as a `201` with the same `Location`, and a business
/// rejection that should be remembered (a declined card, `402`) replays as
/// that rejection. The headers kept are the ones set here: `Location`,
/// `Content-Type` (default `application/json`) and whatever else the
/// application names; headers added outside the operation, by the handler
/// or by middleware, are added anew on every answer.
///
/// It is stored as `{"status": 201, "headers": [["location", "/orders/7"]],
/// "body": ...}`. A response that cannot be stored as it should be replayed
/// fails the call with [`Error::Codec`](crate::Error::Codec) before commit
/// (the operation rolled back, the key still free), its message naming the
/// header:
///
/// - a header value that is not visible ASCII;
/// - a hop-by-hop or framing header (`Connection`, and so whatever it
///   names, `Keep-Alive`, `Proxy-Connection`, `Transfer-Encoding`, `TE`,
///   `Trailer`, `Upgrade`, `Content-Length`): these describe one
///   connection and one serialization of the body, which the server makes
///   anew on every answer, and a stored one would contradict the body it is
///   replayed with;
/// - `Set-Cookie` added with [`with_header`](StoredResponse::with_header):
///   a stored cookie is replayed to every retry of the key, so it is stored
///   only when added with [`with_cookie`](StoredResponse::with_cookie).
///
/// Responses with a status that allows no content (1xx, 204, 205, 304) are
/// sent without the body.
///
/// Returned through [`Outcome`](crate::Outcome), a replay carries `Idempotent-Replayed:
/// true`.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::http::{header, HeaderValue, StatusCode};
/// use axum::response::IntoResponse;
/// use idempotency::http::StoredResponse;
/// use idempotency::Outcome;
///
/// let created = StoredResponse::new(StatusCode::CREATED, serde_json::json!({"id": 7}))
///     .with_header(header::LOCATION, HeaderValue::from_static("/orders/7"));
///
/// let stored = serde_json::to_string(&created)?;
/// let replayed: StoredResponse<serde_json::Value> = serde_json::from_str(&stored)?;
/// assert_eq!(replayed, created);
///
/// let response = Outcome::Replayed(replayed).into_response();
/// assert_eq!(response.status(), StatusCode::CREATED);
/// assert_eq!(response.headers()["location"], "/orders/7");
/// assert_eq!(response.headers()["content-type"], "application/json");
/// assert_eq!(response.headers()["idempotent-replayed"], "true");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse<T> {
    status: StatusCode,
    headers: HeaderMap,
    body: T,
    /// `Set-Cookie` was added deliberately, with `with_cookie`.
    cookies: bool,
}

/// What the server sets for each connection and each serialization of the
/// body, never a stored response.
const PER_CONNECTION: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

impl<T> StoredResponse<T> {
    /// A response with `status` and `body`, and no headers but the
    /// `Content-Type` of JSON.
    pub fn new(status: StatusCode, body: T) -> Self {
        StoredResponse {
            status,
            headers: HeaderMap::new(),
            body,
            cookies: false,
        }
    }

    /// Adds a header to be stored and replayed; a second value for the same
    /// name adds a second field. Hop-by-hop and framing headers, and
    /// `Set-Cookie`, are refused when the response is stored (see above).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// Adds a `Set-Cookie` field to be stored and replayed: the deliberate
    /// choice of a cookie that every retry of the key gets, whoever in the
    /// scope sends it. A session or authentication cookie is the wrong
    /// thing to store: set it on the handler's response, outside the
    /// operation, where it is made anew for each answer.
    ///
    /// ```
    /// use http::{HeaderValue, StatusCode};
    /// use idempotency::http::StoredResponse;
    ///
    /// let chosen = StoredResponse::new(StatusCode::CREATED, 7)
    ///     .with_cookie(HeaderValue::from_static("cart=7; Path=/; Secure"));
    /// let stored = serde_json::to_string(&chosen)?;
    /// assert_eq!(serde_json::from_str::<StoredResponse<i32>>(&stored)?, chosen);
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn with_cookie(mut self, value: HeaderValue) -> Self {
        self.headers.append(header::SET_COOKIE, value);
        self.cookies = true;
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers set with [`with_header`](StoredResponse::with_header).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &T {
        &self.body
    }

    /// The body, taken out.
    pub fn into_body(self) -> T {
        self.body
    }
}

/// Whether a response of `status` has content: not 1xx, 204, 205, 304.
pub(super) fn allows_content(status: StatusCode) -> bool {
    !(status.is_informational()
        || matches!(
            status,
            StatusCode::NO_CONTENT | StatusCode::RESET_CONTENT | StatusCode::NOT_MODIFIED
        ))
}

/// The stored headers: name and value pairs, in order, names lowercase;
/// `cookies` if `Set-Cookie` was chosen.
struct StoredHeaders<'a> {
    headers: &'a HeaderMap,
    cookies: bool,
}

impl Serialize for StoredHeaders<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(Some(self.headers.len()))?;
        for (name, value) in self.headers {
            if PER_CONNECTION.contains(&name.as_str()) {
                return Err(ser::Error::custom(format_args!(
                    "header {name} belongs to one connection or one serialization of the body and is not stored"
                )));
            }
            if name == header::SET_COOKIE && !self.cookies {
                return Err(ser::Error::custom(
                    "header set-cookie is replayed to every retry of the key: store it with StoredResponse::with_cookie",
                ));
            }
            let value = value
                .to_str()
                .map_err(|_| ser::Error::custom(format_args!("the value of header {name} is not visible ascii")))?;
            seq.serialize_element(&(name.as_str(), value))?;
        }
        seq.end()
    }
}

impl<T: Serialize> Serialize for StoredResponse<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut state = serializer.serialize_struct("StoredResponse", 3)?;
        state.serialize_field("status", &self.status.as_u16())?;
        let headers = StoredHeaders {
            headers: &self.headers,
            cookies: self.cookies,
        };
        state.serialize_field("headers", &headers)?;
        state.serialize_field("body", &self.body)?;
        state.end()
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for StoredResponse<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_struct(
            "StoredResponse",
            &["status", "headers", "body"],
            StoredVisitor(PhantomData),
        )
    }
}

struct StoredVisitor<T>(PhantomData<T>);

impl<'de, T: DeserializeOwned> Visitor<'de> for StoredVisitor<T> {
    type Value = StoredResponse<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a stored response with status, headers and body")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut status, mut headers, mut body) = (None, None, None);
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "status" => status = Some(map.next_value::<u16>()?),
                "headers" => headers = Some(map.next_value::<Vec<(String, String)>>()?),
                "body" => body = Some(map.next_value::<T>()?),
                _ => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        let status = status.ok_or_else(|| de::Error::missing_field("status"))?;
        let status = StatusCode::from_u16(status)
            .map_err(|_| de::Error::custom(format_args!("{status} is not an http status")))?;
        let body = body.ok_or_else(|| de::Error::missing_field("body"))?;
        let mut header_map = HeaderMap::new();
        for (name, value) in headers.unwrap_or_default() {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| de::Error::custom("a stored header name is not valid"))?;
            let value = HeaderValue::from_str(&value)
                .map_err(|_| de::Error::custom(format_args!("the stored value of header {name} is not valid")))?;
            header_map.append(name, value);
        }
        // Only a chosen cookie was stored.
        let cookies = header_map.contains_key(header::SET_COOKIE);
        Ok(StoredResponse {
            status,
            headers: header_map,
            body,
            cookies,
        })
    }
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "axum")]
    use serde_json::json;

    use super::*;
    #[cfg(feature = "axum")]
    use axum::response::IntoResponse;

    #[cfg(feature = "axum")]
    use crate::{Outcome, http::IDEMPOTENT_REPLAYED};

    #[test]
    #[cfg(feature = "axum")]
    fn a_stored_content_type_replaces_json() {
        let response = StoredResponse::new(StatusCode::OK, json!({}))
            .with_header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/vnd.api+json"),
            )
            .into_response();
        let types: Vec<_> = response.headers().get_all(header::CONTENT_TYPE).iter().collect();
        assert_eq!(types, ["application/vnd.api+json"]);
    }

    #[test]
    fn repeated_headers_survive_storage_in_order() {
        let response = StoredResponse::new(StatusCode::OK, 1)
            .with_header(header::LINK, HeaderValue::from_static("</a>; rel=next"))
            .with_header(header::LINK, HeaderValue::from_static("</b>; rel=prev"));
        let stored = serde_json::to_string(&response).unwrap();
        assert_eq!(
            stored,
            r#"{"status":200,"headers":[["link","</a>; rel=next"],["link","</b>; rel=prev"]],"body":1}"#
        );
        let back: StoredResponse<i32> = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, response);
    }

    #[test]
    #[cfg(feature = "axum")]
    fn no_content_is_sent_without_a_body() {
        let response = StoredResponse::new(StatusCode::NO_CONTENT, ()).into_response();
        assert!(response.headers().get(header::CONTENT_TYPE).is_none());
    }

    #[test]
    fn a_header_value_that_is_not_visible_ascii_is_not_stored() {
        let value = HeaderValue::from_bytes(b"caf\xe9").unwrap();
        let response = StoredResponse::new(StatusCode::OK, 1).with_header(header::ETAG, value);
        let error = serde_json::to_string(&response).unwrap_err();
        assert_eq!(error.to_string(), "the value of header etag is not visible ascii");
    }

    #[test]
    fn a_stored_response_that_no_longer_fits_does_not_decode() {
        for stored in [
            r#"{"status":1000,"headers":[],"body":1}"#,
            r#"{"status":200,"headers":[["bad name","x"]],"body":1}"#,
            r#"{"status":200,"headers":[["x","a\nb"]],"body":1}"#,
            r#"{"status":200,"headers":[]}"#,
            r#"{"status":200,"headers":[],"body":"not a number"}"#,
        ] {
            assert!(serde_json::from_str::<StoredResponse<i32>>(stored).is_err(), "{stored}");
        }
    }

    #[test]
    fn hop_by_hop_and_framing_headers_are_not_stored() {
        for name in PER_CONNECTION {
            let name = HeaderName::from_static(name);
            let response =
                StoredResponse::new(StatusCode::OK, 1).with_header(name.clone(), HeaderValue::from_static("x"));
            let error = serde_json::to_string(&response).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("header {name} belongs to one connection or one serialization of the body and is not stored")
            );
        }
    }

    #[test]
    #[cfg(feature = "axum")]
    fn a_cookie_is_stored_only_when_chosen() {
        let unchosen = StoredResponse::new(StatusCode::OK, 1)
            .with_header(header::SET_COOKIE, HeaderValue::from_static("session=s3cr3t"));
        let error = serde_json::to_string(&unchosen).unwrap_err();
        assert_eq!(
            error.to_string(),
            "header set-cookie is replayed to every retry of the key: store it with StoredResponse::with_cookie"
        );

        let chosen = StoredResponse::new(StatusCode::OK, 1).with_cookie(HeaderValue::from_static("cart=7"));
        let stored = serde_json::to_string(&chosen).unwrap();
        assert_eq!(stored, r#"{"status":200,"headers":[["set-cookie","cart=7"]],"body":1}"#);
        let back: StoredResponse<i32> = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, chosen);
        assert_eq!(back.into_response().headers()[header::SET_COOKIE], "cart=7");
    }

    #[test]
    #[cfg(feature = "axum")]
    fn an_executed_outcome_is_not_marked() {
        let response = Outcome::Executed(StoredResponse::new(StatusCode::CREATED, 1)).into_response();
        assert!(response.headers().get(IDEMPOTENT_REPLAYED).is_none());
    }
}
