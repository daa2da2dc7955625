//! How the extractor reads the key from a request's headers: the syntax it
//! accepts, set once per API as a request extension.

use std::sync::Arc;

use axum::http::HeaderMap;

use super::header::{HeaderError, Syntax, read_key};

/// How [`IdempotencyKey`](super::IdempotencyKey) reads the key header.
///
/// | setting | default |
/// | --- | --- |
/// | syntax | lenient: an RFC 9651 sf-string (`"8e03978e"`), or a bare value of visible ASCII (`8e03978e`) taken as it is, as Stripe's clients send it |
/// | [`strict`](KeyHeader::strict) | an sf-string only, as the IETF draft (§2.1) requires; a bare value is a 400 |
///
/// In both, parameters after the string (`"8e03978e";d=@1700000000`) may
/// hold any bare item of RFC 9651 and are checked, then ignored: the draft
/// defines none.
///
/// An API sets it once, as a request extension for its routes
/// (`router.layer(axum::Extension(key_header))`), as it sets its
/// [`Problems`](super::Problems); without one the extractor uses the
/// default. A clone is cheap.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use idempotency::http::{Caller, IdempotencyKey, KeyHeader};
///
/// # struct Anyone;
/// # impl<S: Sync> FromRequestParts<S> for Anyone {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(Anyone) }
/// # }
/// # impl Caller for Anyone { fn scope(&self) -> Cow<'_, str> { Cow::Borrowed("public") } }
/// let extract = async |value: &str| {
///     let (mut parts, ()) = Request::post("/orders")
///         .header("Idempotency-Key", value)
///         .extension(KeyHeader::default().strict())
///         .body(())?
///         .into_parts();
///     Ok::<_, axum::http::Error>(IdempotencyKey::<Anyone>::from_request_parts(&mut parts, &()).await)
/// };
///
/// let Ok(key) = extract(r#""order-2b9c";d=@1700000000"#).await? else { return Err("the sf-string was refused".into()) };
/// assert_eq!(key.key(), "order-2b9c");
/// let Err(bare) = extract("order-2b9c").await? else { return Err("a bare value was taken".into()) };
/// assert_eq!(bare.status(), StatusCode::BAD_REQUEST);
/// # Ok(())
/// # })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct KeyHeader {
    settings: Arc<Settings>,
}

#[derive(Debug, Clone)]
struct Settings {
    syntax: Syntax,
}

impl Default for KeyHeader {
    fn default() -> Self {
        KeyHeader {
            settings: Arc::new(Settings {
                syntax: Syntax::Lenient,
            }),
        }
    }
}

impl KeyHeader {
    /// Accepts only an sf-string, as the draft requires: a bare value is
    /// refused with a 400 ([`ProblemKind::InvalidKey`](super::ProblemKind::InvalidKey))
    /// that says to quote the key.
    pub fn strict(mut self) -> Self {
        Arc::make_mut(&mut self.settings).syntax = Syntax::Strict;
        self
    }

    /// Whether only an sf-string is accepted.
    pub fn is_strict(&self) -> bool {
        self.settings.syntax == Syntax::Strict
    }

    /// The key of the request; `None` without the header.
    pub(crate) fn read(&self, headers: &HeaderMap) -> Result<Option<String>, HeaderError> {
        read_key(headers, self.settings.syntax)
    }
}
