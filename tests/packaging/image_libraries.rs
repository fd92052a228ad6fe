//! The runtime image (distroless/cc) has glibc, libgcc and libstdc++ and nothing else,
//! and the Dockerfile refuses a binary that wants any other shared library. This runs
//! the same allow-list, read from the Dockerfile, against the binary `cargo` built
//! here, so a dependency change that links a new library (OpenSSL for Kafka's TLS,
//! zlib, libcurl) fails in CI, not in an image build nobody ran.

#[test]
fn the_binary_needs_only_the_shared_libraries_the_runtime_image_has() {
    let dockerfile = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile"))
        .unwrap_or_else(|e| panic!("Dockerfile: {e}"));
    // The pattern between `grep -Ev '` and the next `'`.
    let start = dockerfile
        .find("grep -Ev '")
        .unwrap_or_else(|| panic!("the Dockerfile's ldd check (grep -Ev '...') is gone"))
        + "grep -Ev '".len();
    let end = start + dockerfile[start..].find('\'').unwrap();
    let pattern = &dockerfile[start..end];
    let out = std::process::Command::new("ldd")
        .arg(env!("CARGO_BIN_EXE_outbox-operator"))
        .output()
        .unwrap_or_else(|e| panic!("ldd: {e}"));
    assert!(out.status.success(), "ldd failed: {out:?}");
    let needed: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    assert!(
        needed.iter().any(|n| n.starts_with("libc.so")),
        "ldd output unexpected: {needed:?}"
    );
    let extra: Vec<&String> = needed
        .iter()
        .filter(|lib| {
            let ok = std::process::Command::new("grep")
                .args([
                    "-Eqx",
                    pattern.trim_start_matches('^').trim_end_matches('$'),
                ])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut child| {
                    use std::io::Write;
                    child
                        .stdin
                        .take()
                        .unwrap()
                        .write_all(format!("{lib}\n").as_bytes())?;
                    child.wait()
                })
                .map(|s| s.success())
                .unwrap_or(false);
            !ok
        })
        .collect();
    assert!(
        extra.is_empty(),
        "the binary needs shared libraries the runtime image lacks: {extra:?} (all: {needed:?})"
    );
}
