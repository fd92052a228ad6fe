//! The layer order docs/development.md states ("How the code is laid out"): every `crate::`
//! path in a source file names a module of a lower layer (or its own), so no module
//! imports one above it and no two import each other. Doc comments and test modules
//! may name anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The table of docs/development.md: module → layer.
fn layers() -> BTreeMap<String, u32> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/development.md"))
            .expect("docs/development.md");
    let section = readme
        .split("## How the code is laid out")
        .nth(1)
        .expect("docs/development.md has a section \"How the code is laid out\"");
    let mut layers = BTreeMap::new();
    for line in section.lines().take_while(|l| !l.starts_with("## ")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(layer) = cells.get(1).and_then(|c| c.parse::<u32>().ok()) else {
            continue;
        };
        for module in cells[2].split(',') {
            layers.insert(module.trim().trim_matches('`').to_owned(), layer);
        }
    }
    assert!(layers.len() > 10, "the layer table: {layers:?}");
    layers
}

/// Every `.rs` file under `dir`, but test files (`tests.rs`, `*/tests/*`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if name != "tests" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The top-level module a file under `src/` belongs to (`None`: the crate root).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let module = first.trim_end_matches(".rs");
    (module != "lib").then(|| module.to_owned())
}

/// The modules a file's code (not its comments, not its `#[cfg(test)]` module) names
/// as `crate::<module>`.
fn named(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let module: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !module.is_empty() {
                found.push((number + 1, module));
            }
        }
        // `use crate::{a, b}` names several.
        if let Some(list) = code.strip_prefix("use crate::{") {
            for part in list.split(',') {
                let module: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !module.is_empty() {
                    found.push((number + 1, module));
                }
            }
        }
    }
    found
}

#[test]
fn no_module_imports_one_above_its_layer() {
    let layers = layers();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        if module == "main" {
            continue;
        }
        let Some(own) = layers.get(&module) else {
            wrong.push(format!(
                "{}: module `{module}` is not in the table of docs/development.md",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read");
        for (line, other) in named(&text) {
            if other == module {
                continue;
            }
            // Items of the crate root (lib.rs), not modules.
            let Some(theirs) = layers.get(&other) else {
                continue;
            };
            if theirs >= own {
                wrong.push(format!(
                    "{}:{line}: `{module}` (layer {own}) uses `crate::{other}` (layer {theirs})",
                    file.strip_prefix(&src).unwrap_or(file).display()
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layer order:\n{}",
        wrong.join("\n")
    );
}

/// A source file's module path: `src/postgres/table.rs` → `postgres::table`,
/// `src/postgres/mod.rs` → `postgres`, the crate roots → the empty path.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap_or(file);
    let mut path: Vec<String> = relative
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .map(|c| c.trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        path.pop();
    }
    path
}

/// The code of a file a module graph reads: no comments, nothing from `#[cfg(test)]` on.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// Every path of a use tree (or a plain path) starting at `at`: `a::{b, c::{d}}` →
/// `a::b`, `a::c::d`. Segments only, no `as` renames, no `*`.
fn expand(code: &[u8], at: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let skip_space = |at: &mut usize| {
        while *at < code.len() && code[*at].is_ascii_whitespace() {
            *at += 1;
        }
    };
    let mut path = prefix;
    loop {
        skip_space(at);
        if *at < code.len() && code[*at] == b'{' {
            *at += 1;
            loop {
                expand(code, at, path.clone(), out);
                skip_space(at);
                match code.get(*at) {
                    Some(b',') => *at += 1,
                    Some(b'}') => {
                        *at += 1;
                        return;
                    }
                    _ => return,
                }
                skip_space(at);
                if code.get(*at) == Some(&b'}') {
                    *at += 1;
                    return;
                }
            }
        }
        let start = *at;
        while *at < code.len() && (code[*at].is_ascii_alphanumeric() || code[*at] == b'_') {
            *at += 1;
        }
        if *at == start {
            break;
        }
        path.push(String::from_utf8_lossy(&code[start..*at]).into_owned());
        if code[*at..].starts_with(b"::") {
            *at += 2;
        } else {
            break;
        }
    }
    // Skip an `as name` and anything else up to the end of this tree's item.
    while *at < code.len() && !matches!(code[*at], b',' | b'}' | b';' | b'{') {
        if code[*at].is_ascii_whitespace() && code[*at + 1..].starts_with(b"as ") {
            *at += 3;
            skip_space(at);
            while *at < code.len() && (code[*at].is_ascii_alphanumeric() || code[*at] == b'_') {
                *at += 1;
            }
            continue;
        }
        break;
    }
    out.push(path);
}

/// The absolute module paths a file's code names: `crate::…`, `super::…`, `self::…`, and
/// `use child::…` of its own child modules.
fn paths_named(own: &[String], modules: &BTreeSet<Vec<String>>, code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let boundary = at == 0
            || !(bytes[at - 1].is_ascii_alphanumeric()
                || bytes[at - 1] == b'_'
                || bytes[at - 1] == b':');
        if !boundary {
            at += 1;
            continue;
        }
        let rest = &bytes[at..];
        let (base, skip): (Vec<String>, usize) = if rest.starts_with(b"crate::") {
            (Vec::new(), "crate::".len())
        } else if rest.starts_with(b"self::") {
            (own.to_vec(), "self::".len())
        } else if rest.starts_with(b"super::") {
            let mut base = own.to_vec();
            let mut skip = 0;
            while bytes[at + skip..].starts_with(b"super::") {
                base.pop();
                skip += "super::".len();
            }
            (base, skip)
        } else if rest.starts_with(b"use ") || rest.starts_with(b"pub use ") {
            // `use child::Item` in a module with that child.
            let after = at + if rest.starts_with(b"use ") { 4 } else { 8 };
            let name: String = code[after..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let mut child = own.to_vec();
            child.push(name);
            if modules.contains(&child) {
                at = after;
                let mut paths = Vec::new();
                expand(bytes, &mut at, own.to_vec(), &mut paths);
                found.extend(paths);
            } else {
                at += 1;
            }
            continue;
        } else {
            at += 1;
            continue;
        };
        at += skip;
        let mut paths = Vec::new();
        expand(bytes, &mut at, base, &mut paths);
        found.extend(paths);
    }
    found
}

/// No two source files import each other, directly or through others: the file graph
/// of `crate::`, `super::` and `self::` paths has no circle. A module naming its own
/// children (`mod x; use x::Y`) is how it is made of them, not an import. (The layer test
/// above sees only the top-level modules; this one sees the files inside them.)
#[test]
fn no_source_files_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let modules: BTreeMap<Vec<String>, usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (module_path(&src, f), i))
        .collect();
    let known: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); files.len()];
    for (i, file) in files.iter().enumerate() {
        let own = module_path(&src, file);
        let text = std::fs::read_to_string(file).expect("read");
        for path in paths_named(&own, &known, &code_of(&text)) {
            // The longest prefix that is a file's module.
            let target = (0..=path.len())
                .rev()
                .find_map(|n| modules.get(&path[..n]).copied());
            // A module's own children are its parts, not imports: `mod x; use x::Y`.
            let part_of_own = |j: usize| module_path(&src, &files[j]).starts_with(&own);
            if let Some(j) = target.filter(|j| *j != i && !part_of_own(*j)) {
                edges[i].insert(j);
            }
        }
    }
    // Circles: a file that reaches itself again.
    let name = |i: usize| {
        files[i]
            .strip_prefix(&src)
            .unwrap_or(&files[i])
            .display()
            .to_string()
    };
    let mut circles = BTreeSet::new();
    for start in 0..files.len() {
        // Depth-first, remembering the path back to `start`.
        let mut previous: BTreeMap<usize, usize> = BTreeMap::new();
        let mut stack = vec![start];
        while let Some(at) = stack.pop() {
            for &next in &edges[at] {
                if next == start {
                    let mut circle = vec![name(at)];
                    let mut back = at;
                    while let Some(&p) = previous.get(&back) {
                        circle.push(name(p));
                        back = p;
                    }
                    circle.reverse();
                    circle.sort();
                    circles.insert(circle.join(" <-> "));
                } else if next != start && !previous.contains_key(&next) {
                    previous.insert(next, at);
                    stack.push(next);
                }
            }
        }
    }
    assert!(
        circles.is_empty(),
        "source files that import each other (directly or through the others listed):\n{}",
        circles.into_iter().collect::<Vec<_>>().join("\n")
    );
}
