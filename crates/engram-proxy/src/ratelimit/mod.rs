//! Rate limits, on governor's keyed GCRA limiters: requests per tenant (and optionally per user)
//! on the hot path, and summarizer tokens per tenant in the worker. Everything is in this
//! process: with N replicas a tenant gets N times the configured rate.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use prometheus::IntCounter;
use serde::Deserialize;

use crate::error::Error;

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitConfig {
    /// Requests per second one tenant may send (chat and pass-through); 0 turns it off.
    pub tenant_requests_per_second: u32,
    /// Requests a tenant may send at once above its steady rate; 0 means one second's worth.
    pub tenant_burst: u32,
    /// Requests per second one user of a tenant may send (chat requests that name a user);
    /// 0 turns it off.
    pub user_requests_per_second: u32,
    /// Like `tenant_burst`, per user.
    pub user_burst: u32,
    /// Summarizer tokens one tenant may spend per minute (the request's estimated input tokens
    /// are charged before the call); 0 turns it off. Over budget, the worker falls back to the
    /// heuristic extractor and retries the model later.
    pub tenant_summarizer_tokens_per_minute: u32,
}

/// How often idle keys are dropped from the limiters, so arbitrary tenant or user ids cannot
/// grow them without bound.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// The request limits of the hot path; `None` from [`RequestLimits::from_config`] when off.
pub struct RequestLimits {
    tenant: Option<DefaultKeyedRateLimiter<String>>,
    /// Keyed by (tenant, user): the same user id in two tenants is two users.
    user: Option<DefaultKeyedRateLimiter<(String, String)>>,
    clock: DefaultClock,
}

/// Which limit turned a request away (the `kind` of the rejection metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Tenant,
    User,
}

impl RequestLimits {
    pub fn from_config(config: &RateLimitConfig) -> Option<RequestLimits> {
        let tenant = per_second(config.tenant_requests_per_second, config.tenant_burst)
            .map(RateLimiter::keyed);
        let user =
            per_second(config.user_requests_per_second, config.user_burst).map(RateLimiter::keyed);
        (tenant.is_some() || user.is_some()).then(|| RequestLimits {
            tenant,
            user,
            clock: DefaultClock::default(),
        })
    }

    /// Admits one request of `tenant` (and `user`, when it names one), or says how long to wait.
    /// The user limit is checked first so a user over their own limit does not spend the
    /// tenant's allowance.
    pub fn check(&self, tenant: &str, user: Option<&str>) -> Result<(), (Scope, Error)> {
        if let (Some(limiter), Some(user)) = (&self.user, user) {
            limiter
                .check_key(&(tenant.to_owned(), user.to_owned()))
                .map_err(|not_until| {
                    (
                        Scope::User,
                        rejected(not_until.wait_time_from(self.clock.now())),
                    )
                })?;
        }
        if let Some(limiter) = &self.tenant {
            limiter.check_key(&tenant.to_owned()).map_err(|not_until| {
                (
                    Scope::Tenant,
                    rejected(not_until.wait_time_from(self.clock.now())),
                )
            })?;
        }
        Ok(())
    }

    /// Forgets keys whose limiter is back to full; run every [`PRUNE_INTERVAL`].
    pub fn prune(&self) {
        if let Some(limiter) = &self.tenant {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        if let Some(limiter) = &self.user {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }

    /// Keys currently tracked (tenants + users), for tests of the pruning.
    pub fn tracked_keys(&self) -> usize {
        self.tenant.as_ref().map_or(0, |limiter| limiter.len())
            + self.user.as_ref().map_or(0, |limiter| limiter.len())
    }
}

/// The per-tenant summarizer token budget; `None` from `from_config` when off.
pub struct TokenBudget {
    limiter: DefaultKeyedRateLimiter<String>,
    rejections: Option<RateLimitMetrics>,
}

impl TokenBudget {
    pub fn from_config(config: &RateLimitConfig) -> Option<TokenBudget> {
        let per_minute = NonZeroU32::new(config.tenant_summarizer_tokens_per_minute)?;
        Some(TokenBudget {
            limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            rejections: None,
        })
    }

    /// Counts refusals in `engram_rate_limited_total{kind="summarizer_tokens"}`.
    pub fn with_metrics(mut self, rejections: RateLimitMetrics) -> TokenBudget {
        self.rejections = Some(rejections);
        self
    }

    /// Spends `tokens` of `tenant`'s budget; false (nothing spent) when the budget cannot
    /// cover them now — or ever, for a request larger than a whole minute's budget.
    pub fn spend(&self, tenant: &str, tokens: u32) -> bool {
        let Some(tokens) = NonZeroU32::new(tokens) else {
            return true;
        };
        let spent = matches!(
            self.limiter.check_key_n(&tenant.to_owned(), tokens),
            Ok(Ok(()))
        );
        if !spent && let Some(rejections) = &self.rejections {
            rejections.rejected(RateLimitKind::SummarizerTokens);
        }
        spent
    }

    pub fn prune(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

fn per_second(rate: u32, burst: u32) -> Option<Quota> {
    let rate = NonZeroU32::new(rate)?;
    let burst = NonZeroU32::new(burst).unwrap_or(rate);
    Some(Quota::per_second(rate).allow_burst(burst))
}

/// A 429 whose `retry-after` (whole seconds, at least 1) covers the wait.
fn rejected(wait: Duration) -> Error {
    let retry_after_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    Error::RateLimited {
        retry_after_secs: retry_after_secs.max(1),
    }
}

/// Why a request or a summarizer call was turned away by engram's own rate limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitKind {
    /// The per-tenant (or per-user) request rate.
    Requests,
    /// The per-tenant summarizer token budget.
    SummarizerTokens,
}

impl RateLimitKind {
    pub const ALL: [RateLimitKind; 2] = [RateLimitKind::Requests, RateLimitKind::SummarizerTokens];

    pub fn as_str(self) -> &'static str {
        match self {
            RateLimitKind::Requests => "requests",
            RateLimitKind::SummarizerTokens => "summarizer_tokens",
        }
    }
}

/// `engram_rate_limited_total{kind}`; cheap to clone into whatever enforces a limit.
#[derive(Clone)]
pub struct RateLimitMetrics {
    rejected: [IntCounter; 2],
}

impl RateLimitMetrics {
    /// Counts into `rejected`, one counter per [`RateLimitKind`] in its order.
    pub fn new(rejected: [IntCounter; 2]) -> RateLimitMetrics {
        RateLimitMetrics { rejected }
    }

    /// Counts one rejection (a 429 to a client, or a summarizer call not made).
    pub fn rejected(&self, kind: RateLimitKind) {
        self.rejected[kind as usize].inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tenant: u32, user: u32) -> RateLimitConfig {
        RateLimitConfig {
            tenant_requests_per_second: tenant,
            user_requests_per_second: user,
            ..RateLimitConfig::default()
        }
    }

    #[test]
    fn off_by_default() {
        assert!(RequestLimits::from_config(&RateLimitConfig::default()).is_none());
        assert!(TokenBudget::from_config(&RateLimitConfig::default()).is_none());
    }

    #[test]
    fn a_tenant_burst_is_cut_at_its_limit_and_other_tenants_pass() {
        let limits = RequestLimits::from_config(&config(3, 0)).unwrap();
        for _ in 0..3 {
            limits.check("a", None).unwrap();
        }
        let (scope, error) = limits.check("a", Some("u")).unwrap_err();
        assert_eq!(scope, Scope::Tenant);
        assert!(matches!(
            error,
            Error::RateLimited {
                retry_after_secs: 1
            }
        ));
        limits.check("b", None).unwrap();
    }

    #[test]
    fn a_user_over_their_limit_does_not_spend_the_tenants_allowance() {
        let limits = RequestLimits::from_config(&RateLimitConfig {
            tenant_requests_per_second: 4,
            user_requests_per_second: 1,
            ..RateLimitConfig::default()
        })
        .unwrap();
        limits.check("t", Some("alice")).unwrap();
        for _ in 0..5 {
            assert_eq!(limits.check("t", Some("alice")).unwrap_err().0, Scope::User);
        }
        // Alice's rejections left the tenant three of its four.
        for user in ["bob", "carol", "dave"] {
            limits.check("t", Some(user)).unwrap();
        }
        assert_eq!(
            limits.check("t", Some("erin")).unwrap_err().0,
            Scope::Tenant
        );
        // The same user id in another tenant is another user.
        limits.check("other", Some("alice")).unwrap();
    }

    #[test]
    fn burst_defaults_to_the_rate_and_can_be_raised() {
        let limits = RequestLimits::from_config(&RateLimitConfig {
            tenant_requests_per_second: 1,
            tenant_burst: 5,
            ..RateLimitConfig::default()
        })
        .unwrap();
        for _ in 0..5 {
            limits.check("t", None).unwrap();
        }
        assert!(limits.check("t", None).is_err());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (wait, secs) in [
            (Duration::ZERO, 1),
            (Duration::from_millis(1), 1),
            (Duration::from_secs(2), 2),
            (Duration::from_millis(2001), 3),
        ] {
            assert!(
                matches!(rejected(wait), Error::RateLimited { retry_after_secs } if retry_after_secs == secs),
                "{wait:?}"
            );
        }
    }

    #[test]
    fn pruning_drops_keys_that_are_back_to_full() {
        let limits = RequestLimits::from_config(&config(1000, 1000)).unwrap();
        limits.check("t", Some("u")).unwrap();
        assert_eq!(limits.tracked_keys(), 2);
        std::thread::sleep(Duration::from_millis(5));
        limits.prune();
        assert_eq!(limits.tracked_keys(), 0);
    }

    #[test]
    fn the_token_budget_is_per_tenant_and_refuses_what_it_cannot_cover() {
        let budget = TokenBudget::from_config(&RateLimitConfig {
            tenant_summarizer_tokens_per_minute: 1000,
            ..RateLimitConfig::default()
        })
        .unwrap();
        assert!(budget.spend("a", 600));
        assert!(!budget.spend("a", 600));
        assert!(budget.spend("a", 400));
        assert!(budget.spend("b", 1000));
        assert!(!budget.spend("c", 1001), "more than a minute's budget");
        assert!(budget.spend("a", 0));
    }
}
