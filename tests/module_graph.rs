//! No two modules of the workspace's crates import each other, directly or
//! around a loop. A module is a source file; it imports another when it
//! names a path into it (`crate::a::b`, `super::x`, `self::y`, or
//! `oomfix_strategies::…` from the oomfix crate into the strategies crate).
//! A module's own submodules and ancestors are left out: a parent declares
//! and re-exports its children, and a child reaches its parent's items, by
//! design.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's modules by path (`memory::activations`), each with its file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            // The binary's `main.rs` is a crate of its own.
            if path.extension().is_none_or(|e| e != "rs") || path.ends_with("src/main.rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// The code of `text` without comments and string literals (so that docs
/// naming a path do not count as imports).
fn code(text: &str) -> String {
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
            '/' if chars.peek() == Some(&'*') => {
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    if c == '"' && !escaped {
                        break;
                    }
                    escaped = c == '\\' && !escaped;
                }
                out.push_str("\"\"");
            }
            _ => out.push(c),
        }
    }
    out
}

/// The paths `code` names after `prefix` (`crate::`), as segment lists; a
/// braced group (`crate::{a, b::c}`) gives each member.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for member in group[..end].split(',') {
                out.push(segments(member.trim()));
            }
        } else {
            out.push(segments(rest));
        }
    }
    out
}

fn segments(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        out.push(rest[..end].to_string());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    out
}

/// The longest module of `known` that `path` (absolute segments) starts with.
fn module_of(path: &[String], known: &BTreeMap<String, PathBuf>) -> Option<String> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// The names a module re-exports (`pub use`, `pub(crate) use`), each with the
/// absolute path it stands for: `(module, name) -> path`.
type Reexports = BTreeMap<(String, String), Vec<String>>;

/// The leaves of a use tree (`a::{b, c::d as e}`), as `(name, path)`.
fn use_leaves(tree: &str, prefix: &[String], out: &mut Vec<(String, Vec<String>)>) {
    let tree = tree.trim();
    let (head, group) = match tree.find('{') {
        Some(open) if tree.ends_with('}') => (&tree[..open], Some(&tree[open + 1..tree.len() - 1])),
        _ => (tree, None),
    };
    let mut path = prefix.to_vec();
    path.extend(
        head.split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    );
    let Some(group) = group else {
        let (path, name) = match tree.split_once(" as ") {
            Some((p, alias)) => (
                {
                    let mut v = prefix.to_vec();
                    v.extend(p.split("::").map(|s| s.trim().to_string()));
                    v
                },
                alias.trim().to_string(),
            ),
            None => (path.clone(), path.last().cloned().unwrap_or_default()),
        };
        if name != "*" && name != "self" {
            out.push((name, path));
        }
        return;
    };
    // Split the group at top-level commas.
    let (mut depth, mut start) = (0, 0);
    let bytes = group.as_bytes();
    for i in 0..=bytes.len() {
        let c = bytes.get(i).copied().unwrap_or(b',');
        match c {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                let member = group[start..i].trim();
                if member == "self" {
                    if let Some(last) = path.last() {
                        out.push((last.clone(), path.clone()));
                    }
                } else if !member.is_empty() {
                    use_leaves(member, &path, out);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
}

/// `module`'s re-exports in `code`, their paths made absolute (`crate`,
/// `super`, `self`, a child module; other roots are other crates', kept as
/// written).
fn reexports_of(
    code: &str,
    module: &[String],
    known: &BTreeMap<String, PathBuf>,
    out: &mut Reexports,
) {
    for marker in ["pub use ", "pub(crate) use ", "pub(super) use "] {
        for (at, _) in code.match_indices(marker) {
            let rest = &code[at + marker.len()..];
            let tree = &rest[..rest.find(';').unwrap_or(rest.len())];
            let mut leaves = Vec::new();
            use_leaves(tree, &[], &mut leaves);
            for (name, path) in leaves {
                let abs = absolute(&path, module, known);
                out.insert((module.join("::"), name), abs);
            }
        }
    }
}

/// `path` as written in `module`, made absolute within the crate.
fn absolute(path: &[String], module: &[String], known: &BTreeMap<String, PathBuf>) -> Vec<String> {
    let Some(first) = path.first() else {
        return Vec::new();
    };
    let parent = &module[..module.len().saturating_sub(1)];
    let (mut base, rest): (Vec<String>, &[String]) = match first.as_str() {
        "crate" => (vec![], &path[1..]),
        "super" => (parent.to_vec(), &path[1..]),
        "self" => (module.to_vec(), &path[1..]),
        _ => {
            let mut child = module.to_vec();
            child.push(first.clone());
            if known.contains_key(&child.join("::")) {
                (module.to_vec(), path)
            } else {
                return path.to_vec();
            }
        }
    };
    base.extend(rest.iter().cloned());
    base
}

/// The module `path` (absolute) names, following re-exports.
fn resolve(
    path: &[String],
    known: &BTreeMap<String, PathBuf>,
    reexports: &Reexports,
) -> Option<String> {
    let mut path = path.to_vec();
    for _ in 0..8 {
        let m = module_of(&path, known)?;
        let depth = if m.is_empty() {
            0
        } else {
            m.split("::").count()
        };
        let Some(next) = path.get(depth) else {
            return Some(m);
        };
        match reexports.get(&(m.clone(), next.clone())) {
            Some(target)
                if target
                    .first()
                    .is_some_and(|_| module_of(target, known).is_some()) =>
            {
                let mut new = target.clone();
                new.extend(path[depth + 1..].iter().cloned());
                if new == path {
                    return Some(m);
                }
                path = new;
            }
            _ => return Some(m),
        }
    }
    module_of(&path, known)
}

fn related(a: &str, b: &str) -> bool {
    let within = |inner: &str, outer: &str| {
        outer.is_empty() || inner == outer || inner.starts_with(&format!("{outer}::"))
    };
    within(a, b) || within(b, a)
}

/// The import edges between the modules of the crates at `crates`
/// (`(name, src dir, path prefix other crates use)`), nodes named
/// `crate/module`.
fn edges(crates: &[(&str, &Path, &str)]) -> BTreeMap<String, BTreeSet<String>> {
    let all: Vec<(&str, BTreeMap<String, PathBuf>, &str, Reexports)> = crates
        .iter()
        .map(|&(name, src, external)| {
            let known = modules(src);
            let mut reexports = Reexports::new();
            for (module, file) in &known {
                let here: Vec<String> = module
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                let text = code(&std::fs::read_to_string(file).unwrap());
                reexports_of(&text, &here, &known, &mut reexports);
            }
            (name, known, external, reexports)
        })
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, known, _, reexports) in &all {
        for (module, file) in known {
            let text = code(&std::fs::read_to_string(file).unwrap());
            let here: Vec<String> = if module.is_empty() {
                vec![]
            } else {
                module.split("::").map(str::to_string).collect()
            };
            // `super` of a `mod.rs` or of a file module is the enclosing module.
            let parent = &here[..here.len().saturating_sub(1)];
            let mut targets: Vec<(String, Vec<String>)> = Vec::new();
            for p in paths_after(&text, "crate::") {
                targets.push((name.to_string(), p));
            }
            for p in paths_after(&text, "super::") {
                let mut abs = parent.to_vec();
                abs.extend(p);
                targets.push((name.to_string(), abs));
            }
            for p in paths_after(&text, "self::") {
                let mut abs = here.clone();
                abs.extend(p);
                targets.push((name.to_string(), abs));
            }
            for (other, other_known, external, other_reexports) in &all {
                if other == name {
                    continue;
                }
                for p in paths_after(&text, &format!("{external}::")) {
                    if let Some(m) = resolve(&p, other_known, other_reexports) {
                        graph
                            .entry(format!("{name}/{module}"))
                            .or_default()
                            .insert(format!("{other}/{m}"));
                    }
                }
            }
            for (krate, p) in targets {
                if let Some(m) = resolve(&p, known, reexports) {
                    if !related(&m, module) {
                        graph
                            .entry(format!("{name}/{module}"))
                            .or_default()
                            .insert(format!("{krate}/{m}"));
                    }
                }
            }
        }
    }
    graph
}

/// The groups of modules that reach each other (Tarjan's strongly connected
/// components of more than one module).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(next) = s.graph.get(v) {
            for w in next {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let low = s.low[v].min(s.low[w]);
                    s.low.insert(v, low);
                } else if s.on_stack.contains(w) {
                    let low = s.low[v].min(s.index[w]);
                    s.low.insert(v, low);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_two_modules_import_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let graph = edges(&[
        ("oomfix", &root.join("src"), "oomfix"),
        (
            "oomfix_strategies",
            &root.join("strategies/src"),
            "oomfix_strategies",
        ),
    ]);
    let found = circles(&graph);
    let described: Vec<String> = found
        .iter()
        .map(|group| {
            let members: BTreeSet<&String> = group.iter().collect();
            let links: Vec<String> = group
                .iter()
                .flat_map(|a| {
                    graph[a]
                        .iter()
                        .filter(|b| members.contains(b))
                        .map(move |b| format!("{a} -> {b}"))
                })
                .collect();
            links.join(", ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "modules that import each other around a loop:\n{}",
        described.join("\n")
    );
}

#[test]
fn the_graph_sees_imports() {
    let text = code(
        "use crate::{memory::Target, speed};\n// crate::spec\nlet x = \"crate::spec\"; super::config::read();",
    );
    assert_eq!(
        paths_after(&text, "crate::"),
        vec![
            vec!["memory".to_string(), "Target".to_string()],
            vec!["speed".to_string()],
        ]
    );
    assert_eq!(
        paths_after(&text, "super::"),
        vec![vec!["config".to_string(), "read".to_string()]]
    );
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    graph.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    graph.insert("d".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(circles(&graph), vec![vec!["a", "b", "c"]]);
}
