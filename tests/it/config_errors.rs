//! `cacheguard --check-config FILE`: exit 0 and `config OK: FILE` for a valid file; exit 1
//! and one `FILE:LINE: key: message` line per problem on stderr otherwise.
//!
//! Runs the real binary. `CACHEGUARD_*` variables are removed from its environment so the
//! developer's shell cannot change the outcome.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const ENV_OVERRIDES: [&str; 4] = [
    "CACHEGUARD_LISTEN",
    "CACHEGUARD_UPSTREAM",
    "CACHEGUARD_REDIS_URL",
    "CACHEGUARD_ADMIN_TOKEN",
];

fn check_config(path: &Path) -> Output {
    let mut command = Command::new(crate::common::process::binary());
    command.arg("--check-config").arg(path);
    for name in ENV_OVERRIDES {
        command.env_remove(name);
    }
    command.output().expect("run cacheguard")
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// Runs `--check-config` on `text` and asserts exit 1 with `FILE:LINE: KEY:` on stderr.
fn assert_refused(dir: &tempfile::TempDir, name: &str, text: &str, line: usize, key: &str) {
    let path = write(dir, name, text);
    let output = check_config(&path);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{name}: stderr:\n{stderr}");
    let expected = format!("{}:{line}: {key}: ", path.display());
    assert!(
        stderr.lines().any(|l| l.starts_with(&expected)),
        "{name}: expected a line starting with {expected:?}, got:\n{stderr}"
    );
    assert!(output.stdout.is_empty(), "{name}: nothing on stdout");
}

#[test]
fn documented_example_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cacheguard.toml");
    let output = check_config(&path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "stderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim_end(), format!("config OK: {}", path.display()));
}

/// A risky but workable setting passes the check, and the check names it with file, line
/// and key on stderr.
#[test]
fn a_risky_setting_is_named_but_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("risky.toml");
    std::fs::write(
        &path,
        "[upstream]\nurl = \"http://127.0.0.1:9000\"\n\
         [redis]\nurl = \"redis://127.0.0.1:6379\"\n\
         [lock]\nwait_replicas = 1\nwait_replicas_timeout = \"3s\"\n",
    )
    .unwrap();
    let output = check_config(&path);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "stderr:\n{stderr}");
    let expected = format!(
        "warning: {}:7: lock.wait_replicas_timeout: ",
        path.display()
    );
    assert!(
        stderr.lines().any(|l| l.starts_with(&expected)),
        "expected a line starting with {expected:?}, got:\n{stderr}"
    );
}

#[test]
fn embedded_example_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/embedded.toml");
    assert_eq!(check_config(&path).status.code(), Some(0));
}

const UPSTREAM: &str = "[upstream]\nurl = \"http://127.0.0.1:9000\"\n";

#[test]
fn syntax_error() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{UPSTREAM}\n[cache]\nttl = 60s\n");
    assert_refused(&dir, "syntax.toml", &text, 5, "syntax");
}

#[test]
fn unknown_key() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{UPSTREAM}\n[cache]\nttl = \"60s\"\ntll = \"60s\"\n");
    assert_refused(&dir, "unknown.toml", &text, 6, "cache.tll");
}

#[test]
fn bad_duration_in_a_route() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{UPSTREAM}\n[[routes]]\nname = \"a\"\nmatch = \"/a\"\n\n\
         [[routes]]\nname = \"b\"\nmatch = \"/b\"\nttl = \"thirty\"\n"
    );
    assert_refused(&dir, "duration.toml", &text, 11, "routes[1].ttl");
}

#[test]
fn bad_enum_value() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{UPSTREAM}\n[lock]\non_timeout = \"retry\"\n");
    assert_refused(&dir, "enum.toml", &text, 5, "lock.on_timeout");
}

#[test]
fn header_field_count_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [("none.toml", "0"), ("absurd.toml", "50000")] {
        let text = format!("[server]\nmax_headers = {value}\n\n{UPSTREAM}");
        assert_refused(&dir, name, &text, 2, "server.max_headers");
        let stderr =
            String::from_utf8_lossy(&check_config(&dir.path().join(name)).stderr).into_owned();
        assert!(
            stderr.contains(&format!("expected an integer from 1 to 1000 (header fields in one request head), got {value}")),
            "{name}: the refusal says why: {stderr}"
        );
    }
    let text = format!("[server]\nmax_headers = 1000\n\n{UPSTREAM}");
    let output = check_config(&write(&dir, "most.toml", &text));
    assert_eq!(output.status.code(), Some(0), "1000 is allowed");
}

#[test]
fn forwarded_client_headers_must_be_forwarding_headers_and_keyed_on_a_read_route() {
    let dir = tempfile::tempdir().unwrap();
    for (name, headers) in [
        ("host.toml", r#"["host"]"#),
        ("unkeyed.toml", r#"["x-forwarded-prefix"]"#),
        ("override.toml", r#"["x-http-method-override"]"#),
    ] {
        let text = format!(
            "{UPSTREAM}\n[[routes]]\nname = \"a\"\nmatch = \"/a\"\nforward_client_headers = {headers}\n"
        );
        assert_refused(&dir, name, &text, 7, "routes[0].forward_client_headers[0]");
    }
    let text = format!(
        "{UPSTREAM}\n[[routes]]\nname = \"a\"\nmatch = \"/a\"\nvary = [\"x-forwarded-prefix\"]\n\
         forward_client_headers = [\"x-forwarded-prefix\"]\n"
    );
    let output = check_config(&write(&dir, "keyed.toml", &text));
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn https_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[server]\nlisten = \"0.0.0.0:8080\"\n\n[upstream]\nurl = \"https://origin:443\"\n";
    assert_refused(&dir, "https.toml", text, 5, "upstream.url");
}

#[test]
fn every_route_problem_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{UPSTREAM}\n[[routes]]\nname = \"item\"\nmatch = \"/items/{{id}}\"\n\n\
         [[routes]]\nname = \"item\"\nmatch = \"/items/{{*rest}}\"\n"
    );
    assert_refused(&dir, "routes.toml", &text, 9, "routes[1].name");
    assert_refused(&dir, "routes.toml", &text, 10, "routes[1].match");
}

#[test]
fn a_public_admin_listener_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{UPSTREAM}\n[admin]\nlisten = \"0.0.0.0:9091\"\n");
    assert_refused(&dir, "admin.toml", &text, 5, "admin.listen");
    let path = write(&dir, "admin.toml", &text);
    let stderr = String::from_utf8_lossy(&check_config(&path).stderr).into_owned();
    assert!(
        stderr.contains("admin.token is not set"),
        "the refusal says why: {stderr}"
    );
}

#[test]
fn a_lease_that_cannot_be_renewed_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{UPSTREAM}\n[redis]\nurl = \"redis://127.0.0.1:6379\"\ncommand_timeout = \"50ms\"\n\n\
         [lock]\nlease = \"100ms\"\n"
    );
    assert_refused(&dir, "lease.toml", &text, 9, "lock.lease");
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.toml");
    let output = check_config(&path);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr.starts_with(&format!("{}: cannot read: ", path.display())),
        "{stderr}"
    );
}

/// A stock gate that cannot keep its promise is refused with its line and key: bound to a
/// route that answers GET, named wrong, or with reservations that would end before the buy
/// they hold a unit for.
#[test]
fn stock_gates_that_cannot_keep_their_promise() {
    let dir = tempfile::tempdir().unwrap();
    let gate = "\n[[stock]]\nname = \"seats\"\nkey = \"/t/{train}\"\n\
                source = { path = \"/internal/stock/{train}\", json = \"/remaining\" }\n";
    let read = format!(
        "{UPSTREAM}{gate}\n[[routes]]\nname = \"t\"\nmatch = \"/t/{{train}}\"\n\
         stock = {{ gate = \"seats\" }}\n"
    );
    assert_refused(&dir, "read.toml", &read, 12, "routes[0].stock");
    let unknown = format!(
        "{UPSTREAM}{gate}\n[[routes]]\nname = \"buy\"\nmatch = \"/t/{{train}}/orders\"\n\
         methods = [\"POST\"]\nstock = {{ gate = \"tickets\" }}\n"
    );
    assert_refused(&dir, "unknown.toml", &unknown, 13, "routes[0].stock.gate");
    let short = format!("{UPSTREAM}timeout = \"30s\"\n{gate}reservation_ttl = \"30s\"\n");
    assert_refused(&dir, "short.toml", &short, 9, "stock[0].reservation_ttl");
}
