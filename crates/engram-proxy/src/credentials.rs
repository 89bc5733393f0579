//! Secrets that come from the environment, never the config file: tables of per-tenant bearer
//! tokens (the management API's tenant tokens, the chat path's client keys) and single secrets
//! (the identity signing secret), each from a variable or from a file such as a Kubernetes
//! Secret mounted as a volume.
//!
//! Tokens are compared in constant time (for equal lengths), every token on every request, and
//! never logged: errors about them name the variable and the entry, not the value.

use http::{HeaderMap, header};

use crate::error::Error;
use engram_store::checked_id;

/// `(tenant, token)` pairs, each tenant and each token once.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TenantTokens {
    entries: Vec<(String, String)>,
}

impl std::fmt::Debug for TenantTokens {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenants: Vec<&str> = self
            .entries
            .iter()
            .map(|(tenant, _)| tenant.as_str())
            .collect();
        formatter.debug_list().entries(tenants).finish()
    }
}

impl TenantTokens {
    /// Reads `tenant=token` pairs from the variable `list_env` (separated by commas or
    /// newlines) and from the file named by `file_env` (one per line, `#` starts a comment).
    /// A malformed pair, a tenant named twice, or a token that is also one of `taken` or
    /// another tenant's is a start-up error.
    pub fn from_env(
        var: &impl Fn(&str) -> Option<String>,
        list_env: &str,
        file_env: &str,
        taken: &[&str],
    ) -> Result<TenantTokens, Error> {
        let mut tokens = TenantTokens::default();
        if let Some(pairs) = var(list_env) {
            tokens.add_pairs(list_env, &pairs.replace(',', "\n"), taken)?;
        }
        if let Some(text) = read_file_named_by(var, file_env)? {
            tokens.add_pairs(file_env, &text, taken)?;
        }
        Ok(tokens)
    }

    fn add_pairs(&mut self, source: &str, text: &str, taken: &[&str]) -> Result<(), Error> {
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
            if self.entries.iter().any(|(known, _)| *known == tenant) {
                return Err(bad(number, &format!("tenant {tenant} has a token already")));
            }
            if taken.contains(&token) || self.entries.iter().any(|(_, known)| known == token) {
                return Err(bad(
                    number,
                    "this token is already in use (every token must name one scope)",
                ));
            }
            self.entries.push((tenant, token.to_owned()));
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tokens, to keep another table from reusing them.
    pub fn tokens(&self) -> Vec<&str> {
        self.entries
            .iter()
            .map(|(_, token)| token.as_str())
            .collect()
    }

    /// The tenant whose token `given` is. Every token is compared, whichever matches, so timing
    /// tells nothing about which.
    pub fn tenant_of(&self, given: &str) -> Option<&str> {
        let mut found = None;
        for (tenant, token) in &self.entries {
            if same(given.as_bytes(), token.as_bytes()) && found.is_none() {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

/// A secret from the variable `env`, else from the file named by `file_env`, trimmed (a
/// mounted file usually ends with a newline); `None` when neither is set. Both set is an error:
/// which one wins would be a guess.
pub fn secret_from_env(
    var: &impl Fn(&str) -> Option<String>,
    env: &str,
    file_env: &str,
) -> Result<Option<String>, Error> {
    let inline = var(env).filter(|secret| !secret.trim().is_empty());
    let file = read_file_named_by(var, file_env)?;
    match (inline, file) {
        (Some(_), Some(_)) => Err(Error::Config {
            path: env.to_owned(),
            message: format!("set {env} or {file_env}, not both"),
        }),
        (Some(secret), None) | (None, Some(secret)) => Ok(Some(secret.trim().to_owned())),
        (None, None) => Ok(None),
    }
}

fn read_file_named_by(
    var: &impl Fn(&str) -> Option<String>,
    file_env: &str,
) -> Result<Option<String>, Error> {
    let Some(path) = var(file_env).filter(|path| !path.is_empty()) else {
        return Ok(None);
    };
    std::fs::read_to_string(&path)
        .map(Some)
        .map_err(|error| Error::Config {
            path: file_env.to_owned(),
            message: format!("cannot read {path}: {error}"),
        })
}

/// The token of the request's `Authorization: Bearer <token>`. The scheme is case-insensitive
/// (RFC 7235 §2.1), so `bearer` and `BEARER` are accepted too; spaces around the token are not
/// part of it.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Constant time for equal lengths.
pub fn same(given: &[u8], token: &[u8]) -> bool {
    given.len() == token.len()
        && given
            .iter()
            .zip(token)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// A variable lookup over fixed pairs, for tests (of the crates above too: feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = "TEST_TOKENS";
    const FILE: &str = "TEST_TOKENS_FILE";

    #[test]
    fn tokens_come_from_the_variable_and_the_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "# keys\nglobex = g-token\n\n").unwrap();
        let path = file.path().display().to_string();
        let env = env_of(&[(LIST, "acme=a-token, initech=i-token"), (FILE, &path)]);
        let tokens = TenantTokens::from_env(&env, LIST, FILE, &[]).unwrap();
        assert_eq!(tokens.tenant_of("a-token"), Some("acme"));
        assert_eq!(tokens.tenant_of("g-token"), Some("globex"));
        assert_eq!(tokens.tenant_of("a-tokeN"), None);
        assert_eq!(tokens.tenant_of(""), None);
        let shown = format!("{tokens:?}");
        assert!(!shown.contains("token"), "{shown}");
        assert!(
            TenantTokens::from_env(&env_of(&[]), LIST, FILE, &[])
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn malformed_or_shared_tokens_are_errors_that_hide_the_token() {
        for (variables, taken, needle) in [
            (vec![(LIST, "acme")], vec![], "expected tenant=token"),
            (vec![(LIST, "acme=")], vec![], "empty"),
            (vec![(LIST, "a:b=x-secret")], vec![], "tenant must be"),
            (vec![(LIST, "a=x-secret,a=y-secret")], vec![], "has a token"),
            (vec![(LIST, "a=x-secret,b=x-secret")], vec![], "in use"),
            (vec![(LIST, "a=x-secret")], vec!["x-secret"], "in use"),
            (vec![(FILE, "/nonexistent/tokens")], vec![], "cannot read"),
        ] {
            let error = TenantTokens::from_env(&env_of(&variables), LIST, FILE, &taken)
                .unwrap_err()
                .to_string();
            assert!(error.contains(needle), "{error}");
            assert!(!error.contains("secret"), "{error}");
        }
    }

    #[test]
    fn a_secret_comes_from_the_variable_or_the_file_not_both() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "from-file\n").unwrap();
        let path = file.path().display().to_string();
        let read = |pairs: &[(&str, &str)]| secret_from_env(&env_of(pairs), "S", "S_FILE");
        assert_eq!(
            read(&[("S", " inline ")]).unwrap().as_deref(),
            Some("inline")
        );
        assert_eq!(
            read(&[("S_FILE", &path)]).unwrap().as_deref(),
            Some("from-file")
        );
        assert_eq!(read(&[("S", "  ")]).unwrap(), None);
        assert_eq!(read(&[]).unwrap(), None);
        let error = read(&[("S", "x"), ("S_FILE", &path)]).unwrap_err();
        assert!(error.to_string().contains("not both"), "{error}");
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_is_not_empty() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            bearer_token(&headers).map(str::to_owned)
        };
        for value in ["bearer k", "BEARER k", "Bearer   k "] {
            assert_eq!(with(value).as_deref(), Some("k"), "{value:?}");
        }
        for value in ["Bearerk", "Bearer", "Bearer ", "Basic k", "Bear k"] {
            assert_eq!(with(value), None, "{value:?}");
        }
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }
}
