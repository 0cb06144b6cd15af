//! The design card's layering rules (`docs/architecture.md`, "Layout"), checked against the
//! code: this test reads every `src/` file's `crate::…` paths (and `super::…` paths that
//! climb to the crate root), outside comments and test code, and fails on any import the card
//! forbids, naming the file and line:
//! - the pure planes (`request_plane/`, `kv/`, `control/`, `worker/`, `model/`, `kernels/`,
//!   `openai/`, `anthropic/`) never import `actors/`, `supervisors/`, `node/` or `cli/`;
//! - `sim/` imports the pure planes and `runtime/` only (it drives the cores, not actors);
//! - `kernels/` and `model/` never import `transport/` (the KV memory they touch is `kv/`'s);
//! - `runtime/` imports nothing of ours;
//! - no circle between top-level modules (every arrow runs down).
//!
//! `EXCEPTIONS` lists the arrows still to be removed, each with what removes it; an exception
//! that no longer occurs fails the test too, so the list only shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PURE: &[&str] = &[
    "request_plane",
    "kv",
    "control",
    "worker",
    "model",
    "kernels",
    "openai",
    "anthropic",
];
const ABOVE_PURE: &[&str] = &["actors", "supervisors", "node", "cli"];

/// Arrows the card forbids that the code still has: (from, to, what removes it).
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

/// One `crate::X` (or root-climbing `super::…::X`) use: the file, its line, the module named.
#[derive(Debug, Clone)]
struct Use {
    file: PathBuf,
    line: usize,
    target: String,
}

/// The top-level module a file belongs to and its module path (`src/a/b/c.rs` → `a::b::c`).
fn module_of(src: &Path, file: &Path) -> Option<(String, Vec<String>)> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    let top = parts.first()?.clone();
    if top == "lib" || top == "main" {
        return None;
    }
    Some((top, parts))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A test-only file: `tests.rs`, `*_tests.rs`, or under a `tests/` folder.
fn is_test_file(src: &Path, file: &Path) -> bool {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let name = rel.file_name().map(|n| n.to_string_lossy().into_owned());
    name.as_deref()
        .is_some_and(|n| n == "tests.rs" || n.ends_with("_tests.rs"))
        || rel.iter().any(|c| c == "tests")
}

/// The code of `text` without comments, string contents and `#[cfg(test)]` items: one entry
/// per line (so that line numbers hold).
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = 0usize;
    for raw in text.lines() {
        let mut line = String::new();
        let mut chars = raw.chars().peekable();
        let mut in_str = false;
        while let Some(c) = chars.next() {
            if in_block > 0 {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    in_block -= 1;
                } else if c == '/' && chars.peek() == Some(&'*') {
                    chars.next();
                    in_block += 1;
                }
                continue;
            }
            if in_str {
                if c == '\\' {
                    chars.next();
                } else if c == '"' {
                    in_str = false;
                    line.push('"');
                }
                continue;
            }
            match c {
                '"' => {
                    in_str = true;
                    line.push('"');
                }
                '/' if chars.peek() == Some(&'/') => break,
                '/' if chars.peek() == Some(&'*') => {
                    chars.next();
                    in_block += 1;
                }
                _ => line.push(c),
            }
        }
        out.push(line);
    }
    // Blank out `#[cfg(test)]` items: the attribute, then the item up to its `;` or the end
    // of its braces.
    let mut i = 0;
    while i < out.len() {
        if out[i].trim_start().starts_with("#[cfg(test)]") {
            let mut depth = 0i64;
            let mut opened = false;
            let mut j = i;
            loop {
                let l = std::mem::take(&mut out[j]);
                for c in l.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            opened = true;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                }
                let ends = (opened && depth <= 0)
                    || (!opened
                        && l.trim_end().ends_with(';')
                        && (j > i || l.trim() != "#[cfg(test)]"));
                if ends || j + 1 >= out.len() {
                    break;
                }
                j += 1;
            }
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// The top-level modules a file's code names, with their lines.
fn uses_of(file: &Path, module: &[String]) -> Vec<Use> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let lines = code_lines(&text);
    let mut uses = Vec::new();
    let mut push = |line: usize, target: &str| {
        uses.push(Use {
            file: file.to_path_buf(),
            line,
            target: target.to_string(),
        });
    };
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut i = 0;
    while i < lines.len() {
        let l = &lines[i];
        // `crate::{a::…, b, …}` groups, possibly over several lines.
        if let Some(at) = l.find("crate::{") {
            let mut group = String::new();
            let mut depth = 0i64;
            let mut j = i;
            let mut rest = l[at + "crate::".len()..].to_string();
            'outer: loop {
                for c in rest.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            if depth == 1 {
                                continue;
                            }
                        }
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                break 'outer;
                            }
                        }
                        _ => {}
                    }
                    group.push(if depth == 1 { c } else { ' ' });
                }
                j += 1;
                if j >= lines.len() {
                    break;
                }
                rest = lines[j].clone();
            }
            for part in group.split(',') {
                let name = ident(part.trim_start());
                if !name.is_empty() && name != "self" {
                    push(i + 1, &name);
                }
            }
        }
        let mut s = l.as_str();
        while let Some(at) = s.find("crate::") {
            let before_ok = at == 0 || {
                let b = s.as_bytes()[at - 1];
                !(b.is_ascii_alphanumeric() || b == b'_')
            };
            let name = ident(&s[at + "crate::".len()..]);
            if before_ok && !name.is_empty() {
                push(i + 1, &name);
            }
            s = &s[at + "crate::".len()..];
        }
        // `super::super::x` that climbs to the crate root names top-level module `x`.
        let mut s = l.as_str();
        while let Some(at) = s.find("super::") {
            let mut depth = 0;
            let mut rest = &s[at..];
            while let Some(r) = rest.strip_prefix("super::") {
                depth += 1;
                rest = r;
            }
            if depth == module.len() {
                let name = ident(rest);
                if !name.is_empty() {
                    push(i + 1, &name);
                }
            }
            s = &s[at + "super::".len()..];
        }
        i += 1;
    }
    uses
}

fn forbidden(from: &str, to: &str) -> Option<&'static str> {
    if PURE.contains(&from) && ABOVE_PURE.contains(&to) {
        return Some("a pure plane imports a driver or the composition root");
    }
    if from == "sim" && !(PURE.contains(&to) || to == "runtime") {
        return Some("sim/ drives the pure cores only");
    }
    if (from == "kernels" || from == "model") && to == "transport" {
        return Some("kernels/ and model/ never import transport/");
    }
    if from == "runtime" {
        return Some("runtime/ is the ground floor and imports nothing of ours");
    }
    None
}

/// Strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn the_crate_follows_the_design_cards_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let tops: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_of(&src, f).map(|(t, _)| t))
        .collect();
    assert!(
        tops.contains("actors") && tops.contains("kv") && tops.contains("runtime"),
        "read the crate's modules: {tops:?}"
    );

    // Every arrow between top-level modules, with where it is written.
    let mut arrows: BTreeMap<(String, String), Vec<Use>> = BTreeMap::new();
    for f in &files {
        if is_test_file(&src, f) {
            continue;
        }
        let Some((top, module)) = module_of(&src, f) else {
            continue;
        };
        for u in uses_of(f, &module) {
            if u.target != top && tops.contains(&u.target) {
                arrows
                    .entry((top.clone(), u.target.clone()))
                    .or_default()
                    .push(u);
            }
        }
    }
    assert!(
        arrows.contains_key(&("actors".into(), "runtime".into())),
        "found the actors' imports"
    );

    let excepted = |from: &str, to: &str| EXCEPTIONS.iter().any(|e| e.0 == from && e.1 == to);
    let where_ = |uses: &[Use]| -> String {
        uses.iter()
            .take(5)
            .map(|u| {
                let rel = u
                    .file
                    .strip_prefix(src.parent().unwrap_or(&src))
                    .unwrap_or(&u.file);
                format!("{}:{}", rel.display(), u.line)
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut problems = Vec::new();
    for ((from, to), uses) in &arrows {
        if let Some(rule) = forbidden(from, to)
            && !excepted(from, to)
        {
            problems.push(format!("{from} -> {to} ({rule}): {}", where_(uses)));
        }
    }
    let graph: BTreeMap<String, BTreeSet<String>> = arrows
        .keys()
        .filter(|(from, to)| !excepted(from, to))
        .fold(BTreeMap::new(), |mut g, (from, to)| {
            g.entry(from.clone()).or_default().insert(to.clone());
            g
        });
    for comp in circles(&graph) {
        let inside: Vec<String> = arrows
            .iter()
            .filter(|((f, t), _)| comp.contains(f) && comp.contains(t) && !excepted(f, t))
            .map(|((f, t), uses)| format!("{f} -> {t}: {}", where_(uses)))
            .collect();
        problems.push(format!(
            "a circle between {}: {}",
            comp.join(", "),
            inside.join("; ")
        ));
    }
    for (from, to, why) in EXCEPTIONS {
        if !arrows.contains_key(&(from.to_string(), to.to_string())) {
            problems.push(format!(
                "{from} -> {to} is gone: remove it from EXCEPTIONS (it was waiting for: {why})"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the card's layers are broken:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_reader_sees_grouped_climbing_and_commented_imports() {
    let dir = std::env::temp_dir().join(format!("flotilla-layering-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let f = dir.join("x.rs");
    std::fs::write(
        &f,
        "use crate::{\n    kv::pool,\n    actors::{a, b},\n};\n// use crate::node::x;\n\
         let s = \"crate::cli\";\nuse super::super::transport::T;\n\
         #[cfg(test)]\nmod tests {\n    use crate::sim::X;\n}\nfn f() { crate::runtime::now() }\n",
    )
    .expect("write");
    let uses = uses_of(&f, &["model".to_string(), "x".to_string()]);
    let got: Vec<(usize, &str)> = uses.iter().map(|u| (u.line, u.target.as_str())).collect();
    assert_eq!(
        got,
        vec![(1, "kv"), (1, "actors"), (7, "transport"), (12, "runtime")],
        "comments, strings and test items are not imports; groups and super chains are"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
