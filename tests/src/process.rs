//! Child processes that cannot outlive their test: spawn, signal, kill + reap on `Drop`.
//!
//! Every child is spawned from one long-lived "spawner" thread with `PR_SET_PDEATHSIG =
//! SIGKILL`, so if the test binary is killed (timeout, Ctrl-C) before `Drop` runs, the kernel
//! kills its Envoys and Redis servers too. (The death signal fires when the *spawning thread*
//! exits; test threads come and go, the spawner thread lives as long as the process.)
//! stdout/stderr go to files in the child's log directory. Reusable for any binary a test
//! needs (e.g. the limiter).

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawn `cmd` so that the child is SIGKILLed if this test process dies.
pub fn spawn_tied(mut cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (prctl, getppid); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl.
            if libc::getppid() != parent {
                return Err(io::Error::other("parent died before exec"));
            }
            Ok(())
        });
    }
    let sender = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("e2e-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("cannot start the spawner thread");
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    sender
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, reply_tx))
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    reply_rx.recv_timeout(STARTUP_DEADLINE).map_err(|_| {
        io::Error::other(format!(
            "spawner thread did not answer within {STARTUP_DEADLINE:?}"
        ))
    })?
}

/// Run a short-lived command to completion, capturing its output, killing it at `timeout`.
pub fn output_with_timeout(mut cmd: Command, timeout: Duration) -> io::Result<Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let what = format!("{cmd:?}");
    let mut child = spawn_tied(cmd)?;
    let mut out_pipe = child.stdout.take();
    let mut err_pipe = child.stderr.take();
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(p) = out_pipe.as_mut() {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(p) = err_pipe.as_mut() {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} did not finish within {timeout:?}"),
            ));
        }
        thread::sleep(Duration::from_millis(10));
    };
    Ok(Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    })
}

/// How long the harness waits for a process it started to be up (an Envoy live, a
/// redis-server answering, a cluster healthy, a limiter listening): generous, because the
/// whole suite (many test binaries, each starting Envoys, Redis servers and limiters) runs at
/// once on a loaded 2-core machine, and a wait that ends early costs nothing.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(60);

/// Poll `check` until it returns `Some`, at most `timeout`. Backs off from 5 ms to 100 ms.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Result<T> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(v) = check() {
            return Ok(v);
        }
        if start.elapsed() >= timeout {
            return Err(HarnessError::new(format!(
                "timed out after {timeout:?} waiting for {what}"
            )));
        }
        thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// The last `lines` lines of a text file ("" if it does not exist).
pub fn tail_file(path: &Path, lines: usize) -> String {
    let text = fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    tail(&text, lines)
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    all.get(from..).unwrap_or_default().join("\n")
}

/// A running child process with its output in files; killed and reaped on `Drop`.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    log_dir: PathBuf,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    status: Option<ExitStatus>,
}

impl ChildProcess {
    /// Spawn `cmd` with stdin closed and stdout/stderr written to
    /// `<log_dir>/<name>.stdout.log` and `<log_dir>/<name>.stderr.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self> {
        let stdout_path = log_dir.join(format!("{name}.stdout.log"));
        let stderr_path = log_dir.join(format!("{name}.stderr.log"));
        cmd.stdin(Stdio::null())
            .stdout(File::create(&stdout_path)?)
            .stderr(File::create(&stderr_path)?);
        let child =
            spawn_tied(cmd).map_err(|e| HarnessError::new(format!("cannot spawn {name}: {e}")))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log_dir: log_dir.to_path_buf(),
            stdout_path,
            stderr_path,
            status: None,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// The exit status if the process has exited (non-blocking; reaps it).
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    pub fn is_running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// Send a signal (e.g. `libc::SIGSTOP`) to the process.
    pub fn signal(&mut self, sig: libc::c_int) -> Result<()> {
        if !self.is_running() {
            return Err(HarnessError::new(format!(
                "{} (pid {}) has already exited",
                self.name,
                self.pid()
            )));
        }
        let pid =
            libc::pid_t::try_from(self.pid()).map_err(|_| HarnessError::new("pid out of range"))?;
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is our unreaped child,
        // so it cannot have been recycled for another process.
        let rc = unsafe { libc::kill(pid, sig) };
        if rc == 0 {
            Ok(())
        } else {
            Err(HarnessError::new(format!(
                "kill({pid}, {sig}) failed: {}",
                io::Error::last_os_error()
            )))
        }
    }

    /// SIGKILL and reap (bounded: gives up after 10 s). Idempotent.
    pub fn kill(&mut self) {
        if self.exit_status().is_some() {
            return;
        }
        let _ = self.child.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.status = Some(status);
                return;
            }
            thread::sleep(Duration::from_millis(5));
        }
        eprintln!(
            "e2e: {} (pid {}) did not exit within 10s of SIGKILL",
            self.name,
            self.pid()
        );
    }

    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.stdout_path).unwrap_or_default()).into_owned()
    }

    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.stderr_path).unwrap_or_default()).into_owned()
    }

    pub fn stdout_path(&self) -> &Path {
        &self.stdout_path
    }

    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// `VmRSS` from `/proc/<pid>/status`, in bytes.
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_takes_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
        assert_eq!(tail("", 5), "");
    }

    #[test]
    fn output_with_timeout_kills_slow_commands() {
        let mut cmd = Command::new("sleep");
        cmd.arg("5");
        let start = Instant::now();
        let err = output_with_timeout(cmd, Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(2));

        let mut cmd = Command::new("echo");
        cmd.arg("hi");
        let out = output_with_timeout(cmd, Duration::from_secs(5)).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    }

    #[test]
    fn child_is_killed_on_drop() {
        let dir = crate::paths::new_log_dir("", "sleep");
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let child = ChildProcess::spawn("sleep", cmd, &dir).unwrap();
        let pid = child.pid();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        drop(child);
        // Reaped, so the pid is gone (not even a zombie).
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }
}
