//! `run_command`: a shell command in the workspace, under limits.
//!
//! The command runs as `/bin/sh -c` under `prlimit` (CPU time, address
//! space, file size, processes, no core files), in its own process group,
//! with the workspace as its working directory and a clean environment
//! (`PATH`, `HOME` and `TMPDIR` at the workspace, `LANG`: none of the
//! server's variables, so no key). The whole group is killed when the
//! command ends, times out or its turn is interrupted, so nothing it started
//! outlives the call. Its output is cut at a limit, with a marker.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use super::workspace::{ToolFailure, Workspace};
use crate::config::SandboxLimits;

/// Kills the command's process group when the call ends, however it ends
/// (done, timed out, or dropped by an interrupted turn).
#[derive(Debug)]
pub(super) struct GroupGuard(Option<Pid>);

impl GroupGuard {
    /// Guards the process group a sandboxed child leads.
    pub(super) fn of(child: &tokio::process::Child) -> Self {
        Self(child.id().and_then(|id| i32::try_from(id).ok()).map(Pid::from_raw))
    }
}

/// Returns the command that runs `program` in `dir` under `limits`' rlimits
/// (through `prlimit`), with a clean environment, in a process group of its
/// own, killed when dropped; the caller sets its standard streams.
pub(super) fn sandboxed(dir: &Path, limits: &SandboxLimits, program: &str, args: &[String]) -> Command {
    let mut command = Command::new("prlimit");
    command
        .arg(format!("--cpu={}", limits.cpu_seconds))
        .arg(format!("--as={}", limits.memory_mb.saturating_mul(1024 * 1024)))
        .arg(format!("--fsize={}", limits.file_mb.saturating_mul(1024 * 1024)))
        .arg(format!("--nproc={}", limits.processes))
        .arg("--core=0")
        .arg("--")
        .arg(program)
        .args(args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", dir)
        .env("TMPDIR", dir)
        .env("LANG", "C.UTF-8")
        .process_group(0)
        .kill_on_drop(true);
    command
}

/// Says why a sandboxed program could not start.
pub(super) fn spawn_failure(what: &str, err: &std::io::Error) -> String {
    match err.kind() {
        std::io::ErrorKind::NotFound => format!("{what} needs `prlimit` (util-linux) on the server"),
        _ => format!("cannot start {what}: {err}"),
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(group) = self.0 {
            // ESRCH: the group is gone already.
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}

/// Runs `command` in the workspace; the text says how it exited and what it
/// printed. `Err` is for a command that could not run or ran out of time.
pub async fn run_command(
    workspace: &Workspace,
    command: &str,
    limits: &SandboxLimits,
) -> Result<(String, bool), ToolFailure> {
    if command.trim().is_empty() {
        return Err("`command` must not be empty".to_owned());
    }
    let mut child = sandboxed(
        workspace.dir(),
        limits,
        "/bin/sh",
        &["-c".to_owned(), command.to_owned()],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .map_err(|err| spawn_failure("run_command", &err))?;
    let _group = GroupGuard::of(&child);
    let stdout = read_capped(child.stdout.take(), limits.output_bytes);
    let stderr = read_capped(child.stderr.take(), limits.output_bytes);
    let timeout = Duration::from_secs(limits.timeout_seconds.max(1));
    let run = async {
        let (stdout, stderr, status) = tokio::join!(stdout, stderr, child.wait());
        (stdout, stderr, status)
    };
    let (stdout, stderr, status) = match tokio::time::timeout(timeout, run).await {
        Ok(done) => done,
        Err(_) => {
            return Err(format!(
                "the command did not finish within {} s and was killed",
                timeout.as_secs()
            ));
        }
    };
    let status = status.map_err(|err| format!("cannot wait for the command: {err}"))?;
    let code = match status.code() {
        Some(code) => format!("exit code {code}"),
        None => {
            use std::os::unix::process::ExitStatusExt;
            format!("killed by signal {}", status.signal().unwrap_or(0))
        }
    };
    let mut text = code;
    for (name, output) in [("stdout", stdout), ("stderr", stderr)] {
        if !output.is_empty() {
            text.push_str(&format!("\n{name}:\n{output}"));
        }
    }
    Ok((text, !status.success()))
}

/// Reads a stream to its end, keeping its first `cap` bytes and counting the rest.
async fn read_capped(stream: Option<impl AsyncRead + Unpin>, cap: usize) -> String {
    let Some(mut stream) = stream else {
        return String::new();
    };
    let mut kept = Vec::new();
    let mut dropped = 0_usize;
    let mut buffer = [0_u8; 8192];
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => {
                let room = cap.saturating_sub(kept.len()).min(read);
                kept.extend_from_slice(&buffer[..room]);
                dropped += read - room;
            }
        }
    }
    let mut text = String::from_utf8_lossy(&kept).into_owned();
    if dropped > 0 {
        text.push_str(&format!("\n[… {dropped} more bytes not shown]"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tools::workspace::temporary as workspace;

    #[tokio::test]
    async fn runs_in_the_workspace_with_a_clean_environment() {
        let (_temp, ws) = workspace();
        std::fs::write(ws.dir().join("a.txt"), "hello").unwrap();
        // The test process's own variables (CARGO_*) stand for the server's.
        let (text, failed) = run_command(&ws, "cat a.txt; echo; pwd; env | sort", &SandboxLimits::default())
            .await
            .unwrap();
        assert!(!failed, "{text}");
        assert!(text.starts_with("exit code 0\nstdout:\nhello\n"), "{text}");
        assert!(text.contains(&ws.dir().display().to_string()), "{text}");
        assert!(!text.contains("CARGO"), "the server's environment leaked: {text}");
    }

    #[tokio::test]
    async fn failures_timeouts_and_floods_are_reported() {
        let (_temp, ws) = workspace();
        let limits = SandboxLimits {
            timeout_seconds: 1,
            output_bytes: 100,
            ..SandboxLimits::default()
        };
        let (text, failed) = run_command(&ws, "echo oops >&2; exit 3", &limits).await.unwrap();
        assert!(failed);
        assert_eq!(text, "exit code 3\nstderr:\noops\n");
        let (text, _) = run_command(&ws, "yes | head -c 100000", &limits).await.unwrap();
        assert!(text.ends_with("[… 99900 more bytes not shown]"), "{text}");
        let err = run_command(&ws, "sleep 30", &limits).await.unwrap_err();
        assert!(err.contains("did not finish within 1 s"), "{err}");
    }
}
