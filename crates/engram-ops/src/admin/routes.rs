//! The management API's route table: method, path template and endpoint. The router matches
//! requests against it and nothing else, and a test checks it against the OpenAPI document,
//! so the two cannot drift apart.

use http::Method;

/// What a route does; `mod.rs` has one handler arm per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    OpenApi,
    Queue,
    Job,
    Export,
    Forget,
    Identity,
    Items,
    Item,
    EditItem,
    DeleteItem,
    Pin,
    Unpin,
    Explain,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub method: Method,
    /// `{name}` segments are parameters (one path segment each).
    pub path: &'static str,
    pub endpoint: Endpoint,
    /// Only the global token reaches it (it is about every tenant).
    pub global_only: bool,
    /// The query parameters it takes; any other is a 400.
    pub query: &'static [&'static str],
}

const fn route(method: Method, path: &'static str, endpoint: Endpoint) -> Route {
    Route {
        method,
        path,
        endpoint,
        global_only: false,
        query: &[],
    }
}

pub static ROUTES: [Route; 13] = [
    route(Method::GET, "/engram/v1/openapi.json", Endpoint::OpenApi),
    Route {
        method: Method::GET,
        path: "/engram/v1/queue",
        endpoint: Endpoint::Queue,
        global_only: true,
        query: &[],
    },
    route(
        Method::GET,
        "/engram/v1/users/{user}/jobs/{job}",
        Endpoint::Job,
    ),
    route(
        Method::GET,
        "/engram/v1/users/{user}/memory",
        Endpoint::Export,
    ),
    route(Method::DELETE, "/engram/v1/users/{user}", Endpoint::Forget),
    route(
        Method::PUT,
        "/engram/v1/users/{user}/identity",
        Endpoint::Identity,
    ),
    Route {
        method: Method::GET,
        path: "/engram/v1/users/{user}/items",
        endpoint: Endpoint::Items,
        global_only: false,
        query: &["q", "kind", "tier", "limit"],
    },
    route(
        Method::GET,
        "/engram/v1/users/{user}/items/{item}",
        Endpoint::Item,
    ),
    route(
        Method::PATCH,
        "/engram/v1/users/{user}/items/{item}",
        Endpoint::EditItem,
    ),
    route(
        Method::DELETE,
        "/engram/v1/users/{user}/items/{item}",
        Endpoint::DeleteItem,
    ),
    route(Method::POST, "/engram/v1/users/{user}/pins", Endpoint::Pin),
    route(
        Method::DELETE,
        "/engram/v1/users/{user}/pins/{pin}",
        Endpoint::Unpin,
    ),
    route(
        Method::GET,
        "/engram/v1/users/{user}/turns/{turn}/explain",
        Endpoint::Explain,
    ),
];

/// How a request path matched the table.
#[derive(Debug, PartialEq)]
pub enum Matched<'a> {
    /// The route and its parameters' raw (still percent-encoded) segments, in order.
    Route(&'static Route, Vec<&'a str>),
    /// The path exists, not with this method.
    WrongMethod,
    NoPath,
}

pub fn find<'a>(method: &Method, path: &'a str) -> Matched<'a> {
    let mut path_known = false;
    for route in &ROUTES {
        let Some(parameters) = parameters(route.path, path) else {
            continue;
        };
        if route.method == method {
            return Matched::Route(route, parameters);
        }
        path_known = true;
    }
    if path_known {
        Matched::WrongMethod
    } else {
        Matched::NoPath
    }
}

/// The parameter segments of `path` if it fits `template`; parameters are never empty.
fn parameters<'a>(template: &str, path: &'a str) -> Option<Vec<&'a str>> {
    let mut template_segments = template.split('/');
    let mut path_segments = path.split('/');
    let mut found = Vec::new();
    loop {
        match (template_segments.next(), path_segments.next()) {
            (None, None) => return Some(found),
            (Some(expected), Some(given)) => {
                if expected.starts_with('{') && expected.ends_with('}') {
                    if given.is_empty() {
                        return None;
                    }
                    found.push(given);
                } else if expected != given {
                    return None;
                }
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_their_template_with_parameters_in_order() {
        let Matched::Route(route, parameters) =
            find(&Method::GET, "/engram/v1/users/ana/turns/t-1/explain")
        else {
            panic!("no match");
        };
        assert_eq!(route.endpoint, Endpoint::Explain);
        assert_eq!(parameters, ["ana", "t-1"]);
        assert_eq!(
            find(&Method::POST, "/engram/v1/users/ana/items/fact:1"),
            Matched::WrongMethod
        );
        for unknown in [
            "/engram/v1/users//memory",
            "/engram/v1/users/ana/memory/",
            "/engram/v1/nope",
            "/engram/v1/users/ana/items/fact:1/more",
        ] {
            assert_eq!(find(&Method::GET, unknown), Matched::NoPath, "{unknown}");
        }
    }

    #[test]
    fn each_method_and_path_is_served_once() {
        for (at, route) in ROUTES.iter().enumerate() {
            for other in &ROUTES[at + 1..] {
                assert!(
                    !(route.method == other.method && route.path == other.path),
                    "{} {} twice",
                    route.method,
                    route.path
                );
            }
        }
    }
}
