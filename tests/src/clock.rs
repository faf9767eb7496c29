//! A shifted wall clock for a child process: [`offset_library`] builds the preload shim
//! `tests/shim/clock_offset.c` (once per test process, with the system C compiler that Rust's
//! linker needs anyway) and [`offset_env`] is the environment that shifts a process' realtime
//! clocks by a number of milliseconds. Used to run a `redis-server` whose `TIME` is ahead of or
//! behind the host's, as a Redis node on a host with a skewed clock would be.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::paths;
use crate::process::output_with_timeout;

const SOURCE: &str = include_str!("../shim/clock_offset.c");

/// The shim's shared library, built on first use; panics with the compiler's output if it
/// cannot be built.
pub fn offset_library() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = paths::target_dir().join("e2e-shim");
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
            let pid = std::process::id();
            let source = dir.join(format!("clock_offset.{pid}.c"));
            std::fs::write(&source, SOURCE)
                .unwrap_or_else(|e| panic!("write {}: {e}", source.display()));
            let built = dir.join(format!("clock_offset.{pid}.so"));
            let mut cc = Command::new("cc");
            cc.args(["-shared", "-fPIC", "-O2", "-o"])
                .arg(&built)
                .arg(&source);
            let out = output_with_timeout(cc, Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("cc (building the clock shim): {e}"));
            assert!(
                out.status.success(),
                "cc failed to build the clock shim: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            // Renamed into place: concurrent test processes never load a half-written file.
            let path = dir.join("clock_offset.so");
            std::fs::rename(&built, &path)
                .unwrap_or_else(|e| panic!("rename {}: {e}", built.display()));
            path
        })
        .clone()
}

/// Environment that runs a process' wall clock `offset_ms` ahead (negative: behind).
pub fn offset_env(offset_ms: i64) -> Vec<(String, String)> {
    vec![
        (
            "LD_PRELOAD".into(),
            offset_library().to_string_lossy().into_owned(),
        ),
        ("TOLLGATE_CLOCK_OFFSET_MS".into(), offset_ms.to_string()),
    ]
}
