//! `kubectl outbox` as kubectl runs it: the binary under test linked as `kubectl-outbox`
//! on the `PATH` of the rig's real kubectl, with the rig's kubeconfig.

use std::process::Output;

use super::Rig;

/// Runs `kubectl outbox <args>` through the rig's kubectl.
pub fn kubectl_outbox(args: &[&str]) -> Output {
    let rig = Rig::load();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        super::operator::operator_binary(),
        dir.path().join("kubectl-outbox"),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    std::process::Command::new(rig.get("OUTBOX_RIG_KUBECTL"))
        .arg("outbox")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", rig.kubeconfig())
        .output()
        .unwrap()
}

/// Its stdout, once it exited with `code`; else a panic with what it printed.
pub fn exited(output: &Output, code: i32) -> String {
    assert_eq!(
        output.status.code(),
        Some(code),
        "{}",
        super::describe_output(output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `text` with what differs from run to run put in words: each `(found, word)` of
/// `names` (a namespace, a database, a stream), then every `a.b.c.d:port` address,
/// RFC 3339 UTC time (`2026-12-07T22:00:46Z`) and `in 0.1s` elapsed time.
pub fn normalized(text: &str, names: &[(&str, &str)]) -> String {
    let mut text = text.to_owned();
    for (found, word) in names {
        text = text.replace(found, word);
    }
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if let Some(len) = address_at(&chars[i..]) {
            out.push_str("<address>");
            i += len;
        } else if let Some(len) = time_at(&chars[i..]) {
            out.push_str("<time>");
            i += len;
        } else if let Some(len) = elapsed_at(&chars[i..]) {
            out.push_str("in <elapsed>");
            i += len;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Digits at the start of `s`: how many.
fn digits(s: &[char]) -> usize {
    s.iter().take_while(|c| c.is_ascii_digit()).count()
}

/// `a.b.c.d:port` at the start of `s`: its length.
fn address_at(s: &[char]) -> Option<usize> {
    let mut at = 0;
    for part in 0..4 {
        let n = digits(&s[at..]);
        if n == 0 || n > 3 {
            return None;
        }
        at += n;
        let sep = if part < 3 { '.' } else { ':' };
        if s.get(at) != Some(&sep) {
            return None;
        }
        at += 1;
    }
    let port = digits(&s[at..]);
    (port > 0).then_some(at + port)
}

/// `YYYY-MM-DDTHH:MM:SS[.frac]Z` at the start of `s`: its length.
fn time_at(s: &[char]) -> Option<usize> {
    let shape = "dddd-dd-ddTdd:dd:dd";
    if s.len() < shape.len() + 1 {
        return None;
    }
    let fits = shape.chars().zip(s).all(|(want, got)| match want {
        'd' => got.is_ascii_digit(),
        other => other == *got,
    });
    if !fits {
        return None;
    }
    let mut at = shape.len();
    if s.get(at) == Some(&'.') {
        at += 1 + digits(&s[at + 1..]);
    }
    (s.get(at) == Some(&'Z')).then_some(at + 1)
}

/// `in <n>.<m>s` at the start of `s`: its length.
fn elapsed_at(s: &[char]) -> Option<usize> {
    if !s.starts_with(&['i', 'n', ' ']) {
        return None;
    }
    let whole = digits(&s[3..]);
    if whole == 0 || s.get(3 + whole) != Some(&'.') {
        return None;
    }
    let frac = digits(&s[4 + whole..]);
    let end = 4 + whole + frac;
    (frac > 0 && s.get(end) == Some(&'s')).then_some(end + 1)
}

/// Compares `text` with the golden file `tests/golden/<name>`; `UPDATE_GOLDEN=1`
/// writes it instead.
pub fn assert_golden(name: &str, text: &str) {
    let golden = format!("{}/tests/golden/{name}", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, text).unwrap();
    }
    let want = std::fs::read_to_string(&golden)
        .unwrap_or_else(|e| panic!("{golden}: {e} (UPDATE_GOLDEN=1 writes it)"));
    assert_eq!(
        text, want,
        "the output differs from {golden} (UPDATE_GOLDEN=1 rewrites it)"
    );
}
