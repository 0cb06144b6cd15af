//! The repository is self-contained: no code, test, example, bench, script or make rule reads
//! a file from a folder beside the clone (the `shared` folder of the development machines).
//! Comments may mention it; code may not. Fixtures live in `tests/data/`, traces in
//! `data/traces/`.

use std::path::{Path, PathBuf};

/// The folders and files searched, relative to the crate root.
const SEARCHED: &[&str] = &[
    "src", "tests", "examples", "benches", "scripts", ".ci", "Makefile",
];

fn files(root: &Path, out: &mut Vec<PathBuf>) {
    if root.is_file() {
        out.push(root.to_owned());
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        files(&e.path(), out);
    }
}

/// A comment line in Rust, shell, Python or make syntax.
fn is_comment(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("//") || t.starts_with('#')
}

#[test]
fn nothing_reads_outside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Built from pieces so that this file does not match itself.
    let needles = [["..", "/shared"].concat(), ["/work", "/shared"].concat()];
    let mut all = Vec::new();
    for s in SEARCHED {
        files(&root.join(s), &mut all);
    }
    assert!(all.len() > 20, "the search found too few files: {all:?}");
    let mut hits = Vec::new();
    for f in &all {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue; // binary fixtures
        };
        for (n, line) in text.lines().enumerate() {
            if !is_comment(line) && needles.iter().any(|x| line.contains(x.as_str())) {
                hits.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "these lines read outside the repository; move the file into it (tests/data/, \
         data/traces/):\n{}",
        hits.join("\n")
    );
}
