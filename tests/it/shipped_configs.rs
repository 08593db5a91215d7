//! The configurations the repository ships, held to `--check-config` and to README:
//!
//! - every one passes `cacheguard --check-config`: `config/*.toml`, `examples/**/*.toml`,
//!   the TOML inside `examples/**/*.yaml` (a Kubernetes ConfigMap), and whatever the
//!   Dockerfile and docker-compose.yml take from the repository (the admin token comes from
//!   `CACHEGUARD_ADMIN_TOKEN`, as the image check in `scripts/test.sh` gives it);
//! - every ```toml example in README passes it too (on a base that names an origin and a
//!   Redis when the example does not): what README documents is accepted;
//! - every key README documents (in those examples, or as `section.key`) is documented in
//!   `config/cacheguard.toml` where its section is, and every key that file sets is named
//!   in README;
//! - no comment in a shipped config says that something "does not exist yet" (a comment
//!   outlives the feature it waits for), and every lock backend README shows is
//!   documented in `config/cacheguard.toml`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Variables `--check-config` must not take from the developer's shell.
const ENV_OVERRIDES: [&str; 3] = [
    "CACHEGUARD_LISTEN",
    "CACHEGUARD_UPSTREAM",
    "CACHEGUARD_REDIS_URL",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `cacheguard --check-config path`, with an admin token in the environment (configs whose
/// admin listener is off loopback need one; none is ever written in a shipped file).
fn check_config(path: &Path) -> Output {
    let mut command = Command::new(crate::common::process::binary());
    command
        .arg("--check-config")
        .arg(path)
        .env("CACHEGUARD_ADMIN_TOKEN", "check-only-token");
    for name in ENV_OVERRIDES {
        command.env_remove(name);
    }
    command.output().expect("run cacheguard")
}

/// Files under `dir` (recursively) whose name ends with one of `extensions`.
fn files_under(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(files_under(&path, extensions));
        } else if extensions
            .iter()
            .any(|ext| path.extension().is_some_and(|e| e == *ext))
        {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// The TOML a Kubernetes manifest carries as a `*.toml: |` block scalar: its lines, less
/// their common indentation.
fn toml_blocks_in_yaml(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if !trimmed.ends_with(".toml: |") || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let body: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
            .copied()
            .collect();
        let strip = body
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.len() - l.trim_start().len())
            .min()
            .unwrap_or(0);
        let block: Vec<&str> = body.iter().map(|l| l.get(strip..).unwrap_or("")).collect();
        blocks.push(block.join("\n") + "\n");
    }
    blocks
}

/// Every shipped config's path: the files where they are, the ones embedded in a manifest
/// written out to `dir`.
fn shipped(dir: &tempfile::TempDir) -> Vec<PathBuf> {
    let root = repo();
    let mut paths = files_under(&root.join("config"), &["toml"]);
    paths.extend(files_under(&root.join("examples"), &["toml"]));
    for manifest in files_under(&root.join("examples"), &["yaml", "yml"]) {
        for (i, block) in toml_blocks_in_yaml(&read(&manifest))
            .into_iter()
            .enumerate()
        {
            let name = format!(
                "{}-{i}.toml",
                manifest
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            );
            let path = dir.path().join(name);
            std::fs::write(&path, block).expect("write");
            paths.push(path);
        }
    }
    paths
}

/// The repository files a build recipe takes into the image or mounts as a config:
/// `COPY config/…` in the Dockerfile, `./config/…:` volumes in docker-compose.yml.
fn configs_the_image_takes() -> Vec<PathBuf> {
    let root = repo();
    let mut found = BTreeSet::new();
    for line in read(&root.join("Dockerfile")).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"COPY") {
            found.extend(
                words
                    .iter()
                    .filter(|w| w.starts_with("config/") && w.ends_with(".toml"))
                    .map(|w| root.join(w)),
            );
        }
    }
    for line in read(&root.join("docker-compose.yml")).lines() {
        if let Some(rest) = line.trim().strip_prefix("- ./")
            && let Some((source, _)) = rest.split_once(':')
            && source.ends_with(".toml")
        {
            found.insert(root.join(source));
        }
    }
    found.into_iter().collect()
}

#[test]
fn every_shipped_config_passes_check_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = shipped(&dir);
    assert!(
        paths.iter().any(|p| p.ends_with("config/cacheguard.toml"))
            && paths.iter().any(|p| p.starts_with(dir.path())),
        "the example config and the Kubernetes ConfigMap's are among them: {paths:?}"
    );
    let image = configs_the_image_takes();
    assert!(
        image.iter().any(|p| p.ends_with("config/docker.toml")),
        "the image's default config: {image:?}"
    );
    for path in &image {
        assert!(paths.contains(path), "{} is not checked", path.display());
    }
    let mut failures = Vec::new();
    for path in &paths {
        let output = check_config(path);
        if output.status.code() != Some(0) {
            failures.push(format!(
                "{}:\n{}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    assert!(failures.is_empty(), "refused:\n{}", failures.join("\n"));
}

/// README's ```toml blocks.
fn readme_toml_blocks() -> Vec<String> {
    let readme = read(&repo().join("README.md"));
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in readme.lines() {
        match (&mut current, line.trim()) {
            (None, "```toml") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn readme_config_examples_pass_check_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blocks = readme_toml_blocks();
    assert!(
        blocks.len() >= 3,
        "README's TOML examples: {}",
        blocks.len()
    );
    let mut failures = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        let table: toml::Table = block
            .parse()
            .unwrap_or_else(|e| panic!("README's TOML example {i} does not parse: {e}\n{block}"));
        let mut text = String::new();
        if !table.contains_key("upstream") {
            text.push_str("[upstream]\nurl = \"http://127.0.0.1:9000\"\n");
        }
        if !table.contains_key("redis") {
            text.push_str("[redis]\nurl = \"redis://127.0.0.1:6379\"\n");
        }
        text.push_str(block);
        let path = dir.path().join(format!("readme-{i}.toml"));
        std::fs::write(&path, &text).expect("write");
        let output = check_config(&path);
        if output.status.code() != Some(0) {
            failures.push(format!(
                "{text}\n{}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "README documents what --check-config refuses:\n{}",
        failures.join("\n---\n")
    );
}

/// A key as documented: its top-level section (`locks` for `[locks.<name>]`) and its name.
type Key = (String, String);

/// The keys a TOML table sets, by top-level section (named tables such as
/// `[locks.<name>]` and inline tables such as `serialize = { … }` are looked into).
fn keys_of(table: &toml::Table) -> BTreeSet<Key> {
    fn walk(section: &str, value: &toml::Value, named: bool, out: &mut BTreeSet<Key>) {
        let tables: Vec<&toml::Table> = match value {
            toml::Value::Table(t) => vec![t],
            toml::Value::Array(items) => items.iter().filter_map(toml::Value::as_table).collect(),
            _ => return,
        };
        for t in tables {
            for (key, value) in t {
                if named {
                    // `[locks.<name>]`: the name is no key.
                    walk(section, value, false, out);
                    continue;
                }
                out.insert((section.to_owned(), key.clone()));
                walk(section, value, false, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    for (section, value) in table {
        walk(section, value, section == "locks", &mut out);
    }
    out
}

/// `section.key` written in backticks in `text`, for the sections `sections` names.
fn dotted_keys(text: &str, sections: &BTreeSet<String>) -> BTreeSet<Key> {
    let mut out = BTreeSet::new();
    for quoted in text.split('`').skip(1).step_by(2) {
        let Some((section, key)) = quoted.split_once('.') else {
            continue;
        };
        // A file (`admin.rs`, `cacheguard.toml`), not a key.
        if [
            "rs", "md", "toml", "sh", "yml", "yaml", "html", "json", "txt",
        ]
        .contains(&key)
        {
            continue;
        }
        if sections.contains(section)
            && !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            out.insert((section.to_owned(), key.to_owned()));
        }
    }
    out
}

/// Whether `word` occurs in `text` as a whole word (not inside a longer key name).
fn has_word(text: &str, word: &str) -> bool {
    let is_key_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(word).any(|(at, _)| {
        text[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !is_key_char(c))
            && text[at + word.len()..]
                .chars()
                .next()
                .is_none_or(|c| !is_key_char(c))
    })
}

/// The part of `config/cacheguard.toml` that documents `section`: from the header before
/// its own (its comments come before its header) to the header after it; for a section
/// that is only described in comments (`[locks.<name>]`), from its first mention.
fn region<'a>(example: &'a str, section: &str) -> &'a str {
    let mut headers = Vec::new();
    let mut offset = 0;
    for line in example.split_inclusive('\n') {
        if line.starts_with('[') {
            let name = line
                .trim()
                .trim_matches(|c| c == '[' || c == ']')
                .split('.')
                .next()
                .unwrap_or_default()
                .to_owned();
            headers.push((offset, name));
        }
        offset += line.len();
    }
    if let Some(i) = headers.iter().position(|(_, name)| name == section) {
        let start = if i == 0 { 0 } else { headers[i - 1].0 };
        let last = headers
            .iter()
            .rposition(|(_, name)| name == section)
            .unwrap_or(i);
        let end = headers.get(last + 1).map_or(example.len(), |(at, _)| *at);
        return &example[start..end];
    }
    let mention = format!("[{section}.");
    let Some(start) = example.find(&mention) else {
        return "";
    };
    let end = headers
        .iter()
        .find(|(at, _)| *at > start)
        .map_or(example.len(), |(at, _)| *at);
    &example[start..end]
}

#[test]
fn readme_and_the_example_config_document_the_same_keys() {
    let readme = read(&repo().join("README.md"));
    let example = read(&repo().join("config/cacheguard.toml"));
    let example_table: toml::Table = example.parse().expect("config/cacheguard.toml parses");
    let mut readme_keys = BTreeSet::new();
    for block in readme_toml_blocks() {
        let table: toml::Table = block.parse().expect("README's TOML parses");
        readme_keys.extend(keys_of(&table));
    }
    let mut sections: BTreeSet<String> = example_table.keys().cloned().collect();
    sections.extend(readme_keys.iter().map(|(s, _)| s.clone()));
    readme_keys.extend(dotted_keys(&readme, &sections));

    let undocumented: Vec<String> = readme_keys
        .iter()
        .filter(|(section, key)| !has_word(region(&example, section), key))
        .map(|(section, key)| format!("{section}: {key}"))
        .collect();
    assert!(
        undocumented.is_empty(),
        "README documents keys config/cacheguard.toml does not (by section): {undocumented:?}"
    );

    let unnamed: Vec<String> = keys_of(&example_table)
        .iter()
        .filter(|(_, key)| !has_word(&readme, key))
        .map(|(section, key)| format!("{section}.{key}"))
        .collect();
    assert!(
        unnamed.is_empty(),
        "config/cacheguard.toml sets keys README never names: {unnamed:?}"
    );
}

/// Phrases of a comment waiting for a feature: once it exists, the comment lies.
const NOT_YET: [&str; 7] = [
    "exists yet",
    "exist yet",
    "not implemented",
    "not yet implemented",
    "not supported yet",
    "not yet supported",
    "reserved for",
];

#[test]
fn shipped_comments_do_not_contradict_readme() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut stale = Vec::new();
    let mut paths = shipped(&dir);
    paths.push(repo().join("Dockerfile"));
    paths.push(repo().join("docker-compose.yml"));
    paths.extend(files_under(&repo().join("examples"), &["yaml", "yml"]));
    for path in &paths {
        for (n, line) in read(path).lines().enumerate() {
            let Some((_, comment)) = line.split_once('#') else {
                continue;
            };
            let comment = comment.to_lowercase();
            if let Some(phrase) = NOT_YET.iter().find(|p| comment.contains(*p)) {
                stale.push(format!("{}:{}: {phrase:?}: {line}", path.display(), n + 1));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "comments that wait for a feature:\n{}",
        stale.join("\n")
    );

    // Every lock service README shows is one the example config documents.
    let example = read(&repo().join("config/cacheguard.toml"));
    let mut backends = BTreeSet::new();
    for block in readme_toml_blocks() {
        let table: toml::Table = block.parse().expect("README's TOML parses");
        if let Some(locks) = table.get("locks").and_then(toml::Value::as_table) {
            backends.extend(
                locks
                    .values()
                    .filter_map(|l| l.get("backend")?.as_str().map(str::to_owned)),
            );
        }
    }
    assert!(backends.len() >= 4, "README's lock services: {backends:?}");
    for backend in &backends {
        assert!(
            example.contains(&format!("backend = \"{backend}\"")),
            "README shows [locks.*] backend = {backend:?}; config/cacheguard.toml does not \
             document it"
        );
    }
}
