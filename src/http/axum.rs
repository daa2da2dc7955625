//! The axum adapter: how the HTTP layer's rules read an axum request (the
//! key extractor, the endpoint from the router) and write an axum response
//! (`IntoResponse` for everything a handler returns). The rules themselves
//! are the framework's neighbours' in this module.

use axum::body::Body;
use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, OptionalFromRequestParts, RawPathParams};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use serde::Serialize;

use super::endpoint::Endpoint;
use super::response::allows_content;
use super::{
    Answer, Caller, Failure, IDEMPOTENT_REPLAYED, IdempotencyKey, IdempotencyKeyRejection, KeyHeader, Problem,
    Problems, StoredResponse,
};
use crate::Outcome;

impl<S, A> FromRequestParts<S> for IdempotencyKey<A>
where
    S: Send + Sync,
    A: FromRequestParts<S> + Caller + Send,
{
    type Rejection = IdempotencyKeyRejection<A::Rejection>;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let caller = A::from_request_parts(parts, state)
            .await
            .map_err(IdempotencyKeyRejection::Caller)?;
        read(caller, parts).await
    }
}

impl<S, A> OptionalFromRequestParts<S> for IdempotencyKey<A>
where
    S: Send + Sync,
    A: FromRequestParts<S> + Caller + Send,
{
    type Rejection = IdempotencyKeyRejection<A::Rejection>;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Option<Self>, Self::Rejection> {
        // Before looking at the header: authentication must not depend on
        // whether the client sent one.
        let caller = A::from_request_parts(parts, state)
            .await
            .map_err(IdempotencyKeyRejection::Caller)?;
        let header = parts.extensions.get::<KeyHeader>().cloned().unwrap_or_default();
        if !header.is_present(&parts.headers) {
            return Ok(None);
        }
        read(caller, parts).await.map(Some)
    }
}

/// The key of the request in `parts`, for the authenticated `caller`.
async fn read<A: Caller, R>(caller: A, parts: &mut Parts) -> Result<IdempotencyKey<A>, IdempotencyKeyRejection<R>> {
    let problems = parts.extensions.get::<Problems>().cloned().unwrap_or_default();
    let header = parts.extensions.get::<KeyHeader>().cloned().unwrap_or_default();
    let key = IdempotencyKey::<A>::read_key(&parts.headers, &header, &problems)?;
    let endpoint = endpoint(parts).await.map_err(IdempotencyKeyRejection::PathParams)?;
    Ok(IdempotencyKey::new(
        caller,
        key,
        problems,
        (&header, &parts.headers),
        endpoint,
    ))
}

/// The endpoint of the request in `parts`: the route axum matched (the
/// request's path where none did, as outside a router) and the path
/// parameters as axum's `Path` decodes them.
///
/// # Errors
///
/// axum's rejection of path parameters it cannot decode, as `Path`
/// refuses them.
async fn endpoint(parts: &mut Parts) -> Result<Endpoint, RawPathParamsRejection> {
    let route = match parts.extensions.get::<MatchedPath>() {
        Some(matched) => matched.as_str().to_owned(),
        None => parts.uri.path().to_owned(),
    };
    let path = match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => params
            .iter()
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect(),
        // A route without parameters, or no router at all.
        Err(RawPathParamsRejection::MissingPathParams(_)) => Vec::new(),
        Err(rejection) => return Err(rejection),
    };
    Ok(Endpoint::new(parts.method.as_str(), route, path, parts.uri.query()))
}

impl<R: IntoResponse> IntoResponse for IdempotencyKeyRejection<R> {
    fn into_response(self) -> Response {
        match self {
            IdempotencyKeyRejection::Caller(rejection) => rejection.into_response(),
            IdempotencyKeyRejection::MissingKey(problem) | IdempotencyKeyRejection::InvalidKey(problem) => {
                problem.into_response()
            }
            IdempotencyKeyRejection::PathParams(rejection) => rejection.into_response(),
            // Not made by this adapter; answered as its problem all the same.
            #[cfg(feature = "actix")]
            IdempotencyKeyRejection::InvalidPath(problem) => problem.into_response(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status();
        let headers = self.response_headers();
        let mut response = (status, axum::Json(self)).into_response();
        for (name, value) in headers {
            response.headers_mut().insert(name, value);
        }
        response
    }
}

impl<E: IntoResponse> IntoResponse for Failure<E> {
    fn into_response(self) -> Response {
        match self {
            Failure::Operation(error) => error.into_response(),
            Failure::Refused(problem) | Failure::Failed { problem, .. } => problem.into_response(),
        }
    }
}

impl<T: Serialize> IntoResponse for StoredResponse<T> {
    fn into_response(self) -> Response {
        let mut response = if allows_content(self.status()) {
            axum::Json(self.body()).into_response()
        } else {
            Response::new(Body::empty())
        };
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        for name in self.headers().keys() {
            headers.remove(name);
            for value in self.headers().get_all(name) {
                headers.append(name, value.clone());
            }
        }
        response
    }
}

impl<R: IntoResponse> IntoResponse for Outcome<R> {
    /// The response of `R`; a replay adds `Idempotent-Replayed: true`.
    fn into_response(self) -> Response {
        match self {
            Outcome::Executed(response) => response.into_response(),
            Outcome::Replayed(response) => {
                let mut response = response.into_response();
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, http::HeaderValue::from_static("true"));
                response
            }
        }
    }
}

impl<R: IntoResponse> IntoResponse for Answer<R> {
    fn into_response(self) -> Response {
        let (response, added) = self.into_parts();
        let mut response = response.into_response();
        for (name, value) in added {
            response.headers_mut().insert(name, value);
        }
        response
    }
}
