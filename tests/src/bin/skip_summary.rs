//! Runs the test command and ends it with one summary of every test that skipped (all or
//! part of itself), with its reason: `skip_summary cargo test --workspace` (the README's
//! test command).
//!
//! It empties the folder the tests record their skips in
//! ([`gpufrac_e2e::skipped_tests_dir`]), runs the command with the terminal as its own
//! (nothing it prints is held back or reordered), then prints the skips it recorded. Its
//! exit status is the command's when the command failed; otherwise, with
//! `GPUFRAC_E2E_STRICT_SKIPS=1` (set by `.ci/run`), 1 if a test skipped for want of
//! something CI's machine has (`this-machine` in the summary); otherwise 0.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitCode};

use gpufrac_e2e::{read_skips, skipped_tests_dir, SkipRecord};

/// The variable that makes a skip CI's machine should not need a failure.
const STRICT_VAR: &str = "GPUFRAC_E2E_STRICT_SKIPS";

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let Some((program, rest)) = args.split_first() else {
        eprintln!("skip_summary: usage: skip_summary COMMAND [ARGUMENT...] (e.g. skip_summary cargo test --workspace)");
        return ExitCode::from(2);
    };
    let strict = match std::env::var_os(STRICT_VAR).as_deref().map(|v| v.to_str()) {
        None | Some(Some("0")) => false,
        Some(Some("1")) => true,
        Some(value) => {
            eprintln!("skip_summary: {STRICT_VAR}={value:?} is not understood: set it to 1 or 0");
            return ExitCode::from(2);
        }
    };
    let dir = skipped_tests_dir();
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            eprintln!("skip_summary: cannot empty {}: {e}", dir.display());
            return ExitCode::from(2);
        }
    }

    let status = match Command::new(program).args(rest).status() {
        Ok(status) => status,
        Err(e) => {
            eprintln!("skip_summary: cannot run {}: {e}", program.to_string_lossy());
            return ExitCode::from(2);
        }
    };
    let records = match read_skips(&dir) {
        Ok(records) => records,
        Err(e) => {
            eprintln!("skip_summary: {e}");
            return ExitCode::from(2);
        }
    };
    print_summary(&records);

    if !status.success() {
        let code = status.code().or(status.signal().map(|s| 128 + s)).unwrap_or(1);
        println!("skip_summary: the test command failed ({status})");
        return ExitCode::from(u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1));
    }
    let unexpected: Vec<&SkipRecord> = records.iter().filter(|r| !r.kind.expected_on_ci()).collect();
    if strict && !unexpected.is_empty() {
        println!(
            "skip_summary: {} skipped for want of something CI's machine has ({STRICT_VAR}=1: only tests \
             that need a GPU the machine lacks, or PyTorch, may skip): {}",
            unexpected.len(),
            unexpected.iter().map(|r| r.test.as_str()).collect::<Vec<_>>().join(", ")
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

fn print_summary(records: &[SkipRecord]) {
    println!();
    if records.is_empty() {
        println!("skipped tests: none");
        return;
    }
    println!("skipped tests ({}):", records.len());
    let width = records.iter().map(|r| r.test.len()).max().unwrap_or(0);
    for r in records {
        println!("  {:width$}  {:14}  {}", r.test, r.kind.label(), r.reason);
    }
}
