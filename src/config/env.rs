//! Environment overrides for the few deployment-specific values, read through [`Vars`] so
//! tests never touch the process environment.
//!
//! | variable                 | overrides                                            |
//! |--------------------------|------------------------------------------------------|
//! | `CACHEGUARD_LISTEN`      | `server.listen`                                      |
//! | `CACHEGUARD_UPSTREAM`    | `upstream.url`                                       |
//! | `CACHEGUARD_REDIS_URL`   | `redis.url` (creates `[redis]` with defaults if absent) |
//! | `CACHEGUARD_REDIS_PASSWORD` | `redis.password` (and drops `redis.password_file`) |
//! | `CACHEGUARD_ADMIN_TOKEN` | `admin.token`                                        |
//!
//! Overrides are applied after the file is parsed and before it is validated. An empty
//! value means "no override". Each value is checked here, with the same check as the file's
//! key, and a bad one is reported as `environment: CACHEGUARD_LISTEN: …` (and the file's
//! value is kept); a good one replaces the file's value.

use std::collections::HashMap;

use toml::Spanned;

use super::raw::{NO_SPAN, RawConfig, defaults};
use super::values::{self, ConfigProblem};

/// A source of `CACHEGUARD_*` variables.
pub trait Vars {
    fn get(&self, key: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl Vars for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl Vars for HashMap<String, String> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).cloned()
    }
}

pub(super) const LISTEN: &str = "CACHEGUARD_LISTEN";
pub(super) const UPSTREAM: &str = "CACHEGUARD_UPSTREAM";
pub(super) const REDIS_URL: &str = "CACHEGUARD_REDIS_URL";
pub(super) const ADMIN_TOKEN: &str = "CACHEGUARD_ADMIN_TOKEN";
pub(super) const REDIS_PASSWORD: &str = "CACHEGUARD_REDIS_PASSWORD";

/// Applies every set override to `raw`; bad values go to `problems` instead.
pub(super) fn apply(raw: &mut RawConfig, vars: &dyn Vars, problems: &mut Vec<ConfigProblem>) {
    if let Some(value) = lookup(vars, LISTEN, problems, |v| {
        values::parse_listen(v, defaults::SERVER_LISTEN).map(|_| ())
    }) {
        raw.server.listen = value;
    }
    if let Some(value) = lookup(vars, UPSTREAM, problems, |v| {
        values::parse_upstream_url(v).map(|_| ())
    }) {
        let section = raw
            .upstream
            .get_or_insert_with(|| Spanned::new(NO_SPAN, Default::default()));
        section.get_mut().url = Some(value);
    }
    if let Some(value) = lookup(vars, REDIS_URL, problems, values::check_redis_url) {
        let section = raw
            .redis
            .get_or_insert_with(|| Spanned::new(NO_SPAN, Default::default()));
        section.get_mut().url = Some(value);
    }
    // A password only means something for a Redis the file (or CACHEGUARD_REDIS_URL) sets.
    if let Some(section) = raw.redis.as_mut()
        && let Some(value) = lookup(vars, REDIS_PASSWORD, problems, |_| Ok(()))
    {
        let section = section.get_mut();
        section.password = Some(value);
        section.password_file = None;
    }
    if let Some(value) = lookup(vars, ADMIN_TOKEN, problems, values::check_token) {
        raw.admin.token = Some(value);
    }
}

/// The variable's value if it is set, non-empty and passes `check`.
fn lookup(
    vars: &dyn Vars,
    name: &str,
    problems: &mut Vec<ConfigProblem>,
    check: impl Fn(&str) -> Result<(), String>,
) -> Option<Spanned<String>> {
    let value = vars.get(name).filter(|v| !v.is_empty())?;
    match check(&value) {
        Ok(()) => Some(Spanned::new(NO_SPAN, value)),
        Err(message) => {
            problems.push(ConfigProblem {
                file: "environment".to_owned(),
                line: None,
                key: name.to_owned(),
                message,
            });
            None
        }
    }
}
