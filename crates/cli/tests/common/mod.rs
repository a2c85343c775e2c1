//! Helpers shared by the CLI tests: run the `simpler` binary, read its output, make a fresh
//! temporary directory.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `simpler` with `args` (no backtraces, so error messages are what a user sees).
pub fn simpler(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_simpler"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run simpler")
}

/// Output bytes as text.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts that `simpler args` fails, its error holds `needle`, and it printed nothing (it
/// was refused before it ran).
pub fn refused(args: &[&str], needle: &str) {
    let out = simpler(args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{args:?}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(text(&out.stdout).is_empty(), "{args:?}: ran anyway");
}

/// An empty directory unique to this test process and `name`.
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("simpler-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
