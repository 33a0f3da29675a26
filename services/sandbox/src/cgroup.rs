//! A control group per command, where the server may make one: it bounds
//! the processes of the command as a whole (which rlimits cannot do for
//! root) and its memory together, and it holds every process the command
//! started, even one that left its process group, so that all are killed
//! when the call ends.
//!
//! cgroup v1 hierarchies (`pids`, `memory`) under the server's own groups
//! are used when the server may write them (as root, or when delegated);
//! elsewhere commands run with their rlimits only, as the README says.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::SandboxLimits;

/// Where the v1 hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The controllers used, each with the file that bounds it.
const CONTROLLERS: [&str; 2] = ["pids", "memory"];

/// The directories commands' groups are made in, one per controller the
/// server may write; found once.
fn bases() -> &'static [PathBuf] {
    static BASES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    BASES.get_or_init(|| {
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let bases: Vec<PathBuf> = CONTROLLERS
            .iter()
            .filter_map(|controller| {
                // `4:memory:/some/path`: the server's own group in that hierarchy.
                let path = own.lines().find_map(|line| {
                    let mut fields = line.splitn(3, ':');
                    let (_, names, path) = (fields.next()?, fields.next()?, fields.next()?);
                    names
                        .split(',')
                        .any(|name| name == *controller)
                        .then(|| path.to_owned())
                })?;
                let base = Path::new(CGROUP_ROOT)
                    .join(controller)
                    .join(path.trim_start_matches('/'))
                    .join("avm-sandbox");
                fs::create_dir_all(&base).ok().map(|()| base)
            })
            .collect();
        if bases.is_empty() {
            tracing::info!("no writable cgroup v1 hierarchy: commands are bounded by rlimits only");
        }
        bases
    })
}

/// The group of one command; its processes are killed and the group removed
/// when it is dropped.
#[derive(Debug)]
pub(super) struct Cgroup {
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    /// Makes a group bounded by `limits` (processes, memory), `None` where
    /// the server can make none.
    pub(super) fn create(limits: &SandboxLimits) -> Option<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut group = Self { dirs: Vec::new() };
        for base in bases() {
            let dir = base.join(&name);
            if fs::create_dir(&dir).is_err() {
                continue;
            }
            let bound = if dir.starts_with(Path::new(CGROUP_ROOT).join("pids")) {
                fs::write(dir.join("pids.max"), limits.processes.max(1).to_string())
            } else {
                fs::write(
                    dir.join("memory.limit_in_bytes"),
                    limits.memory_mb.saturating_mul(1024 * 1024).to_string(),
                )
            };
            group.dirs.push(dir);
            if bound.is_err() {
                // A group that bounds nothing is no sandbox: none rather than a false one.
                return None;
            }
        }
        (!group.dirs.is_empty()).then_some(group)
    }

    /// Returns the shell words that move the shell into the group before it
    /// runs its arguments: `/bin/sh -c '<script>' avm-sandbox <command…>`.
    pub(super) fn enter_script(&self) -> String {
        let mut script = String::new();
        for dir in &self.dirs {
            // The directories are the server's own names: no quoting needed beyond this.
            script.push_str(&format!("echo $$ > '{}/cgroup.procs' && ", dir.display()));
        }
        // The shell's own PWD is not passed on: the command's environment stays as set.
        script.push_str("unset PWD; exec \"$@\"");
        script
    }

    /// Kills every process in the group.
    pub(super) fn kill_all(&self) {
        for dir in &self.dirs {
            let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|line| line.trim().parse::<i32>().ok()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.kill_all();
        let dirs = std::mem::take(&mut self.dirs);
        // A killed process leaves its group once reaped: remove the groups
        // when they are empty, without holding up the caller.
        let remove = move || {
            for _ in 0..50 {
                let left: Vec<&PathBuf> = dirs
                    .iter()
                    .filter(|dir| fs::remove_dir(dir).is_err() && dir.exists())
                    .collect();
                if left.is_empty() {
                    return;
                }
                for dir in &left {
                    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                    for pid in procs.lines().filter_map(|line| line.trim().parse::<i32>().ok()) {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            tracing::warn!(groups = ?dirs, "sandbox cgroups could not be removed");
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}
