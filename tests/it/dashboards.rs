//! The observability deliverables in `dashboards/`: the Grafana dashboard
//! (`cacheguard.json`), Grafana provisioning, the Prometheus scrape config
//! (`prometheus.yml`) and its alerting rules (`alerts.yml`).
//!
//! - [`dashboard_and_rule_files_are_well_formed`]: the dashboard JSON (unique panel ids, the
//!   `datasource` variable used by every panel and target, the `instance` variable, range
//!   vectors over `$__rate_interval`, every metric defined in `src/metrics.rs`), the
//!   provisioning files, and `promtool check rules` / `promtool check config`.
//! - [`every_panel_and_alert_expression_returns_data`]: two cacheguard instances against a
//!   real redis-server, a real Prometheus (Debian's `prometheus` package) scraping both every
//!   second with `dashboards/alerts.yml` loaded, and a short bounded load that drives every
//!   protection and every alert condition (a Redis cut for one instance, a restart with a
//!   damaged journal record, a Bloom source that is down, an origin answering 500 under lock
//!   contention, a burst past the origin guard, a hot key, a dead consumer of the
//!   invalidation stream, a dead scrape target, a flash sale on a stock gate: sold out,
//!   replays, 409 and 422, not_sold and in-doubt answers, a restock, sources that give no
//!   count, buys while Redis is cut). Then every panel target and every alert
//!   expression is evaluated through Prometheus's HTTP API: each must succeed and return
//!   data, and each alert must be pending or firing. All failures are reported at once.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::common;
use crate::common::{
    CgConfig, HttpClient, IdsFault, RedisServer, Resp, TcpProxy, TestOrigin, bloom_table,
    buy_route, free_port, item_route, kv_routes, metric, no_poke, orders, poll_until, post, put,
    route, set_seats, stock_table, url, wait_metric,
};

const TOKEN: &str = "dashboards-admin-token-0123";

/// How often a wait on a metric polls `/metrics`.
const POLL_EVERY: Duration = Duration::from_millis(50);
/// What `$__rate_interval` becomes: Grafana's value for a 1 s scrape interval is far
/// smaller; 30 s keeps every `rate()` well fed.
const RATE_INTERVAL: &str = "30s";
/// Instance A's origin guard, also what the dashboard's cap variables are set to.
const A_MAX_CONCURRENCY: usize = 12;
const A_MAX_RPS: u32 = 500;
const DATASOURCE: &str = "${datasource}";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

// === the dashboard ===

fn load_dashboard() -> Value {
    serde_json::from_str(&read("dashboards/cacheguard.json"))
        .unwrap_or_else(|e| panic!("dashboards/cacheguard.json is not JSON: {e}"))
}

/// Every panel, rows and the panels of collapsed rows included.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(panels: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in panels.as_array().into_iter().flatten() {
            out.push(panel);
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// One query of one panel.
#[derive(Clone, Debug)]
struct Target {
    panel: String,
    ref_id: String,
    /// As written in the dashboard.
    raw: String,
    /// With the variables substituted (see [`substitute`]).
    expr: String,
    legend: String,
}

impl Target {
    fn name(&self) -> String {
        format!("panel {:?} target {}", self.panel, self.ref_id)
    }
}

/// The dashboard's variables as the test sets them: every instance.
fn substitute(expr: &str) -> String {
    let mut out = expr.to_owned();
    for (var, value) in [
        ("__rate_interval", RATE_INTERVAL.to_owned()),
        ("instance", ".*".to_owned()),
    ] {
        out = out
            .replace(&format!("${{{var}}}"), &value)
            .replace(&format!("${var}"), &value);
    }
    out
}

fn targets(dashboard: &Value) -> Vec<Target> {
    let mut out = Vec::new();
    for panel in all_panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or("<untitled>");
        let id = &panel["id"];
        for target in panel["targets"].as_array().into_iter().flatten() {
            let raw = target["expr"].as_str().unwrap_or_default().to_owned();
            out.push(Target {
                panel: format!("{id} {title}"),
                ref_id: target["refId"].as_str().unwrap_or("?").to_owned(),
                expr: substitute(&raw),
                raw,
                legend: target["legendFormat"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            });
        }
    }
    out
}

fn variable<'a>(dashboard: &'a Value, name: &str) -> Option<&'a Value> {
    dashboard["templating"]["list"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == name)
}

/// `(metric, label)` of the `instance` variable's `label_values(metric, label)` query.
fn instance_variable_query(dashboard: &Value) -> Result<(String, String), String> {
    let var = variable(dashboard, "instance").ok_or("no `instance` variable")?;
    let query = var["query"]["query"]
        .as_str()
        .or_else(|| var["query"].as_str())
        .ok_or("the `instance` variable has no query")?;
    let args = query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|rest| rest.strip_suffix(')'))
        .ok_or_else(|| format!("`instance` is not label_values(metric, label): {query}"))?;
    let (metric, label) = args
        .split_once(',')
        .ok_or_else(|| format!("`instance` query needs a metric and a label: {query}"))?;
    Ok((metric.trim().to_owned(), label.trim().to_owned()))
}

// === PromQL references ===

/// What an expression refers to: metric names and label names.
#[derive(Debug, Default)]
struct Refs {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    Other,
}

/// Aggregations, keywords and operators that read like identifiers (besides
/// [`LABEL_LISTS`]).
const NOT_METRICS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
];
/// Keywords followed by a parenthesized list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Whether `name` is one of [`NOT_METRICS`] or [`LABEL_LISTS`].
fn is_keyword(name: &str) -> bool {
    NOT_METRICS.contains(&name) || LABEL_LISTS.contains(&name)
}

fn tokenize(expr: &str) -> Vec<Tok> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(Tok::Other);
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
            out.push(Tok::Other);
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            out.push(Tok::Ident(chars[start..i].iter().collect()));
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            out.push(Tok::Other);
        } else {
            if !c.is_whitespace() {
                out.push(Tok::Punct(c));
            }
            i += 1;
        }
    }
    out
}

fn refs(expr: &str) -> Refs {
    let toks = tokenize(expr);
    let mut out = Refs::default();
    let mut in_braces = false;
    let mut i = 0;
    while i < toks.len() {
        let next = toks.get(i + 1);
        match &toks[i] {
            Tok::Punct('{') => in_braces = true,
            Tok::Punct('}') => in_braces = false,
            Tok::Ident(name) if in_braces => {
                if matches!(next, Some(Tok::Punct('=' | '!'))) {
                    out.labels.insert(name.clone());
                }
            }
            Tok::Ident(kw)
                if LABEL_LISTS.contains(&kw.as_str()) && next == Some(&Tok::Punct('(')) =>
            {
                i += 2;
                while i < toks.len() && toks[i] != Tok::Punct(')') {
                    if let Tok::Ident(label) = &toks[i] {
                        out.labels.insert(label.clone());
                    }
                    i += 1;
                }
            }
            Tok::Ident(_) if next == Some(&Tok::Punct('(')) => {} // a function
            Tok::Ident(name) if is_keyword(name) => {}
            Tok::Ident(name) => {
                out.metrics.insert(name.clone());
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Problems with the metric names of `expr` against `src/metrics.rs` (the only source of
/// truth): each `cacheguard_*` name, less a histogram suffix, must be defined there.
fn undefined_metrics(expr: &str, metrics_rs: &str) -> Vec<String> {
    refs(expr)
        .metrics
        .into_iter()
        .filter(|name| name != "up" && !metric_or_series_defined(name, metrics_rs))
        .collect()
}

/// Every `[...]` range of `expr` (as written).
fn ranges(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find('[') {
        let after = &rest[start + 1..];
        let Some(end) = after.find(']') else {
            out.push(after.to_owned());
            break;
        };
        out.push(after[..end].to_owned());
        rest = &after[end + 1..];
    }
    out
}

/// The `{{label}}` names of a legend format.
fn legend_labels(legend: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = legend;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else { break };
        out.push(after[..end].trim().to_owned());
        rest = &after[end + 2..];
    }
    out
}

/// The `$labels.X` names an annotation template uses.
fn template_labels(text: &str) -> Vec<String> {
    text.split("$labels.")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn promql_scanner_finds_metrics_and_labels() {
    let expr = r#"histogram_quantile(0.99, sum by (le, op) (rate(cacheguard_x_bucket{instance=~".*", outcome!="by"}[30s]))) / on (job) group_left (route) max without (filter) (up) > bool 0"#;
    let found = refs(expr);
    assert_eq!(
        found.metrics.iter().map(String::as_str).collect::<Vec<_>>(),
        ["cacheguard_x_bucket", "up"]
    );
    assert_eq!(
        found.labels.iter().map(String::as_str).collect::<Vec<_>>(),
        ["filter", "instance", "job", "le", "op", "outcome", "route"]
    );
    assert_eq!(
        ranges("rate(a[$__rate_interval]) + rate(b[5m])"),
        ["$__rate_interval", "5m"]
    );
    assert_eq!(legend_labels("{{route}} x {{ to }}"), ["route", "to"]);
    assert_eq!(
        template_labels("on {{ $labels.instance }}/{{$labels.filter}}"),
        ["instance", "filter"]
    );
    assert_eq!(
        substitute("rate(x{instance=~\"$instance\"}[$__rate_interval]) > ${instance}"),
        format!("rate(x{{instance=~\".*\"}}[{RATE_INTERVAL}]) > .*")
    );
}

// === promtool ===

/// Panics with an install hint when `tool` cannot run.
fn require_tool(tool: &str) {
    let runs = Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        runs,
        "`{tool}` is not installed: this test needs Debian's `prometheus` package, which ships \
         `prometheus` and `promtool` (`bash scripts/test.sh` installs it; or \
         `apt-get install -y prometheus`)"
    );
}

fn promtool(args: &[&str]) -> Result<String, String> {
    require_tool("promtool");
    let out = Command::new("promtool")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run promtool {args:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("promtool {} failed:\n{text}", args.join(" ")))
    }
}

// === the static checks ===

#[test]
fn dashboard_and_rule_files_are_well_formed() {
    let dashboard = load_dashboard();
    let metrics_rs = read("src/metrics.rs");
    let mut problems = Vec::new();

    if dashboard["schemaVersion"].as_u64().unwrap_or(0) < 36 {
        problems.push(format!("schemaVersion {} < 36", dashboard["schemaVersion"]));
    }
    match variable(&dashboard, "datasource") {
        Some(v) if v["type"] == "datasource" && v["query"] == "prometheus" => {}
        other => problems.push(format!(
            "no `datasource` variable of type datasource with query prometheus: {other:?}"
        )),
    }
    match variable(&dashboard, "instance") {
        Some(v) if v["type"] == "query" && v["datasource"]["uid"] == DATASOURCE => {}
        other => problems.push(format!(
            "`instance` must be a query variable on ${{datasource}}: {other:?}"
        )),
    }
    match instance_variable_query(&dashboard) {
        Ok((metric, label)) => {
            if label != "instance" || !metric_defined(&metric, &metrics_rs) {
                problems.push(format!(
                    "`instance` variable: label_values({metric}, {label}) is not a cacheguard metric's instance label"
                ));
            }
        }
        Err(e) => problems.push(e),
    }

    let expected_ds = serde_json::json!({"type": "prometheus", "uid": DATASOURCE});
    let mut ids = BTreeMap::<i64, usize>::new();
    let panels = all_panels(&dashboard);
    let mut rows = 0;
    for panel in &panels {
        let title = panel["title"].as_str().unwrap_or("<untitled>");
        match panel["id"].as_i64() {
            Some(id) => *ids.entry(id).or_default() += 1,
            None => problems.push(format!("panel {title:?} has no integer id")),
        }
        if panel["datasource"] != expected_ds {
            problems.push(format!(
                "panel {title:?} does not use the datasource variable: {}",
                panel["datasource"]
            ));
        }
        if panel["type"] == "row" {
            rows += 1;
            continue;
        }
        let targets = panel["targets"].as_array().map_or(0, Vec::len);
        if targets == 0 {
            problems.push(format!("panel {title:?} has no targets"));
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            if target["datasource"] != expected_ds {
                problems.push(format!(
                    "panel {title:?} target {} does not use the datasource variable",
                    target["refId"]
                ));
            }
        }
    }
    for (id, n) in &ids {
        if *n > 1 {
            problems.push(format!("panel id {id} is used {n} times"));
        }
    }
    if rows < 6 {
        problems.push(format!(
            "{rows} rows: expected overview plus one per protection"
        ));
    }

    let targets = targets(&dashboard);
    for t in &targets {
        if t.raw.trim().is_empty() {
            problems.push(format!("{}: empty expression", t.name()));
            continue;
        }
        for range in ranges(&t.raw) {
            if range != "$__rate_interval" {
                problems.push(format!(
                    "{}: range [{range}] instead of [$__rate_interval]",
                    t.name()
                ));
            }
        }
        if t.expr.contains('$') {
            problems.push(format!(
                "{}: a variable the test does not know: {}",
                t.name(),
                t.raw
            ));
        }
        for name in undefined_metrics(&t.expr, &metrics_rs) {
            problems.push(format!(
                "{}: metric {name} is not defined in src/metrics.rs",
                t.name()
            ));
        }
    }

    // A hit ratio's denominator leaves out what no cache could have answered: bypasses and
    // a stock gate's own answers (a flash sale's crowd would otherwise sink it to 0).
    for t in &targets {
        let denominators = t.raw.matches("outcome!").count();
        let right = t
            .raw
            .matches(r#"outcome!~"bypass|sold_out|replayed""#)
            .count();
        if denominators != right {
            problems.push(format!(
                "{}: a hit ratio over answers that are not cache answers (want outcome!~\"bypass|sold_out|replayed\"): {}",
                t.name(),
                t.raw
            ));
        }
    }

    // Grafana provisioning.
    let datasource = read("dashboards/provisioning/datasources/prometheus.yml");
    for needle in [
        "type: prometheus",
        "uid: prometheus",
        "url: http://prometheus:9090",
    ] {
        if !datasource.contains(needle) {
            problems.push(format!(
                "provisioning/datasources/prometheus.yml lacks `{needle}`"
            ));
        }
    }
    let provider = read("dashboards/provisioning/dashboards/cacheguard.yml");
    for needle in ["type: file", "path: /var/lib/grafana/dashboards"] {
        if !provider.contains(needle) {
            problems.push(format!(
                "provisioning/dashboards/cacheguard.yml lacks `{needle}`"
            ));
        }
    }
    let scrape = read("dashboards/prometheus.yml");
    for needle in [
        "job_name: cacheguard",
        "cacheguard-a:9091",
        "cacheguard-b:9091",
        "scrape_interval: 5s",
        "- alerts.yml",
    ] {
        if !scrape.contains(needle) {
            problems.push(format!("dashboards/prometheus.yml lacks `{needle}`"));
        }
    }

    // Prometheus's own checks (check config also checks the rule file it names).
    let alerts = repo("dashboards/alerts.yml");
    let config = repo("dashboards/prometheus.yml");
    for args in [
        ["check", "rules", path_str(&alerts)],
        ["check", "config", path_str(&config)],
    ] {
        match promtool(&args) {
            Ok(out) => eprintln!("promtool {}: {}", args.join(" "), out.trim()),
            Err(e) => problems.push(e),
        }
    }
    // Every metric named anywhere (expressions, descriptions, annotations) is defined.
    for file in ["dashboards/alerts.yml", "dashboards/cacheguard.json"] {
        for name in named_metrics(&read(file)) {
            if !metric_or_series_defined(&name, &metrics_rs) {
                problems.push(format!("{file}: {name} is not defined in src/metrics.rs"));
            }
        }
    }

    assert!(
        problems.is_empty(),
        "{} problem(s) with dashboards/:\n{}",
        problems.len(),
        problems.join("\n")
    );
    eprintln!(
        "dashboard: {} panels ({rows} rows), {} targets",
        panels.len(),
        targets.len()
    );
}

fn metric_defined(name: &str, metrics_rs: &str) -> bool {
    metrics_rs.contains(&format!("\"{name}\""))
}

/// A metric family, or a histogram's `_bucket` / `_sum` / `_count` series of one.
fn metric_or_series_defined(name: &str, metrics_rs: &str) -> bool {
    metric_defined(name, metrics_rs)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .any(|base| metric_defined(base, metrics_rs))
}

/// Every `cacheguard_*` word in `text`.
fn named_metrics(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("cacheguard_"))
        .map(str::to_owned)
        .collect()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("repo path is UTF-8")
}

// === a real Prometheus ===

/// `prometheus` on a free loopback port, its TSDB in a tempdir. Killed by PID on `Drop`.
struct Prometheus {
    child: Option<Child>,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    const READY_TIMEOUT: Duration = Duration::from_secs(20);

    async fn start(config: &str) -> Prometheus {
        require_tool("prometheus");
        let dir = tempfile::tempdir().expect("tempdir for prometheus");
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let mut prom = Prometheus {
            child: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
        };
        let client = HttpClient::new();
        for _attempt in 0..5 {
            prom.addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let log = std::fs::File::create(prom.log_path()).expect("prometheus log file");
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    prom.dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={}", prom.addr))
                .arg("--storage.tsdb.retention.time=1h")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("clone log file"))
                .stderr(log)
                .spawn()
                .expect("spawn prometheus");
            prom.child = Some(child);
            let ready_url = format!("http://{}/-/ready", prom.addr);
            let deadline = Instant::now() + Self::READY_TIMEOUT;
            loop {
                if let Some(child) = prom.child.as_mut()
                    && let Ok(Some(status)) = child.try_wait()
                {
                    prom.child = None;
                    let log = prom.log();
                    if log.contains("address already in use") {
                        break; // another port
                    }
                    panic!("prometheus exited early with {status}:\n{log}");
                }
                if client.answers_200(&ready_url, Duration::from_secs(1)).await {
                    return prom;
                }
                if Instant::now() >= deadline {
                    panic!(
                        "prometheus not ready within {:?}:\n{}",
                        Self::READY_TIMEOUT,
                        prom.log()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("prometheus could not bind a free port:\n{}", prom.log());
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("prometheus.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// GET an API path; the `data` of a `success` answer.
    async fn api(&self, client: &HttpClient, path_and_query: &str) -> Result<Value, String> {
        let resp = client
            .try_get(&format!("http://{}{path_and_query}", self.addr))
            .await?;
        let doc: Value = serde_json::from_slice(&resp.body)
            .map_err(|e| format!("HTTP {}: not JSON ({e}): {}", resp.status, resp.text()))?;
        if doc["status"] != "success" {
            return Err(format!("{}: {}", doc["errorType"], doc["error"]));
        }
        Ok(doc["data"].clone())
    }

    /// An instant query: the result series (a scalar counts as one).
    async fn query(&self, client: &HttpClient, expr: &str) -> Result<Vec<Value>, String> {
        let encoded =
            percent_encoding::utf8_percent_encode(expr, percent_encoding::NON_ALPHANUMERIC);
        let data = self
            .api(client, &format!("/api/v1/query?query={encoded}"))
            .await?;
        match data["resultType"].as_str() {
            Some("vector" | "matrix") => Ok(data["result"].as_array().cloned().unwrap_or_default()),
            Some("scalar" | "string") => Ok(vec![data["result"].clone()]),
            other => Err(format!("unexpected resultType {other:?}")),
        }
    }

    /// Label names of the series of `metric`.
    async fn labels_of(
        &self,
        client: &HttpClient,
        metric: &str,
    ) -> Result<BTreeSet<String>, String> {
        let matcher = format!("{{__name__=\"{metric}\"}}");
        let encoded =
            percent_encoding::utf8_percent_encode(&matcher, percent_encoding::NON_ALPHANUMERIC);
        let data = self
            .api(client, &format!("/api/v1/labels?match%5B%5D={encoded}"))
            .await?;
        Ok(data
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect())
    }

    /// The alerting rules Prometheus loaded.
    async fn rules(&self, client: &HttpClient) -> Result<Vec<Value>, String> {
        let data = self.api(client, "/api/v1/rules?type=alert").await?;
        Ok(data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL to this PID
            let _ = child.wait();
        }
    }
}

// === the fleet ===

/// The fleet's routes: `item` (checked against the `items` filter) and `item-create`
/// (adds to it), `thing` (warmed up at start), the KV routes, the filters `items` and
/// `ghost`, and `buy`, bound to the stock gate [`GATE`].
fn routes() -> String {
    [
        item_route(r#"bloom = { filter = "items", param = "id" }"#),
        route(
            "item-create",
            "/api/items",
            "POST",
            r#"bloom_add = { filter = "items", from = "location" }"#,
        ),
        route(
            "thing",
            "/api/things/{id}",
            "GET",
            r#"warmup = { paths = ["/api/things/warm-1", "/api/things/warm-2"], rate = 10 }"#,
        ),
        kv_routes("200ms", true, Some("all")),
        // Sized for 200 ids and loaded with 400: overfull, so it rejects most absent ids
        // and lets a measurable share through (false positives).
        bloom_table("items", 200, 0.01, "2s", r#"{ url = "/internal/ids" }"#),
        // Its source is down from the start: never loaded.
        bloom_table(
            "ghost",
            1000,
            0.01,
            "1s",
            &format!("{{ url = {GHOST_IDS_PATH:?} }}"),
        ),
        buy_route(GATE),
        stock_table(GATE, r#"reconcile = "1s""#),
    ]
    .concat()
}

const GATE: &str = "seats";

const ITEM_IDS: u64 = 400;
const GHOST_IDS_PATH: &str = "/internal/ghost-ids";

fn fleet_config(origin: &TestOrigin, redis_url: &str) -> CgConfig {
    CgConfig::new(origin)
        .set_str("redis", "url", redis_url)
        .set_str("redis", "command_timeout", "200ms")
        .set_str("admin", "token", TOKEN)
        .set("hot_keys", "threshold_rps", "20")
        .set_str("hot_keys", "l1_ttl", "50ms")
        .set("hot_keys", "max_backend_rps_per_key", "1")
        // The dead consumer's entries stay pending for the whole test.
        .set_str("invalidation_stream", "claim_idle", "60s")
        .routes(&routes())
}

async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> Resp {
    client.get(&url(addr, path)).await
}

async fn shutdown(cg: cacheguard::Running) {
    tokio::time::timeout(Duration::from_secs(15), cg.shutdown())
        .await
        .expect("cacheguard shutdown did not finish within 15s");
}

/// `conns` keep-alive clients GET `path` in closed loops, each for at most `duration` and
/// `per_conn` requests; the answers tallied by status and X-Cache.
async fn hammer(
    addr: SocketAddr,
    path: &str,
    conns: usize,
    duration: Duration,
    per_conn: usize,
) -> BTreeMap<String, u64> {
    let deadline = Instant::now() + duration;
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let target = url(addr, path);
            tokio::spawn(async move {
                let client = HttpClient::new();
                let mut tally = BTreeMap::<String, u64>::new();
                for _ in 0..per_conn {
                    if Instant::now() >= deadline {
                        break;
                    }
                    let key = match client.try_get(&target).await {
                        Ok(r) => format!("{} {}", r.status.as_u16(), r.x_cache()),
                        Err(_) => "transport error".to_owned(),
                    };
                    *tally.entry(key).or_default() += 1;
                }
                tally
            })
        })
        .collect();
    let mut all = BTreeMap::new();
    for task in tasks {
        let tally = tokio::time::timeout(duration + Duration::from_secs(20), task)
            .await
            .expect("a load task did not finish")
            .expect("a load task panicked");
        for (k, v) in tally {
            *all.entry(k).or_default() += v;
        }
    }
    all
}

/// GETs of every path at once, each its own task; the statuses (0 = transport error).
async fn burst(client: &HttpClient, addr: SocketAddr, paths: &[String]) -> Vec<u16> {
    let tasks: Vec<_> = paths
        .iter()
        .map(|p| {
            let (client, target) = (client.clone(), url(addr, p));
            tokio::spawn(async move { client.try_get(&target).await })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        let answer = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("a burst request did not finish")
            .expect("a burst task panicked");
        out.push(answer.map_or(0, |r| r.status.as_u16()));
    }
    out
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

/// The seats the flash sale sells: `t1/a` (10, the sale), `t1/b` (5, keyed buys), `t1/c`
/// (5, a slow buy), `t1/d` (3, buys the origin refuses with a `not_sold` 422), `t1/e` (3,
/// buys it fails with 500: in doubt) and `t2/a` (1000, bought while Redis is cut). Seats
/// `t1/x*` have no count at the origin: their loads fail.
fn seats_on_sale(origin: &TestOrigin) {
    for (train, kind, n) in [
        ("t1", "a", 10),
        ("t1", "b", 5),
        ("t1", "c", 5),
        ("t1", "d", 3),
        ("t1", "e", 3),
        ("t2", "a", 1000),
    ] {
        set_seats(origin, train, kind, n);
    }
    origin.set_status(&orders("t1", "d"), 422);
    origin.set_status(&orders("t1", "e"), 500);
    origin.set_delay(&orders("t1", "c"), Duration::from_millis(600));
}

/// A flash sale on the stock gate over both instances: every decision, settlement and
/// reconcile result the stock panels chart, and enough failed loads for the reconcile alert.
async fn flash_sale(client: &HttpClient, origin: &TestOrigin, a: SocketAddr, b: SocketAddr) {
    let buy = |addr: SocketAddr, train: &str, kind: &str, key: Option<&str>, body: &str| {
        let (client, target) = (client.clone(), url(addr, &orders(train, kind)));
        let key = key.map(str::to_owned);
        let body = body.to_owned();
        async move {
            let headers: Vec<(&str, &str)> = key
                .as_deref()
                .map(|k| ("idempotency-key", k))
                .into_iter()
                .collect();
            post(&client, &target, &headers, &body).await
        }
    };
    // The sale: 10 seats, 30 buyers over both instances.
    let mut statuses = BTreeMap::<String, u32>::new();
    for n in 0..30 {
        let r = buy(if n % 2 == 0 { a } else { b }, "t1", "a", None, "").await;
        *statuses
            .entry(format!("{} {}", r.status.as_u16(), r.x_cache()))
            .or_default() += 1;
    }
    eprintln!("the sale: {statuses:?}");
    assert_eq!(origin.seats("/trains/t1/seats/a"), Some(0), "{statuses:?}");
    assert!(
        statuses.keys().any(|k| k.ends_with("SOLDOUT")),
        "{statuses:?}"
    );
    // Idempotency keys: a buy, its replay on the other instance, its key with another body,
    // a key that is none; a retry while the first is still at the (slow) origin.
    assert_eq!(buy(a, "t1", "b", Some("k1"), "x").await.status, 200);
    assert_eq!(
        buy(b, "t1", "b", Some("k1"), "x").await.x_cache(),
        "REPLAYED"
    );
    assert_eq!(buy(b, "t1", "b", Some("k1"), "y").await.status, 422);
    assert_eq!(buy(a, "t1", "b", Some("no key"), "x").await.status, 400);
    let slow = tokio::spawn(buy(a, "t1", "c", Some("k2"), "x"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(buy(b, "t1", "c", Some("k2"), "x").await.status, 409);
    assert_eq!(slow.await.expect("the slow buy").status, 200);
    // The origin's answers: nothing sold (the unit goes back), and in doubt.
    assert_eq!(buy(a, "t1", "d", None, "").await.status, 422);
    assert_eq!(buy(b, "t1", "e", None, "").await.status, 500);
    // A restock of the sold-out seats: once the marks lapse (the gate's reconcile, 1 s), a
    // buy asks Redis, finds none and nothing in flight, and the reconcile that follows
    // takes the origin's new count (a positive delta).
    set_seats(origin, "t1", "a", 4);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let restocked = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async { (buy(a, "t1", "a", None, "").await.status == 200).then_some(()) },
    )
    .await;
    assert!(restocked.is_some(), "the restock never reached the gate");
    // Seats whose source gives no count: each load fails (503 not_loaded).
    for n in 0..6 {
        let kind = format!("x{n}");
        assert_eq!(buy(b, "t1", &kind, None, "").await.status, 503);
    }
}

/// The test's Prometheus config: both instances and one dead target, every second.
fn prometheus_config(targets: &[String], rules: &Path) -> String {
    let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - '{}'\n\
         scrape_configs:\n  - job_name: cacheguard\n    static_configs:\n      - targets: [{}]\n",
        rules.display(),
        targets.join(", ")
    )
}

// === the live check ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_expression_returns_data() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let started = Instant::now();
    let step = |what: &str| eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
    require_tool("prometheus");
    let dashboard = load_dashboard();
    let targets = targets(&dashboard);

    // --- the fleet: A reaches Redis through a proxy that can cut it, B directly ---
    let redis = RedisServer::start().await;
    let link = TcpProxy::start(redis.addr()).await;
    let origin = TestOrigin::builder()
        .ids((1..=ITEM_IDS).map(|i| i.to_string()))
        .start()
        .await;
    origin.enable_items_api();
    origin.enable_kv();
    origin.set_kv_tags(true);
    origin.set_status(GHOST_IDS_PATH, 503);
    seats_on_sale(&origin);

    // Fixed ports, so Prometheus can be started first (its scrape manager takes about 5 s
    // to begin) and A keeps its `instance` label across its restart.
    let addr = || SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (a_listen, a_admin, b_listen, b_admin, dead) = (addr(), addr(), addr(), addr(), addr());
    let prom = Prometheus::start(&prometheus_config(
        &[a_admin.to_string(), b_admin.to_string(), dead.to_string()],
        &repo("dashboards/alerts.yml"),
    ))
    .await;
    step("prometheus started");

    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("a.journal");
    let a_cfg = fleet_config(&origin, &link.redis_url())
        .set_str("server", "listen", &a_listen.to_string())
        .set_str("admin", "listen", &a_admin.to_string())
        .set_str("journal", "path", &journal.display().to_string())
        .set(
            "upstream",
            "max_concurrency",
            &A_MAX_CONCURRENCY.to_string(),
        )
        .set("upstream", "max_rps", &A_MAX_RPS.to_string())
        .set_str("upstream", "queue_timeout", "50ms");
    let b_cfg = fleet_config(&origin, &redis.url())
        .set_str("server", "listen", &b_listen.to_string())
        .set_str("admin", "listen", &b_admin.to_string());
    let a = a_cfg.start().await;
    let b = b_cfg.start().await;
    let client = HttpClient::new();
    for admin in [a_admin, b_admin] {
        for (name, labels) in [
            ("cacheguard_event_bus_subscribed", vec![]),
            ("cacheguard_bloom_ready", vec![("filter", "items")]),
        ] {
            wait_metric(
                &client,
                admin,
                name,
                &labels,
                Duration::from_secs(15),
                POLL_EVERY,
                |v| v == 1.0,
                no_poke,
            )
            .await;
        }
    }
    step("fleet up");

    // --- reads: misses, L2 and L1 hits ---
    for id in 1..=30 {
        let path = format!("/api/items/{id}");
        for addr in [a_listen, b_listen, a_listen] {
            let resp = get(&client, addr, &path).await;
            assert_eq!(resp.status, 200, "GET {path}: {resp}");
        }
    }
    // --- Bloom: absent ids, rejected or (the overfull filter's false positives) passed ---
    let mut seen = BTreeMap::<String, u32>::new();
    for n in 0..130 {
        let addr = if n < 100 { a_listen } else { b_listen };
        let resp = get(&client, addr, &format!("/api/items/absent-{n}")).await;
        *seen.entry(resp.x_cache()).or_default() += 1;
    }
    eprintln!("absent ids: {seen:?}");
    for _ in 0..3 {
        let resp = post(&client, &url(a_listen, "/api/items"), &[], "{}").await;
        assert_eq!(resp.status, 201, "create: {resp}");
    }
    // --- writes: invalidation by pattern and surrogate key, quarantined fills ---
    for k in 0..10 {
        let path = format!("/kv/k{k}");
        for addr in [a_listen, a_listen, b_listen] {
            assert_eq!(get(&client, addr, &path).await.status, 200);
        }
        let written = put(&client, a_listen, &path).await;
        assert_eq!(written.status, 200, "PUT {path}: {written}");
        assert_eq!(get(&client, b_listen, &path).await.status, 200);
    }
    // --- purges: one done, one refused ---
    let purge_url = url(a_admin, "/admin/purge");
    let bearer = format!("Bearer {TOKEN}");
    let ok = post(
        &client,
        &purge_url,
        &[
            ("authorization", &bearer),
            ("content-type", "application/json"),
        ],
        r#"{"keys": ["/kv/k1"], "patterns": ["/kv/k*"], "tags": ["kv-k2"]}"#,
    )
    .await;
    assert_eq!(ok.status, 200, "purge: {ok}");
    let refused = post(
        &client,
        &purge_url,
        &[("content-type", "application/json")],
        "{}",
    )
    .await;
    assert_eq!(refused.status, 401, "purge without a token: {refused}");
    step("reads, creates, writes, purges");

    // --- the invalidation stream: one entry applied, one malformed, 150 left pending by a
    // consumer that read them and died ---
    let mut con = redis.client().await;
    let mut pipe = redis::pipe();
    pipe.cmd("XADD")
        .arg("cg:invalidate")
        .arg("*")
        .arg("path")
        .arg("/kv/k3")
        .ignore();
    pipe.cmd("XADD")
        .arg("cg:invalidate")
        .arg("*")
        .arg("nothing")
        .arg("useful")
        .ignore();
    pipe.query_async::<()>(&mut con).await.expect("XADD");
    for result in ["applied", "malformed"] {
        let handled = poll_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || async {
                let labels = [("result", result)];
                let n = metric(&client, a_admin, "cacheguard_stream_entries_total", &labels).await
                    + metric(&client, b_admin, "cacheguard_stream_entries_total", &labels).await;
                (n >= 1.0).then_some(())
            },
        )
        .await;
        assert!(handled.is_some(), "no stream entry counted {result}");
    }
    let mut pipe = redis::pipe();
    pipe.atomic();
    for n in 0..150 {
        pipe.cmd("XADD")
            .arg("cg:invalidate")
            .arg("*")
            .arg("path")
            .arg(format!("/kv/ghost-{n}"))
            .ignore();
    }
    pipe.cmd("XREADGROUP")
        .arg("GROUP")
        .arg("cacheguard")
        .arg("dead-consumer")
        .arg("COUNT")
        .arg(1000)
        .arg("STREAMS")
        .arg("cg:invalidate")
        .arg(">")
        .ignore();
    pipe.query_async::<()>(&mut con)
        .await
        .expect("XADD + XREADGROUP as a consumer that dies");
    step("stream");

    // Counters whose increase the alerts watch (lock takeovers, origin errors, Bloom load
    // failures, journal give-ups) must have been scraped at their old values first.
    // Prometheus's scrape manager starts about 5 s after the server: the traffic above
    // needs no history, so it ran meanwhile.
    let scraped = poll_until(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let up = prom.query(&client, "up == 1").await.ok()?;
            (up.len() == 2).then_some(())
        },
    )
    .await;
    assert!(
        scraped.is_some(),
        "Prometheus never scraped both instances:\n{}",
        prom.log()
    );
    step("both instances scraped");

    flash_sale(&client, &origin, a_listen, b_listen).await;
    step("flash sale");

    // --- lock takeovers: A holds each key's lock and its fetch fails (a 500 too large to
    // leave in Redis for the waiters), so B's waiter takes over ---
    let takeover: Vec<String> = (0..A_MAX_CONCURRENCY)
        .map(|i| format!("/api/things/takeover-{i}"))
        .collect();
    for path in &takeover {
        origin.set_delay(path, Duration::from_millis(400));
        origin.set_status(path, 500);
        origin.set_body(path, vec![b'e'; 100 * 1024]);
    }
    // Each of A's origin slots must be free for one of these (its queue waits 50 ms): on a
    // busy machine an earlier step's fetch can still hold one.
    let idle = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let busy = metric(&client, a_admin, "cacheguard_origin_in_flight", &[]).await;
            (busy == 0.0).then_some(())
        },
    )
    .await;
    assert!(idle.is_some(), "A's origin slots never all came free");
    let holders = {
        let (client, paths) = (client.clone(), takeover.clone());
        tokio::spawn(async move { burst(&client, a_listen, &paths).await })
    };
    let fetching = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || async { takeover.iter().all(|p| origin.count(p) >= 1).then_some(()) },
    )
    .await;
    assert!(
        fetching.is_some(),
        "A's fetches did not all reach the origin"
    );
    let waiters = burst(&client, b_listen, &takeover).await;
    let holders = holders.await.expect("holders");
    eprintln!("takeover: A answered {holders:?}, B answered {waiters:?}");
    let takeovers = metric(
        &client,
        b_admin,
        "cacheguard_lock_events_total",
        &[("outcome", "takeover")],
    )
    .await;
    eprintln!("takeovers on B: {takeovers}");
    step("lock takeovers");

    // --- A loses Redis: its breaker opens, its writes are journaled ---
    link.cut();
    let mut n = 0;
    wait_metric(
        &client,
        a_admin,
        "cacheguard_redis_breaker_open",
        &[],
        Duration::from_secs(10),
        POLL_EVERY,
        |v| v == 1.0,
        || {
            n += 1;
            let (client, path) = (client.clone(), format!("/api/things/cut-{n}"));
            async move {
                let _ = client.try_get(&url(a_listen, &path)).await;
            }
        },
    )
    .await;
    for k in 0..10 {
        let path = format!("/kv/j{k}");
        let written = put(&client, a_listen, &path).await;
        assert_eq!(written.status, 200, "PUT {path} with Redis cut: {written}");
    }
    // Buys the gate cannot decide without Redis: refused (on_redis_error = "reject"), and
    // scraped before A restarts with its counters at 0.
    for n in 0..10 {
        let r = post(&client, &url(a_listen, &orders("t2", "a")), &[], "").await;
        assert_eq!(r.status, 503, "buy {n} with Redis cut: {r}");
    }
    let scraped = poll_until(
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async {
            let errors = prom
                .query(&client, "max(cacheguard_stock_redis_errors_total) >= 6")
                .await
                .ok()?;
            (!errors.is_empty()).then_some(())
        },
    )
    .await;
    assert!(
        scraped.is_some(),
        "Prometheus never saw A's stock Redis errors:\n{}",
        prom.log()
    );
    wait_metric(
        &client,
        a_admin,
        "cacheguard_journal_depth",
        &[],
        Duration::from_secs(5),
        POLL_EVERY,
        |v| v >= 10.0,
        no_poke,
    )
    .await;
    step("A cut off from Redis, writes journaled");

    // --- the Bloom source of "items" fails from now on: the loaded filter keeps serving ---
    origin.set_ids_fault(IdsFault::Status(503));

    // --- A restarts on its journal, one record of which is damaged: a give-up ---
    shutdown(a).await;
    let text = std::fs::read_to_string(&journal).expect("read A's journal");
    std::fs::write(&journal, format!("this is not a journal record\n{text}"))
        .expect("damage A's journal");
    let a = a_cfg.start().await;
    assert_eq!(a.admin_addr(), a_admin);
    let client_a = HttpClient::new();
    let give_ups = metric(&client_a, a_admin, "cacheguard_journal_give_ups_total", &[]).await;
    assert_eq!(give_ups, 1.0, "the damaged record is given up");
    for k in 10..20 {
        let path = format!("/kv/j{k}");
        let written = put(&client_a, a_listen, &path).await;
        assert_eq!(
            written.status, 200,
            "PUT {path} after the restart: {written}"
        );
    }
    step("A restarted on a damaged journal");

    // --- a burst of distinct slow misses past A's origin guard: shed ---
    let slow: Vec<String> = (0..40).map(|i| format!("/api/things/slow-{i}")).collect();
    for path in &slow {
        origin.set_delay(path, Duration::from_millis(300));
    }
    let statuses = burst(&client_a, a_listen, &slow).await;
    eprintln!(
        "burst on A: {} answered 200, {} shed (503), {} other",
        count(&statuses, 200),
        count(&statuses, 503),
        statuses.len() - count(&statuses, 200) - count(&statuses, 503)
    );
    assert!(count(&statuses, 503) > 0, "nothing was shed: {statuses:?}");

    // --- a hot key on B, limited past L1 ---
    let tally = hammer(b_listen, "/api/items/1", 6, Duration::from_secs(3), 20_000).await;
    let limited = metric(&client, b_admin, "cacheguard_hot_key_limited_total", &[]).await;
    let requests = metric(&client, b_admin, "cacheguard_requests_total", &[]).await;
    eprintln!("hot key on B: {tally:?}; limited {limited} of {requests} requests");
    step("shed burst and hot key");

    // --- every panel target and every alert expression, through Prometheus ---
    let rules_in_file = read("dashboards/alerts.yml")
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut round = 0;
    let failures = loop {
        round += 1;
        let failures = evaluate(&prom, &client, &targets, rules_in_file).await;
        if failures.is_empty() || Instant::now() >= deadline {
            break failures;
        }
        let waiting: Vec<&str> = failures
            .iter()
            .filter_map(|f| f.split(':').next())
            .collect();
        eprintln!("round {round}: waiting for {}", waiting.join(", "));
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    step(&format!("evaluated in {round} round(s)"));
    let variable_ok = {
        let (metric_name, label) = instance_variable_query(&dashboard).expect("instance variable");
        let found = prom
            .query(&client, &format!("count by ({label}) ({metric_name})"))
            .await
            .unwrap_or_default();
        let values: BTreeSet<String> = found
            .iter()
            .filter_map(|s| s["metric"][label.as_str()].as_str().map(str::to_owned))
            .collect();
        (values.contains(&a_admin.to_string()) && values.contains(&b_admin.to_string()))
            .then_some(())
            .ok_or(format!("the instance variable's query finds {values:?}"))
    };

    drop(prom);
    shutdown(a).await;
    shutdown(b).await;
    drop(link);
    drop(redis);
    eprintln!("done in {:.1}s", started.elapsed().as_secs_f64());

    let mut all = failures;
    if let Err(e) = variable_ok {
        all.push(e);
    }
    assert!(
        all.is_empty(),
        "{} failing expression(s):\n{}",
        all.len(),
        all.join("\n")
    );
}

/// The label names of each metric's series, as Prometheus has them (cached).
struct LabelIndex<'a> {
    prom: &'a Prometheus,
    client: &'a HttpClient,
    cache: BTreeMap<String, BTreeSet<String>>,
}

impl LabelIndex<'_> {
    /// Every label `expr` names must exist on one of its metrics.
    async fn check(&mut self, what: &str, expr: &str, failures: &mut Vec<String>) {
        let refs = refs(expr);
        let mut available = BTreeSet::new();
        for metric in &refs.metrics {
            if !self.cache.contains_key(metric) {
                match self.prom.labels_of(self.client, metric).await {
                    Ok(labels) => {
                        self.cache.insert(metric.clone(), labels);
                    }
                    Err(e) => {
                        failures.push(format!("{what}: labels of {metric}: {e}"));
                        continue;
                    }
                }
            }
            available.extend(self.cache.get(metric).into_iter().flatten().cloned());
        }
        for label in refs.labels.difference(&available) {
            failures.push(format!(
                "{what}: label {label:?} is on none of {:?}",
                refs.metrics
            ));
        }
    }
}

/// One evaluation round: every dashboard target and every alert rule. Returns the failures.
async fn evaluate(
    prom: &Prometheus,
    client: &HttpClient,
    targets: &[Target],
    rules_in_file: usize,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut labels = LabelIndex {
        prom,
        client,
        cache: BTreeMap::new(),
    };

    for t in targets {
        match prom.query(client, &t.expr).await {
            Err(e) => failures.push(format!("{}: {e}\n    {}", t.name(), t.expr)),
            Ok(series) if series.is_empty() => {
                failures.push(format!("{}: no data\n    {}", t.name(), t.expr));
            }
            Ok(series) => {
                for label in legend_labels(&t.legend) {
                    if !series.iter().any(|s| s["metric"].get(&label).is_some()) {
                        failures.push(format!(
                            "{}: legend {{{{{label}}}}} is on no result series",
                            t.name()
                        ));
                    }
                }
            }
        }
        labels.check(&t.name(), &t.expr, &mut failures).await;
    }

    let rules = match prom.rules(client).await {
        Ok(rules) => rules,
        Err(e) => {
            failures.push(format!("/api/v1/rules: {e}"));
            return failures;
        }
    };
    if rules.len() != rules_in_file {
        failures.push(format!(
            "Prometheus loaded {} alerting rules, dashboards/alerts.yml has {rules_in_file}",
            rules.len()
        ));
    }
    for rule in &rules {
        let name = rule["name"].as_str().unwrap_or("<unnamed>");
        let expr = rule["query"].as_str().unwrap_or_default();
        let what = format!("alert {name}");
        if rule["health"] != "ok" {
            failures.push(format!(
                "{what}: health {} {}",
                rule["health"], rule["lastError"]
            ));
        }
        if !matches!(
            rule["labels"]["severity"].as_str(),
            Some("critical" | "warning" | "info")
        ) {
            failures.push(format!("{what}: severity {}", rule["labels"]["severity"]));
        }
        for key in ["summary", "description"] {
            if rule["annotations"][key]
                .as_str()
                .is_none_or(|s| s.trim().is_empty())
            {
                failures.push(format!("{what}: no {key} annotation"));
            }
        }
        if rule["duration"].as_f64().unwrap_or(0.0) <= 0.0 {
            failures.push(format!("{what}: no `for:` duration"));
        }
        match prom.query(client, expr).await {
            Err(e) => failures.push(format!("{what}: {e}\n    {expr}")),
            Ok(series) if series.is_empty() => {
                failures.push(format!("{what}: expression is not true\n    {expr}"));
            }
            Ok(series) => {
                let annotations = format!(
                    "{} {}",
                    rule["annotations"]["summary"], rule["annotations"]["description"]
                );
                for label in template_labels(&annotations) {
                    if !series.iter().all(|s| s["metric"].get(&label).is_some()) {
                        failures.push(format!(
                            "{what}: annotations use $labels.{label}, which the result lacks"
                        ));
                    }
                }
                if rule["state"] == "inactive" {
                    failures.push(format!(
                        "{what}: the expression is true but Prometheus's rule is still inactive"
                    ));
                }
            }
        }
        labels.check(&what, expr, &mut failures).await;
    }
    failures
}

// === series that exist before their first event ===

/// Every `name{label="value", …}` selector in `expr`: the metric and its equality matchers
/// whose value is a literal (not a dashboard variable). A bare name has no matchers.
fn selectors(expr: &str) -> Vec<(String, Vec<(String, String)>)> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if !(c.is_ascii_alphabetic() || c == '_') {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
            i += 1;
        }
        let name: String = chars[start..i].iter().collect();
        if !name.starts_with("cacheguard_") {
            continue;
        }
        let mut matchers = Vec::new();
        if chars.get(i) == Some(&'{') {
            let end = chars[i..]
                .iter()
                .position(|&c| c == '}')
                .map_or(chars.len(), |p| i + p);
            let body: String = chars[i + 1..end].iter().collect();
            for part in body.split(',') {
                // Only `=`: `!=`, `=~` and `!~` select no one value.
                let Some((label, value)) = part.split_once('=') else {
                    continue;
                };
                let (label, value) = (label.trim(), value.trim());
                if label.ends_with('!') || value.starts_with('~') || value.contains('$') {
                    continue;
                }
                matchers.push((label.to_owned(), value.trim_matches('"').to_owned()));
            }
            i = end;
        }
        out.push((name, matchers));
    }
    out
}

#[test]
fn selector_scanner_finds_equality_matchers() {
    let found = selectors(
        r#"sum(rate(cacheguard_requests_total{instance=~"$instance", outcome="miss"}[5m])) / cacheguard_l1_entries"#,
    );
    assert_eq!(
        found,
        vec![
            (
                "cacheguard_requests_total".to_owned(),
                vec![("outcome".to_owned(), "miss".to_owned())]
            ),
            ("cacheguard_l1_entries".to_owned(), vec![]),
        ]
    );
}

/// The route-labelled families every configured route must have a series in.
const PER_ROUTE: [&str; 5] = [
    "cacheguard_requests_total",
    "cacheguard_request_duration_seconds_count",
    "cacheguard_origin_requests_total",
    "cacheguard_shed_total",
    "cacheguard_hot_key_limited_total",
];

/// Dashboards and alerts must show 0, not "no data", before anything happened: right after
/// start (shared mode, no request made yet), every metric the dashboard's panels and the
/// alerting rules read has a series — with each label value they select by — and every
/// route has its series in the per-route families.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_series_exists_right_after_start() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::builder()
        .ids((1..=ITEM_IDS).map(|i| i.to_string()))
        .start()
        .await;
    origin.enable_items_api();
    let cg = fleet_config(&origin, &redis.url()).start().await;
    let client = HttpClient::new();
    let exposition = common::metrics(&client, cg.admin_addr()).await;

    let mut wanted = BTreeSet::new();
    for target in targets(&load_dashboard()) {
        wanted.extend(selectors(&target.raw));
    }
    wanted.extend(selectors(&read("dashboards/alerts.yml")));
    let routes = ["item", "item-create", "thing", "kv", "kv-write", "buy"];
    for family in PER_ROUTE {
        for route in routes {
            wanted.insert((
                family.to_owned(),
                vec![("route".to_owned(), route.to_owned())],
            ));
        }
    }

    let mut missing = Vec::new();
    for (name, matchers) in &wanted {
        let present = exposition
            .samples
            .iter()
            .filter(|s| {
                s.name == *name
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|suffix| s.name.strip_suffix(suffix) == Some(name.as_str()))
            })
            .any(|s| {
                matchers
                    .iter()
                    .all(|(k, v)| s.labels.get(k).map(String::as_str) == Some(v.as_str()))
            });
        if !present {
            missing.push(format!("{name}{matchers:?}"));
        }
    }
    shutdown(cg).await;
    assert!(
        missing.is_empty(),
        "{} of {} series the dashboards and alerts read do not exist right after start:\n  {}",
        missing.len(),
        wanted.len(),
        missing.join("\n  ")
    );
}
