//! The crate is one stack of layers (docs/architecture.md, "Layers"): a module imports from
//! its own layer or from below, never from above, and no set of modules imports each other
//! in a loop. This test reads `src/**/*.rs` and fails on any `crate::` path that points up
//! the stack, and on any cycle between the modules of one folder (`src/` itself included).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Within one folder: module → the sibling modules it uses.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Top-level modules from the bottom up; a module may use its own layer and below.
const LAYERS: &[&[&str]] = &[
    &[
        "clock",
        "tally",
        "worker",
        "error",
        "config",
        "metrics",
        "shutdown",
        "test_redis",
        "test_mariadb",
    ],
    &["coord"],
    &["cache"],
    &["protect"],
    &["consistency"],
    &["proxy"],
    &["admin", "reload"],
    &["app"],
    &["lib", "main"],
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The text of a source file without comments, string and char literals (so a path written
/// in a doc comment or a message is not an import). Block comments are not used in `src/`.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let next = chars.get(i + 1).copied();
        match chars[i] {
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '"' => {
                // A raw string (`r"…"`, `r#"…"#`) ends at `"` and as many `#`; no escapes.
                let hashes = chars[..i].iter().rev().take_while(|c| **c == '#').count();
                let raw = i > hashes && chars[i - hashes - 1] == 'r';
                i += 1;
                while i < chars.len() {
                    if raw
                        && chars[i] == '"'
                        && chars[i + 1..].iter().take_while(|c| **c == '#').count() >= hashes
                    {
                        i += hashes;
                        break;
                    }
                    match chars[i] {
                        '\\' if !raw => i += 1,
                        '"' if !raw => break,
                        _ => {}
                    }
                    i += 1;
                }
                out.push_str("\"\"");
            }
            // A char literal (`'"'`, `'\''`), not a lifetime (`'a`).
            '\'' if next == Some('\\') || chars.get(i + 2) == Some(&'\'') => {
                i += if next == Some('\\') { 3 } else { 2 };
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                out.push_str("' '");
            }
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// Every module path a file names: `crate::a::b` and `super::b`, including each member of
/// grouped imports (`use crate::{a::x, b::{y, z}}`), as segment lists.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for root in ["crate", "super"] {
        for (at, _) in code.match_indices(&format!("{root}::")) {
            let before = code[..at].chars().next_back();
            let rest = &code[at + root.len() + 2..];
            if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                expand(vec![root.to_owned()], rest, &mut found);
            }
        }
    }
    found
}

/// Expands the path starting at `text` (after `prefix::`), one level of braces at a time.
fn expand(prefix: Vec<String>, text: &str, found: &mut Vec<Vec<String>>) {
    let text = text.trim_start();
    if let Some(inner) = text.strip_prefix('{') {
        let (mut depth, mut start) = (0usize, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' | ',' if depth == 0 => {
                    expand(prefix.clone(), &inner[start..i], found);
                    if c == '}' {
                        return;
                    }
                    start = i + 1;
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
        return;
    }
    let ident: String = text
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if ident.is_empty() || ident == "self" {
        return found.push(prefix);
    }
    let mut path = prefix;
    path.push(ident.clone());
    match text[ident.len()..].strip_prefix("::") {
        Some(more) => expand(path, more, found),
        None => found.push(path),
    }
}

/// A source file as the checker sees it: its path under `src/` and its text.
struct Source {
    path: PathBuf,
    text: String,
}

/// The module path of a file: `proxy/read.rs` → `[proxy, read]`, `proxy.rs` → `[proxy]`.
fn module_of(path: &Path) -> Vec<String> {
    let path = path.with_extension("");
    let parts = path.iter().map(|c| c.to_string_lossy().into_owned());
    parts.filter(|c| c != "mod").collect()
}

/// Every upward import and every loop, as readable lines.
fn violations(sources: &[Source]) -> Vec<String> {
    let mut problems = Vec::new();
    // Per folder (module path): which of its children uses which. An import from
    // `a/b/c.rs` of `crate::a::d::x` is the edge `b -> d` in folder `a`.
    let mut graphs: BTreeMap<Vec<String>, Graph> = BTreeMap::new();
    for source in sources {
        let file = format!("src/{}", source.path.display());
        let module = module_of(&source.path);
        let Some(own) = module.first().and_then(|top| layer(top)) else {
            problems.push(format!("{file}: not in the layer list"));
            continue;
        };
        let folder = &module[..module.len() - 1];
        for path in paths(&code_only(&source.text)) {
            // `super::` from a file is its folder's module.
            let base = if path[0] == "crate" { &[][..] } else { folder };
            let target: Vec<String> = base.iter().chain(&path[1..]).cloned().collect();
            let Some(top) = target.first() else { continue };
            if let Some(above) = layer(top).filter(|t| *t > own) {
                let target = target.join("::");
                problems.push(format!(
                    "{file}: imports crate::{target} (layer {above} above layer {own})"
                ));
            }
            // Where the two paths part: in folder `module[..at]`, `module[at]` uses `target[at]`.
            if let Some(at) = module.iter().zip(&target).position(|(a, b)| a != b) {
                let graph = graphs.entry(module[..at].to_vec()).or_default();
                let uses = graph.entry(module[at].clone()).or_default();
                uses.insert(target[at].clone());
            }
        }
    }
    problems.sort();
    problems.dedup();
    for (folder, graph) in &graphs {
        let mut done = BTreeSet::new();
        let mut from = |n| find_cycle(n, graph, &mut Vec::new(), &mut done);
        if let Some(cycle) = graph.keys().find_map(&mut from) {
            let folder: String = folder.iter().map(|f| format!("{f}/")).collect();
            problems.push(format!("src/{folder}: import loop {}", cycle.join(" -> ")));
        }
    }
    problems
}

/// A cycle reachable from `node` in `graph`, if any (depth-first search; `stack` is the
/// path to `node`, `done` the modules already searched).
fn find_cycle(
    node: &String,
    graph: &Graph,
    stack: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = stack.iter().position(|n| n == node) {
        return Some(stack[at..].iter().chain([node]).cloned().collect());
    }
    if !done.insert(node.clone()) {
        return None;
    }
    stack.push(node.clone());
    let mut next = graph.get(node).into_iter().flatten();
    let found = next.find_map(|n| find_cycle(n, graph, stack, done));
    stack.pop();
    found
}

fn read_tree(dir: &Path, root: &Path, out: &mut Vec<Source>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for path in entries.filter_map(Result::ok).map(|e| e.path()) {
        if path.is_dir() {
            read_tree(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let path = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            out.push(Source { path, text });
        }
    }
}

#[test]
fn every_import_points_down_the_layers_and_nothing_loops() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    read_tree(&root, &root, &mut sources);
    sources.sort_by(|a, b| a.path.cmp(&b.path));
    assert!(sources.len() > 40, "found only {} files", sources.len());
    let problems = violations(&sources);
    assert!(
        problems.is_empty(),
        "imports that break the layering:\n{}",
        problems.join("\n")
    );
}

fn fake(files: &[(&str, &str)]) -> Vec<String> {
    let source = |(path, text): &(&str, &str)| Source {
        path: PathBuf::from(path),
        text: (*text).to_owned(),
    };
    violations(&files.iter().map(source).collect::<Vec<_>>())
}

#[test]
fn the_checker_catches_an_upward_import_in_every_form() {
    for text in [
        "use crate::proxy::fetch::SharedFailure;",
        "use crate::{config::X, proxy::Y};",
        "use crate::{config::{A, B}, proxy::{fill::{Filler}}};",
        "fn f() { let n = crate::proxy::server::worker_index(); }",
        "let c = '\"'; use crate::proxy::Y; let s = \"\\\"\";",
        "let s = r#\"a\\\"#; use crate::proxy::Y; let t = r\"b\\\";",
    ] {
        let found = fake(&[("cache/l1.rs", text)]);
        assert_eq!(found.len(), 1, "{text}: {found:?}");
        assert!(
            found[0].starts_with("src/cache/l1.rs: imports crate::proxy"),
            "{found:?}"
        );
        assert!(found[0].ends_with("(layer 5 above layer 2)"), "{found:?}");
    }
}

#[test]
fn the_checker_ignores_comments_strings_and_downward_imports() {
    let text = "//! see crate::proxy::read\n\
                use crate::config::X; // crate::app\n\
                use super::l2::L2;\n\
                fn f<'a>(_: &'a str) -> char { let _ = \"crate::proxy\"; '\\'' }";
    assert_eq!(fake(&[("cache/l1.rs", text)]), Vec::<String>::new());
}

#[test]
fn the_checker_catches_a_loop_between_siblings_at_any_depth() {
    let found = fake(&[
        ("config/env.rs", "use super::validate::check;"),
        ("config/validate.rs", "use super::{raw::Raw, env};"),
        ("config/raw.rs", ""),
    ]);
    assert_eq!(found, ["src/config/: import loop env -> validate -> env"]);
    // Within one layer, across folders: `protect/flight/fleet.rs` uses `bloom`.
    let found = fake(&[
        (
            "protect/flight/fleet.rs",
            "use crate::protect::bloom::Filter;",
        ),
        ("protect/bloom.rs", "use super::flight::Flights;"),
    ]);
    assert_eq!(
        found,
        ["src/protect/: import loop bloom -> flight -> bloom"]
    );
    let found = fake(&[
        ("admin.rs", "use crate::reload::Live;"),
        ("reload.rs", "use crate::admin::A;"),
    ]);
    assert_eq!(found, ["src/: import loop admin -> reload -> admin"]);
}
