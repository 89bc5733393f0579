//! Who a request's memory belongs to (DESIGN.md §4): tenant, user and session from the
//! `x-engram-*` headers (with the body's `user`/`safety_identifier` as a configurable fallback),
//! within what the request's credential vouches for ([`super::trust`]), the memory mode, and an
//! optional event time for imported turns.
//!
//! Identifiers become parts of storage keys (`engram:{tenant:user}:…`), so they are checked
//! strictly: a value that could break out of its key segment, or carry a header injection, is a
//! 400, never silently rewritten into somebody else's key.

use http::HeaderMap;
use serde::Deserialize;

use super::trust::{Trust, Vouched};
use crate::error::Error;
use engram_memory::openai::ChatRequest;
pub use engram_store::{MAX_ID_LEN, checked_id};

pub const USER_HEADER: &str = "x-engram-user";
pub const SESSION_HEADER: &str = "x-engram-session";
pub const TENANT_HEADER: &str = "x-engram-tenant";
pub const MODE_HEADER: &str = "x-engram-mode";
pub const EVENT_TIME_HEADER: &str = "x-engram-event-time";

/// How far past this process's clock an `x-engram-event-time` may lie: room for clocks that
/// disagree and for time zones written wrongly, no more. A later one is a 400: stored, it
/// would date a turn in the future, after everything the user says until then.
pub const EVENT_TIME_MAX_AHEAD_SECONDS: i64 = 24 * 60 * 60;
/// The session of a user who sends no `x-engram-session`.
pub const DEFAULT_SESSION: &str = "default";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityConfig {
    /// Tenant of requests without `x-engram-tenant`.
    pub default_tenant: String,
    /// Use the body's `user` (or `safety_identifier`) when `x-engram-user` is absent.
    pub user_from_body: bool,
    /// Who vouches for the identity a request names (see [`super::trust`]).
    pub trust: Trust,
    /// Let `trust: headers` serve on an address other than loopback, for a network where only
    /// trusted clients reach it.
    pub allow_headers_off_loopback: bool,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            default_tenant: "default".to_owned(),
            user_from_body: true,
            trust: Trust::Headers,
            allow_headers_off_loopback: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Read memory, inject it, and record the exchange.
    #[default]
    Normal,
    /// Inject memory but record nothing (evaluation probes, background jobs).
    ReadOnly,
    /// Bypass memory for this request.
    Off,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub user: String,
    pub session: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestIdentity {
    /// `None` when the request names no user: it passes through without memory.
    pub identity: Option<Identity>,
    pub mode: Mode,
    /// A validated RFC 3339 timestamp for an imported turn.
    pub event_time: Option<String>,
}

impl RequestIdentity {
    /// Whether memory is read for this request.
    pub fn reads_memory(&self) -> bool {
        self.identity.is_some() && self.mode != Mode::Off
    }

    /// Whether the exchange is recorded.
    pub fn records(&self) -> bool {
        self.identity.is_some() && self.mode == Mode::Normal
    }
}

/// Resolves the identity of a chat request within what its credential vouches for; a malformed
/// identity header is a 400.
pub fn resolve(
    headers: &HeaderMap,
    vouched: &Vouched,
    request: &ChatRequest,
    config: &IdentityConfig,
) -> Result<RequestIdentity, Error> {
    let mode = match header(headers, MODE_HEADER)? {
        None => Mode::Normal,
        Some(value) => match value.to_ascii_lowercase().as_str() {
            "on" | "normal" => Mode::Normal,
            "read-only" | "readonly" => Mode::ReadOnly,
            "off" => Mode::Off,
            _ => {
                return Err(bad_header(
                    MODE_HEADER,
                    "must be `off`, `read-only` or `normal`",
                ));
            }
        },
    };
    let (tenant, user) = tenant_and_user(headers, vouched, Some(request), config)?;
    let session = match header(headers, SESSION_HEADER)? {
        Some(session) => checked_id(SESSION_HEADER, session)?,
        None => DEFAULT_SESSION.to_owned(),
    };
    let event_time = match header(headers, EVENT_TIME_HEADER)? {
        Some(time) => {
            let now = i64::try_from(engram_runtime::now_micros() / 1_000_000).unwrap_or(i64::MAX);
            Some(checked_event_time(time, now)?)
        }
        None => None,
    };
    Ok(RequestIdentity {
        identity: user.map(|user| Identity {
            tenant,
            user,
            session,
        }),
        mode,
        event_time,
    })
}

/// The tenant of a request and the user it names, if any: what the credential vouches for,
/// else `x-engram-tenant` (or `identity.default_tenant`) and `x-engram-user`, else (if allowed,
/// for a chat request) the body's `user`. A signed identity is the only source of its user.
pub fn tenant_and_user(
    headers: &HeaderMap,
    vouched: &Vouched,
    request: Option<&ChatRequest>,
    config: &IdentityConfig,
) -> Result<(String, Option<String>), Error> {
    let named_user = || -> Result<Option<String>, Error> {
        match (user_header(headers)?, request) {
            (Some(user), _) => Ok(Some(user)),
            (None, Some(request)) if config.user_from_body => {
                Ok(request.end_user().and_then(body_user_id))
            }
            (None, _) => Ok(None),
        }
    };
    Ok(match vouched {
        Vouched::Headers => (
            named_tenant(headers)?.unwrap_or_else(|| config.default_tenant.clone()),
            named_user()?,
        ),
        Vouched::Tenant(tenant) => (tenant.clone(), named_user()?),
        Vouched::User { tenant, user } => (tenant.clone(), Some(user.clone())),
        Vouched::Nobody => (config.default_tenant.clone(), None),
    })
}

/// The user `x-engram-user` names, if it is sent; sent twice, or not an id, it is a 400.
pub fn user_header(headers: &HeaderMap) -> Result<Option<String>, Error> {
    header(headers, USER_HEADER)?
        .map(|user| checked_id(USER_HEADER, user))
        .transpose()
}

/// Prefix of the user ids made from body `user` values that are not ids already.
pub const ENCODED_USER_PREFIX: &str = "enc+";

/// The user id of OpenAI's body `user` (or `safety_identifier`), which may be any string: an
/// app that already sets it must not get a 400 for swapping its base URL. Empty names no user.
/// A value that is an id already ([`checked_id`]) is used as it is; any other, and an id that
/// begins with [`ENCODED_USER_PREFIX`], becomes that prefix and the value's bytes in hex (up to
/// 62 bytes; a longer one, a 128-bit hash of it), so two different values never share a
/// memory and every result is a valid id the management API can address.
pub fn body_user_id(value: &str) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    if !value.starts_with(ENCODED_USER_PREFIX) && checked_id("user", value).is_ok() {
        return Some(value.to_owned());
    }
    let encoded = if value.len() <= (MAX_ID_LEN - ENCODED_USER_PREFIX.len()) / 2 {
        hex_of(value.as_bytes())
    } else {
        let hash =
            crate::recorder::ids::job_key(&engram_store::UserKey::new("body-user", value), "", "");
        format!("h{hash}")
    };
    Some(format!("{ENCODED_USER_PREFIX}{encoded}"))
}

/// The body `user` value a [`body_user_id`] id was made from, when it is the value's bytes in
/// hex (not a hash of a long one) and they are text.
pub fn body_user_of(id: &str) -> Option<String> {
    let hex = id.strip_prefix(ENCODED_USER_PREFIX)?;
    if hex.starts_with('h') {
        return None;
    }
    String::from_utf8(hex_bytes(hex)?).ok()
}

/// `bytes` as lowercase hex digit pairs, what [`hex_bytes`] reads back.
pub fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The bytes of a string of hex digit pairs; `None` for anything else.
pub fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(hex.get(at..at + 2)?, 16).ok())
        .collect()
}

/// The user a management route names: an id as it is (an `enc+` id included), or else a body
/// `user` value as an app sent it, found under the id [`body_user_id`] gave it.
pub fn admin_user_id(segment: &str) -> Result<String, Error> {
    match checked_id("user", segment) {
        Ok(id) => Ok(id),
        Err(error) => body_user_id(segment).ok_or(error),
    }
}

/// The tenant `x-engram-tenant` names, if it is sent (and not empty); sent twice, or not an
/// id, it is a 400. The chat path and the management API read it by this one rule.
pub fn named_tenant(headers: &HeaderMap) -> Result<Option<String>, Error> {
    header(headers, TENANT_HEADER)?
        .map(|tenant| checked_id(TENANT_HEADER, tenant))
        .transpose()
}

/// The one value of an identity header, trimmed; `None` when absent or empty. Sent twice, or
/// not visible ASCII, it is a 400.
pub fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<Option<&'a str>, Error> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(bad_header(name, "must be sent once"));
    }
    let value = value
        .to_str()
        .map_err(|_| bad_header(name, "must be visible ASCII"))?
        .trim();
    Ok((!value.is_empty()).then_some(value))
}

fn bad_header(name: &str, rule: &str) -> Error {
    Error::invalid_request(format!("Invalid `{name}`: it {rule}."), Some(name))
}

/// An `x-engram-event-time` value: an RFC 3339 timestamp from the Unix epoch (1970, UTC) to
/// at most [`EVENT_TIME_MAX_AHEAD_SECONDS`] past `now` (seconds since the epoch). Older
/// times, an import's, are accepted; one before 1970 cannot be a chat turn and has no
/// place in the microsecond clock turns are ordered by.
fn checked_event_time(text: &str, now: i64) -> Result<String, Error> {
    let Some(seconds) = rfc3339_seconds(text) else {
        return Err(bad_header(
            EVENT_TIME_HEADER,
            "must be an RFC 3339 timestamp such as 2023-05-08T13:56:00Z",
        ));
    };
    if seconds < 0 {
        return Err(bad_header(
            EVENT_TIME_HEADER,
            "must not be before 1970-01-01T00:00:00Z",
        ));
    }
    if seconds > now.saturating_add(EVENT_TIME_MAX_AHEAD_SECONDS) {
        return Err(bad_header(
            EVENT_TIME_HEADER,
            "must not be more than a day ahead of the server's clock (it dates a turn that \
             has happened, such as an imported one)",
        ));
    }
    Ok(text.to_owned())
}

/// `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`, with calendar-plausible fields.
pub fn is_rfc3339(text: &str) -> bool {
    rfc3339_seconds(text).is_some()
}

/// The seconds since the Unix epoch (negative before 1970) of an RFC 3339 timestamp
/// ([`is_rfc3339`]'s form), its offset applied and its fraction dropped.
fn rfc3339_seconds(text: &str) -> Option<i64> {
    let bytes = text.as_bytes();
    if bytes.len() < 20 {
        return None;
    }
    let digits = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = text.get(range)?;
        part.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| part.parse().ok())
            .flatten()
    };
    let separators_ok = bytes[4] == b'-'
        && bytes[7] == b'-'
        && matches!(bytes[10], b'T' | b't' | b' ')
        && bytes[13] == b':'
        && bytes[16] == b':';
    let (Some(year), Some(month), Some(day), Some(hour), Some(minute), Some(second)) = (
        digits(0..4),
        digits(5..7),
        digits(8..10),
        digits(11..13),
        digits(14..16),
        digits(17..19),
    ) else {
        return None;
    };
    if !separators_ok
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut rest = &text[19..];
    if let Some(fraction) = rest.strip_prefix('.') {
        let digits_len = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if digits_len == 0 {
            return None;
        }
        rest = &fraction[digits_len..];
    }
    let offset_minutes = match rest.as_bytes() {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2]
            if [h1, h2, m1, m2].iter().all(|b| b.is_ascii_digit()) =>
        {
            let hours = i64::from((*h1 - b'0') * 10 + (*h2 - b'0'));
            let minutes = i64::from((*m1 - b'0') * 10 + (*m2 - b'0'));
            if hours > 23 || minutes > 59 {
                return None;
            }
            let offset = hours * 60 + minutes;
            if *sign == b'-' { -offset } else { offset }
        }
        _ => return None,
    };
    let local = days_from_civil(i64::from(year), month, day) * 86_400
        + i64::from(hour * 3_600 + minute * 60 + second);
    Some(local - offset_minutes * 60)
}

/// Days from 1970-01-01 to a proleptic Gregorian date (H. Hinnant's `days_from_civil`). A
/// day past its month's end counts on into the next month.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month = i64::from(month);
    let day_of_year =
        (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// `headers` mode: the identity as sent.
    fn resolve(
        headers: &HeaderMap,
        request: &ChatRequest,
        config: &IdentityConfig,
    ) -> Result<RequestIdentity, Error> {
        super::resolve(headers, &Vouched::Headers, request, config)
    }

    fn request(body: serde_json::Value) -> ChatRequest {
        ChatRequest::from_slice(body.to_string().as_bytes()).unwrap()
    }

    fn plain() -> ChatRequest {
        request(serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn headers_name_tenant_user_and_session() {
        let resolved = resolve(
            &headers(&[
                (USER_HEADER, "alice@example.com"),
                (TENANT_HEADER, "acme"),
                (SESSION_HEADER, "s-1"),
            ]),
            &plain(),
            &IdentityConfig::default(),
        )
        .unwrap();
        assert_eq!(
            resolved.identity,
            Some(Identity {
                tenant: "acme".into(),
                user: "alice@example.com".into(),
                session: "s-1".into(),
            })
        );
        assert!(resolved.reads_memory() && resolved.records());
    }

    #[test]
    fn a_vouched_identity_bounds_what_the_request_may_name() {
        let body = request(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "bob"
        }));
        let config = IdentityConfig::default();
        let who = |vouched: Vouched, pairs: &[(&'static str, &str)]| {
            super::resolve(&headers(pairs), &vouched, &body, &config)
                .unwrap()
                .identity
                .map(|identity| (identity.tenant, identity.user))
        };
        let pair = |tenant: &str, user: &str| Some((tenant.to_owned(), user.to_owned()));
        // A client key's tenant, not the default; the user from the header or the body.
        let acme = || Vouched::Tenant("acme".into());
        assert_eq!(who(acme(), &[]), pair("acme", "bob"));
        assert_eq!(who(acme(), &[(USER_HEADER, "jane")]), pair("acme", "jane"));
        // A signed identity's user, never the body's.
        let signed = Vouched::User {
            tenant: "acme".into(),
            user: "jane".into(),
        };
        assert_eq!(who(signed, &[]), pair("acme", "jane"));
        // Nothing signed: no user, whatever the body says.
        assert_eq!(who(Vouched::Nobody, &[]), None);
        let (tenant, user) =
            tenant_and_user(&HeaderMap::new(), &Vouched::Nobody, Some(&body), &config).unwrap();
        assert_eq!((tenant.as_str(), user), ("default", None));
    }

    #[test]
    fn any_body_user_maps_to_an_id_of_its_own() {
        let cases = [
            "bob",
            "user:123",
            "a b",
            "josé",
            "enc+626f62",
            ".",
            "..",
            "x".repeat(500).as_str(),
        ]
        .map(str::to_owned);
        let mut ids = std::collections::HashSet::new();
        for value in &cases {
            let id = body_user_id(value).unwrap();
            assert!(checked_id("user", &id).is_ok(), "{value:?} -> {id:?}");
            assert!(ids.insert(id), "{value:?} shares an id");
        }
        assert_eq!(body_user_id("bob").as_deref(), Some("bob"));
        assert_eq!(body_user_id("a b").as_deref(), Some("enc+612062"));
        assert_eq!(body_user_id(""), None);
        // The prefix cannot be forged: "enc+612062" sent as such is encoded again.
        assert_ne!(body_user_id("enc+612062").as_deref(), Some("enc+612062"));
    }

    #[test]
    fn the_management_api_finds_a_body_user_by_its_value_and_reads_it_back() {
        for value in ["user:123", "a b", "josé@example.com", "enc+626f62"] {
            let id = body_user_id(value).unwrap();
            assert_eq!(body_user_of(&id).as_deref(), Some(value));
            if checked_id("user", value).is_err() {
                // The value as the app sent it names the same memory as its id.
                assert_eq!(admin_user_id(value).unwrap(), id);
            }
            assert_eq!(admin_user_id(&id).unwrap(), id);
        }
        assert_eq!(admin_user_id("bob").unwrap(), "bob");
        assert!(admin_user_id("").is_err());
        // A long value is a hash: found by its value, not read back.
        let long = "x".repeat(500);
        let id = body_user_id(&long).unwrap();
        assert_eq!(admin_user_id(&long).unwrap(), id);
        assert_eq!(body_user_of(&id), None);
        assert_eq!(body_user_of("bob"), None);
    }

    #[test]
    fn defaults_and_body_fallback() {
        let body = request(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "bob"
        }));
        let config = IdentityConfig::default();
        let resolved = resolve(&HeaderMap::new(), &body, &config).unwrap();
        let identity = resolved.identity.unwrap();
        assert_eq!(
            (identity.tenant.as_str(), identity.user.as_str()),
            ("default", "bob")
        );
        assert_eq!(identity.session, DEFAULT_SESSION);

        let config = IdentityConfig {
            user_from_body: false,
            ..config
        };
        let resolved = resolve(&HeaderMap::new(), &body, &config).unwrap();
        assert!(resolved.identity.is_none());
        assert!(!resolved.reads_memory() && !resolved.records());
    }

    #[test]
    fn modes() {
        let config = IdentityConfig::default();
        let read_only = resolve(
            &headers(&[(USER_HEADER, "u"), (MODE_HEADER, "read-only")]),
            &plain(),
            &config,
        )
        .unwrap();
        assert!(read_only.reads_memory() && !read_only.records());
        let off = resolve(
            &headers(&[(USER_HEADER, "u"), (MODE_HEADER, "OFF")]),
            &plain(),
            &config,
        )
        .unwrap();
        assert!(!off.reads_memory() && !off.records());
        assert!(resolve(&headers(&[(MODE_HEADER, "maybe")]), &plain(), &config).is_err());
    }

    #[test]
    fn ids_that_could_escape_their_key_are_rejected() {
        let config = IdentityConfig::default();
        for bad in [
            "a:b",
            "{x}",
            "a b",
            "../etc",
            "a\tb",
            &"x".repeat(129),
            "é",
            ".",
            "..",
        ] {
            let error = checked_id(USER_HEADER, bad).unwrap_err();
            assert_eq!(error.status_code(), 400, "{bad:?}");
        }
        for good in ["a.b", "...x", "jane.doe+tag@example.com", &"x".repeat(128)] {
            assert_eq!(checked_id(USER_HEADER, good).unwrap(), good);
        }
        // Header values that are not visible ASCII never reach the check.
        let mut map = HeaderMap::new();
        map.insert(USER_HEADER, HeaderValue::from_bytes(b"al\xffice").unwrap());
        assert!(resolve(&map, &plain(), &config).is_err());
        // Two values for one identity header are ambiguous, for the management API too.
        let twice = headers(&[(USER_HEADER, "a"), (USER_HEADER, "b")]);
        assert!(resolve(&twice, &plain(), &config).is_err());
        let twice = headers(&[(TENANT_HEADER, "a"), (TENANT_HEADER, "a")]);
        assert_eq!(named_tenant(&twice).unwrap_err().status_code(), 400);
        let once = headers(&[(TENANT_HEADER, "a")]);
        assert_eq!(named_tenant(&once).unwrap().as_deref(), Some("a"));
        assert_eq!(named_tenant(&HeaderMap::new()).unwrap(), None);
        // A body user with a separator reaches no other key: it is encoded into an id.
        let body = request(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}], "user": "eve:alice"
        }));
        let resolved = resolve(&HeaderMap::new(), &body, &config).unwrap();
        let user = resolved.identity.unwrap().user;
        assert_eq!(user, "enc+6576653a616c696365");
        assert!(checked_id("user", &user).is_ok());
    }

    #[test]
    fn event_times_must_be_rfc3339() {
        for good in [
            "2023-05-08T13:56:00Z",
            "2023-05-08T13:56:00.123+02:00",
            "2023-05-08t13:56:00-05:30",
        ] {
            assert!(is_rfc3339(good), "{good}");
        }
        for bad in [
            "1:56 pm on 8 May, 2023",
            "2023-13-08T13:56:00Z",
            "2023-05-08T24:00:00Z",
            "2023-05-08T13:56:00",
            "2023-05-08T13:56:00.Z",
            "2023-05-08T13:56:00+2:00",
            "",
        ] {
            assert!(!is_rfc3339(bad), "{bad}");
        }
        let error = resolve(
            &headers(&[(USER_HEADER, "u"), (EVENT_TIME_HEADER, "yesterday")]),
            &plain(),
            &IdentityConfig::default(),
        )
        .unwrap_err();
        assert_eq!(error.status_code(), 400);
    }

    #[test]
    fn event_times_are_read_as_seconds_since_the_epoch() {
        for (text, seconds) in [
            ("1970-01-01T00:00:00Z", 0),
            ("2023-05-08T13:56:00Z", 1_683_554_160),
            ("2023-05-08T15:56:00.999+02:00", 1_683_554_160),
            ("2023-05-08T08:26:00-05:30", 1_683_554_160),
            ("2000-02-29T00:00:00Z", 951_782_400),
            ("2024-03-01T00:00:00z", 1_709_251_200),
            ("1969-12-31T23:59:59Z", -1),
            ("0001-01-01T00:00:00Z", -62_135_596_800),
            ("9999-12-31T00:00:00Z", 253_402_214_400),
        ] {
            assert_eq!(rfc3339_seconds(text), Some(seconds), "{text}");
        }
    }

    #[test]
    fn event_times_run_from_1970_to_a_day_ahead() {
        // 2023-05-08T13:56:00Z.
        let now = 1_683_554_160;
        assert_eq!(EVENT_TIME_MAX_AHEAD_SECONDS, 86_400);
        for ok in [
            "2023-05-08T13:56:00Z",
            "2023-05-09T13:56:00Z",
            "2023-05-09T15:56:00+02:00",
            "1983-05-08T13:56:00Z",
            "1970-01-01T00:00:00Z",
            "1970-01-01T01:00:00+01:00",
        ] {
            assert_eq!(checked_event_time(ok, now).unwrap(), ok);
        }
        for early in [
            "1969-12-31T23:59:59Z",
            "1970-01-01T00:59:59+01:00",
            "1066-10-14T09:00:00Z",
            "0000-01-01T00:00:00Z",
        ] {
            let error = checked_event_time(early, now).unwrap_err();
            assert_eq!(error.status_code(), 400, "{early}");
            assert!(error.to_string().contains("1970"), "{error}");
        }
        for late in [
            "2023-05-09T13:56:01Z",
            "2023-05-09T15:56:01+02:00",
            "2023-05-09T09:00:00-05:00",
            "2024-05-08T13:56:00Z",
        ] {
            let error = checked_event_time(late, now).unwrap_err();
            assert_eq!(error.status_code(), 400, "{late}");
        }
        // Against this process's clock.
        let error = resolve(
            &headers(&[
                (USER_HEADER, "u"),
                (EVENT_TIME_HEADER, "9999-12-31T00:00:00Z"),
            ]),
            &plain(),
            &IdentityConfig::default(),
        )
        .unwrap_err();
        assert_eq!(error.status_code(), 400);
        assert!(error.to_string().contains(EVENT_TIME_HEADER), "{error}");
        assert!(error.to_string().contains("ahead"), "{error}");
    }
}
