//! The documentation book (docs/, mdBook): it builds, its summary lists every page,
//! and no link is broken — every relative link of every built page reaches a page of
//! the book (and the heading it names), and every link out of the book into the
//! repository (`../examples/…`) names a file that exists. The README's links are held
//! to the same rule.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `href="…"` and `id="…"` values of an HTML page.
fn attributes(html: &str, name: &str) -> Vec<String> {
    let needle = format!("{name}=\"");
    html.match_indices(&needle)
        .filter_map(|(i, _)| {
            let rest = &html[i + needle.len()..];
            rest.find('"').map(|end| rest[..end].replace("&amp;", "&"))
        })
        .collect()
}

/// The HTML pages under `dir`, by path relative to it.
fn pages(dir: &Path, base: &Path, out: &mut BTreeMap<PathBuf, String>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            pages(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "html") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.insert(path.strip_prefix(base).unwrap().to_owned(), text);
        }
    }
}

/// Whether `link` (from a page at `from`, both relative to the book) is one the site
/// itself resolves; `Err` says what is broken.
fn check_link(
    from: &Path,
    link: &str,
    built: &BTreeMap<PathBuf, String>,
    ids: &BTreeMap<PathBuf, BTreeSet<String>>,
) -> Result<(), String> {
    if link.is_empty()
        || link.starts_with("http://")
        || link.starts_with("https://")
        || link.starts_with("mailto:")
        || link.starts_with("javascript:")
    {
        return Ok(());
    }
    let (target, anchor) = link.split_once('#').unwrap_or((link, ""));
    let page = if target.is_empty() {
        from.to_owned()
    } else {
        let joined = from.parent().unwrap_or(Path::new("")).join(target);
        normalize(&joined)
    };
    let is_book_asset = !target.is_empty()
        && !target.ends_with(".html")
        && !target.ends_with('/')
        && !page.starts_with("..");
    if is_book_asset {
        // mdBook's own stylesheets, scripts and fonts.
        return Ok(());
    }
    if page.starts_with("..") {
        // Out of the book, into the repository: the file must exist there.
        let in_repo = normalize(&Path::new("docs").join(&page));
        return if repo().join(&in_repo).exists() {
            Ok(())
        } else {
            Err(format!("{link}: {} does not exist", in_repo.display()))
        };
    }
    let page = if target.ends_with('/') || page.as_os_str().is_empty() {
        page.join("index.html")
    } else {
        page
    };
    if !built.contains_key(&page) {
        return Err(format!("{link}: no page {}", page.display()));
    }
    if !anchor.is_empty() && !ids.get(&page).is_some_and(|i| i.contains(anchor)) {
        return Err(format!(
            "{link}: {} has no heading #{anchor}",
            page.display()
        ));
    }
    Ok(())
}

fn normalize(path: &Path) -> PathBuf {
    let mut out: Vec<std::ffi::OsString> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                if out.last().is_some_and(|p| p != "..") {
                    out.pop();
                } else {
                    out.push("..".into());
                }
            }
            std::path::Component::CurDir => {}
            other => out.push(other.as_os_str().to_owned()),
        }
    }
    out.iter().collect()
}

#[test]
fn the_book_builds_lists_every_page_and_has_no_broken_link() {
    let rig = common::Rig::load();
    let mdbook = rig.mdbook();
    let out = tempfile::tempdir().unwrap();
    let output = common::run_tool(
        mdbook,
        &[
            "build",
            repo().join("docs").to_str().unwrap(),
            "--dest-dir",
            out.path().to_str().unwrap(),
        ],
    );
    assert!(
        output.status.success(),
        "mdbook build: {}",
        common::describe_output(&output)
    );
    // Every page of docs/ is in the summary (mdBook builds only those).
    let summary = std::fs::read_to_string(repo().join("docs/SUMMARY.md")).unwrap();
    for entry in std::fs::read_dir(repo().join("docs")).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(
                summary.contains(&format!("({name})")),
                "docs/{name} is not in docs/SUMMARY.md"
            );
        }
    }
    let mut built = BTreeMap::new();
    pages(out.path(), out.path(), &mut built);
    let ids: BTreeMap<PathBuf, BTreeSet<String>> = built
        .iter()
        .map(|(p, html)| (p.clone(), attributes(html, "id").into_iter().collect()))
        .collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for (page, html) in &built {
        if ["print.html", "toc.html", "404.html"]
            .iter()
            .any(|p| page.starts_with(p))
        {
            // mdBook's print view and sidebar repeat every link; its 404 page links
            // the site's root, which only a served site has.
            continue;
        }
        for link in attributes(html, "href") {
            checked += 1;
            if let Err(why) = check_link(page, &link, &built, &ids) {
                broken.push(format!("{}: {why}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 100, "only {checked} links checked");
    println!(
        "docs book: {} pages, {checked} links, none broken",
        built.len()
    );
}

#[test]
fn a_broken_link_is_caught() {
    let built: BTreeMap<PathBuf, String> =
        [(PathBuf::from("install.html"), "<h2 id=\"kind\">".to_owned())].into();
    let ids = built
        .iter()
        .map(|(p, h)| (p.clone(), attributes(h, "id").into_iter().collect()))
        .collect();
    let from = Path::new("operations.html");
    assert!(check_link(from, "install.html#kind", &built, &ids).is_ok());
    assert!(check_link(from, "install.html#nowhere", &built, &ids).is_err());
    assert!(check_link(from, "upgrade.html", &built, &ids).is_err());
    assert!(check_link(from, "../examples/schema.sql", &built, &ids).is_ok());
    assert!(check_link(from, "../examples/none.sql", &built, &ids).is_err());
}

/// The README's relative links name files that exist.
#[test]
fn the_readmes_links_name_files_that_exist() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let mut missing = Vec::new();
    for (i, _) in readme.match_indices("](") {
        let rest = &readme[i + 2..];
        let Some(end) = rest.find(')') else { continue };
        let target = rest[..end].split('#').next().unwrap_or_default();
        if target.is_empty() || target.contains("://") {
            continue;
        }
        if !repo().join(target).exists() {
            missing.push(target.to_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "README links to missing files: {missing:?}"
    );
}
