//! `run_command`: a shell command in the workspace, under limits.
//!
//! The command runs as `/bin/sh -c` under `prlimit` (CPU time, address
//! space, file size, processes, no core files), in its own process group,
//! with the workspace as its working directory and a clean environment
//! (`PATH`, `HOME` at the workspace, `TMPDIR`, `LANG`: none of the server's
//! variables, so no key), behind the fence of `isolation.rs` and in the
//! control group of `cgroup.rs` where the server can make them. Whatever
//! it started is killed when the command ends, times out or its turn is
//! interrupted, so nothing outlives the call. Its output is cut at a limit,
//! with a marker.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use avm_common::address::AddressGuard;

use crate::SandboxLimits;
#[cfg(test)]
use crate::SandboxRequest;
use crate::cgroup::Cgroup;
use crate::egress::Egress;
use crate::isolation;
use crate::workspace::{ToolFailure, Workspace};

/// Kills the command's process group when the call ends, however it ends
/// (done, timed out, or dropped by an interrupted turn).
#[derive(Debug)]
struct GroupGuard(Option<Pid>);

impl GroupGuard {
    /// Guards the process group a sandboxed child leads.
    fn of(child: &tokio::process::Child) -> Self {
        Self(child.id().and_then(|id| i32::try_from(id).ok()).map(Pid::from_raw))
    }
}

/// Returns the command that runs `program` in `dir` under `limits`' rlimits
/// (through `prlimit`; files up to `file_bytes`), in a control group of its
/// own where the server can make one (returned: keep it while the command
/// runs), behind the fence `limits` ask for (check [`isolation::check`]
/// first), with a clean environment, in a process group of its own, killed
/// when dropped; the caller sets its standard streams.
fn sandboxed(
    dir: &Path,
    limits: &SandboxLimits,
    file_bytes: u64,
    program: &str,
    args: &[String],
    egress: Option<&Egress>,
    env: &[(String, String)],
) -> (Command, Option<Cgroup>) {
    let cgroup = Cgroup::create(limits);
    // Killed when what started it dies (a sandbox killed mid-command): the
    // fence's `--kill-child` takes everything behind it along.
    let mut words: Vec<String> = ["setpriv", "--pdeathsig", "KILL", "--"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    words.extend(isolation::words(limits, dir, egress));
    words.extend([
        "prlimit".to_owned(),
        format!("--cpu={}", limits.cpu_seconds),
        format!("--as={}", limits.memory_mb.saturating_mul(1024 * 1024)),
        format!("--fsize={}", file_bytes.max(1)),
        format!("--nproc={}", limits.processes),
        "--core=0".to_owned(),
        "--".to_owned(),
        program.to_owned(),
    ]);
    words.extend(args.iter().cloned());
    let mut command = match &cgroup {
        // The shell joins the group, then becomes the command: nothing runs outside it.
        Some(group) => {
            let mut shell = Command::new("/bin/sh");
            shell
                .arg("-c")
                .arg(group.enter_script())
                .arg("avm-sandbox")
                .args(&words);
            shell
        }
        None => {
            let mut direct = Command::new(&words[0]);
            direct.args(&words[1..]);
            direct
        }
    };
    // Behind the fence the workspace is `/workspace`, with a private `/tmp`;
    // without it, the workspace is where the command stands and keeps its files.
    let (home, tmp) = if limits.isolate {
        (Path::new(isolation::WORKSPACE), Path::new(isolation::TMP))
    } else {
        (dir, dir)
    };
    // The sandbox's own variables first: the fence's are set after them.
    command
        .current_dir(dir)
        .env_clear()
        .envs(env.iter().map(|(name, value)| (name, value)))
        .env("PATH", crate::COMMAND_PATH.join(":"))
        .env("HOME", home)
        .env("TMPDIR", tmp)
        .env("LANG", "C.UTF-8")
        .process_group(0)
        .kill_on_drop(true);
    if egress.is_some() {
        let proxy = Egress::url();
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            command.env(name, &proxy);
        }
    }
    (command, cgroup)
}

/// Opens the network proxy of a fenced program with network (`None` for
/// one that has none, or is not fenced and so uses the server's network).
fn way_out(limits: &SandboxLimits, guard: &Arc<AddressGuard>) -> Result<Option<Egress>, ToolFailure> {
    if !(limits.isolate && limits.network) {
        return Ok(None);
    }
    Egress::open(Arc::clone(guard))
        .map(Some)
        .map_err(|err| format!("cannot open the command's network proxy: {err}"))
}

/// Says why a sandboxed program could not start.
fn spawn_failure(what: &str, err: &std::io::Error) -> String {
    match err.kind() {
        std::io::ErrorKind::NotFound => format!("{what} needs `prlimit` (util-linux) on the server"),
        _ => format!("cannot start {what}: {err}"),
    }
}

impl GroupGuard {
    /// Kills the group now (again when dropped: harmless).
    fn kill(&self) {
        if let Some(group) = self.0 {
            // ESRCH: the group is gone already.
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A long-lived program run in a workspace behind the same fence as a
/// command (a stdio MCP server): its standard streams are piped; it and
/// everything it started are killed when this is dropped.
#[derive(Debug)]
pub struct Server {
    pub child: tokio::process::Child,
    _group: GroupGuard,
    _cgroup: Option<Cgroup>,
    /// Its network proxy, open while it runs.
    _egress: Option<Egress>,
}

/// Starts `program` with `args` in the (made) workspace under `limits`; it
/// sees `env` (the sandbox's variables) and then `own` (its own).
pub async fn serve(
    workspace: &Workspace,
    program: &str,
    args: &[String],
    limits: &SandboxLimits,
    guard: &Arc<AddressGuard>,
    env: &[(String, String)],
    own: &std::collections::BTreeMap<String, String>,
) -> Result<Server, ToolFailure> {
    workspace.ensure()?;
    isolation::check(limits, workspace.dir()).await?;
    let file_bytes = limits.file_mb.saturating_mul(1024 * 1024);
    let egress = way_out(limits, guard)?;
    let (mut command, cgroup) = sandboxed(workspace.dir(), limits, file_bytes, program, args, egress.as_ref(), env);
    command
        .envs(own)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = command.spawn().map_err(|err| spawn_failure("an MCP server", &err))?;
    Ok(Server {
        _group: GroupGuard::of(&child),
        child,
        _cgroup: cgroup,
        _egress: egress,
    })
}

/// Runs `command` in the workspace; the text says how it exited and what it
/// printed. `Err` is for a command that could not run or ran out of time.
pub async fn run_command(
    workspace: &Workspace,
    command: &str,
    limits: &SandboxLimits,
    guard: &Arc<AddressGuard>,
    env: &[(String, String)],
) -> Result<(String, bool), ToolFailure> {
    if command.trim().is_empty() {
        return Err("`command` must not be empty".to_owned());
    }
    isolation::check(limits, workspace.dir()).await?;
    // A command may fill what is left of the workspace's quota, no more.
    let file_bytes = limits.file_mb.saturating_mul(1024 * 1024);
    let file_bytes = match workspace.quota() {
        Some(quota) => file_bytes.min(quota.saturating_sub(workspace.usage())),
        None => file_bytes,
    };
    let script = ["-c".to_owned(), command.to_owned()];
    // Kept while the command runs: what it started goes out through it.
    let egress = way_out(limits, guard)?;
    let (mut command, cgroup) = sandboxed(
        workspace.dir(),
        limits,
        file_bytes,
        "/bin/sh",
        &script,
        egress.as_ref(),
        env,
    );
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| spawn_failure("run_command", &err))?;
    let group = GroupGuard::of(&child);
    let stdout = tokio::spawn(read_capped(child.stdout.take(), limits.output_bytes));
    let stderr = tokio::spawn(read_capped(child.stderr.take(), limits.output_bytes));
    let timeout = Duration::from_secs(limits.timeout_seconds.max(1));
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => status.map_err(|err| format!("cannot wait for the command: {err}"))?,
        Err(_) => {
            stdout.abort();
            stderr.abort();
            return Err(format!(
                "the command did not finish within {} s and was killed",
                timeout.as_secs()
            ));
        }
    };
    // The shell is done: what it left running goes with it, so its output ends.
    group.kill();
    if let Some(cgroup) = &cgroup {
        cgroup.kill_all();
    }
    let (stdout, stderr) = (stdout.await.unwrap_or_default(), stderr.await.unwrap_or_default());
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
    let mut failed = !status.success();
    if let Some(quota) = workspace.quota() {
        let used = workspace.usage();
        if used > quota {
            text.push_str(&format!(
                "\n[the workspace now holds {used} bytes, over its quota of {quota} bytes: remove files; \
                 writes are refused until then]"
            ));
            failed = true;
        }
    }
    Ok((text, failed))
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

    /// Runs a command without network: its relay is the `avm` executable,
    /// which a unit test does not have (the integration tests give it).
    async fn run_command(
        workspace: &Workspace,
        command: &str,
        limits: &SandboxLimits,
    ) -> Result<(String, bool), ToolFailure> {
        let offline = SandboxLimits {
            network: false,
            ..limits.clone()
        };
        super::run_command(workspace, command, &offline, &Arc::new(AddressGuard::default()), &[]).await
    }

    use crate::workspace::temporary as workspace;

    #[tokio::test]
    async fn runs_in_the_workspace_with_a_clean_environment() {
        let (_temp, ws) = workspace();
        std::fs::write(ws.dir().join("a.txt"), "hello").unwrap();
        // The test process's own variables (CARGO_*) stand for the server's.
        let (text, failed) = run_command(&ws, "cat a.txt; echo; pwd; env | sort", &SandboxLimits::default())
            .await
            .unwrap();
        assert!(!failed, "{text}");
        assert!(text.starts_with("exit code 0\nstdout:\nhello\n/workspace\n"), "{text}");
        assert!(
            text.contains("\nHOME=/workspace\n") && text.contains("\nTMPDIR=/tmp\n"),
            "{text}"
        );
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

    #[tokio::test]
    async fn a_sandbox_without_network_has_only_a_down_loopback() {
        let (_temp, ws) = workspace();
        let isolated = SandboxLimits {
            network: false,
            ..SandboxLimits::default()
        };
        let script = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '";
        if let Err(refused) = isolation::check(&isolated, ws.dir()).await {
            assert_eq!(run_command(&ws, script, &isolated).await.unwrap_err(), refused);
            return;
        }
        let (text, failed) = run_command(&ws, script, &isolated).await.unwrap();
        assert!(!failed, "{text}");
        assert_eq!(text, "exit code 0\nstdout:\nlo\n", "only a loopback interface");
    }

    #[tokio::test]
    async fn the_servers_files_and_processes_are_out_of_sight() {
        let temp = tempfile::tempdir().unwrap();
        let data = temp.path().join("data");
        let ws = Workspace::new(data.join("workspaces/ten_a/img_1"));
        ws.ensure().unwrap();
        std::fs::write(data.join("admin.key"), "the-admin-key").unwrap();
        std::fs::create_dir_all(data.join("workspaces/ten_b/img_2")).unwrap();
        std::fs::write(data.join("workspaces/ten_b/img_2/theirs.txt"), "theirs").unwrap();
        std::fs::write(ws.dir().join("mine.txt"), "mine").unwrap();
        let limits = SandboxLimits {
            network: false,
            ..SandboxLimits::default()
        };
        if let Err(refused) = isolation::check(&limits, ws.dir()).await {
            assert_eq!(run_command(&ws, "true", &limits).await.unwrap_err(), refused);
            return;
        }
        let server = std::process::id();
        let script = format!(
            "cat mine.txt; echo; cat {admin} 2>&1; ls {others} 2>&1; cat /proc/{server}/environ 2>&1 | head -c 40; echo; \
             echo new > new.txt; touch {outside} /planted /usr/planted /etc/planted 2>&1; pwd",
            outside = temp.path().join("planted").display(),
            admin = data.join("admin.key").display(),
            others = data.join("workspaces/ten_b").display(),
        );
        let (text, _) = run_command(&ws, &script, &limits).await.unwrap();
        assert!(text.contains("mine\n"), "{text}");
        assert!(!text.contains("the-admin-key") && !text.contains("theirs"), "{text}");
        assert!(
            !text.contains("CARGO"),
            "the server's environment is out of sight: {text}"
        );
        assert!(text.ends_with("\n/workspace\n"), "{text}");
        assert_eq!(std::fs::read_to_string(ws.dir().join("new.txt")).unwrap(), "new\n");
        assert_eq!(
            text.matches("Read-only file system").count(),
            3,
            "nothing outside is writable: {text}"
        );
        assert!(!temp.path().join("planted").exists() && !Path::new("/usr/planted").exists());
        // Its root holds its own mounts only, all read-only but its workspace,
        // its /tmp and the devices.
        let (text, _) = run_command(&ws, "cat /proc/self/mountinfo", &limits).await.unwrap();
        let writable = ["/workspace", "/tmp", "/dev/shm", "/dev/null", "/dev/zero", "/dev/full"];
        let devices = ["/dev/random", "/dev/urandom"];
        let mut points = Vec::new();
        for line in text.lines().skip(2).filter(|line| !line.is_empty()) {
            let fields: Vec<&str> = line.split(' ').collect();
            let (point, options) = (fields[4], fields[5]);
            points.push(point);
            assert!(!point.starts_with("/sys") && !point.contains("data"), "{line}");
            if !writable.contains(&point) && !devices.contains(&point) {
                assert!(options.starts_with("ro,"), "{line}");
            }
            if point == "/workspace" {
                assert!(options.contains("nosuid") && options.contains("nodev"), "{line}");
            }
        }
        for expected in ["/", "/usr", "/workspace", "/tmp", "/proc", "/dev/null", "/etc/passwd"] {
            assert!(points.contains(&expected), "{expected} in {points:?}");
        }
        assert!(
            !points.contains(&"/dev/tty"),
            "the server's terminal is out of reach: {points:?}"
        );
        // Nor its control groups (no /sys at all): a command cannot leave its own.
        let (text, _) = run_command(&ws, "ls -A /sys 2>/dev/null | wc -l", &limits)
            .await
            .unwrap();
        assert_eq!(text, "exit code 0\nstdout:\n0\n");
        assert_eq!(
            std::fs::read_to_string(data.join("admin.key")).unwrap(),
            "the-admin-key",
            "nothing outside changed"
        );
    }

    /// Issue 26 item 1: a command undid its own fence — `umount -l` of the
    /// data directory's cover showed the admin key, `mount -o
    /// remount,bind,rw /` let it write to the host, `umount -l
    /// /sys/fs/cgroup` showed the control groups.
    #[tokio::test]
    async fn a_command_cannot_undo_its_fence() {
        let temp = tempfile::tempdir().unwrap();
        let data = temp.path().join("data");
        let ws = Workspace::new(data.join("workspaces/ten_a/img_1"));
        ws.ensure().unwrap();
        std::fs::write(data.join("admin.key"), "the-admin-key").unwrap();
        let limits = SandboxLimits::default();
        let planted = temp.path().join("planted");
        let script = format!(
            "umount -l {data}; cat {data}/admin.key; mount -o remount,bind,rw / && touch {planted}; \
             umount -l /sys/fs/cgroup; echo cgroups=$(ls -A /sys/fs/cgroup 2>/dev/null | wc -l); \
             umount -l /proc; mount -t tmpfs avm-x /tmp && echo mounted; grep CapEff /proc/self/status",
            data = data.display(),
            planted = planted.display(),
        );
        let (text, _) = run_command(&ws, &script, &limits).await.unwrap();
        assert!(!text.contains("the-admin-key"), "{text}");
        assert!(!planted.exists(), "the command wrote outside its workspace: {text}");
        assert!(text.contains("cgroups=0\n"), "{text}");
        assert!(!text.contains("mounted"), "{text}");
        assert!(text.contains("CapEff:\t0000000000000000"), "no capability: {text}");
    }

    /// Issue 26 item 3: the configuration file `avm serve --config` named
    /// (the LLM key in it) and the server's home were readable by commands.
    #[tokio::test]
    async fn a_command_reads_neither_the_config_file_nor_the_servers_home() {
        let temp = tempfile::tempdir().unwrap();
        let home = temp.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(home.join(".netrc"), "password home-secret").unwrap();
        let config = temp.path().join("avm.toml");
        std::fs::write(&config, "[llm]\napi_key = \"sk-config-secret\"\n").unwrap();
        let ws = Workspace::new(temp.path().join("data/workspaces/t/i"));
        ws.ensure().unwrap();
        let limits = SandboxLimits::default();
        let script = format!(
            "cat {config}; ls -A {home}; cat {home}/.netrc; echo done",
            config = config.display(),
            home = home.display()
        );
        let (text, _) = run_command(&ws, &script, &limits).await.unwrap();
        assert!(text.contains("done"), "{text}");
        for secret in ["sk-config-secret", "home-secret", ".netrc\n"] {
            assert!(!text.contains(secret), "{secret} was read: {text}");
        }
    }

    #[tokio::test]
    async fn a_fork_bomb_is_bounded_and_nothing_outlives_the_command() {
        let (_temp, ws) = workspace();
        let limits = SandboxLimits {
            processes: 16,
            timeout_seconds: 20,
            ..SandboxLimits::default()
        };
        // 200 sleepers asked for; a child that leaves the process group
        // (setsid) is still the command's. Its odd duration marks it.
        let bomb = "setsid sleep 313 & n=0; while [ $n -lt 200 ]; do sleep 2 & n=$((n+1)); done; wait";
        let (text, _) = run_command(&ws, bomb, &limits).await.unwrap();
        if Cgroup::create(&limits).is_none() {
            // Without a writable cgroup hierarchy only rlimits apply (not to root).
            return;
        }
        assert!(text.contains("Cannot fork"), "the processes were bounded: {text}");
        // Everything is killed as the call ends; the kernel reaps it right after.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !escaped_sleepers().is_empty() && std::time::Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            escaped_sleepers(),
            Vec::<std::path::PathBuf>::new(),
            "the escaped process was killed"
        );
    }

    /// Returns the live `sleep 313` processes.
    fn escaped_sleepers() -> Vec<std::path::PathBuf> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .map(|entry| entry.path())
            .filter(|dir| {
                std::fs::read(dir.join("cmdline")).is_ok_and(|cmdline| cmdline == b"sleep\x00313\x00")
                    && !is_zombie(dir)
            })
            .collect()
    }

    fn is_zombie(proc_dir: &std::path::Path) -> bool {
        std::fs::read_to_string(proc_dir.join("stat")).is_ok_and(|stat| stat.contains(") Z "))
    }

    #[tokio::test]
    async fn a_memory_hog_is_stopped_at_its_limit() {
        let (_temp, ws) = workspace();
        let limits = SandboxLimits {
            memory_mb: 256,
            ..SandboxLimits::default()
        };
        let hog = "python3 -c 'b = bytearray(1024 * 1024 * 1024); print(len(b))'";
        let (text, failed) = run_command(&ws, hog, &limits).await.unwrap();
        assert!(failed && text.contains("MemoryError"), "{text}");
    }

    #[tokio::test]
    async fn commands_fill_the_workspace_up_to_its_quota() {
        let (_temp, ws) = workspace();
        let ws = ws.with_quota_mb(1);
        let (text, failed) = run_command(&ws, "head -c 3000000 /dev/zero > big", &SandboxLimits::default())
            .await
            .unwrap();
        assert!(failed, "{text}");
        let size = std::fs::metadata(ws.dir().join("big")).unwrap().len();
        assert!(size <= 1024 * 1024, "the file stopped at the quota: {size}");
        // Over the quota (a file written some other way), a command is told so.
        std::fs::write(ws.dir().join("more"), vec![0_u8; 600 * 1024]).unwrap();
        let (text, failed) = run_command(&ws, "true", &SandboxLimits::default()).await.unwrap();
        assert!(failed && text.contains("over its quota of 1048576 bytes"), "{text}");
        assert!(ws.check_room(0, 1).is_err());
    }

    #[test]
    fn a_sandbox_resource_lowers_limits_and_never_raises_them() {
        let server = SandboxLimits::default();
        let asked = SandboxRequest::from_content(&serde_json::json!({"limits": {
            "cpuMillis": 1500, "memoryMb": 100_000, "diskMb": 10, "timeoutSeconds": 5, "network": false}}));
        let limits = server.narrowed(&asked);
        assert_eq!(
            (
                limits.cpu_seconds,
                limits.memory_mb,
                limits.disk_mb,
                limits.timeout_seconds,
                limits.network
            ),
            (2, server.memory_mb, 10, 5, false)
        );
        assert_eq!(server.narrowed(&SandboxRequest::default()), server);
    }
}
