//! Who is calling: the account a bearer token names.
//!
//! The token stands in for a signed credential that names its account, as
//! a verified token's subject does: `acct-42`, or `acct-42.<anything>`
//! after a rotation. The account id, never the token, is the scope of the
//! account's idempotency keys and the owner of its orders, so a retry sent
//! with a rotated token still replays.

use std::borrow::Cow;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idempotency::http::Caller;

use super::problems::problem;

/// The authenticated account, by its id: the scope of its idempotency keys
/// and the owner of its orders. A request without a valid bearer token is
/// answered 401.
#[derive(Debug, Clone)]
pub struct Account(String);

impl Account {
    /// The account's id.
    pub(super) fn id(&self) -> &str {
        &self.0
    }
}

impl<S: Sync> FromRequestParts<S> for Account {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
        let token = match (values.next(), values.next()) {
            (Some(value), None) => value.to_str().ok().and_then(bearer_token),
            _ => None,
        };
        match token.and_then(account_of) {
            Some(account) => Ok(Account(account.to_owned())),
            None => {
                let problem = problem(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
                    .with_detail("send Authorization: Bearer <account token>");
                Err(([(header::WWW_AUTHENTICATE, "Bearer")], problem).into_response())
            }
        }
    }
}

impl Caller for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// The account a token names: what precedes its first `.`, where a real
/// service would verify the token and read its subject. The part after it
/// changes when the token is rotated; the account does not, and a scope
/// that held the token would make a retry sent with the new one execute
/// again (and store a credential in every key record).
fn account_of(token: &str) -> Option<&str> {
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let account = token.split_once('.').map_or(token, |(account, _)| account);
    // An id the key rules would refuse as a scope is no account of ours.
    (!account.is_empty() && account.len() <= 255).then_some(account)
}

fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}
