//! The route table: path → handler, nothing else.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::{AppState, chat, passthrough};
use crate::error::{Error, ProxyBody, full_body};

pub async fn route(state: Arc<AppState>, request: Request<Incoming>) -> Response<ProxyBody> {
    let path = request.uri().path();
    let result = match (request.method(), path) {
        (&Method::POST, "/v1/chat/completions") => chat::handle(state, request).await,
        (_, "/v1/chat/completions") => Err(Error::MethodNotAllowed {
            method: request.method().to_string(),
            path: path.to_owned(),
        }),
        (_, path) if path.starts_with("/v1/") => passthrough::handle(state, request).await,
        (_, path) if path.starts_with(crate::admin::PREFIX) => match state.admin.clone() {
            Some(admin) => admin.handle(request).await,
            None => Err(Error::NotFound {
                method: request.method().to_string(),
                path: path.to_owned(),
            }),
        },
        (&Method::GET | &Method::HEAD, "/healthz") => {
            Ok(json(StatusCode::OK, r#"{"status":"ok"}"#))
        }
        (&Method::GET | &Method::HEAD, "/readyz") => Ok(if state.is_draining() {
            json(StatusCode::SERVICE_UNAVAILABLE, r#"{"status":"draining"}"#)
        } else {
            json(StatusCode::OK, r#"{"status":"ready"}"#)
        }),
        (method, path) => Err(Error::NotFound {
            method: method.to_string(),
            path: path.to_owned(),
        }),
    };
    result.unwrap_or_else(Error::into_response)
}

fn json(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}
