//! Who may call the management API: a global admin token (every tenant) and per-tenant tokens
//! (one tenant each), all from the environment, so a Kubernetes Secret can hold them as env
//! vars or as a mounted file.
//!
//! - `ENGRAM_ADMIN_TOKEN`: the global token.
//! - `ENGRAM_ADMIN_TENANT_TOKENS`: `tenant=token` pairs separated by commas or newlines.
//! - `ENGRAM_ADMIN_TENANT_TOKENS_FILE`: a file of the same pairs, one per line (`#` starts a
//!   comment), e.g. a Secret mounted as a volume.
//!
//! Tokens are compared in constant time (for equal lengths), every token on every request, and
//! never logged: errors about them name the variable and the line, not the value.

use http::{HeaderMap, header};

use crate::error::Error;
use crate::pipeline::identity::checked_id;

pub const TOKEN_ENV: &str = "ENGRAM_ADMIN_TOKEN";
pub const TENANT_TOKENS_ENV: &str = "ENGRAM_ADMIN_TENANT_TOKENS";
pub const TENANT_TOKENS_FILE_ENV: &str = "ENGRAM_ADMIN_TENANT_TOKENS_FILE";

/// What a presented token may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// The global token: every tenant, and the process-wide routes (queue).
    All,
    /// A tenant's token: that tenant's users only.
    Tenant(String),
}

#[derive(Clone, Default, PartialEq, Eq)]
pub struct AdminAuth {
    global: Option<String>,
    /// `(tenant, token)`, each tenant and each token once.
    tenants: Vec<(String, String)>,
}

impl std::fmt::Debug for AdminAuth {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenants: Vec<&str> = self
            .tenants
            .iter()
            .map(|(tenant, _)| tenant.as_str())
            .collect();
        formatter
            .debug_struct("AdminAuth")
            .field("global", &self.global.as_ref().map(|_| "*****"))
            .field("tenants", &tenants)
            .finish()
    }
}

impl AdminAuth {
    /// Only the global token (tests, embedding).
    pub fn global(token: impl Into<String>) -> AdminAuth {
        let token = token.into();
        AdminAuth {
            global: (!token.is_empty()).then_some(token),
            tenants: Vec::new(),
        }
    }

    /// Reads the tokens from the environment (`var` looks a variable up); a malformed pair, a
    /// tenant named twice or a token shared by two scopes is a start-up error.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<AdminAuth, Error> {
        let global = var(TOKEN_ENV).filter(|token| !token.trim().is_empty());
        let mut auth = AdminAuth {
            global: global.map(|token| token.trim().to_owned()),
            tenants: Vec::new(),
        };
        if let Some(pairs) = var(TENANT_TOKENS_ENV) {
            auth.add_pairs(TENANT_TOKENS_ENV, &pairs.replace(',', "\n"))?;
        }
        if let Some(path) = var(TENANT_TOKENS_FILE_ENV).filter(|path| !path.is_empty()) {
            let text = std::fs::read_to_string(&path).map_err(|error| Error::Config {
                path: TENANT_TOKENS_FILE_ENV.into(),
                message: format!("cannot read {path}: {error}"),
            })?;
            auth.add_pairs(TENANT_TOKENS_FILE_ENV, &text)?;
        }
        Ok(auth)
    }

    fn add_pairs(&mut self, source: &str, text: &str) -> Result<(), Error> {
        let bad = |line: usize, message: &str| Error::Config {
            path: source.to_owned(),
            message: format!("entry {line}: {message}"),
        };
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let number = number + 1;
            let Some((tenant, token)) = line.split_once('=') else {
                return Err(bad(number, "expected tenant=token"));
            };
            let (tenant, token) = (tenant.trim(), token.trim());
            let tenant = checked_id("tenant", tenant).map_err(|_| {
                bad(
                    number,
                    "the tenant must be 1-128 of letters, digits and . _ - @ +",
                )
            })?;
            if token.is_empty() {
                return Err(bad(number, "the token is empty"));
            }
            if self.tenants.iter().any(|(known, _)| *known == tenant) {
                return Err(bad(number, &format!("tenant {tenant} has a token already")));
            }
            if self.global.as_deref() == Some(token)
                || self.tenants.iter().any(|(_, known)| known == token)
            {
                return Err(bad(
                    number,
                    "this token is already in use (every token must name one scope)",
                ));
            }
            self.tenants.push((tenant, token.to_owned()));
        }
        Ok(())
    }

    /// Whether any token is configured (without one the API is off).
    pub fn is_enabled(&self) -> bool {
        self.global.is_some() || !self.tenants.is_empty()
    }

    /// What the request's bearer token may reach; `None` for a missing or unknown token.
    pub fn access(&self, headers: &HeaderMap) -> Option<Access> {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(bearer_token)?
            .as_bytes();
        // Every token is compared, whichever matches, so timing tells nothing about which.
        let mut access = None;
        if let Some(global) = &self.global
            && same(given, global.as_bytes())
        {
            access = Some(Access::All);
        }
        for (tenant, token) in &self.tenants {
            if same(given, token.as_bytes()) && access.is_none() {
                access = Some(Access::Tenant(tenant.clone()));
            }
        }
        access
    }
}

/// The token of `Bearer <token>`. The scheme is case-insensitive (RFC 7235 §2.1), so `bearer`
/// and `BEARER` are accepted too; spaces around the token are not part of it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Constant time for equal lengths.
fn same(given: &[u8], token: &[u8]) -> bool {
    given.len() == token.len()
        && given
            .iter()
            .zip(token)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
        }
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        headers
    }

    #[test]
    fn tokens_must_match_exactly() {
        let auth = AdminAuth::global("secret");
        assert_eq!(auth.access(&HeaderMap::new()), None);
        assert_eq!(auth.access(&bearer("secret")), Some(Access::All));
        assert_eq!(auth.access(&bearer("secret2")), None);
        assert_eq!(auth.access(&bearer("secreT")), None);
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, "Basic secret".parse().unwrap());
        assert_eq!(auth.access(&basic), None);
        assert!(!AdminAuth::global("").is_enabled());
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_is_not() {
        let auth = AdminAuth::global("secret");
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            auth.access(&headers)
        };
        for value in [
            "bearer secret",
            "BEARER secret",
            "BeArEr secret",
            "Bearer   secret ",
        ] {
            assert_eq!(with(value), Some(Access::All), "{value:?}");
        }
        for value in [
            "bearer SECRET",
            "Bearersecret",
            "Bearer",
            "Bearer ",
            "Bear secret",
        ] {
            assert_eq!(with(value), None, "{value:?}");
        }
    }

    #[test]
    fn tenant_tokens_come_from_the_variable_and_the_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "# tenant tokens\nglobex = g-token\n\n").unwrap();
        let path = file.path().display().to_string();
        let auth = AdminAuth::from_env(env(&[
            (TENANT_TOKENS_ENV, "acme=a-token, initech=i-token"),
            (TENANT_TOKENS_FILE_ENV, &path),
        ]))
        .unwrap();
        assert!(auth.is_enabled());
        assert_eq!(
            auth.access(&bearer("a-token")),
            Some(Access::Tenant("acme".into()))
        );
        assert_eq!(
            auth.access(&bearer("g-token")),
            Some(Access::Tenant("globex".into()))
        );
        assert_eq!(auth.access(&bearer("nope")), None);
        // The debug form never shows a token.
        let shown = format!("{auth:?}");
        assert!(
            !shown.contains("a-token") && !shown.contains("g-token"),
            "{shown}"
        );
        assert!(
            AdminAuth::from_env(env(&[]))
                .map(|auth| !auth.is_enabled())
                .unwrap()
        );
    }

    #[test]
    fn malformed_or_ambiguous_tokens_are_start_up_errors_that_hide_the_token() {
        for (variables, needle) in [
            (vec![(TENANT_TOKENS_ENV, "acme")], "expected tenant=token"),
            (vec![(TENANT_TOKENS_ENV, "acme=")], "empty"),
            (vec![(TENANT_TOKENS_ENV, "a:b=x-secret")], "tenant must be"),
            (
                vec![(TENANT_TOKENS_ENV, "a=x-secret,a=y-secret")],
                "has a token",
            ),
            (vec![(TENANT_TOKENS_ENV, "a=x-secret,b=x-secret")], "in use"),
            (
                vec![(TOKEN_ENV, "x-secret"), (TENANT_TOKENS_ENV, "a=x-secret")],
                "in use",
            ),
            (
                vec![(TENANT_TOKENS_FILE_ENV, "/nonexistent/tokens")],
                "cannot read",
            ),
        ] {
            let error = AdminAuth::from_env(env(&variables))
                .unwrap_err()
                .to_string();
            assert!(error.contains(needle), "{error}");
            assert!(!error.contains("secret"), "{error}");
        }
    }
}
