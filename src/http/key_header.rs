//! The key's headers: the names and the syntax the extractor accepts, and
//! the name of the response header that tells when a key expires, set once
//! per API as a request extension.

use std::sync::Arc;

use http::{HeaderName, HeaderValue};

use super::answer::Marks;
use super::header::{HeaderError, HeaderFields, Syntax, read_key};
use super::headers::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, X_REQUEST_ID};
use crate::outcome::Origin;

/// How [`IdempotencyKey`](super::IdempotencyKey) reads the key header, and
/// the headers an [`Answer`](super::Answer) of the key carries.
///
/// | setting | default |
/// | --- | --- |
/// | names | `Idempotency-Key` only, the draft's; [`also_accept`](KeyHeader::also_accept) adds another, such as `X-Idempotency-Key` |
/// | syntax | lenient: an RFC 9651 sf-string (`"8e03978e"`), or a bare value of visible ASCII without a comma (`8e03978e`) taken as it is, as Stripe's clients send it |
/// | [`strict`](KeyHeader::strict) | an sf-string only, as the IETF draft (§2.1) requires; a bare value is a 400 |
/// | [`expiry_header`](KeyHeader::expiry_header) | `Idempotency-Expires`: the response header of every [`Answer`](super::Answer) |
/// | [`replay_header`](KeyHeader::replay_header) | `Idempotent-Replayed`: `true` on a replay |
/// | [`mark_first_responses`](KeyHeader::mark_first_responses) | `false`: a first response carries neither the replay header nor the key |
/// | [`request_id_header`](KeyHeader::request_id_header) | `X-Request-Id`: the request header whose value the record keeps as the request's id, sent back in `Original-Request` on replays and lookups |
///
/// A request with two fields among the names accepted, of one name or of
/// two (`Idempotency-Key: a` and `X-Idempotency-Key: a`), has two keys: it
/// is refused with a 400 ([`ProblemKind::InvalidKey`](super::ProblemKind::InvalidKey)),
/// even when the values agree, since which one the client meant cannot be
/// told. So has a bare value with a comma (`abc,def`, `abc, def`): a proxy
/// joins two fields of one name into one value with a comma (RFC 9110
/// §5.3), so it is refused in both syntaxes; a comma inside an sf-string
/// (`"abc,def"`) is part of the key.
///
/// In both syntaxes, parameters after the string (`"8e03978e";d=@1700000000`) may
/// hold any bare item of RFC 9651 and are checked, then ignored: the draft
/// defines none.
///
/// An API sets it once, as a request extension for its routes
/// (`router.layer(axum::Extension(key_header))`; on actix-web as app data,
/// `App::app_data(key_header)`), as it sets its
/// [`Problems`](super::Problems); without one the extractor uses the
/// default. A clone is cheap.
///
/// ```
/// # #[cfg(not(feature = "axum"))] fn main() {}
/// # #[cfg(feature = "axum")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// use std::borrow::Cow;
/// use axum::extract::FromRequestParts;
/// use axum::http::{request::Parts, Request, StatusCode};
/// use idempotency::http::{Caller, IdempotencyKey, IdempotencyKeyRejection, KeyHeader};
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
/// assert_eq!(KeyHeader::default().also_accept(axum::http::HeaderName::from_static("x-idempotency-key")).names().len(), 2);
///
/// let Ok(key) = extract(r#""order-2b9c";d=@1700000000"#).await? else { return Err("the sf-string was refused".into()) };
/// assert_eq!(key.key(), "order-2b9c");
/// let Err(IdempotencyKeyRejection::InvalidKey(bare)) = extract("order-2b9c").await? else {
///     return Err("a bare value was taken".into());
/// };
/// assert_eq!(bare.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(bare.detail(), Some("the Idempotency-Key header must be a structured field string: the key in double quotes"));
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
    names: Vec<HeaderName>,
    syntax: Syntax,
    expiry: HeaderName,
    replayed: HeaderName,
    mark_first: bool,
    request_id: Option<HeaderName>,
}

impl Default for KeyHeader {
    fn default() -> Self {
        KeyHeader {
            settings: Arc::new(Settings {
                names: vec![IDEMPOTENCY_KEY],
                syntax: Syntax::Lenient,
                expiry: IDEMPOTENCY_EXPIRES,
                replayed: IDEMPOTENT_REPLAYED,
                mark_first: false,
                request_id: Some(X_REQUEST_ID),
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

    /// Accepts the key in a header of this name as well, such as
    /// `X-Idempotency-Key`, which some clients and gateways send. A name
    /// already accepted is not added twice.
    pub fn also_accept(mut self, name: HeaderName) -> Self {
        let names = &mut Arc::make_mut(&mut self.settings).names;
        if !names.contains(&name) {
            names.push(name);
        }
        self
    }

    /// Names the response header that tells when the key's guarantee ends
    /// (default `Idempotency-Expires`), sent on every response a key
    /// produced: the first, its replays and a lookup's. No standard name
    /// exists yet (the draft's issues #35 and #49 are open); an API that
    /// documented another one, such as `X-Idempotency-Expires`, keeps it.
    pub fn expiry_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.settings).expiry = name;
        self
    }

    /// The name of the response header that tells when the key expires.
    pub fn expiry_header_name(&self) -> &HeaderName {
        &self.settings.expiry
    }

    /// Names the response header that marks a replay with `true` (default
    /// `Idempotent-Replayed`, as Stripe's API sends it). An API that
    /// documented another name, such as Crunchy Bridge's
    /// `Idempotency-Replay`, keeps it. A browser reads it only where CORS
    /// exposes it: the [HTTP guide](crate::guide::http#browsers-and-cors)
    /// lists the headers to expose.
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.settings).replayed = name;
        self
    }

    /// The name of the response header that marks a replay.
    pub fn replay_header_name(&self) -> &HeaderName {
        &self.settings.replayed
    }

    /// Whether every response of a key also says what it is (default
    /// `false`): a first response carries the replay header with `false`,
    /// and every response, first or replayed, echoes the key in an
    /// `Idempotency-Key` header as an sf-string, so that a client that logs
    /// responses can tell which request each answered and whether it ran.
    pub fn mark_first_responses(mut self, mark: bool) -> Self {
        Arc::make_mut(&mut self.settings).mark_first = mark;
        self
    }

    /// Names the request header whose value the key record keeps as the id
    /// of the request that executed (default `X-Request-Id`; `None` keeps
    /// none). A replay and a lookup send it back in an `Original-Request`
    /// header, as Stripe's API does, and
    /// [`KeyStatus::Completed`](crate::KeyStatus::Completed) and
    /// [`Answer::origin`](super::Answer::origin) tell it: a client, or an
    /// operator reading its logs, finds the request that did the work. A
    /// value kept is one field of 1 to 128 visible ASCII characters; any
    /// other (two fields, a longer or a non-ASCII value) is not kept, and
    /// the request goes on without it.
    pub fn request_id_header(mut self, name: impl Into<Option<HeaderName>>) -> Self {
        Arc::make_mut(&mut self.settings).request_id = name.into();
        self
    }

    /// The name of the request header whose value is kept as the request's
    /// id, if any.
    pub fn request_id_header_name(&self) -> Option<&HeaderName> {
        self.settings.request_id.as_ref()
    }

    /// The request's id in its header `fields`, where it is one the record
    /// keeps.
    pub(crate) fn read_request_id(&self, fields: &impl HeaderFields) -> Option<String> {
        let mut values = fields.values(self.settings.request_id.as_ref()?);
        let (Some(value), None) = (values.next(), values.next()) else {
            return None;
        };
        let id = std::str::from_utf8(value).ok()?;
        Origin::keeps_request_id(id).then(|| id.to_owned())
    }

    /// The headers an answer of `key` carries besides its own.
    pub(super) fn marks(&self, key: &str) -> Marks {
        Marks {
            expiry: self.settings.expiry.clone(),
            replayed: self.settings.replayed.clone(),
            echo: self.settings.mark_first.then(|| sf_string(key)).flatten(),
        }
    }

    /// The header names accepted, `Idempotency-Key` first.
    pub fn names(&self) -> &[HeaderName] {
        &self.settings.names
    }

    /// Whether the request has a field of a name accepted.
    pub(crate) fn is_present(&self, fields: &impl HeaderFields) -> bool {
        self.settings
            .names
            .iter()
            .any(|name| fields.values(name).next().is_some())
    }

    /// Whether only an sf-string is accepted.
    pub fn is_strict(&self) -> bool {
        self.settings.syntax == Syntax::Strict
    }

    /// The key of the request; `None` without the header.
    pub(crate) fn read(&self, fields: &impl HeaderFields) -> Result<Option<String>, HeaderError> {
        read_key(fields, &self.settings.names, self.settings.syntax)
    }
}

/// `key` as an RFC 9651 sf-string: in double quotes, with `"` and `\`
/// escaped. `None` for a key with a byte an sf-string cannot hold, which the
/// key rules refuse anyway.
fn sf_string(key: &str) -> Option<HeaderValue> {
    let escaped = key.replace('\\', "\\\\").replace('"', "\\\"");
    HeaderValue::try_from(format!("\"{escaped}\"")).ok()
}
