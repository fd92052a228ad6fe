//! The layer order docs/development.md states ("How the code is laid out"): every `crate::`
//! path in a source file names a module of a lower layer (or its own), so no module
//! imports one above it and no two import each other. Doc comments and test modules
//! may name anything.

use std::collections::BTreeMap;
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
