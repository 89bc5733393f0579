//! Who may call the management API: a global admin token (every tenant) and per-tenant tokens
//! (one tenant each), all from the environment, so a Kubernetes Secret can hold them as env
//! vars or as a mounted file.
//!
//! - `ENGRAM_ADMIN_TOKEN`: the global token.
//! - `ENGRAM_ADMIN_TENANT_TOKENS`: `tenant=token` pairs separated by commas or newlines.
//! - `ENGRAM_ADMIN_TENANT_TOKENS_FILE`: a file of the same pairs, one per line (`#` starts a
//!   comment), e.g. a Secret mounted as a volume.
//!
//! Tokens are compared in constant time and never logged ([`engram_proxy::credentials`]).

use http::HeaderMap;

use crate::error::Error;
use engram_proxy::credentials::{TenantTokens, bearer_token, same};

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
    tenants: TenantTokens,
}

impl std::fmt::Debug for AdminAuth {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("AdminAuth")
            .field("global", &self.global.as_ref().map(|_| "*****"))
            .field("tenants", &self.tenants)
            .finish()
    }
}

impl AdminAuth {
    /// Only the global token (tests, embedding).
    pub fn global(token: impl Into<String>) -> AdminAuth {
        let token = token.into();
        AdminAuth {
            global: (!token.is_empty()).then_some(token),
            tenants: TenantTokens::default(),
        }
    }

    /// Reads the tokens from the environment (`var` looks a variable up); a malformed pair, a
    /// tenant named twice or a token shared by two scopes is a start-up error.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<AdminAuth, Error> {
        let global = var(TOKEN_ENV)
            .filter(|token| !token.trim().is_empty())
            .map(|token| token.trim().to_owned());
        let taken: Vec<&str> = global.as_deref().into_iter().collect();
        let tenants =
            TenantTokens::from_env(&var, TENANT_TOKENS_ENV, TENANT_TOKENS_FILE_ENV, &taken)?;
        Ok(AdminAuth { global, tenants })
    }

    /// Whether any token is configured (without one the API is off).
    pub fn is_enabled(&self) -> bool {
        self.global.is_some() || !self.tenants.is_empty()
    }

    /// Every token, so the chat path's client keys can be kept apart from them.
    pub fn tokens(&self) -> Vec<&str> {
        let mut tokens: Vec<&str> = self.global.as_deref().into_iter().collect();
        tokens.extend(self.tenants.tokens());
        tokens
    }

    /// What the request's bearer token may reach; `None` for a missing or unknown token.
    pub fn access(&self, headers: &HeaderMap) -> Option<Access> {
        let given = bearer_token(headers)?;
        // Both tables are searched whichever matches, so timing tells nothing about which.
        let global = self
            .global
            .as_ref()
            .is_some_and(|global| same(given.as_bytes(), global.as_bytes()));
        let tenant = self.tenants.tenant_of(given);
        if global {
            return Some(Access::All);
        }
        tenant.map(|tenant| Access::Tenant(tenant.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_proxy::credentials::env_of as env;
    use http::header;

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
