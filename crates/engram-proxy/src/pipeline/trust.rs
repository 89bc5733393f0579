//! Who vouches for the identity a proxied request names (`identity.trust`), checked before
//! anything else of the request is read:
//!
//! - `headers`: nobody; the `x-engram-*` headers (and the body's `user`) are taken as sent. For
//!   a sidecar, whose only client is the app beside it on loopback.
//! - `client_keys`: the client's `Authorization: Bearer <key>` is one of engram's client keys
//!   (`ENGRAM_CLIENT_KEYS`, `ENGRAM_CLIENT_KEYS_FILE`: `tenant=key` pairs), and the key's tenant
//!   is the request's. Every proxied request needs one: it spends engram's upstream key.
//! - `signed`: `x-engram-identity: v1:<tenant>:<user>:<expiry>:<signature>`, minted by a
//!   trusted backend with the secret in `ENGRAM_IDENTITY_SECRET` (or `_FILE`), names tenant and
//!   user. `<expiry>` is Unix seconds, the last second the identity is good for;
//!   `<signature>` is the lowercase hex HMAC-SHA256 of everything before its `:`. The
//!   separator `:` is never part of an id ([`checked_id`]).
//!
//! An identity header that names another tenant or user than the vouched one is a 403, never
//! silently overridden: the client has a bug or is probing.

use http::HeaderMap;
use ring::hmac;

use super::identity::{
    TENANT_HEADER, USER_HEADER, checked_id, header, hex_bytes, hex_of, named_tenant, user_header,
};
use crate::credentials::{TenantTokens, bearer_token, secret_from_env};
use crate::error::Error;

pub const IDENTITY_HEADER: &str = "x-engram-identity";
pub const CLIENT_KEYS_ENV: &str = "ENGRAM_CLIENT_KEYS";
pub const CLIENT_KEYS_FILE_ENV: &str = "ENGRAM_CLIENT_KEYS_FILE";
pub const IDENTITY_SECRET_ENV: &str = "ENGRAM_IDENTITY_SECRET";
pub const IDENTITY_SECRET_FILE_ENV: &str = "ENGRAM_IDENTITY_SECRET_FILE";
/// HMAC-SHA256 keys shorter than its output are guessable sooner than the MAC is.
pub const MIN_SECRET_BYTES: usize = 32;
const TOKEN_VERSION: &str = "v1";

/// `identity.trust`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trust {
    /// The identity headers as sent (a sidecar on loopback).
    #[default]
    Headers,
    /// A client key per tenant in `Authorization`.
    ClientKeys,
    /// A signed `x-engram-identity`.
    Signed,
}

/// What the gate established about a request's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vouched {
    /// `headers` mode: the identity headers name whom they like.
    Headers,
    /// A client key's tenant; the user and session still come from the request.
    Tenant(String),
    /// A signed identity: tenant and user.
    User { tenant: String, user: String },
    /// `signed` mode without an identity: no user, so no memory.
    Nobody,
}

/// The credentials of `identity.trust`, loaded at start.
pub struct Gate {
    trust: Trust,
    client_keys: TenantTokens,
    secret: Option<hmac::Key>,
    /// `upstream.api_key_env` is set: an unauthenticated request would spend engram's key.
    holds_upstream_key: bool,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Gate")
            .field("trust", &self.trust)
            .field("client_keys", &self.client_keys)
            .field("secret", &self.secret.as_ref().map(|_| "*****"))
            .finish()
    }
}

impl Gate {
    /// `headers` mode, which needs no credentials (tests, embedding).
    pub fn headers() -> Gate {
        Gate {
            trust: Trust::Headers,
            client_keys: TenantTokens::default(),
            secret: None,
            holds_upstream_key: false,
        }
    }

    /// Loads what `trust` needs from the environment. A mode without its credentials, or
    /// credentials for a mode not chosen (an operator who set keys but not the mode would
    /// believe the proxy locked), is a start-up error. Client keys may not be admin tokens.
    pub fn from_env(
        trust: Trust,
        holds_upstream_key: bool,
        admin_tokens: &[&str],
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Gate, Error> {
        let client_keys =
            TenantTokens::from_env(&var, CLIENT_KEYS_ENV, CLIENT_KEYS_FILE_ENV, admin_tokens)?;
        let secret = secret_from_env(&var, IDENTITY_SECRET_ENV, IDENTITY_SECRET_FILE_ENV)?;
        let unused = |variable: &str, mode: &str| Error::Config {
            path: "identity.trust".into(),
            message: format!(
                "{variable} is set but identity.trust is not {mode}; set identity.trust: {mode} \
                 (ENGRAM_IDENTITY__TRUST={mode}) or remove the variable"
            ),
        };
        let missing = |what: &str| Error::Config {
            path: "identity.trust".into(),
            message: what.to_owned(),
        };
        match trust {
            Trust::ClientKeys if client_keys.is_empty() => {
                return Err(missing(&format!(
                    "client_keys needs at least one tenant=key pair in {CLIENT_KEYS_ENV} or \
                     {CLIENT_KEYS_FILE_ENV}"
                )));
            }
            Trust::Signed if secret.is_none() => {
                return Err(missing(&format!(
                    "signed needs the signing secret in {IDENTITY_SECRET_ENV} or \
                     {IDENTITY_SECRET_FILE_ENV}"
                )));
            }
            _ => {}
        }
        if trust != Trust::ClientKeys && !client_keys.is_empty() {
            return Err(unused(CLIENT_KEYS_ENV, "client_keys"));
        }
        if trust != Trust::Signed && secret.is_some() {
            return Err(unused(IDENTITY_SECRET_ENV, "signed"));
        }
        let secret = match secret {
            Some(secret) if secret.len() < MIN_SECRET_BYTES => {
                return Err(Error::Config {
                    path: IDENTITY_SECRET_ENV.into(),
                    message: format!(
                        "the secret must be at least {MIN_SECRET_BYTES} bytes (e.g. `openssl \
                         rand -hex 32`)"
                    ),
                });
            }
            Some(secret) => Some(hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes())),
            None => None,
        };
        Ok(Gate {
            trust,
            client_keys,
            secret,
            holds_upstream_key,
        })
    }

    /// Checks a proxied request's credentials against the identity headers it sends; `now` is
    /// Unix seconds. A missing or bad credential is a 401, a header that names another tenant
    /// or user than the credential's is a 403.
    pub fn check(&self, headers: &HeaderMap, now: u64) -> Result<Vouched, Error> {
        match self.trust {
            Trust::Headers => Ok(Vouched::Headers),
            Trust::ClientKeys => self.check_client_key(headers),
            Trust::Signed => self.check_signed(headers, now),
        }
    }

    fn check_client_key(&self, headers: &HeaderMap) -> Result<Vouched, Error> {
        let Some(key) = bearer_token(headers) else {
            return Err(Error::InvalidApiKey(
                "You didn't provide an API key. You need to provide your engram client key in \
                 an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                    .into(),
            ));
        };
        let Some(tenant) = self.client_keys.tenant_of(key) else {
            // The key is never echoed: it may be a real key sent to the wrong place.
            return Err(Error::InvalidApiKey(
                "Incorrect API key provided. Use an engram client key of your tenant.".into(),
            ));
        };
        if let Some(named) = named_tenant(headers)?
            && named != tenant
        {
            return Err(other_identity(TENANT_HEADER, "tenant", "client key"));
        }
        Ok(Vouched::Tenant(tenant.to_owned()))
    }

    fn check_signed(&self, headers: &HeaderMap, now: u64) -> Result<Vouched, Error> {
        let Some(secret) = &self.secret else {
            return Err(Error::Internal("signed mode without a secret".into()));
        };
        let Some(token) = header(headers, IDENTITY_HEADER)? else {
            if self.holds_upstream_key {
                return Err(Error::InvalidIdentity(format!(
                    "This proxy requires a signed `{IDENTITY_HEADER}` header on every request."
                )));
            }
            // An unsigned claim is refused rather than ignored: ignored, the client would
            // believe its memory in use.
            for name in [USER_HEADER, TENANT_HEADER] {
                if headers.contains_key(name) {
                    return Err(Error::InvalidIdentity(format!(
                        "`{name}` needs a signed `{IDENTITY_HEADER}` header on this proxy."
                    )));
                }
            }
            return Ok(Vouched::Nobody);
        };
        let (tenant, user) = verify(secret, token, now).map_err(|why| {
            Error::InvalidIdentity(format!("Invalid `{IDENTITY_HEADER}`: {why}."))
        })?;
        if named_tenant(headers)?.is_some_and(|named| named != tenant) {
            return Err(other_identity(TENANT_HEADER, "tenant", "signed identity"));
        }
        if user_header(headers)?.is_some_and(|named| named != user) {
            return Err(other_identity(USER_HEADER, "user", "signed identity"));
        }
        Ok(Vouched::User { tenant, user })
    }
}

fn other_identity(header: &str, what: &str, credential: &str) -> Error {
    Error::Forbidden(format!(
        "`{header}` names another {what} than your {credential} is for."
    ))
}

/// A signed identity for `tenant` and `user`, good until `expiry` (Unix seconds, inclusive).
pub fn sign(secret: &hmac::Key, tenant: &str, user: &str, expiry: u64) -> String {
    let signed = format!("{TOKEN_VERSION}:{tenant}:{user}:{expiry}");
    let tag = hmac::sign(secret, signed.as_bytes());
    format!("{signed}:{}", hex_of(tag.as_ref()))
}

/// The tenant and user of a signed identity that is well formed, signed with `secret` and not
/// past its expiry at `now`; else why not. The signature is checked before anything else is
/// believed, in constant time.
pub fn verify(secret: &hmac::Key, token: &str, now: u64) -> Result<(String, String), &'static str> {
    const FORM: &str = "it must be v1:<tenant>:<user>:<expiry>:<signature>";
    let Some((signed, signature)) = token.rsplit_once(':') else {
        return Err(FORM);
    };
    let signature = hex_bytes(signature).ok_or(FORM)?;
    hmac::verify(secret, signed.as_bytes(), &signature).map_err(|_| "the signature is wrong")?;
    let mut fields = signed.split(':');
    let (Some(TOKEN_VERSION), Some(tenant), Some(user), Some(expiry), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return Err(FORM);
    };
    let expiry: u64 = expiry.parse().map_err(|_| FORM)?;
    if now > expiry {
        return Err("it has expired");
    }
    let tenant = checked_id("tenant", tenant).map_err(|_| "its tenant is not an id")?;
    let user = checked_id("user", user).map_err(|_| "its user is not an id")?;
    Ok((tenant, user))
}

/// Unix seconds now, for [`Gate::check`].
pub fn unix_now() -> u64 {
    engram_runtime::now_micros() / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::credentials::env_of;
    use http::HeaderValue;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";
    const NOW: u64 = 1_767_225_600;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    fn key() -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, SECRET.as_bytes())
    }

    fn keys_gate() -> Gate {
        let env = env_of(&[(CLIENT_KEYS_ENV, "acme=k-acme,globex=k-globex")]);
        Gate::from_env(Trust::ClientKeys, true, &[], env).unwrap()
    }

    fn signed_gate(holds_upstream_key: bool) -> Gate {
        let env = env_of(&[(IDENTITY_SECRET_ENV, SECRET)]);
        Gate::from_env(Trust::Signed, holds_upstream_key, &[], env).unwrap()
    }

    fn status(result: Result<Vouched, Error>) -> u16 {
        result.unwrap_err().status_code().as_u16()
    }

    #[test]
    fn a_signed_identity_round_trips_until_it_expires() {
        let token = sign(&key(), "acme", "jane.doe@example.com", NOW);
        assert!(token.starts_with("v1:acme:jane.doe@example.com:1767225600:"));
        assert_eq!(
            verify(&key(), &token, NOW),
            Ok(("acme".into(), "jane.doe@example.com".into()))
        );
        assert_eq!(verify(&key(), &token, NOW + 1), Err("it has expired"));
    }

    #[test]
    fn the_signature_is_the_documented_hmac() {
        // From `printf %s "v1:acme:jane:1767225600" | openssl dgst -sha256 -hmac "$SECRET"`.
        assert_eq!(
            sign(&key(), "acme", "jane", NOW),
            "v1:acme:jane:1767225600:\
             085f3c852584c2c8a6f013855caf20d4be6e122d3fcc09d03149918d019e5550"
        );
    }

    #[test]
    fn a_tampered_or_malformed_identity_is_refused() {
        let token = sign(&key(), "acme", "jane", NOW);
        let other_key = hmac::Key::new(hmac::HMAC_SHA256, b"another secret of thirty-two bytes");
        assert_eq!(
            verify(&other_key, &token, NOW),
            Err("the signature is wrong")
        );
        for tampered in [
            token.replace("acme", "acmf"),
            token.replace(":jane:", ":john:"),
            token.replace("1767225600", "1767225601"),
            token.replace("v1:", "v2:"),
        ] {
            assert_eq!(
                verify(&key(), &tampered, NOW),
                Err("the signature is wrong")
            );
        }
        for malformed in ["", "acme", "v1:acme:jane:1:zz", "v1:acme:jane:1:abc"] {
            assert!(verify(&key(), malformed, NOW).is_err(), "{malformed:?}");
        }
        // Well signed, badly formed: still refused.
        for (tenant, user) in [("a:b", "jane"), ("acme", ""), ("{x}", "jane")] {
            let token = sign(&key(), tenant, user, NOW);
            assert!(verify(&key(), &token, NOW).is_err(), "{token}");
        }
        let token = format!(
            "{}:{}",
            "v1:acme:jane:soon",
            sign(&key(), "x", "y", 0).rsplit(':').next().unwrap()
        );
        assert!(verify(&key(), &token, NOW).is_err());
    }

    #[test]
    fn client_keys_name_the_tenant_and_allow_no_other() {
        let gate = keys_gate();
        assert_eq!(status(gate.check(&HeaderMap::new(), NOW)), 401);
        let unknown = headers(&[("authorization", "Bearer k-nope")]);
        assert_eq!(status(gate.check(&unknown, NOW)), 401);
        let acme = headers(&[("authorization", "Bearer k-acme")]);
        assert_eq!(
            gate.check(&acme, NOW).unwrap(),
            Vouched::Tenant("acme".into())
        );
        let same = headers(&[("authorization", "Bearer k-acme"), (TENANT_HEADER, "acme")]);
        assert_eq!(
            gate.check(&same, NOW).unwrap(),
            Vouched::Tenant("acme".into())
        );
        let other = headers(&[
            ("authorization", "Bearer k-acme"),
            (TENANT_HEADER, "globex"),
        ]);
        assert_eq!(status(gate.check(&other, NOW)), 403);
        // A user header is the tenant's business.
        let user = headers(&[("authorization", "Bearer k-globex"), (USER_HEADER, "x")]);
        assert_eq!(
            gate.check(&user, NOW).unwrap(),
            Vouched::Tenant("globex".into())
        );
        let error = gate.check(&unknown, NOW).unwrap_err();
        assert!(!error.to_string().contains("k-nope"), "{error}");
        assert_eq!(error.error_type(), "invalid_api_key");
    }

    #[test]
    fn a_signed_identity_names_tenant_and_user_and_allows_no_other() {
        let gate = signed_gate(false);
        let token = sign(&key(), "acme", "jane", NOW);
        let with = |extra: &[(&str, &str)]| {
            let mut pairs = vec![(IDENTITY_HEADER, token.as_str())];
            pairs.extend_from_slice(extra);
            gate.check(&headers(&pairs), NOW)
        };
        let jane = Vouched::User {
            tenant: "acme".into(),
            user: "jane".into(),
        };
        assert_eq!(with(&[]).unwrap(), jane);
        assert_eq!(
            with(&[(TENANT_HEADER, "acme"), (USER_HEADER, "jane")]).unwrap(),
            jane
        );
        assert_eq!(status(with(&[(TENANT_HEADER, "globex")])), 403);
        assert_eq!(status(with(&[(USER_HEADER, "john")])), 403);
        let expired = headers(&[(IDENTITY_HEADER, &token)]);
        assert_eq!(status(gate.check(&expired, NOW + 1)), 401);
        let twice = headers(&[(IDENTITY_HEADER, &token), (IDENTITY_HEADER, &token)]);
        assert_eq!(status(gate.check(&twice, NOW)), 400);
    }

    #[test]
    fn without_a_signed_identity_there_is_no_user_and_no_unsigned_claim() {
        let gate = signed_gate(false);
        assert_eq!(gate.check(&HeaderMap::new(), NOW).unwrap(), Vouched::Nobody);
        for name in [USER_HEADER, TENANT_HEADER] {
            assert_eq!(status(gate.check(&headers(&[(name, "jane")]), NOW)), 401);
        }
        // Holding engram's upstream key, the proxy serves only signed requests.
        let gate = signed_gate(true);
        assert_eq!(status(gate.check(&HeaderMap::new(), NOW)), 401);
    }

    #[test]
    fn credentials_must_match_the_mode() {
        let check = |trust, pairs: &[(&str, &str)], needle: &str| {
            let error = Gate::from_env(trust, true, &["admin-token"], env_of(pairs)).unwrap_err();
            assert!(error.to_string().contains(needle), "{error}");
            assert!(!error.to_string().contains(SECRET), "{error}");
        };
        check(Trust::ClientKeys, &[], CLIENT_KEYS_ENV);
        check(Trust::Signed, &[], IDENTITY_SECRET_ENV);
        check(Trust::Signed, &[(IDENTITY_SECRET_ENV, "short")], "32 bytes");
        check(Trust::Headers, &[(CLIENT_KEYS_ENV, "a=k")], "client_keys");
        check(Trust::Headers, &[(IDENTITY_SECRET_ENV, SECRET)], "signed");
        check(
            Trust::Signed,
            &[(IDENTITY_SECRET_ENV, SECRET), (CLIENT_KEYS_ENV, "a=k")],
            "client_keys",
        );
        check(
            Trust::ClientKeys,
            &[(CLIENT_KEYS_ENV, "a=admin-token")],
            "in use",
        );
        let gate = Gate::from_env(Trust::Headers, false, &[], env_of(&[])).unwrap();
        assert_eq!(
            gate.check(&HeaderMap::new(), NOW).unwrap(),
            Vouched::Headers
        );
        let shown = format!("{:?}", signed_gate(true));
        assert!(!shown.contains(SECRET), "{shown}");
    }
}
