#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The README's quick start, run as a newcomer would: `just up` (what `./dev demo` runs once
//! the tools are installed), then every `$ ` command of the README's transcript in a shell,
//! each output compared with the lines the README shows under it. Only the `date:` response
//! header is not compared (it is the time of the run).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use tollgate_e2e::paths;
use tollgate_e2e::ports::is_free;
use tollgate_e2e::process::{output_with_timeout, spawn_tied, wait_for};

/// One command of the transcript and the output the README shows for it.
#[derive(Debug)]
struct Step {
    command: String,
    output: Vec<String>,
}

/// The transcript: the first ```sh block of the Quick start section that holds `$ ` lines.
fn transcript(readme: &str) -> Vec<Step> {
    let section = readme
        .split("\n## Quick start\n")
        .nth(1)
        .expect("README has a Quick start section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let block = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("\n```").next())
        .find(|b| b.lines().any(|l| l.starts_with("$ ")))
        .expect("the Quick start shows a transcript");
    let mut steps: Vec<Step> = Vec::new();
    let mut continued = false;
    for line in block.lines() {
        if continued {
            let step = steps.last_mut().unwrap();
            step.command.push('\n');
            step.command.push_str(line);
            continued = line.ends_with('\\');
        } else if let Some(command) = line.strip_prefix("$ ") {
            steps.push(Step {
                command: command.to_string(),
                output: Vec::new(),
            });
            continued = line.ends_with('\\');
        } else {
            steps
                .last_mut()
                .expect("output before the first command")
                .output
                .push(line.to_string());
        }
    }
    steps
}

/// The lines compared: trailing blanks trimmed, `date:` headers left out.
fn comparable(lines: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = lines
        .into_iter()
        .map(|l| l.trim_end().to_string())
        .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
        .collect();
    while out.last().is_some_and(|l| l.is_empty()) {
        out.pop();
    }
    out
}

/// `just up` in its own process group, stopped (with everything it started) on drop.
struct Demo {
    child: std::process::Child,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let pgid = i32::try_from(self.child.id()).unwrap();
        // SAFETY: plain signal syscalls on the process group this test created.
        unsafe {
            libc::killpg(pgid, libc::SIGTERM);
        }
        let stopped = wait_for("the demo to stop", Duration::from_secs(10), || {
            self.child.try_wait().ok().flatten()
        });
        if stopped.is_err() {
            unsafe {
                libc::killpg(pgid, libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

#[test]
fn the_readme_quick_start_prints_what_the_readme_shows() {
    let root = paths::workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let steps = transcript(&readme);
    assert!(steps.len() >= 3, "{steps:?}");
    for port in [10000, 10001, 9901, 8081] {
        assert!(
            is_free(port),
            "port {port} is in use: the quick start needs it (is a demo running?)"
        );
    }
    let venv = root.join(".venv/bin");
    let path = format!(
        "{}:{}",
        venv.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let log = paths::new_log_dir(&paths::current_test_name(), "demo").join("just-up.log");
    let mut cmd = Command::new("just");
    // A newcomer's shell: `just up` builds the limiter, and cargo must not see this test's
    // own cargo variables as changed inputs (it would rebuild ring and the limiter).
    paths::as_from_a_shell(&mut cmd)
        .arg("up")
        .current_dir(&root)
        .env("PATH", &path)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
        .process_group(0);
    let child = spawn_tied(cmd).expect("cannot run `just up`");
    let _demo = Demo { child };
    wait_for("the demo to listen", Duration::from_secs(300), || {
        (!is_free(10000) && !is_free(8081) && !is_free(9901)).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: see {}", log.display()));
    // Envoy listens before its wasm filter is configured on every worker; wait until the
    // admin says it is live.
    wait_for("Envoy to be live", Duration::from_secs(60), || {
        let mut probe = Command::new("curl");
        probe.args(["-sf", "localhost:9901/ready"]);
        output_with_timeout(probe, Duration::from_secs(5))
            .ok()
            .filter(|o| o.status.success())
            .map(|_| ())
    })
    .unwrap();
    for step in &steps {
        let mut shell = Command::new("bash");
        shell
            .arg("-c")
            .arg(&step.command)
            .current_dir(&root)
            .env("PATH", &path);
        let out = output_with_timeout(shell, Duration::from_secs(30)).unwrap();
        let got = comparable(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string),
        );
        let want = comparable(step.output.iter().cloned());
        assert_eq!(
            got,
            want,
            "README command:\n$ {}\nprinted:\n{}\nthe README shows:\n{}",
            step.command,
            got.join("\n"),
            want.join("\n")
        );
    }
}

#[test]
fn the_transcript_parser_reads_continued_commands() {
    let readme = "x\n## Quick start\n```sh\n./dev demo\n```\ntext\n```sh\n$ echo a \\\n  b\na b\n$ true\n```\n## Next\n";
    let steps = transcript(readme);
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].command, "echo a \\\n  b");
    assert_eq!(steps[0].output, vec!["a b"]);
    assert!(steps[1].output.is_empty());
}
