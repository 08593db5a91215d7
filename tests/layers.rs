//! The crate is one stack of layers (docs/architecture.md, "Layers"): a module imports from
//! its own layer or from below, never from above, and the files of one folder import each
//! other without a loop. This test reads `src/**/*.rs` and fails on any `crate::` path that
//! points up the stack, and on any cycle between the files of a folder.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules from the bottom up; a module may use its own rank and below.
const LAYERS: &[(&str, u8)] = &[
    ("clock", 0),
    ("worker", 0),
    ("error", 0),
    ("config", 0),
    ("metrics", 0),
    ("shutdown", 0),
    ("coord", 1),
    ("cache", 2),
    ("protect", 3),
    ("consistency", 4),
    ("proxy", 5),
    ("admin", 6),
    ("reload", 6),
    ("app", 7),
    ("lib", 8),
    ("main", 8),
];

fn rank(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, r)| *r)
}

/// The text of a source file without comments and string literals (so a path written in a
/// doc comment or a message is not an import).
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => break,
                        _ => escaped = false,
                    }
                }
                out.push_str("\"\"");
            }
            _ => out.push(c),
        }
    }
    out
}

/// Every module path a file names: `crate::a::b` and `super::b`, including each member of
/// grouped imports (`use crate::{a::x, b::{y, z}}`), as segment lists.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for root in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(at) = rest.find(root) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + root.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let prefix = vec![root.trim_end_matches(':').to_owned()];
            expand(prefix, rest, &mut found);
        }
    }
    found
}

/// Expands the path starting at `text` (after `prefix::`), following one level of braces
/// at a time.
fn expand(prefix: Vec<String>, text: &str, found: &mut Vec<Vec<String>>) {
    let text = text.trim_start();
    if let Some(inner) = text.strip_prefix('{') {
        let mut depth = 0usize;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(prefix.clone(), &inner[start..i], found);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(prefix.clone(), &inner[start..i], found);
                    start = i + 1;
                }
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
        found.push(prefix);
        return;
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

/// The module path of a file: `src/proxy/read.rs` → `[proxy, read]`, `src/proxy.rs` →
/// `[proxy]`, `src/lib.rs` → `[lib]`.
fn module_of(path: &Path) -> Vec<String> {
    path.with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .filter(|c| c != "mod")
        .collect()
}

/// Every upward import and every in-folder cycle, as readable lines.
fn violations(sources: &[Source]) -> Vec<String> {
    let mut problems = Vec::new();
    // Within each folder (the module path minus its last segment): file → sibling files.
    let mut siblings: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for source in sources {
        let module = module_of(&source.path);
        let Some(top) = module.first() else { continue };
        let Some(own) = rank(top) else {
            problems.push(format!("{}: not in the layer list", source.path.display()));
            continue;
        };
        let folder = module[..module.len() - 1].to_vec();
        let edges = siblings
            .entry(folder.clone())
            .or_default()
            .entry(module[module.len() - 1].clone())
            .or_default();
        for path in paths(&code_only(&source.text)) {
            // Resolve to an absolute module path.
            let absolute: Vec<String> = if path[0] == "crate" {
                path[1..].to_vec()
            } else {
                // `super::` from a file is its folder's module.
                let mut base = folder.clone();
                base.extend(path[1..].iter().cloned());
                base
            };
            let Some(target_top) = absolute.first() else {
                continue;
            };
            if let Some(target) = rank(target_top)
                && target > own
            {
                problems.push(format!(
                    "{}: imports crate::{} (layer {target} is above layer {own})",
                    source.path.display(),
                    absolute.join("::")
                ));
            }
            // A sibling in the same folder (not the folder's own module file).
            if absolute.len() > folder.len() && absolute[..folder.len()] == folder[..] {
                let sibling = &absolute[folder.len()];
                if sibling != &module[module.len() - 1] && !folder.is_empty() {
                    edges.insert(sibling.clone());
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    for (folder, graph) in &siblings {
        if let Some(cycle) = find_cycle(graph) {
            problems.push(format!(
                "src/{}/: import loop {}",
                folder.join("/"),
                cycle.join(" -> ")
            ));
        }
    }
    problems
}

/// A cycle in `graph`, if any (depth-first search).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

fn read_tree(dir: &Path, root: &Path, out: &mut Vec<Source>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_tree(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let relative = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            out.push(Source {
                path: relative,
                text,
            });
        }
    }
}

#[test]
fn every_import_points_down_the_layers_and_no_folder_has_a_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    read_tree(&root, &root, &mut sources);
    assert!(sources.len() > 40, "found only {} files", sources.len());
    let problems = violations(&sources);
    assert!(
        problems.is_empty(),
        "imports that break the layering:\n{}",
        problems.join("\n")
    );
}

fn fake(files: &[(&str, &str)]) -> Vec<String> {
    let sources: Vec<Source> = files
        .iter()
        .map(|(path, text)| Source {
            path: PathBuf::from(path),
            text: (*text).to_owned(),
        })
        .collect();
    violations(&sources)
}

#[test]
fn the_checker_catches_an_upward_import_in_every_form() {
    for text in [
        "use crate::proxy::fetch::SharedFailure;",
        "use crate::{config::X, proxy::Y};",
        "use crate::{config::{A, B}, consistency::{marks::{LocalMarks}}};",
        "fn f() { let n = crate::proxy::server::worker_index(); }",
    ] {
        let found = fake(&[("cache/l1.rs", text)]);
        assert_eq!(found.len(), 1, "{text}: {found:?}");
        assert!(
            found[0].starts_with("cache/l1.rs: imports crate::"),
            "{found:?}"
        );
    }
}

#[test]
fn the_checker_ignores_comments_strings_and_downward_imports() {
    let text = "//! see crate::proxy::read\n\
                use crate::config::X; // crate::app\n\
                use super::l2::L2;\n\
                const S: &str = \"crate::proxy\";";
    assert_eq!(fake(&[("cache/l1.rs", text)]), Vec::<String>::new());
}

#[test]
fn the_checker_catches_a_loop_between_siblings() {
    let found = fake(&[
        ("config/env.rs", "use super::validate::check;"),
        ("config/validate.rs", "use super::{raw::Raw, env};"),
        ("config/raw.rs", ""),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("import loop"), "{found:?}");
    assert!(
        found[0].contains("env") && found[0].contains("validate"),
        "{found:?}"
    );
}
