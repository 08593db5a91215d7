//! Unit tests of config loading: the documented example, defaults, every kind of error
//! message (with its exact `file:line: key:` prefix), environment overrides and query
//! policies. The binary's `--check-config` is tested in `tests/it/config_errors.rs`.

use std::collections::HashMap;
use std::time::Duration;

use http::Method;

use super::{
    AccessLogConfig, AccessLogFormat, AccessLogPath, Config, ConfigError, L1Policy, L1WhileBusDown,
    OnTimeout, QueryPolicy,
};

const EXAMPLE: &str = include_str!("../../config/cacheguard.toml");
const EMBEDDED: &str = include_str!("../../config/embedded.toml");

/// The smallest valid file.
const MINIMAL: &str = "[upstream]\nurl = \"http://127.0.0.1:9000\"\n";

fn no_env() -> HashMap<String, String> {
    HashMap::new()
}

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn load(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, "test.toml", &no_env())
}

fn problems_with(text: &str, vars: &HashMap<String, String>) -> Vec<String> {
    match Config::from_toml(text, "test.toml", vars) {
        Ok(_) => panic!("expected errors for:\n{text}"),
        Err(error) => error.problems.iter().map(ToString::to_string).collect(),
    }
}

fn problems(text: &str) -> Vec<String> {
    problems_with(text, &no_env())
}

/// The single problem reported for `text`.
fn problem(text: &str) -> String {
    let mut all = problems(text);
    assert_eq!(all.len(), 1, "expected exactly one problem, got {all:#?}");
    all.remove(0)
}

/// `MINIMAL` followed by `rest`; `rest` starts on line 3.
fn with_minimal(rest: &str) -> String {
    format!("{MINIMAL}{rest}")
}

// === the documented examples ===

#[test]
fn example_file_parses_with_the_documented_values() {
    let config = Config::from_toml(EXAMPLE, "config/cacheguard.toml", &no_env()).unwrap();
    assert_eq!(config.source, "config/cacheguard.toml");

    assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(config.server.max_header_bytes, 16384);
    assert_eq!(config.server.max_headers, 100);
    assert_eq!(config.server.max_body_bytes, 10_485_760);
    assert_eq!(config.server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(config.server.keepalive_timeout, Duration::from_secs(75));
    assert_eq!(config.server.lingering_time, Duration::from_secs(30));
    assert_eq!(config.server.lingering_timeout, Duration::from_secs(5));
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(10));

    assert_eq!(config.upstream.url, "http://127.0.0.1:9000");
    assert_eq!(config.upstream.timeout, Duration::from_secs(10));
    assert_eq!(config.upstream.connect_timeout, Duration::from_secs(2));
    assert_eq!(config.upstream.max_concurrency, 256);
    assert_eq!(config.upstream.max_rps, 0);
    assert_eq!(config.upstream.queue_timeout, Duration::from_millis(100));
    assert_eq!(config.upstream.pool_max_idle, 64);
    assert_eq!(config.upstream.upload_timeout, Duration::from_secs(10));
    assert_eq!(config.upstream.upload_min_rate, 500);
    assert_eq!(config.upstream.upload_deadline, Duration::from_secs(300));
    assert_eq!(config.server.body_buffer_bytes, 65536);
    assert_eq!(
        config.upstream.pool_idle_timeout,
        Duration::from_secs(4),
        "below the 5 s keep-alive of Node.js, Apache httpd and uvicorn"
    );

    let redis = config
        .redis
        .as_ref()
        .expect("the example runs in shared mode");
    assert_eq!(redis.url, "redis://127.0.0.1:6379");
    assert_eq!(redis.command_timeout, Duration::from_millis(50));
    assert_eq!(redis.connect_timeout, Duration::from_secs(1));
    assert_eq!(redis.key_prefix, "cg:");
    assert_eq!(redis.breaker_failures, 3);

    assert_eq!(config.admin.listen, "127.0.0.1:9091".parse().unwrap());
    assert_eq!(config.admin.token, None);
    assert_eq!(
        (config.admin.purge_rate, config.admin.purge_burst),
        (10, 20)
    );

    assert_eq!(config.cache.ttl, Duration::from_secs(60));
    assert_eq!(config.cache.jitter, 0.2);
    assert_eq!(config.cache.grace, Duration::from_secs(30));
    assert_eq!(config.cache.negative_ttl, Duration::from_secs(10));
    assert_eq!(config.cache.max_entry_bytes, 1_048_576);
    assert_eq!(config.cache.l1_max_bytes, 268_435_456);
    assert_eq!(config.cache.l1, L1Policy::Hot);
    assert_eq!(config.cache.l1_while_bus_down, L1WhileBusDown::Bypass);

    assert_eq!(config.lock.lease, Duration::from_secs(5));
    assert_eq!(config.lock.wait_timeout, Duration::from_secs(3));
    assert_eq!(config.lock.on_timeout, OnTimeout::Origin);

    let [item, write, create, buy, seat_update] = config.routes.as_slice() else {
        panic!("expected five routes, got {:#?}", config.routes);
    };
    assert_eq!(item.name, "item");
    assert_eq!(item.pattern, "/api/items/{id}");
    assert_eq!(item.methods, [Method::GET]);
    assert!(item.is_read());
    assert_eq!(item.ttl, Duration::from_secs(300));
    assert_eq!(item.jitter, 0.2, "inherited from [cache]");
    assert_eq!(
        item.grace,
        Duration::from_secs(30),
        "inherited from [cache]"
    );
    assert_eq!(item.query, QueryPolicy::Sorted);
    assert_eq!(item.vary, ["accept-language"]);
    assert!(item.invalidate.is_empty());

    assert_eq!(write.name, "item-write");
    assert_eq!(write.methods, [Method::PUT, Method::PATCH, Method::DELETE]);
    assert!(!write.is_read());
    assert_eq!(write.invalidate, ["/api/items/{id}"]);
    assert_eq!(write.double_delete_delay, Duration::from_secs(1));

    let [items] = config.bloom.as_slice() else {
        panic!("expected one filter, got {:#?}", config.bloom);
    };
    assert_eq!(
        (items.name.as_str(), items.expected_items, items.fp_rate),
        ("items", 1_000_000, 0.001)
    );
    assert_eq!(items.refresh, Duration::from_secs(600));
    assert_eq!(item.bloom.as_ref().map(|b| b.param.as_str()), Some("id"));
    assert_eq!(
        config.access_log,
        AccessLogConfig {
            format: AccessLogFormat::Off,
            path: AccessLogPath::Stdout,
            sample: 1.0,
            query: false,
            buffer: 8192,
        }
    );
    let warmup = item.warmup.as_ref().expect("the item route warms up");
    assert_eq!((warmup.paths.len(), warmup.rate), (3, 10));
    assert_eq!(create.methods, [Method::POST]);
    assert_eq!(
        create.bloom_add.as_ref().map(|b| &b.from),
        Some(&super::AddFrom::Location)
    );
    let [seats] = config.stock.as_slice() else {
        panic!("expected one stock gate, got {:#?}", config.stock);
    };
    assert_eq!(seats.key, "/trains/{train}/seats/{type}");
    assert_eq!(
        buy.stock.as_ref().map(|s| (s.gate.as_str(), s.units)),
        Some(("seats", 1))
    );
    let serialize = seat_update
        .serialize
        .as_ref()
        .expect("the seat-update route is serialized");
    assert_eq!(serialize.key, "/trains/{train}/seats/{seat}");
    assert_eq!(
        (
            serialize.lease,
            serialize.wait_timeout,
            serialize.max_waiters,
            serialize.retry_after
        ),
        (
            Duration::from_secs(5),
            Duration::from_secs(2),
            256,
            Duration::from_secs(1)
        ),
        "the documented defaults"
    );
    assert_eq!(
        serialize
            .fence_header
            .as_ref()
            .map(http::HeaderName::as_str),
        Some("fencing-token")
    );
    assert_eq!(serialize.on_redis_error, super::OnRedisError::Reject);
}

#[test]
fn example_file_documents_every_key() {
    // Every key the loader knows appears in the example, so the example cannot fall behind.
    let keys = [
        "listen",
        "max_header_bytes",
        "max_headers",
        "max_body_bytes",
        "header_read_timeout",
        "keepalive_timeout",
        "lingering_time",
        "lingering_timeout",
        "shutdown_grace",
        "url",
        "timeout",
        "connect_timeout",
        "max_concurrency",
        "max_rps",
        "queue_timeout",
        "max_buffered_bytes",
        "upload_timeout",
        "upload_min_rate",
        "upload_deadline",
        "body_buffer_bytes",
        "body_spool_dir",
        "pool_max_idle",
        "pool_idle_timeout",
        "freshness",
        "heuristic",
        "command_timeout",
        "key_prefix",
        "breaker_failures",
        "token",
        "purge_rate",
        "purge_burst",
        "ttl",
        "jitter",
        "grace",
        "negative_ttl",
        "max_entry_bytes",
        "l1_max_bytes",
        "l1",
        "lease",
        "wait_timeout",
        "on_timeout",
        "name",
        "match",
        "methods",
        "query",
        "vary",
        "forward_client_headers",
        "invalidate",
        "double_delete_delay",
        "expected_items",
        "fp_rate",
        "source",
        "format",
        "field",
        "refresh",
        "load_timeout",
        "bloom",
        "param",
        "status",
        "body",
        "bloom_add",
        "from",
        "warmup",
        "paths",
        "rate",
        "threshold_rps",
        "cool_rps",
        "window",
        "l1_ttl",
        "max_backend_rps_per_key",
        "max_hot_keys",
        "[access_log]",
        "sample",
        "buffer",
        "[[stock]]",
        "key",
        "json",
        "reconcile",
        "reservation_ttl",
        "sold_out",
        "content_type",
        "not_sold",
        "origin_sold_out",
        "on_redis_error",
        "idempotency_header",
        "idempotency_ttl",
        "in_doubt_retry",
        "segments",
        "stock",
        "gate",
        "units",
        "serialize",
        "fence_header",
        "max_waiters",
        "retry_after",
        "lock",
        "version",
        "version_floor_ttl",
    ];
    for key in keys {
        assert!(
            EXAMPLE.contains(key),
            "config/cacheguard.toml does not mention {key}"
        );
    }
}

#[test]
fn embedded_example_has_no_redis() {
    let config = Config::from_toml(EMBEDDED, "config/embedded.toml", &no_env()).unwrap();
    assert!(config.redis.is_none());
    assert_eq!(config.cache.ttl, Duration::from_secs(30));
    assert_eq!(config.routes.len(), 2);
}

#[test]
fn defaults_apply_to_a_minimal_file() {
    let config = load(MINIMAL).unwrap();
    assert_eq!(config.source, "test.toml");
    assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(config.server.max_header_bytes, 16384);
    assert_eq!(config.server.max_headers, 100, "hyper's default");
    assert_eq!(config.server.max_body_bytes, 10 * 1024 * 1024);
    assert_eq!(config.server.body_buffer_bytes, 64 * 1024);
    assert_eq!(config.server.body_spool_dir, std::env::temp_dir());
    assert_eq!(config.upstream.upload_min_rate, 500);
    assert_eq!(config.upstream.upload_deadline, Duration::from_secs(300));
    assert_eq!(config.upstream.max_concurrency, 256);
    assert_eq!(config.upstream.queue_timeout, Duration::from_millis(100));
    assert!(config.redis.is_none(), "no [redis] = embedded mode");
    assert_eq!(config.admin.listen, "127.0.0.1:9091".parse().unwrap());
    assert_eq!(
        (config.admin.purge_rate, config.admin.purge_burst),
        (10, 20)
    );
    assert_eq!(config.cache.jitter, 0.2);
    assert_eq!(config.cache.l1, L1Policy::Hot);
    assert_eq!(config.cache.l1_while_bus_down, L1WhileBusDown::Bypass);
    assert_eq!(config.lock.on_timeout, OnTimeout::Origin);
    assert!(config.routes.is_empty());
}

#[test]
fn redis_section_takes_defaults() {
    let config = load(&with_minimal("[redis]\nurl = \"unix:///run/redis.sock\"\n")).unwrap();
    let redis = config.redis.unwrap();
    assert_eq!(redis.url, "unix:///run/redis.sock");
    assert_eq!(redis.command_timeout, Duration::from_millis(50));
    assert_eq!(redis.connect_timeout, Duration::from_secs(1));
    assert_eq!(redis.key_prefix, "cg:");
    assert_eq!(redis.breaker_failures, 3);
}

#[test]
fn route_defaults_and_overrides() {
    let config = load(&with_minimal(
        "[cache]\nttl = \"2m\"\nl1 = \"all\"\n\n\
         [[routes]]\nname = \"plain\"\nmatch = \"/a/{id}\"\n\n\
         [[routes]]\nname = \"tuned\"\nmatch = \"/b/{*rest}\"\nmethods = [\"get\", \"HEAD\"]\n\
         ttl = \"250ms\"\njitter = 0.0\ngrace = \"0s\"\nnegative_ttl = \"1s\"\n\
         max_entry_bytes = 10\nl1 = \"off\"\nvary = [\"X-Tenant\", \"accept\", \"x-tenant\"]\n",
    ))
    .unwrap();
    let [plain, tuned] = config.routes.as_slice() else {
        panic!("two routes expected");
    };
    assert_eq!(plain.methods, [Method::GET]);
    assert_eq!(plain.ttl, Duration::from_secs(120));
    assert_eq!(plain.l1, L1Policy::All);
    assert_eq!(plain.jitter, 0.2);
    assert_eq!(plain.double_delete_delay, Duration::from_secs(1));
    assert!(plain.vary.is_empty());

    assert_eq!(tuned.methods, [Method::GET, Method::HEAD], "uppercased");
    assert_eq!(tuned.ttl, Duration::from_millis(250));
    assert_eq!(tuned.jitter, 0.0);
    assert_eq!(tuned.grace, Duration::ZERO);
    assert_eq!(tuned.negative_ttl, Duration::from_secs(1));
    assert_eq!(tuned.max_entry_bytes, 10);
    assert_eq!(tuned.l1, L1Policy::Off);
    assert_eq!(
        tuned.vary,
        ["accept", "x-tenant"],
        "lowercased, sorted, deduplicated"
    );
}

#[test]
fn query_policy_variants() {
    let route = |query: &str| {
        let text = with_minimal(&format!(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\n{query}\n"
        ));
        load(&text).unwrap().routes.remove(0).query
    };
    assert_eq!(route(""), QueryPolicy::Sorted);
    assert_eq!(route("query = \"sorted\""), QueryPolicy::Sorted);
    assert_eq!(route("query = \"ignore\""), QueryPolicy::Ignore);
    assert_eq!(
        route("query = [\"page\", \"limit\", \"page\"]"),
        QueryPolicy::Allow(vec!["limit".to_owned(), "page".to_owned()]),
        "sorted and deduplicated"
    );
}

#[test]
fn variant_overflow_rate_is_inherited_and_overridden() {
    let routes = |cache: &str, route: &str| {
        let text = with_minimal(&format!(
            "{cache}\n[[routes]]\nname = \"r\"\nmatch = \"/r\"\n{route}\n"
        ));
        let r = load(&text).unwrap().routes.remove(0);
        (r.max_variants, r.variant_overflow_rate)
    };
    assert_eq!(routes("", ""), (64, 10), "the defaults");
    assert_eq!(
        routes("[cache]\nvariant_overflow_rate = 0", ""),
        (64, 0),
        "from [cache]"
    );
    assert_eq!(
        routes(
            "[cache]\nvariant_overflow_rate = 0",
            "variant_overflow_rate = 3"
        ),
        (64, 3),
        "the route's own"
    );
}

// === one test per kind of error; each asserts the whole line, file:line: key: message ===

#[test]
fn syntax_error_names_the_line() {
    assert_eq!(
        problem("[server]\nlisten = \"0.0.0.0:8080\"\nmax_body_bytes = \n"),
        "test.toml:3: syntax: string values must be quoted, expected literal string"
    );
}

#[test]
fn duplicate_key_is_a_syntax_error() {
    assert_eq!(
        problem(&with_minimal("[cache]\nttl = \"1s\"\nttl = \"2s\"\n")),
        "test.toml:5: syntax: duplicate key \"ttl\""
    );
}

#[test]
fn unknown_key_lists_the_known_ones() {
    assert_eq!(
        problem(&with_minimal("[cache]\ntll = \"5s\"\n")),
        "test.toml:4: cache.tll: unknown key, expected one of ttl, jitter, grace, negative_ttl, \
         max_entry_bytes, l1_max_bytes, l1, l1_while_bus_down, freshness, heuristic, \
         max_variants, variant_overflow_rate"
    );
}

#[test]
fn unknown_key_in_a_route() {
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\ncache_ttl = \"5s\"\n"
        )),
        "test.toml:6: routes[0].cache_ttl: unknown key, expected one of name, match, methods, \
         ttl, jitter, grace, negative_ttl, max_entry_bytes, l1, freshness, heuristic, max_variants, \
         variant_overflow_rate, query, vary, forward_client_headers, invalidate, \
         double_delete_delay, early_refresh_beta, bloom, bloom_add, warmup, stock, serialize, \
         version, version_floor_ttl"
    );
}

#[test]
fn warmup_paths_must_match_their_route() {
    let route = |warmup: &str| {
        with_minimal(&format!(
            "[[routes]]\nname = \"item\"\nmatch = \"/api/items/{{id}}\"\n{warmup}\n"
        ))
    };
    let config = load(&route(
        "warmup = { paths = [\"/api/items/1?x=1\"], rate = 5 }",
    ))
    .unwrap();
    let warmup = config.routes[0].warmup.as_ref().unwrap();
    assert_eq!(
        (warmup.paths.as_slice(), warmup.rate),
        (&["/api/items/1?x=1".to_owned()][..], 5)
    );
    assert_eq!(
        problem(&route("warmup = { paths = [\"/other/1\"] }")),
        "test.toml:6: routes[0].warmup.paths[0]: expected a path this route matches \
         (\"/api/items/{id}\"), got \"/other/1\""
    );
    assert_eq!(
        problem(&route("warmup = { file = \"w.txt\", rate = 0 }")),
        "test.toml:6: routes[0].warmup.rate: expected paths per second of at least 1, got 0"
    );
}

// === Bloom filters ===

/// `[[bloom]]` "items" on lines 3–6, then `routes` from line 7.
fn with_filter(routes: &str) -> String {
    with_minimal(&format!(
        "[[bloom]]\nname = \"items\"\nexpected_items = 1000\nfp_rate = 0.01\nsource = {{ url = \"/internal/ids\" }}\n{routes}"
    ))
}

#[test]
fn bloom_filters_and_their_routes_load() {
    let config = load(&with_filter(
        "[[routes]]\nname = \"item\"\nmatch = \"/api/items/{id}\"\n\
         bloom = { filter = \"items\", param = \"id\", status = 410 }\n\
         [[routes]]\nname = \"create\"\nmatch = \"/api/items\"\nmethods = [\"POST\"]\n\
         bloom_add = { filter = \"items\", from = \"json:/id\" }\n",
    ))
    .unwrap();
    let filter = &config.bloom[0];
    assert_eq!(filter.expected_items, 1000);
    assert_eq!(filter.refresh, Duration::from_secs(600));
    assert_eq!(
        filter.source,
        super::BloomSource::Url("http://127.0.0.1:9000/internal/ids".parse().unwrap())
    );
    assert_eq!(filter.format, super::SourceFormat::Lines);
    let bloom = config.routes[0].bloom.as_ref().unwrap();
    assert_eq!((bloom.param.as_str(), bloom.status.as_u16()), ("id", 410));
    assert_eq!(bloom.body, "not found\n");
    let add = config.routes[1].bloom_add.as_ref().unwrap();
    assert_eq!(add.from, super::AddFrom::Json("/id".to_owned()));
}

#[test]
fn bloom_errors_name_the_line_and_key() {
    let route = |bloom: &str| {
        with_filter(&format!(
            "[[routes]]\nname = \"item\"\nmatch = \"/api/items/{{id}}\"\n{bloom}\n"
        ))
    };
    assert_eq!(
        problem(&route("bloom = { filter = \"nope\", param = \"id\" }")),
        "test.toml:11: routes[0].bloom.filter: expected the name of a [[bloom]] filter \
         (\"items\"), got \"nope\""
    );
    assert_eq!(
        problem(&route(
            "bloom = { filter = \"items\", param = \"item_id\" }"
        )),
        "test.toml:11: routes[0].bloom.param: expected a parameter of this route's match \
         \"/api/items/{id}\" ({id}), got \"item_id\""
    );
    assert_eq!(
        problem(&route(
            "bloom_add = { filter = \"items\", from = \"location\" }"
        )),
        "test.toml:11: routes[0].bloom_add: only write routes (no GET/HEAD) add ids; move it to \
         the route that creates them"
    );
    assert_eq!(
        problem(&route(
            "methods = [\"POST\"]\nbloom_add = { filter = \"items\", from = \"body\" }"
        )),
        "test.toml:12: routes[0].bloom_add.from: expected \"location\" or \"json:/pointer\" \
         (like \"json:/id\"), got \"body\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[[bloom]]\nname = \"items\"\nexpected_items = 10\nfp_rate = 1.5\nsource = { file = \"/x\" }\n"
        )),
        "test.toml:6: bloom[0].fp_rate: expected a false-positive rate above 0.0 and at most 0.5, \
         like 0.001, got 1.5"
    );
    assert_eq!(
        problem(&with_minimal(
            "[[bloom]]\nname = \"items\"\nexpected_items = 10\nfp_rate = 0.1\nsource = { file = \"/x\", format = \"ndjson\" }\n"
        )),
        "test.toml:7: bloom[0].source.field: format = \"ndjson\" needs field = \"…\": the name \
         of the id field"
    );
    assert_eq!(
        problems(&with_minimal(
            "[[bloom]]\nname = \"items\"\nexpected_items = 0\nfp_rate = 0.1\nsource = { url = \"https://x:1/ids\" }\n"
        )),
        [
            "test.toml:5: bloom[0].expected_items: expected a count from 1 to 2000000000, like \
             1000000, got 0",
            "test.toml:7: bloom[0].source.url: expected a path like \"/internal/ids\" or an \
             http://host:port/… URL, got \"https://x:1/ids\""
        ]
    );
}

#[test]
fn hot_keys_take_defaults_and_check_their_rates() {
    let config = load(MINIMAL).unwrap();
    assert_eq!(config.hot_keys.threshold_rps, 100);
    assert_eq!(config.hot_keys.cool_rps, 50);
    assert_eq!(config.hot_keys.l1_ttl, Duration::from_secs(1));
    assert_eq!(
        problem(&with_minimal(
            "[hot_keys]\nthreshold_rps = 100\ncool_rps = 150\n"
        )),
        "test.toml:5: hot_keys.cool_rps: expected a rate below threshold_rps (100), got 150"
    );
    assert_eq!(
        problem(&with_minimal("[hot_keys]\nmax_hot_keys = 0\n")),
        "test.toml:4: hot_keys.max_hot_keys: expected a count from 1 to 100000, got 0"
    );
}

#[test]
fn wrong_type() {
    assert_eq!(
        problem("[upstream]\nmax_concurrency = \"many\"\nurl = \"http://127.0.0.1:9000\"\n"),
        "test.toml:2: upstream.max_concurrency: expected a non-negative integer, got \"many\""
    );
    assert_eq!(
        problem(&with_minimal("[server]\nmax_body_bytes = -1\n")),
        "test.toml:4: server.max_body_bytes: expected a non-negative integer, got -1"
    );
    assert_eq!(
        problem(&with_minimal("[cache]\nl1_max_bytes = \"1GB\"\n")),
        "test.toml:4: cache.l1_max_bytes: expected a non-negative integer, got \"1GB\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nmethods = \"GET\"\n"
        )),
        "test.toml:6: routes[0].methods: expected an array, got \"GET\""
    );
    assert_eq!(
        problem(&format!("routes = 5\n{MINIMAL}")),
        "test.toml:1: routes: expected an array, got 5"
    );
}

#[test]
fn bad_duration_names_route_and_line() {
    let text = "\
[upstream]
url = \"http://127.0.0.1:9000\"

[[routes]]
name = \"item\"
match = \"/api/items/{id}\"
ttl = \"5m\"

[[routes]]
name = \"list\"
match = \"/api/items\"
methods = [\"GET\"]
query = [\"page\", \"limit\"]
ttl = \"thirty\"
";
    assert_eq!(
        problem(text),
        "test.toml:14: routes[1].ttl: expected a duration like \"30s\", got \"thirty\""
    );
    assert_eq!(
        problem(&with_minimal("[lock]\nlease = 5\n")),
        "test.toml:4: lock.lease: expected a duration like \"30s\", got 5"
    );
}

#[test]
fn missing_required_keys() {
    // A route without `match`: the line of its [[routes]] header.
    assert_eq!(
        problem(&with_minimal("\n[[routes]]\nname = \"r\"\n")),
        "test.toml:4: routes[0].match: required key is missing"
    );
    // [upstream] without url: the line of the header.
    assert_eq!(
        problem("[server]\nlisten = \"0.0.0.0:8080\"\n\n[upstream]\ntimeout = \"1s\"\n"),
        "test.toml:4: upstream.url: required key is missing: expected the origin URL like \
         \"http://127.0.0.1:9000\" (or set CACHEGUARD_UPSTREAM)"
    );
    // No [upstream] at all: line 1.
    assert_eq!(
        problem("[cache]\nttl = \"1s\"\n"),
        "test.toml:1: upstream.url: required key is missing: expected the origin URL like \
         \"http://127.0.0.1:9000\" (or set CACHEGUARD_UPSTREAM)"
    );
    assert_eq!(
        problem(&with_minimal("[redis]\nkey_prefix = \"x:\"\n")),
        "test.toml:3: redis.url: required key is missing: expected a Redis URL like \
         \"redis://127.0.0.1:6379\" (or remove [redis] for embedded mode)"
    );
}

#[test]
fn bad_enum_value() {
    assert_eq!(
        problem(&with_minimal("[cache]\nl1 = \"sometimes\"\n")),
        "test.toml:4: cache.l1: expected one of \"hot\", \"all\", \"off\", got \"sometimes\""
    );
    assert_eq!(
        problem(&with_minimal("[cache]\nl1_while_bus_down = \"check\"\n")),
        "test.toml:4: cache.l1_while_bus_down: expected one of \"bypass\", \"serve\", got \
         \"check\""
    );
    assert_eq!(
        problem(&with_minimal("[lock]\non_timeout = \"retry\"\n")),
        "test.toml:4: lock.on_timeout: expected one of \"origin\", \"error\", got \"retry\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nl1 = 1\n"
        )),
        "test.toml:6: routes[0].l1: expected one of \"hot\", \"all\", \"off\", got 1"
    );
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nquery = \"all\"\n"
        )),
        "test.toml:6: routes[0].query: expected \"sorted\", \"ignore\" or an array of \
         parameter names, got \"all\""
    );
}

#[test]
fn out_of_range_numbers() {
    assert_eq!(
        problem(&with_minimal("[cache]\njitter = 1.5\n")),
        "test.toml:4: cache.jitter: expected a number from 0.0 up to (not including) 1.0, got 1.5"
    );
    assert_eq!(
        problem(&with_minimal("[cache]\nheuristic = 1.5\n")),
        "test.toml:4: cache.heuristic: expected a fraction from 0.0 to 1.0 of the time since \
         Last-Modified, got 1.5"
    );
    assert_eq!(
        problem(&with_minimal("[cache]\nfreshness = \"headers\"\n")),
        "test.toml:4: cache.freshness: expected one of \"route\", \"origin\", got \"headers\""
    );
    assert_eq!(
        problem(&with_minimal("[cache]\njitter = 1\n")),
        "test.toml:4: cache.jitter: expected a number from 0.0 up to (not including) 1.0, got 1.0"
    );
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\njitter = -0.1\n"
        )),
        "test.toml:6: routes[0].jitter: expected a number from 0.0 up to (not including) 1.0, \
         got -0.1"
    );
    assert_eq!(
        problem("[server]\nmax_connections = 0\n[upstream]\nurl = \"http://127.0.0.1:9000\"\n"),
        "test.toml:2: server.max_connections: expected an integer of at least 1, got 0"
    );
    for (value, shown) in [("0", "0"), ("1001", "1001"), ("100000000", "100000000")] {
        assert_eq!(
            problem(&format!(
                "[server]\nmax_headers = {value}\n[upstream]\nurl = \"http://127.0.0.1:9000\"\n"
            )),
            format!(
                "test.toml:2: server.max_headers: expected an integer from 1 to 1000 (header \
                 fields in one request head), got {shown}"
            )
        );
    }
    let edges = "[server]\nmax_headers = 1\n[upstream]\nurl = \"http://127.0.0.1:9000\"\n";
    assert_eq!(load(edges).unwrap().server.max_headers, 1);
    assert_eq!(
        load(&edges.replace("= 1\n", "= 1000\n"))
            .unwrap()
            .server
            .max_headers,
        1000
    );
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\n[lock]\nmax_waiters = 0\n"),
        "test.toml:4: lock.max_waiters: expected an integer of at least 1, got 0"
    );
    // A fetch reserves its route's max_entry_bytes in max_buffered_bytes before it starts:
    // an answer that cannot fit could never be fetched.
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\nmax_buffered_bytes = 1048575\n"),
        "test.toml:3: upstream.max_buffered_bytes: 1048575 is below cache.max_entry_bytes \
         (1048576): no answer of that size could ever be fetched"
    );
    assert_eq!(
        problem(&with_minimal(
            "max_buffered_bytes = 2097152\n[[routes]]\nname = \"r\"\nmatch = \"/r\"\n\
             max_entry_bytes = 4194304\n"
        )),
        "test.toml:4: routes[0].max_entry_bytes: 4194304 is above upstream.max_buffered_bytes \
         (2097152): no answer of that size could ever be fetched"
    );
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\nmax_concurrency = 0\n"),
        "test.toml:3: upstream.max_concurrency: expected an integer of at least 1, got 0"
    );
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\nupload_deadline = \"0s\"\n"),
        "test.toml:3: upstream.upload_deadline: expected a duration above zero like \"5m\" \
         (every request body has a deadline; make it long for large uploads)"
    );
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\nupload_min_rate = -1\n"),
        "test.toml:3: upstream.upload_min_rate: expected an integer from 0 to 4294967295, got -1"
    );
    // A write's body reserves its in-memory part in max_buffered_bytes.
    assert_eq!(
        problem(&with_minimal(
            "max_buffered_bytes = 2097152\n[server]\nbody_buffer_bytes = 4194304\n"
        )),
        "test.toml:5: server.body_buffer_bytes: 4194304 is above upstream.max_buffered_bytes \
         (2097152), where it is reserved: one request body would hold the whole budget"
    );
    assert_eq!(
        problem("[upstream]\nurl = \"http://127.0.0.1:9000\"\npool_idle_timeout = \"0s\"\n"),
        "test.toml:3: upstream.pool_idle_timeout: expected a duration above zero like \"4s\" \
         (pool_max_idle = 0 keeps no idle connection)"
    );
    assert_eq!(
        problem("[upstream]\nmax_rps = 5000000000\nurl = \"http://127.0.0.1:9000\"\n"),
        "test.toml:2: upstream.max_rps: expected an integer from 0 to 4294967295, got 5000000000"
    );
}

#[test]
fn bad_listen_addresses() {
    assert_eq!(
        problem(&with_minimal("[server]\nlisten = \"localhost:8080\"\n")),
        "test.toml:4: server.listen: expected a socket address like \"0.0.0.0:8080\", \
         got \"localhost:8080\""
    );
    assert_eq!(
        problem(&with_minimal("[admin]\nlisten = \"9091\"\n")),
        "test.toml:4: admin.listen: expected a socket address like \"127.0.0.1:9091\", \
         got \"9091\""
    );
    assert_eq!(
        problem(&with_minimal("[server]\nlisten = \"0.0.0.0:9091\"\n")),
        "test.toml:1: admin.listen: expected an address apart from server.listen \
         (0.0.0.0:9091), got \"127.0.0.1:9091\""
    );
}

#[test]
fn bad_upstream_urls() {
    let url = |url: &str| problem(&format!("[upstream]\nurl = \"{url}\"\n"));
    assert_eq!(
        url("https://127.0.0.1:9443"),
        "test.toml:2: upstream.url: https is not supported: the upstream client speaks plain \
         HTTP to a sidecar-local origin; expected a URL like \"http://127.0.0.1:9000[/prefix]\", \
         got \"https://127.0.0.1:9443\""
    );
    assert_eq!(
        url("127.0.0.1:9000"),
        "test.toml:2: upstream.url: expected a URL like \"http://127.0.0.1:9000[/prefix]\", \
         got \"127.0.0.1:9000\" (the scheme must be http://)"
    );
    assert_eq!(
        url("http://origin"),
        "test.toml:2: upstream.url: expected a URL like \"http://127.0.0.1:9000[/prefix]\", \
         got \"http://origin\" (the port is required)"
    );
    assert_eq!(
        url("http://h:1/v1?x=1"),
        "test.toml:2: upstream.url: expected a URL like \"http://127.0.0.1:9000[/prefix]\", \
         got \"http://h:1/v1?x=1\" (a query or fragment is not allowed)"
    );
    assert_eq!(
        url("http://user:secret@h:1"),
        "test.toml:2: upstream.url: expected a URL like \"http://127.0.0.1:9000[/prefix]\", \
         got \"http://user:***@h:1\" (user info is not allowed)"
    );
    assert!(url("http://exa mple:80").starts_with("test.toml:2: upstream.url: expected a URL"));
    let config = load("[upstream]\nurl = \"http://origin.local:9000/v1\"\n").unwrap();
    assert_eq!(config.upstream.url.path(), "/v1");
}

#[test]
fn bad_redis_urls() {
    let redis = |url: &str| problem(&with_minimal(&format!("[redis]\nurl = \"{url}\"\n")));
    assert_eq!(
        redis("http://127.0.0.1:6379"),
        "test.toml:4: redis.url: expected a Redis URL like \"redis://127.0.0.1:6379\" \
         (redis://, rediss:// or unix://), got \"http://127.0.0.1:6379\""
    );
    let message = redis("redis://:hunter2@127.0.0.1:6379/zero");
    assert!(
        message.starts_with(
            "test.toml:4: redis.url: expected a Redis URL like \"redis://127.0.0.1:6379\" \
             (redis://, rediss:// or unix://), got \"redis://:***@127.0.0.1:6379/zero\" ("
        ),
        "{message}"
    );
    assert!(
        !message.contains("hunter2"),
        "the password leaked: {message}"
    );
}

#[test]
fn purge_limits() {
    let config = load(&with_minimal("[admin]\npurge_rate = 0\npurge_burst = 0\n")).unwrap();
    assert_eq!(
        (config.admin.purge_rate, config.admin.purge_burst),
        (0, 0),
        "no limit"
    );
    assert_eq!(
        problem(&with_minimal("[admin]\npurge_rate = 5\npurge_burst = 0\n")),
        "test.toml:5: admin.purge_burst: expected an integer of at least 1 with \
         admin.purge_rate above 0 (no purge could ever pass), got 0"
    );
    assert_eq!(
        problem(&with_minimal("[admin]\npurge_rate = -1\n")),
        "test.toml:4: admin.purge_rate: expected an integer from 0 to 4294967295, got -1"
    );
}

#[test]
fn admin_token_must_not_be_empty() {
    assert_eq!(
        problem(&with_minimal("[admin]\ntoken = \"\"\n")),
        "test.toml:4: admin.token: expected a non-empty string (omit the token to refuse \
         mutating admin calls)"
    );
}

#[test]
fn route_name_rules() {
    let text = with_minimal(
        "[[routes]]\nname = \"item\"\nmatch = \"/a/{id}\"\n\n\
         [[routes]]\nname = \"item\"\nmatch = \"/b/{id}\"\n\n\
         [[routes]]\nname = \"bad name\"\nmatch = \"/c\"\n",
    );
    assert_eq!(
        problems(&text),
        [
            "test.toml:8: routes[1].name: expected a unique route name, got \"item\" again \
             (routes[0], line 4)",
            "test.toml:12: routes[2].name: expected a name of letters, digits, '_', '.' and '-' \
             like \"item\", got \"bad name\"",
        ]
    );
}

#[test]
fn conflicting_patterns() {
    let text = with_minimal(
        "[[routes]]\nname = \"one\"\nmatch = \"/files/{id}\"\n\n\
         [[routes]]\nname = \"all\"\nmatch = \"/files/{*rest}\"\n",
    );
    assert_eq!(
        problem(&text),
        "test.toml:9: routes[1].match: pattern \"/files/{*rest}\" conflicts with route \"one\" \
         (routes[0]): insertion failed due to conflict with previously registered route: \
         /files/{id}"
    );
}

#[test]
fn invalid_patterns() {
    let route = |pattern: &str| {
        problem(&with_minimal(&format!(
            "[[routes]]\nname = \"r\"\nmatch = \"{pattern}\"\n"
        )))
    };
    assert_eq!(
        route("api/items"),
        "test.toml:5: routes[0].match: expected a path pattern starting with \"/\" like \
         \"/api/items/{id}\", got \"api/items\""
    );
    assert_eq!(
        route("/api/{id"),
        "test.toml:5: routes[0].match: \"/api/{id\" is not a valid route pattern: parameters \
         must be registered with a valid name"
    );
}

#[test]
fn read_routes_must_not_take_writes() {
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nmethods = [\"GET\", \"POST\", \"DELETE\"]\n"
        )),
        "test.toml:6: routes[0].methods: a read route (GET/HEAD) cannot also take POST, DELETE: \
         split read and write methods into two routes with the same match"
    );
}

#[test]
fn routes_with_the_same_match_must_not_share_a_method() {
    let text = with_minimal(
        "[[routes]]\nname = \"get\"\nmatch = \"/r\"\n\n\
         [[routes]]\nname = \"head\"\nmatch = \"/r\"\nmethods = [\"HEAD\"]\n",
    );
    assert_eq!(
        problem(&text),
        "test.toml:10: routes[1].methods: HEAD already handled by route \"get\" (routes[0]) \
         with the same match \"/r\""
    );
}

#[test]
fn bad_methods() {
    assert_eq!(
        problems(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nmethods = [\"GE T\"]\n\n\
             [[routes]]\nname = \"w\"\nmatch = \"/w\"\nmethods = []\n"
        )),
        [
            "test.toml:6: routes[0].methods[0]: expected an HTTP method like \"GET\", got \"GE T\"",
            "test.toml:8: routes[1].methods: expected at least one method like \"GET\", got an \
             empty array",
        ]
    );
}

#[test]
fn vary_refuses_per_user_headers() {
    assert_eq!(
        problems(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nvary = [\"Authorization\", \"cookie\", \"bad header\"]\n"
        )),
        [
            "test.toml:6: routes[0].vary[0]: \"authorization\" cannot be a vary header: it \
             identifies the user, and per-user responses are never shared (leave this path \
             uncached)",
            "test.toml:6: routes[0].vary[1]: \"cookie\" cannot be a vary header: it identifies \
             the user, and per-user responses are never shared (leave this path uncached)",
            "test.toml:6: routes[0].vary[2]: expected a header name like \"accept-language\", \
             got \"bad header\"",
        ]
    );
}

#[test]
fn forward_client_headers_rules() {
    let config = load(&with_minimal(
        "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nvary = [\"X-Forwarded-Prefix\"]\n\
         forward_client_headers = [\"X-Forwarded-Prefix\", \"x-forwarded-prefix\"]\n\n\
         [[routes]]\nname = \"w\"\nmatch = \"/r\"\nmethods = [\"PUT\"]\n\
         forward_client_headers = [\"x-http-method-override\", \"X-Forwarded-Host\"]\n\n\
         [[routes]]\nname = \"plain\"\nmatch = \"/p\"\n",
    ))
    .unwrap();
    let [read, write, plain] = config.routes.as_slice() else {
        panic!("three routes expected");
    };
    assert_eq!(
        read.forward_client_headers,
        ["x-forwarded-prefix"],
        "lowercased, deduplicated"
    );
    assert_eq!(
        write.forward_client_headers,
        ["x-forwarded-host", "x-http-method-override"],
        "a write route may take a method override; sorted"
    );
    assert!(plain.forward_client_headers.is_empty(), "default: none");

    let refused = problems(&with_minimal(
        "[[routes]]\nname = \"r\"\nmatch = \"/r\"\n\
         forward_client_headers = [\"host\", \"x-forwarded-for\", \"X-Trace\", \"bad header\", \
         \"x-forwarded-prefix\", \"x-http-method-override\"]\n",
    ));
    let unknown = |got: &str, j: usize| {
        format!(
            "test.toml:6: routes[0].forward_client_headers[{j}]: expected one of the client \
             headers cacheguard drops before forwarding (forwarded, x-forwarded-host, \
             x-forwarded-port, x-forwarded-server, x-forwarded-scheme, x-forwarded-ssl, \
             x-forwarded-prefix, x-real-ip, x-client-ip, x-host, x-original-url, x-rewrite-url, \
             x-original-host, x-http-method-override, x-http-method, x-method-override, \
             x-original-method), got \
             {got:?}"
        )
    };
    assert_eq!(
        refused,
        [
            unknown("host", 0),
            unknown("x-forwarded-for", 1),
            unknown("X-Trace", 2),
            unknown("bad header", 3),
            "test.toml:6: routes[0].forward_client_headers[4]: \"x-forwarded-prefix\" changes \
             what the origin answers, and this route caches it for everybody: add it to this \
             route's vary too (each value is then stored apart), or leave it off this route"
                .to_owned(),
            "test.toml:6: routes[0].forward_client_headers[5]: \"x-http-method-override\" \
             cannot be forwarded on a read route: it would make the origin run another method \
             than the GET the cache stores, and nothing invalidates what that changes; allow it \
             on a write route"
                .to_owned(),
        ]
    );
    // Keyed or not, a method override stays off a read route.
    assert_eq!(
        problems(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nvary = [\"x-http-method\"]\n\
             forward_client_headers = [\"x-http-method\"]\n",
        ))
        .len(),
        1
    );
}

#[test]
fn invalidate_rules() {
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r/{id}\"\ninvalidate = [\"/r/{id}\"]\n"
        )),
        "test.toml:6: routes[0].invalidate: only write routes (no GET/HEAD) invalidate; move it \
         to the route that takes the writes"
    );
    assert_eq!(
        problems(&with_minimal(
            "[[routes]]\nname = \"w\"\nmatch = \"/r/{id}\"\nmethods = [\"POST\"]\n\
             invalidate = [\"/r/{id}\", \"/r/{sku}\", \"r\"]\n"
        )),
        [
            "test.toml:7: routes[0].invalidate[1]: expected parameters taken from this route's \
             match \"/r/{id}\", got {sku} in \"/r/{sku}\"",
            "test.toml:7: routes[0].invalidate[2]: expected a path pattern starting with \"/\" \
             like \"/api/items/{id}\", got \"r\"",
        ]
    );
}

#[test]
fn missing_file_names_the_io_error() {
    let error = Config::load(
        std::path::Path::new("/nonexistent/cacheguard.toml"),
        &no_env(),
    )
    .unwrap_err();
    let message = error.to_string();
    assert!(
        message.starts_with("/nonexistent/cacheguard.toml: cannot read: "),
        "{message}"
    );
    assert_eq!(error.problems[0].line, None);
}

#[test]
fn problems_are_sorted_environment_first_then_by_line() {
    let text = with_minimal(
        "[[routes]]\nname = \"a\"\nmatch = \"/a/{id}\"\n\n\
         [[routes]]\nname = \"a\"\nmatch = \"/a/{*rest}\"\n\n\
         [server]\nlisten = \"x\"\n",
    );
    let vars = env(&[("CACHEGUARD_ADMIN_TOKEN", "t"), ("CACHEGUARD_LISTEN", "y")]);
    let lines: Vec<String> = problems_with(&text, &vars)
        .iter()
        .map(|p| p.split(": ").take(2).collect::<Vec<_>>().join(": "))
        .collect();
    assert_eq!(
        lines,
        [
            "environment: CACHEGUARD_LISTEN",
            "test.toml:8: routes[1].name",
            "test.toml:9: routes[1].match",
            "test.toml:12: server.listen",
        ]
    );
}

#[test]
fn semantic_problems_are_all_collected() {
    let text = "\
[server]
listen = \"nowhere\"

[upstream]
url = \"https://origin:443\"

[cache]
jitter = 2.0
";
    let error = load(text).unwrap_err();
    let lines: Vec<(Option<usize>, &str)> = error
        .problems
        .iter()
        .map(|p| (p.line, p.key.as_str()))
        .collect();
    assert_eq!(
        lines,
        [
            (Some(2), "server.listen"),
            (Some(5), "upstream.url"),
            (Some(8), "cache.jitter")
        ]
    );
    assert_eq!(error.to_string().lines().count(), 3, "one problem per line");
}

// === environment overrides ===

#[test]
fn env_overrides_replace_file_values() {
    let vars = env(&[
        ("CACHEGUARD_LISTEN", "127.0.0.1:18080"),
        ("CACHEGUARD_UPSTREAM", "http://10.0.0.5:8000/api"),
        ("CACHEGUARD_REDIS_URL", "redis://redis:6379/2"),
        ("CACHEGUARD_ADMIN_TOKEN", "s3cret"),
    ]);
    let config = Config::from_toml(EXAMPLE, "x.toml", &vars).unwrap();
    assert_eq!(config.server.listen, "127.0.0.1:18080".parse().unwrap());
    assert_eq!(config.upstream.url, "http://10.0.0.5:8000/api");
    assert_eq!(config.redis.unwrap().url, "redis://redis:6379/2");
    assert_eq!(config.admin.token.as_deref(), Some("s3cret"));
}

#[test]
fn env_supplies_required_values_and_creates_redis() {
    let vars = env(&[
        ("CACHEGUARD_UPSTREAM", "http://127.0.0.1:9000"),
        ("CACHEGUARD_REDIS_URL", "redis://127.0.0.1:6379"),
    ]);
    let config = Config::from_toml("", "empty.toml", &vars).unwrap();
    assert_eq!(config.upstream.url, "http://127.0.0.1:9000");
    assert_eq!(
        config.upstream.timeout,
        Duration::from_secs(10),
        "section defaults"
    );
    let redis = config.redis.expect("CACHEGUARD_REDIS_URL creates [redis]");
    assert_eq!(redis.command_timeout, Duration::from_millis(50));
    assert_eq!(redis.key_prefix, "cg:");
    assert_eq!(redis.breaker_failures, 3);
}

#[test]
fn empty_env_values_do_not_override() {
    let vars = env(&[
        ("CACHEGUARD_LISTEN", ""),
        ("CACHEGUARD_UPSTREAM", ""),
        ("CACHEGUARD_REDIS_URL", ""),
        ("CACHEGUARD_ADMIN_TOKEN", ""),
    ]);
    let config = Config::from_toml(EMBEDDED, "x.toml", &vars).unwrap();
    assert!(
        config.redis.is_none(),
        "an empty CACHEGUARD_REDIS_URL keeps embedded mode"
    );
    assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(config.upstream.url, "http://127.0.0.1:9000");
    assert_eq!(config.admin.token, None);
}

#[test]
fn bad_env_values_name_the_variable() {
    let vars = env(&[
        ("CACHEGUARD_LISTEN", "x"),
        ("CACHEGUARD_UPSTREAM", "https://origin:443"),
        ("CACHEGUARD_REDIS_URL", "memcached://h:11211"),
    ]);
    assert_eq!(
        problems_with(MINIMAL, &vars),
        [
            "environment: CACHEGUARD_LISTEN: expected a socket address like \"0.0.0.0:8080\", \
             got \"x\"",
            "environment: CACHEGUARD_UPSTREAM: https is not supported: the upstream client \
             speaks plain HTTP to a sidecar-local origin; expected a URL like \
             \"http://127.0.0.1:9000[/prefix]\", got \"https://origin:443\"",
            "environment: CACHEGUARD_REDIS_URL: expected a Redis URL like \
             \"redis://127.0.0.1:6379\" (redis://, rediss:// or unix://), got \
             \"memcached://h:11211\"",
        ]
    );
}

#[test]
fn early_refresh_and_hit_for_miss_settings() {
    let config = load(&with_minimal(
        "[lock]\nuncacheable_ttl = \"3s\"\n[[routes]]\nname = \"r\"\nmatch = \"/r\"\nearly_refresh_beta = 2.5\n",
    ))
    .unwrap();
    assert_eq!(config.lock.uncacheable_ttl, Duration::from_secs(3));
    assert!((config.routes[0].early_refresh_beta - 2.5).abs() < f64::EPSILON);
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nearly_refresh_beta = -1.0\n"
        )),
        "test.toml:6: routes[0].early_refresh_beta: expected a number from 0.0 (off) to 100.0, \
         like 1.0, got -1.0"
    );
}

#[test]
fn debug_output_redacts_secrets() {
    let config = load(&with_minimal(
        "[redis]\nurl = \"redis://app:hunter2@127.0.0.1:6379\"\n[admin]\ntoken = \"s3cret-token\"\n",
    ))
    .unwrap();
    let shown = format!("{config:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(!shown.contains("s3cret-token"), "{shown}");
    assert!(shown.contains("app:***@127.0.0.1:6379"), "{shown}");
}

#[test]
fn journal_and_stream_take_defaults_and_check_their_values() {
    let config = load(MINIMAL).unwrap();
    assert_eq!(
        config.journal.path,
        std::path::PathBuf::from("cacheguard.journal")
    );
    assert_eq!(config.journal.fsync, crate::config::JournalFsync::Always);
    assert!(config.stream.enabled);
    assert_eq!(config.stream.key, "cg:invalidate");
    assert_eq!(config.stream.group, "cacheguard");
    assert_eq!(config.stream.claim_idle, Duration::from_secs(30));
    let interval = load(&with_minimal("[journal]\nfsync = \"250ms\"\n")).unwrap();
    assert_eq!(
        interval.journal.fsync,
        crate::config::JournalFsync::Interval(Duration::from_millis(250))
    );
    assert_eq!(
        problem(&with_minimal("[journal]\nfsync = \"sometimes\"\n")),
        "test.toml:4: journal.fsync: expected \"always\", \"never\" or an interval like \"1s\", got \"sometimes\""
    );
    assert_eq!(
        problem(&with_minimal("[journal]\npath = \"\"\n")),
        "test.toml:4: journal.path: expected a file path, got \"\""
    );
    assert_eq!(
        problem(&with_minimal("[invalidation_stream]\nbatch = 0\n")),
        "test.toml:4: invalidation_stream.batch: expected a count from 1 to 10000, got 0"
    );
}

#[test]
fn a_relative_journal_path_is_next_to_the_config_file() {
    let vars = std::collections::HashMap::<String, String>::new();
    let text = format!("{MINIMAL}\n[journal]\npath = \"j/owed.journal\"\n");
    let config = crate::Config::from_toml(&text, "/etc/cacheguard/cacheguard.toml", &vars).unwrap();
    assert_eq!(
        config.journal.path,
        std::path::PathBuf::from("/etc/cacheguard/j/owed.journal")
    );
}

#[test]
fn access_log_is_off_by_default_and_takes_its_defaults() {
    let config = load(MINIMAL).unwrap();
    assert_eq!(
        config.access_log,
        AccessLogConfig {
            format: AccessLogFormat::Off,
            path: AccessLogPath::Stdout,
            sample: 1.0,
            query: false,
            buffer: 8192,
        }
    );
    let set = load(&with_minimal(
        "[access_log]\nformat = \"combined\"\npath = \"stderr\"\nsample = 0.25\nquery = true\n\
         buffer = 1\n",
    ))
    .unwrap();
    assert_eq!(
        set.access_log,
        AccessLogConfig {
            format: AccessLogFormat::Combined,
            path: AccessLogPath::Stderr,
            sample: 0.25,
            query: true,
            buffer: 1,
        }
    );
}

#[test]
fn a_relative_access_log_path_is_next_to_the_config_file() {
    let vars = std::collections::HashMap::<String, String>::new();
    let text = format!("{MINIMAL}\n[access_log]\nformat = \"json\"\npath = \"logs/access.log\"\n");
    let config = crate::Config::from_toml(&text, "/etc/cacheguard/cacheguard.toml", &vars).unwrap();
    assert_eq!(
        config.access_log.path,
        AccessLogPath::File(std::path::PathBuf::from("/etc/cacheguard/logs/access.log"))
    );
    let absolute = text.replace("logs/access.log", "/var/log/cg.log");
    let config =
        crate::Config::from_toml(&absolute, "/etc/cacheguard/cacheguard.toml", &vars).unwrap();
    assert_eq!(
        config.access_log.path,
        AccessLogPath::File(std::path::PathBuf::from("/var/log/cg.log"))
    );
}

#[test]
fn access_log_errors_name_the_line_and_key() {
    assert_eq!(
        problem(&with_minimal("[access_log]\nformat = \"common\"\n")),
        "test.toml:4: access_log.format: expected one of \"off\", \"json\", \"combined\", got \"common\""
    );
    for (value, shown) in [
        ("0.0", "0.0"),
        ("0", "0.0"),
        ("1.5", "1.5"),
        ("-0.1", "-0.1"),
        ("nan", "NaN"),
    ] {
        assert_eq!(
            problem(&with_minimal(&format!("[access_log]\nsample = {value}\n"))),
            format!(
                "test.toml:4: access_log.sample: expected a fraction of requests above 0.0 and \
                 at most 1.0, like 0.1, got {shown}"
            ),
            "sample = {value}"
        );
    }
    assert_eq!(
        problem(&with_minimal("[access_log]\nbuffer = 0\n")),
        "test.toml:4: access_log.buffer: expected a count of lines from 1 to 1000000, got 0"
    );
    assert_eq!(
        problem(&with_minimal("[access_log]\nbuffer = 1000001\n")),
        "test.toml:4: access_log.buffer: expected a count of lines from 1 to 1000000, got 1000001"
    );
    assert_eq!(
        problem(&with_minimal("[access_log]\npath = \" \"\n")),
        "test.toml:4: access_log.path: expected \"stdout\", \"stderr\" or a file path, got \" \""
    );
    assert_eq!(
        problem(&with_minimal("[access_log]\nfile = \"a.log\"\n")),
        "test.toml:4: access_log.file: unknown key, expected one of format, path, sample, query, \
         buffer"
    );
    // The edges are accepted.
    let edges = load(&with_minimal(
        "[access_log]\nsample = 1.0\nbuffer = 1000000\n",
    ))
    .unwrap();
    assert_eq!(
        (edges.access_log.sample, edges.access_log.buffer),
        (1.0, 1_000_000)
    );
    let tiny = load(&with_minimal("[access_log]\nsample = 0.0001\n")).unwrap();
    assert!((tiny.access_log.sample - 0.0001).abs() < f64::EPSILON);
}

// === redis topologies and secrets (Scale-out) ===

#[test]
fn sentinel_and_cluster_modes_parse() {
    let sentinel = load(&with_minimal(
        "[redis]\nmode = \"sentinel\"\nurls = [\"redis://127.0.0.1:26379\", \"redis://127.0.0.1:26380\"]\n\
         master_name = \"mymaster\"\nusername = \"cg\"\npassword = \"pw\"\n",
    ))
    .unwrap();
    let redis = sentinel.redis.unwrap();
    assert_eq!(redis.mode, crate::config::RedisMode::Sentinel);
    assert_eq!(redis.urls.len(), 2);
    assert_eq!(redis.master_name, "mymaster");
    assert_eq!(redis.username.as_deref(), Some("cg"));
    assert_eq!(redis.password.as_deref(), Some("pw"));

    let cluster = load(&with_minimal(
        "[redis]\nmode = \"cluster\"\nurls = [\"redis://127.0.0.1:7000\", \"rediss://127.0.0.1:7001\"]\n",
    ))
    .unwrap();
    let redis = cluster.redis.unwrap();
    assert_eq!(redis.mode, crate::config::RedisMode::Cluster);
    assert_eq!(redis.urls.len(), 2);
    // A cluster may also be given one seed as `url` (as CACHEGUARD_REDIS_URL does).
    let one_seed = Config::from_toml(
        &with_minimal("[redis]\nmode = \"cluster\"\n"),
        "test.toml",
        &env(&[("CACHEGUARD_REDIS_URL", "redis://127.0.0.1:7000")]),
    )
    .unwrap();
    assert_eq!(one_seed.redis.unwrap().urls, ["redis://127.0.0.1:7000"]);
}

#[test]
fn topology_keys_are_checked_with_file_line_and_key() {
    assert_eq!(
        problem(&with_minimal(
            "[redis]\nmode = \"sharded\"\nurl = \"redis://h:1\"\n"
        )),
        "test.toml:4: redis.mode: expected \"standalone\", \"sentinel\" or \"cluster\", got \"sharded\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[redis]\nmode = \"sentinel\"\nurls = [\"redis://127.0.0.1:26379\"]\n"
        )),
        "test.toml:3: redis.master_name: required key is missing: expected the name the \
         sentinels monitor the primary under, like \"mymaster\""
    );
    assert!(
        problem(&with_minimal("[redis]\nmode = \"cluster\"\n")).starts_with(
            "test.toml:3: redis.urls: required key is missing: expected the cluster's seed nodes"
        )
    );
    assert!(
        problem(&with_minimal(
            "[redis]\nmode = \"cluster\"\nurls = [\"redis://127.0.0.1:7000\", \"unix:///run/r.sock\"]\n"
        ))
        .starts_with("test.toml:5: redis.urls[1]: a unix socket cannot be a cluster node")
    );
    assert!(
        problem(&with_minimal(
            "[redis]\nurl = \"redis://h:1\"\nurls = [\"redis://h:2\"]\n"
        ))
        .starts_with("test.toml:5: redis.urls: urls is for mode = \"sentinel\" or \"cluster\"")
    );
    assert_eq!(
        problem(&with_minimal(
            "[redis]\nurl = \"redis://h:1\"\nmaster_name = \"m\"\n"
        )),
        "test.toml:5: redis.master_name: master_name is only for mode = \"sentinel\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[redis]\nurl = \"redis://h:1\"\npassword = \"a\"\npassword_file = \"/x\"\n"
        )),
        "test.toml:6: redis.password_file: set either password or password_file, not both"
    );
    let missing = problem(&with_minimal(
        "[redis]\nurl = \"redis://h:1\"\npassword_file = \"/nonexistent/cg-secret\"\n",
    ));
    assert!(
        missing.starts_with("test.toml:5: redis.password_file: cannot read /nonexistent/cg-secret"),
        "{missing}"
    );
}

#[test]
fn password_comes_from_a_file_or_the_environment_and_is_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("redis-password");
    std::fs::write(&secret, "from-file-s3cret\n").unwrap();
    let text = with_minimal(&format!(
        "[redis]\nmode = \"sentinel\"\nurls = [\"redis://u:sentinel-pw@127.0.0.1:26379\"]\n\
         master_name = \"m\"\npassword_file = {:?}\n",
        secret.display().to_string()
    ));
    let config = load(&text).unwrap();
    let redis = config.redis.as_ref().unwrap();
    assert_eq!(redis.password.as_deref(), Some("from-file-s3cret"));
    let shown = format!("{config:?}");
    assert!(!shown.contains("from-file-s3cret"), "{shown}");
    assert!(!shown.contains("sentinel-pw"), "{shown}");
    assert!(shown.contains("password: Some(\"***\")"), "{shown}");

    // The environment wins over the file.
    let from_env = Config::from_toml(
        &text,
        "test.toml",
        &env(&[("CACHEGUARD_REDIS_PASSWORD", "from-env-s3cret")]),
    )
    .unwrap();
    assert_eq!(
        from_env.redis.as_ref().unwrap().password.as_deref(),
        Some("from-env-s3cret")
    );
    assert!(!format!("{from_env:?}").contains("from-env-s3cret"));
}

#[test]
fn lock_wait_replicas_defaults_off() {
    assert_eq!(load(MINIMAL).unwrap().lock.wait_replicas, 0);
    let set = load(&with_minimal("[lock]\nwait_replicas = 1\n")).unwrap();
    assert_eq!(set.lock.wait_replicas, 1);
}

#[test]
fn the_replica_wait_has_its_own_bound() {
    let default = load(MINIMAL).unwrap();
    assert_eq!(default.lock.wait_replicas_timeout, Duration::from_secs(1));
    let set = load(&with_minimal(
        "[lock]\nwait_replicas = 1\nwait_replicas_timeout = \"250ms\"\n",
    ))
    .unwrap();
    assert_eq!(set.lock.wait_replicas_timeout, Duration::from_millis(250));
}

#[test]
fn tls_ca_file_must_be_a_readable_pem_certificate() {
    let missing = problem(&with_minimal(
        "[redis]\nurl = \"rediss://h:1\"\ntls_ca_file = \"/nonexistent/ca.crt\"\n",
    ));
    assert!(
        missing.starts_with("test.toml:5: redis.tls_ca_file: cannot read /nonexistent/ca.crt"),
        "{missing}"
    );
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("ca.crt");
    std::fs::write(&not_pem, "hello").unwrap();
    let text = with_minimal(&format!(
        "[redis]\nurl = \"rediss://h:1\"\ntls_ca_file = {:?}\n",
        not_pem.display().to_string()
    ));
    assert!(
        problem(&text).ends_with("holds no PEM certificate"),
        "{}",
        problem(&text)
    );
}

#[test]
fn sentinel_and_cluster_example_files_parse() {
    let sentinel = Config::from_toml(
        include_str!("../../config/sentinel.toml"),
        "config/sentinel.toml",
        &no_env(),
    )
    .unwrap();
    let redis = sentinel.redis.unwrap();
    assert_eq!(redis.mode, crate::config::RedisMode::Sentinel);
    assert_eq!(redis.urls.len(), 3);
    assert_eq!(sentinel.lock.wait_replicas, 1);
    let cluster = Config::from_toml(
        include_str!("../../config/cluster.toml"),
        "config/cluster.toml",
        &no_env(),
    )
    .unwrap();
    assert_eq!(
        cluster.redis.unwrap().mode,
        crate::config::RedisMode::Cluster
    );
}

// === promises the config could not keep ===

/// `[redis]` at `redis://h:1` (lines 3–4) with `rest` from line 5.
fn shared(rest: &str) -> String {
    with_minimal(&format!("[redis]\nurl = \"redis://h:1\"\n{rest}"))
}

#[test]
fn a_public_admin_listener_needs_a_token() {
    let message = |addr: &str| {
        format!(
            "\"{addr}\" is reachable from other hosts and admin.token is not set: /metrics, \
             /admin/config and /admin/hotkeys would be open to the network; set admin.token \
             (or CACHEGUARD_ADMIN_TOKEN) and keep the port private, or listen on a loopback \
             address like \"127.0.0.1:9091\""
        )
    };
    assert_eq!(
        problem(&with_minimal("[admin]\nlisten = \"0.0.0.0:9091\"\n")),
        format!("test.toml:4: admin.listen: {}", message("0.0.0.0:9091"))
    );
    assert_eq!(
        problem(&with_minimal("[admin]\nlisten = \"[::]:9091\"\n")),
        format!("test.toml:4: admin.listen: {}", message("[::]:9091"))
    );
    assert_eq!(
        problem(&with_minimal("[admin]\nlisten = \"10.1.2.3:9091\"\n")),
        format!("test.toml:4: admin.listen: {}", message("10.1.2.3:9091"))
    );
    for private in [
        "127.0.0.1:9091",
        "127.3.2.1:9091",
        "[::1]:9091",
        "[::ffff:127.0.0.1]:9091",
    ] {
        load(&with_minimal(&format!("[admin]\nlisten = \"{private}\"\n")))
            .unwrap_or_else(|e| panic!("{private}: {e}"));
    }
    // A token in the file or from the environment counts.
    load(&with_minimal(
        "[admin]\nlisten = \"0.0.0.0:9091\"\ntoken = \"s3cret\"\n",
    ))
    .unwrap();
    Config::from_toml(
        &with_minimal("[admin]\nlisten = \"0.0.0.0:9091\"\n"),
        "test.toml",
        &env(&[("CACHEGUARD_ADMIN_TOKEN", "s3cret")]),
    )
    .unwrap();
    // An address that does not parse is reported once, as such.
    assert_eq!(
        problem(&with_minimal("[admin]\nlisten = \"nowhere\"\n")),
        "test.toml:4: admin.listen: expected a socket address like \"127.0.0.1:9091\", got \
         \"nowhere\""
    );
}

#[test]
fn the_lock_lease_must_outlast_two_renewals() {
    assert_eq!(
        problem(&shared(
            "command_timeout = \"50ms\"\n[lock]\nlease = \"100ms\"\n"
        )),
        "test.toml:7: lock.lease: lock.lease (\"100ms\") is below 3 × redis.command_timeout \
         (\"50ms\"): the lease is renewed every lease/3 and a renewal may take command_timeout, \
         so one renewal that times out would leave no time for the next before the lease runs \
         out and another instance fetches the same key; set lock.lease to at least \"150ms\" \
         or lower redis.command_timeout"
    );
    // With the lease left at its default, the line of command_timeout.
    assert_eq!(
        problem(&shared("command_timeout = \"2s\"\n")),
        "test.toml:5: redis.command_timeout: lock.lease (\"5s\") is below 3 × \
         redis.command_timeout (\"2s\"): the lease is renewed every lease/3 and a renewal may \
         take command_timeout, so one renewal that times out would leave no time for the next \
         before the lease runs out and another instance fetches the same key; set lock.lease \
         to at least \"6s\" or lower redis.command_timeout"
    );
    load(&shared(
        "command_timeout = \"50ms\"\n[lock]\nlease = \"150ms\"\n",
    ))
    .unwrap();
    // Embedded mode has no lease to renew.
    load(&with_minimal("[lock]\nlease = \"100ms\"\n")).unwrap();
}

#[test]
fn a_waiter_must_not_outwait_the_whole_fetch() {
    let message = |wait: &str, upstream: &str| {
        format!(
            "lock.wait_timeout (\"{wait}\") is longer than upstream.timeout (\"{upstream}\") with \
             lock.on_timeout = \"origin\": a waiter would outwait the holder's whole fetch (which \
             has answered or timed out by then) and then fetch from the origin itself; set \
             lock.wait_timeout to at most upstream.timeout, or on_timeout = \"error\""
        )
    };
    assert_eq!(
        problem(&shared("[lock]\nwait_timeout = \"15s\"\n")),
        format!("test.toml:6: lock.wait_timeout: {}", message("15s", "10s"))
    );
    // The default wait (3 s) against a short origin timeout: the line of upstream.timeout.
    assert_eq!(
        problem(
            "[upstream]\nurl = \"http://127.0.0.1:9000\"\ntimeout = \"1s\"\n\
             [redis]\nurl = \"redis://h:1\"\n"
        ),
        format!("test.toml:3: upstream.timeout: {}", message("3s", "1s"))
    );
    load(&shared("[lock]\nwait_timeout = \"10s\"\n")).unwrap();
    load(&shared(
        "[lock]\nwait_timeout = \"15s\"\non_timeout = \"error\"\n",
    ))
    .unwrap();
    // Embedded mode: no other instance to wait for.
    load(&with_minimal("[lock]\nwait_timeout = \"15s\"\n")).unwrap();
}

fn with_memory(text: &str, bytes: u64) -> Result<Config, ConfigError> {
    let limit = Some(super::env::MemoryLimit {
        bytes,
        source: "the cgroup limit in /sys/fs/cgroup/memory.max".to_owned(),
    });
    super::validate::from_toml_with(text, "test.toml", &no_env(), &limit)
}

#[test]
fn l1_must_fit_in_the_memory_the_process_may_use() {
    const GIB: u64 = 1 << 30;
    let text = with_minimal("[cache]\nl1_max_bytes = 2147483648\n");
    let error = with_memory(&text, GIB).unwrap_err();
    assert_eq!(
        error.to_string(),
        "test.toml:4: cache.l1_max_bytes: 2147483648 is above the memory this process may use, \
         1073741824 bytes (the cgroup limit in /sys/fs/cgroup/memory.max): a full L1 would get \
         the process killed for lack of memory; set it well below that"
    );
    // The default (256 MiB) in a 128 MiB container.
    assert_eq!(
        with_memory(MINIMAL, 128 << 20).unwrap_err().to_string(),
        "test.toml:1: cache.l1_max_bytes: 268435456 (the default) is above the memory this \
         process may use, 134217728 bytes (the cgroup limit in \
         /sys/fs/cgroup/memory.max): a full L1 would get the process killed for lack of \
         memory; set it well below that"
    );
    with_memory(&text, 4 * GIB).unwrap();
    // Nothing could be read: nothing is checked.
    super::validate::from_toml_with(&text, "test.toml", &no_env(), &None).unwrap();
}

#[test]
fn the_memory_limit_is_the_smaller_of_the_cgroup_and_the_machine() {
    use super::env::memory_limit_under;

    let root = tempfile::tempdir().unwrap();
    let put = |file: &str, text: &str| {
        let path = root.path().join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    assert_eq!(memory_limit_under(root.path()), None);
    put(
        "proc/meminfo",
        "MemTotal:        4194304 kB\nMemFree:  1 kB\n",
    );
    let limit = |bytes: u64, source: &str| {
        Some(super::env::MemoryLimit {
            bytes,
            source: source.to_owned(),
        })
    };
    let machine = limit(4 << 30, "MemTotal in /proc/meminfo");
    assert_eq!(memory_limit_under(root.path()), machine);
    // cgroup v1: a limit, or its "no limit" (a huge number).
    put("sys/fs/cgroup/memory/memory.limit_in_bytes", "536870912\n");
    assert_eq!(
        memory_limit_under(root.path()),
        limit(
            512 << 20,
            "the cgroup limit in /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
    );
    put(
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "9223372036854771712\n",
    );
    assert_eq!(memory_limit_under(root.path()), machine);
    // cgroup v2 wins over v1; "max" is no limit.
    put("sys/fs/cgroup/memory.max", "max\n");
    assert_eq!(memory_limit_under(root.path()), machine);
    put("sys/fs/cgroup/memory.max", "268435456\n");
    assert_eq!(
        memory_limit_under(root.path()),
        limit(256 << 20, "the cgroup limit in /sys/fs/cgroup/memory.max")
    );
}

#[test]
fn a_ttl_of_zero_is_refused() {
    let message = "expected a duration above zero like \"60s\", got \"0s\": an entry that is \
                   never fresh is stored only to be fetched again; to not cache a path, do not \
                   route it";
    assert_eq!(
        problem(&with_minimal("[cache]\nttl = \"0s\"\n")),
        format!("test.toml:4: cache.ttl: {message}")
    );
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"r\"\nmatch = \"/r\"\nttl = \"0ms\"\n"
        )),
        format!("test.toml:6: routes[0].ttl: {message}")
    );
}

#[test]
fn the_replica_wait_must_fit_in_the_lease() {
    assert_eq!(
        problem(&shared(
            "[lock]\nwait_replicas = 1\nwait_replicas_timeout = \"4s\"\nwait_timeout = \"5s\"\n"
        )),
        "test.toml:7: lock.wait_replicas_timeout: lock.wait_replicas_timeout (\"4s\") does not \
         fit in lock.lease (\"5s\"): a won lock waits that long for its replicas (its answer up \
         to redis.command_timeout more) before the fetch starts, and is first renewed lease/3 \
         later, within command_timeout; so wait_replicas_timeout + 2 × command_timeout must be \
         at most 2/3 of the lease. Set wait_replicas_timeout to at most \"3s 233ms\", or raise \
         lock.lease"
    );
    // The same wait is fine without replicas to wait for.
    load(&shared(
        "[lock]\nwait_replicas = 0\nwait_replicas_timeout = \"4s\"\nwait_timeout = \"5s\"\n",
    ))
    .unwrap();
}

#[test]
fn a_replica_wait_as_long_as_the_lock_wait_is_a_warning() {
    let config = load(&shared(
        "[lock]\nwait_replicas = 1\nwait_replicas_timeout = \"3s\"\n",
    ))
    .unwrap();
    let warnings: Vec<String> = config.warnings().iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            "test.toml:7: lock.wait_replicas_timeout: lock.wait_replicas_timeout (\"3s\") is not \
             below lock.wait_timeout (\"3s\"): while the replicas lag, a won lock waits for them \
             that long before its fetch starts, so the other instances' waiters give up first \
             and each fetch the key from the origin itself; set wait_replicas_timeout well below \
             wait_timeout"
        ]
    );
    let fine = load(&shared("[lock]\nwait_replicas = 1\n")).unwrap();
    assert!(fine.warnings().is_empty(), "{:?}", fine.warnings());
}

#[test]
fn the_examples_have_no_warnings() {
    for (text, name) in [
        (EXAMPLE, "config/cacheguard.toml"),
        (EMBEDDED, "config/embedded.toml"),
        (
            include_str!("../../config/sentinel.toml"),
            "config/sentinel.toml",
        ),
        (
            include_str!("../../config/cluster.toml"),
            "config/cluster.toml",
        ),
    ] {
        let config = Config::from_toml(text, name, &no_env()).unwrap();
        assert!(
            config.warnings().is_empty(),
            "{name}: {:?}",
            config.warnings()
        );
    }
}

// === stock gates ===

/// `[[stock]]` "seats" on lines 3–6 (with `extra` lines after its `source`), then `routes`.
fn with_gate(extra: &str, routes: &str) -> String {
    with_minimal(&format!(
        "[[stock]]\nname = \"seats\"\nkey = \"/trains/{{train}}/seats/{{type}}\"\n\
         source = {{ path = \"/internal/stock/{{train}}/{{type}}\", json = \"/remaining\" }}\n\
         {extra}{routes}"
    ))
}

const BUY_ROUTE: &str = "[[routes]]\nname = \"buy\"\nmatch = \"/trains/{train}/seats/{type}/orders\"\n\
                         methods = [\"POST\"]\nstock = { gate = \"seats\", units = 2 }\n";

#[test]
fn stock_gates_and_their_routes_load_with_defaults() {
    let config = load(&with_gate("", BUY_ROUTE)).unwrap();
    let gate = &config.stock[0];
    assert_eq!(gate.name, "seats");
    assert_eq!(gate.source_path, "/internal/stock/{train}/{type}");
    assert_eq!(gate.source_json, "/remaining");
    assert_eq!(gate.reconcile, Duration::from_secs(5));
    assert_eq!(gate.reservation_ttl, Duration::from_secs(30));
    assert_eq!(gate.sold_out.status.as_u16(), 409);
    assert_eq!(gate.sold_out.content_type, "application/problem+json");
    let codes = |list: &[http::StatusCode]| list.iter().map(|s| s.as_u16()).collect::<Vec<_>>();
    assert_eq!(codes(&gate.not_sold), [400, 402, 422]);
    assert_eq!(codes(&gate.origin_sold_out), [409, 410]);
    assert_eq!(gate.on_redis_error, super::OnRedisError::Reject);
    assert_eq!(
        gate.in_doubt_retry,
        super::InDoubtRetry::Reject,
        "safe by default"
    );
    assert_eq!(
        gate.idempotency_header.as_ref().map(|h| h.as_str()),
        Some("idempotency-key")
    );
    assert_eq!(gate.segments, 1);
    assert_eq!(
        config.routes[0].stock,
        Some(super::RouteStock {
            gate: "seats".to_owned(),
            units: 2
        })
    );
    let off = load(&with_gate(
        "idempotency_header = \"\"\non_redis_error = \"forward\"\nsegments = 4\n",
        BUY_ROUTE,
    ))
    .unwrap();
    assert_eq!(off.stock[0].idempotency_header, None);
    assert_eq!(off.stock[0].on_redis_error, super::OnRedisError::Forward);
    assert_eq!(off.stock[0].segments, 4);
    let forward = load(&with_gate("in_doubt_retry = \"forward\"\n", BUY_ROUTE)).unwrap();
    assert_eq!(
        forward.stock[0].in_doubt_retry,
        super::InDoubtRetry::Forward
    );
}

#[test]
fn stock_errors_name_the_line_and_key() {
    // A gate on a read route, an unknown gate, a key the route does not capture.
    assert_eq!(
        problem(&with_gate(
            "",
            "[[routes]]\nname = \"seats\"\nmatch = \"/trains/{train}/seats/{type}\"\n\
             stock = { gate = \"seats\" }\n"
        )),
        "test.toml:10: routes[0].stock: a stock gate takes units from buys: bind it to a write \
         route (POST, PUT, PATCH or DELETE), not one that answers GET/HEAD"
    );
    assert_eq!(
        problem(&with_gate(
            "",
            "[[routes]]\nname = \"buy\"\nmatch = \"/trains/{train}/seats/{type}/orders\"\n\
             methods = [\"POST\"]\nstock = { gate = \"tickets\" }\n"
        )),
        "test.toml:11: routes[0].stock.gate: expected the name of a [[stock]] gate (\"seats\"), \
         got \"tickets\""
    );
    assert_eq!(
        problem(&with_gate(
            "",
            "[[routes]]\nname = \"buy\"\nmatch = \"/trains/{train}/orders\"\n\
             methods = [\"POST\"]\nstock = { gate = \"seats\" }\n"
        )),
        "test.toml:11: routes[0].stock.gate: gate \"seats\" is keyed by \
         \"/trains/{train}/seats/{type}\", whose {type} this route's match \
         \"/trains/{train}/orders\" does not capture"
    );
    // The reservation must outlive the buy it holds a unit for.
    assert_eq!(
        problem(&with_gate("reservation_ttl = \"10s\"\n", BUY_ROUTE)),
        "test.toml:7: stock[0].reservation_ttl: expected a duration above upstream.timeout \
         (\"10s\"): a reservation must outlive the buy it holds a unit for, got \"10s\""
    );
    assert_eq!(
        problem(&with_gate("sold_out = { status = 200 }\n", BUY_ROUTE)),
        "test.toml:7: stock[0].sold_out.status: expected a 4xx or 5xx status, got 200 (a \
         sold-out answer must never look like a sale)"
    );
    assert_eq!(
        problem(&with_gate("not_sold = [201]\n", BUY_ROUTE)),
        "test.toml:7: stock[0].not_sold: expected a 4xx or 5xx status, got 201 (a 2xx is a \
         sale; other answers are in doubt)"
    );
    assert_eq!(
        problem(&with_gate("not_sold = [409]\n", BUY_ROUTE)),
        "test.toml:7: stock[0].origin_sold_out: status 409 is in both not_sold and \
         origin_sold_out: an answer means either that nothing was sold or that nothing is left"
    );
    assert_eq!(
        problem(&with_gate("segments = 0\n", BUY_ROUTE)),
        "test.toml:7: stock[0].segments: expected an integer from 1 to 64, got 0"
    );
    assert_eq!(
        problem(&with_gate("in_doubt_retry = \"refuse\"\n", BUY_ROUTE)),
        "test.toml:7: stock[0].in_doubt_retry: expected one of \"reject\", \"forward\", got \
         \"refuse\""
    );
    assert_eq!(
        problem(&with_gate(
            "idempotency_header = \"\"\nin_doubt_retry = \"forward\"\n",
            BUY_ROUTE
        )),
        "test.toml:8: stock[0].in_doubt_retry: \"forward\" forwards retries with an \
         idempotency key, and idempotency_header = \"\" turns keys off: set a header, or \
         leave in_doubt_retry out"
    );
    assert_eq!(
        problem(&with_gate("reconcile = \"10ms\"\n", BUY_ROUTE)),
        "test.toml:7: stock[0].reconcile: expected a duration of at least \"100ms\" like \
         \"5s\", got \"10ms\""
    );
    assert_eq!(
        problem(&with_minimal(
            "[[stock]]\nname = \"seats\"\nkey = \"/t/{id}\"\n\
             source = { path = \"/stock/{other}\", json = \"/remaining\" }\n"
        )),
        "test.toml:6: stock[0].source.path: the source path names {other}, which the \
         gate's key \"/t/{id}\" does not have"
    );
    assert_eq!(
        problem(&with_minimal(
            "[[stock]]\nname = \"seats\"\nkey = \"/t/{id}\"\n\
             source = { path = \"/stock/{id}\", json = \"remaining\" }\n"
        )),
        "test.toml:6: stock[0].source.json: expected a JSON pointer starting with \"/\" like \
         \"/remaining\" (or \"\" when the whole answer is the number), got \"remaining\""
    );
    // A gate without a source is refused by the parser, with its line.
    let missing = problem(&with_minimal(
        "[[stock]]\nname = \"seats\"\nkey = \"/t/{id}\"\n",
    ));
    assert!(
        missing.starts_with("test.toml:3: stock[0]") && missing.contains("source"),
        "{missing}"
    );
}

#[test]
fn patterns_are_filled_from_the_route_params() {
    let params = vec![("id".to_owned(), "7".to_owned())];
    assert_eq!(
        super::fill_pattern("/api/items/{id}", &params),
        "/api/items/7"
    );
    assert_eq!(super::fill_pattern("/api/items", &params), "/api/items");
    let rest = vec![("rest".to_owned(), "a/b".to_owned())];
    assert_eq!(super::fill_pattern("/files/{*rest}", &rest), "/files/a/b");
}

// === serialized writes and version floors ===

/// A `seat` read route and a `seat-update` write route with `write` settings (from line 7).
fn with_seat_routes(read: &str, write: &str) -> String {
    with_minimal(&format!(
        "[[routes]]\nname = \"seat\"\nmatch = \"/trains/{{train}}/seats/{{seat}}\"\n{read}\n\
         [[routes]]\nname = \"seat-update\"\nmatch = \"/trains/{{train}}/seats/{{seat}}\"\n\
         methods = [\"PUT\", \"PATCH\", \"DELETE\"]\n{write}\n"
    ))
}

#[test]
fn serialize_and_version_load_with_defaults() {
    let config = load(&with_seat_routes(
        "version = { header = \"x-row-version\" }",
        "serialize = { key = \"/trains/{train}/seats/{seat}\", fence_header = \"fencing-token\" }\n\
         version = { header = \"last-modified\" }\nversion_floor_ttl = \"2s\"",
    ))
    .unwrap();
    let [read, write] = config.routes.as_slice() else {
        panic!("two routes")
    };
    assert_eq!(
        read.version,
        Some(super::VersionSource::Integer(
            http::HeaderName::from_static("x-row-version")
        ))
    );
    assert_eq!(
        write.version,
        Some(super::VersionSource::Date(http::header::LAST_MODIFIED))
    );
    assert_eq!(write.version_floor_ttl, Duration::from_secs(2));
    let serialize = write.serialize.as_ref().expect("serialized");
    assert_eq!(serialize.key, "/trains/{train}/seats/{seat}");
    assert_eq!(serialize.lease, Duration::from_secs(5));
    assert_eq!(serialize.wait_timeout, Duration::from_secs(2));
    assert_eq!(serialize.max_waiters, 256);
    assert_eq!(
        serialize.fence_header.as_ref().map(|h| h.as_str()),
        Some("fencing-token")
    );
    assert_eq!(serialize.on_redis_error, super::OnRedisError::Reject);
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
    // Without a fence header: accepted, with a warning that says what that means.
    let efficiency = load(&with_seat_routes(
        "",
        "serialize = { key = \"/trains/{train}/seats/{seat}\" }",
    ))
    .unwrap();
    let warnings: Vec<String> = efficiency
        .warnings()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("test.toml:11: routes[1].serialize: no fence_header")
            && warnings[0].contains("efficiency lock"),
        "{warnings:?}"
    );
}

#[test]
fn serialize_and_version_errors_name_the_line_and_key() {
    assert_eq!(
        problem(&with_seat_routes(
            "",
            "serialize = { key = \"/trains/{train}/seats/{seat}/{row}\", fence_header = \"f\" }"
        )),
        "test.toml:11: routes[1].serialize.key: the key names {row}, which this route's match \
         \"/trains/{train}/seats/{seat}\" does not capture"
    );
    assert_eq!(
        problem(&with_seat_routes(
            "serialize = { key = \"/trains/{train}/seats/{seat}\" }",
            ""
        )),
        "test.toml:6: routes[0].serialize: only writes are serialized: move it to a write route \
         (POST, PUT, PATCH or DELETE)"
    );
    assert_eq!(
        problem(&with_minimal(&format!(
            "[redis]\nurl = \"redis://127.0.0.1:6379\"\ncommand_timeout = \"200ms\"\n{}",
            with_seat_routes(
                "",
                "serialize = { key = \"/trains/{train}/seats/{seat}\", lease = \"500ms\", \
                 fence_header = \"f\" }"
            )
            .trim_start_matches(MINIMAL)
        ))),
        "test.toml:14: routes[1].serialize.lease: expected a lease of at least 3 × \
         redis.command_timeout (\"600ms\"): it is renewed every third of it, and one renewal \
         that times out must leave time for the next, got \"500ms\""
    );
    assert_eq!(
        problem(&with_seat_routes("version = {}", "")),
        "test.toml:6: routes[0].version: expected the header the origin tells a row's version \
         in, like { header = \"x-row-version\" } (or \"last-modified\" to compare dates)"
    );
    assert_eq!(
        problem(&with_seat_routes("", "version_floor_ttl = \"5s\"")),
        "test.toml:11: routes[1].version_floor_ttl: only a write route with `version` sets a \
         floor: add version = { header = \"…\" } to this write route, or remove this key"
    );
}

#[test]
fn the_spool_directory_must_take_a_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = load(&with_minimal(&format!(
        "[server]\nbody_spool_dir = {:?}\n",
        dir.path().display().to_string()
    )))
    .expect("a writable directory");
    assert_eq!(config.server.body_spool_dir, dir.path());
    // Relative to the config file, like the journal.
    let config = Config::from_toml(
        &with_minimal("[server]\nbody_spool_dir = \"spool\"\n"),
        &dir.path().join("cacheguard.toml").display().to_string(),
        &no_env(),
    );
    let missing = dir.path().join("spool");
    let problems: Vec<String> = config
        .expect_err("no such directory")
        .problems
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(problems.len(), 1, "{problems:?}");
    let expected = format!(
        "{}:4: server.body_spool_dir: cannot make a temporary file in {}: ",
        dir.path().join("cacheguard.toml").display(),
        missing.display()
    );
    assert!(problems[0].starts_with(&expected), "{}", problems[0]);
    assert!(
        problems[0].ends_with("(request bodies over server.body_buffer_bytes are spooled there)"),
        "{}",
        problems[0]
    );
    std::fs::create_dir(&missing).expect("create it");
    let config = Config::from_toml(
        &with_minimal("[server]\nbody_spool_dir = \"spool\"\n"),
        &dir.path().join("cacheguard.toml").display().to_string(),
        &no_env(),
    )
    .expect("now it exists");
    assert_eq!(config.server.body_spool_dir, missing);
    assert_eq!(
        problem(&with_minimal("[server]\nbody_spool_dir = \"\"\n")),
        "test.toml:4: server.body_spool_dir: expected a directory path, got \"\""
    );
}

// === lock services ===

#[test]
fn lock_services_load_and_routes_pick_them() {
    let config = load(&with_minimal(
        "[locks.orders-etcd]\nbackend = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n\
         [locks.orders-zk]\nbackend = \"zookeeper\"\nconnect = \"127.0.0.1:2181\"\n\
         [locks.orders-db]\nbackend = \"mysql\"\nurl = \"mysql://u:secret@127.0.0.1:3306/app\"\n\
         [locks.orders-rl]\nbackend = \"redlock\"\n\
         urls = [\"redis://127.0.0.1:7001\", \"redis://127.0.0.1:7002\", \"redis://127.0.0.1:7003\"]\n\
         [[routes]]\nname = \"w\"\nmatch = \"/w/{id}\"\nmethods = [\"PUT\"]\n\
         serialize = { key = \"/w/{id}\", fence_header = \"fencing-token\", lock = \"orders-zk\" }\n",
    ))
    .unwrap();
    let kinds: Vec<(&str, &str)> = config
        .locks
        .iter()
        .map(|l| (l.name.as_str(), l.backend.kind()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("orders-db", "mysql"),
            ("orders-etcd", "etcd"),
            ("orders-rl", "redlock"),
            ("orders-zk", "zookeeper")
        ]
    );
    assert!(
        !format!("{:?}", config.locks).contains("secret"),
        "a password is never shown"
    );
    assert_eq!(
        config.routes[0]
            .serialize
            .as_ref()
            .and_then(|s| s.lock.as_deref()),
        Some("orders-zk")
    );
}

#[test]
fn lock_service_errors_name_the_line_and_key() {
    assert_eq!(
        problem(&with_minimal(
            "[locks.rl]\nbackend = \"redlock\"\nurls = [\"redis://127.0.0.1:7001\", \"redis://127.0.0.1:7002\"]\n"
        )),
        "test.toml:5: locks.rl.urls: expected at least 3 servers, got 2"
    );
    assert_eq!(
        problem(&with_minimal(
            "[locks.e]\nbackend = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]\n"
        )),
        "test.toml:5: locks.e.endpoints[0]: expected a URL like \"http://127.0.0.1:…\", got \
         \"127.0.0.1:2379\""
    );
    let unknown = problem(&with_minimal(
        "[locks.z]\nbackend = \"zookeeper\"\nconnect = \"127.0.0.1:2181\"\ntable = \"x\"\n",
    ));
    assert!(unknown.starts_with("test.toml:"), "{unknown}");
    assert!(unknown.contains("table"), "{unknown}");
    assert_eq!(
        problem(&with_minimal(
            "[[routes]]\nname = \"w\"\nmatch = \"/w/{id}\"\nmethods = [\"PUT\"]\n\
             serialize = { key = \"/w/{id}\", fence_header = \"f\", lock = \"nope\" }\n"
        )),
        "test.toml:7: routes[0].serialize.lock: expected the name of a [locks.<name>] section, \
         but none is defined, got \"nope\""
    );
}

#[test]
fn a_zookeeper_route_lease_is_at_most_the_session_timeout() {
    let zk = "[locks.zk]\nbackend = \"zookeeper\"\nconnect = \"127.0.0.1:2181\"\n\
              session_timeout = \"3s\"\n\
              [[routes]]\nname = \"w\"\nmatch = \"/w/{id}\"\nmethods = [\"PUT\"]\n";
    assert_eq!(
        problem(&with_minimal(&format!(
            "{zk}serialize = {{ key = \"/w/{{id}}\", fence_header = \"f\", lock = \"zk\", \
             lease = \"4s\" }}\n"
        ))),
        "test.toml:11: routes[0].serialize.lease: expected a lease of at most \
         locks.zk.session_timeout (\"3s\"): a ZooKeeper lock lasts as long as its session, \
         which the server ends that long after it last heard from this instance, got \"4s\""
    );
    // The default lease (5s) is over a 3s session too; 3s is fine.
    assert!(
        problem(&with_minimal(&format!(
            "{zk}serialize = {{ key = \"/w/{{id}}\", fence_header = \"f\", lock = \"zk\" }}\n"
        )))
        .contains("routes[0].serialize.lease: expected a lease of at most")
    );
    assert!(
        load(&with_minimal(&format!(
            "{zk}serialize = {{ key = \"/w/{{id}}\", fence_header = \"f\", lock = \"zk\", \
             lease = \"3s\" }}\n"
        )))
        .is_ok()
    );
}

#[test]
fn etcd_and_zookeeper_addresses_and_credentials_are_checked_before_connecting() {
    let etcd = |rest: &str| {
        problem(&with_minimal(&format!(
            "[locks.e]\nbackend = \"etcd\"\n{rest}"
        )))
    };
    assert_eq!(
        etcd("endpoints = [\"http://127.0.0.1:2379\", \"http://127.0.0.1\"]\n"),
        "test.toml:5: locks.e.endpoints[1]: expected http://host:port like \
         \"http://127.0.0.1:2379\" (no port in \"127.0.0.1\"), got \"http://127.0.0.1\""
    );
    assert_eq!(
        etcd("endpoints = [\"http://127.0.0.1:99999\"]\n"),
        "test.toml:5: locks.e.endpoints[0]: expected http://host:port like \
         \"http://127.0.0.1:2379\" (port \"99999\" is not a port from 1 to 65535), got \
         \"http://127.0.0.1:99999\""
    );
    assert_eq!(
        etcd("endpoints = [\"http://127.0.0.1:2379\"]\nusername = \"root\"\n"),
        "test.toml:6: locks.e.username: expected a password too: etcd authenticates with both"
    );
    assert_eq!(
        etcd("endpoints = [\"http://127.0.0.1:2379\"]\npassword = \"s3cret\"\n"),
        "test.toml:6: locks.e.password: expected a username too: etcd authenticates with both"
    );
    let zk = |connect: &str| {
        problem(&with_minimal(&format!(
            "[locks.z]\nbackend = \"zookeeper\"\nconnect = \"{connect}\"\n"
        )))
    };
    assert_eq!(
        zk("zk1:2181,zk2"),
        "test.toml:5: locks.z.connect: expected host:port[,host:port…][/chroot] like \
         \"127.0.0.1:2181\" (no port in \"zk2\"), got \"zk1:2181,zk2\""
    );
    assert_eq!(
        zk(""),
        "test.toml:5: locks.z.connect: expected host:port[,host:port…][/chroot] like \
         \"127.0.0.1:2181\" (no server), got \"\""
    );
    for fine in [
        "127.0.0.1:2181",
        "zk1:2181,zk2:2181,[::1]:2181/apps",
        "tcp://zk1:2181",
    ] {
        assert!(
            load(&with_minimal(&format!(
                "[locks.z]\nbackend = \"zookeeper\"\nconnect = \"{fine}\"\n"
            )))
            .is_ok(),
            "{fine}"
        );
    }
    assert!(
        load(&with_minimal(
            "[locks.e]\nbackend = \"etcd\"\nendpoints = [\"http://[::1]:2379/\"]\n\
             username = \"u\"\npassword = \"p\"\n"
        ))
        .is_ok()
    );
}

#[test]
fn mysql_and_redlock_urls_are_checked_by_their_clients() {
    let bad_port = problem(&with_minimal(
        "[locks.db]\nbackend = \"mysql\"\nurl = \"mysql://u:secret@127.0.0.1:notaport/app\"\n",
    ));
    assert!(
        bad_port.starts_with("test.toml:5: locks.db.url: expected a URL like \"mysql://"),
        "{bad_port}"
    );
    assert!(!bad_port.contains("secret"), "{bad_port}");
    let bad_master = problem(&with_minimal(
        "[locks.rl]\nbackend = \"redlock\"\nurls = [\"redis://127.0.0.1:7001\", \
         \"redis://127.0.0.1:x\", \"redis://127.0.0.1:7003\"]\n",
    ));
    assert!(
        bad_master.starts_with("test.toml:5: locks.rl.urls[1]: expected a Redis URL"),
        "{bad_master}"
    );
}

#[test]
fn connection_timeouts_are_above_zero_and_keepalive_is_apart_from_the_head() {
    for key in [
        "header_read_timeout",
        "keepalive_timeout",
        "lingering_time",
        "lingering_timeout",
    ] {
        let text = format!("{MINIMAL}[server]\n{key} = \"0s\"\n");
        let problem = problem(&text);
        assert!(
            problem.starts_with(&format!(
                "test.toml:4: server.{key}: expected a duration above zero like"
            )),
            "{problem}"
        );
    }
    let config = load(MINIMAL).unwrap();
    assert_eq!(config.server.keepalive_timeout, Duration::from_secs(75));
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
    // Shorter than the time a head may take: accepted, with a warning on its line.
    let config = load(&with_minimal(
        "[server]\nheader_read_timeout = \"2m\"\nkeepalive_timeout = \"1m\"\n",
    ))
    .unwrap();
    let warnings: Vec<String> = config.warnings().iter().map(ToString::to_string).collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(
            "test.toml:5: server.keepalive_timeout: 1m is shorter than \
             server.header_read_timeout (2m): an idle connection is closed after \
             keepalive_timeout"
        ),
        "{warnings:?}"
    );
}
