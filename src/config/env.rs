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
//!
//! The memory the process may use (for `cache.l1_max_bytes`) is read through [`Memory`] for
//! the same reason: tests pass a fixed figure instead of this machine's.

use std::collections::HashMap;
use std::path::Path;

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

/// The memory this process may use, and where that figure was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MemoryLimit {
    pub(super) bytes: u64,
    /// Shown in messages, e.g. `MemTotal in /proc/meminfo`.
    pub(super) source: String,
}

/// A source of the memory limit.
pub(super) trait Memory {
    /// `None` when nothing could be read: then no limit is checked.
    fn limit(&self) -> Option<MemoryLimit>;
}

/// The real machine: the container's cgroup limit and the machine's memory, whichever is
/// smaller.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SystemMemory;

impl Memory for SystemMemory {
    fn limit(&self) -> Option<MemoryLimit> {
        memory_limit_under(Path::new("/"))
    }
}

/// A fixed figure (tests).
impl Memory for Option<MemoryLimit> {
    fn limit(&self) -> Option<MemoryLimit> {
        self.clone()
    }
}

const CGROUP_V2: &str = "sys/fs/cgroup/memory.max";
const CGROUP_V1: &str = "sys/fs/cgroup/memory/memory.limit_in_bytes";
const MEMINFO: &str = "proc/meminfo";

/// The smaller of the cgroup's memory limit (v2 `memory.max`, where `max` means none; else
/// v1 `memory.limit_in_bytes`) and the machine's `MemTotal`, read under `root`.
pub(super) fn memory_limit_under(root: &Path) -> Option<MemoryLimit> {
    let read = |file: &str| std::fs::read_to_string(root.join(file)).ok();
    let shown = |file: &str| format!("/{file}");
    let cgroup = match read(CGROUP_V2) {
        Some(text) => text.trim().parse::<u64>().ok().map(|bytes| MemoryLimit {
            bytes,
            source: format!("the cgroup limit in {}", shown(CGROUP_V2)),
        }),
        None => read(CGROUP_V1)
            .and_then(|text| text.trim().parse::<u64>().ok())
            .map(|bytes| MemoryLimit {
                bytes,
                source: format!("the cgroup limit in {}", shown(CGROUP_V1)),
            }),
    };
    let total = read(MEMINFO)
        .and_then(|text| mem_total(&text))
        .map(|bytes| MemoryLimit {
            bytes,
            source: format!("MemTotal in {}", shown(MEMINFO)),
        });
    match (cgroup, total) {
        (Some(cgroup), Some(total)) if total.bytes < cgroup.bytes => Some(total),
        (Some(cgroup), _) => Some(cgroup),
        (None, total) => total,
    }
}

/// `MemTotal:  24576000 kB` in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let mut words = line.split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}
