//! The namespaces a command runs in (`unshare`, util-linux): a user
//! namespace (its root is the server's user, no more), a PID namespace (it
//! sees only its own processes, so no other process's environment, and all
//! of them end with it), a mount namespace in which the server's own paths
//! (`[runtime.sandbox] hide`: the data directory with every other
//! workspace, …) are covered by empty directories, the image's workspace is
//! mounted back where it was and every other mount is read-only, and,
//! without network, a network namespace of its own.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::process::Command;

use crate::config::SandboxLimits;

/// Says why a command cannot be isolated here.
pub(super) const NO_ISOLATION: &str = "this server cannot isolate commands (no user, mount or PID \
    namespaces: `unshare --user --mount --pid` failed), so nothing was run; an operator may run commands \
    without isolation ([runtime.sandbox] isolate = false), where they see the server's files";

/// Says why a command needing no network cannot run here.
pub(super) const NO_NETWORK_ISOLATION: &str = "this agent's sandbox has no network (network: false), and this \
    server cannot take the network away from a command (no user or network namespaces): nothing was run";

/// Returns whether `unshare` can make these namespaces; checked once each.
async fn probe(flags: &'static [&'static str]) -> bool {
    let status = Command::new("unshare")
        .args(flags)
        .args(["--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    status.is_ok_and(|status| status.success())
}

const ISOLATE: &[&str] = &[
    "--user",
    "--map-root-user",
    "--mount",
    "--pid",
    "--fork",
    "--mount-proc",
];
const NETWORK: &[&str] = &["--user", "--map-root-user", "--net"];

/// Refuses a command these limits cannot be kept for on this server.
pub(super) async fn check(limits: &SandboxLimits) -> Result<(), String> {
    static ISOLATED: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    static OFFLINE: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    if limits.isolate && !*ISOLATED.get_or_init(|| probe(ISOLATE)).await {
        tracing::warn!("{NO_ISOLATION}");
        return Err(NO_ISOLATION.to_owned());
    }
    if !limits.network && !*OFFLINE.get_or_init(|| probe(NETWORK)).await {
        return Err(NO_NETWORK_ISOLATION.to_owned());
    }
    Ok(())
}

/// Quotes a word for `/bin/sh`.
fn quoted(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

/// Returns the words that run the rest of a command line in the namespaces
/// `limits` ask for, its working directory `dir` (empty when none are asked).
pub(super) fn words(limits: &SandboxLimits, dir: &Path) -> Vec<String> {
    let mut flags: Vec<&str> = Vec::new();
    if limits.isolate {
        flags.extend(ISOLATE);
    }
    if !limits.network {
        if !limits.isolate {
            flags.extend(["--user", "--map-root-user"]);
        }
        flags.push("--net");
    }
    if flags.is_empty() {
        return Vec::new();
    }
    let mut words: Vec<String> = ["unshare"].into_iter().chain(flags).map(str::to_owned).collect();
    words.push("--".to_owned());
    if limits.isolate {
        words.extend([
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            setup_script(&limits.hide, dir),
            "avm-sandbox".to_owned(),
        ]);
    }
    words
}

/// Returns the script that covers the hidden paths, mounts the workspace
/// (`dir`, the shell's working directory) back as the one writable place,
/// makes every other mount read-only, and runs its arguments.
fn setup_script(hide: &[PathBuf], dir: &Path) -> String {
    // Existing paths only, and none inside another (covered already).
    let mut covered: Vec<&PathBuf> = hide.iter().filter(|path| path.is_absolute() && path.exists()).collect();
    covered.sort();
    covered.dedup_by(|inner, outer| inner.starts_with(outer.as_path()));
    let mut script = String::from("set -e; ");
    for path in &covered {
        if path.is_dir() {
            script.push_str(&format!(
                "mount -t tmpfs -o size=64k,mode=0755 avm-hidden {}; ",
                quoted(path)
            ));
        } else {
            script.push_str(&format!("mount --bind /dev/null {}; ", quoted(path)));
        }
    }
    // The shell still stands in the workspace: mount that directory (the
    // magic link, not its name, which may lead into a cover now) at its name.
    let ws = quoted(dir);
    script.push_str(&format!(
        "mkdir -p {ws}; mount --no-canonicalize --bind /proc/self/cwd {ws}; cd {ws}; "
    ));
    // The control groups are out of reach (a command must not leave its own).
    if Path::new("/sys/fs/cgroup").is_dir() {
        script.push_str("mount -t tmpfs -o ro,size=4k avm-hidden /sys/fs/cgroup; ");
    }
    // Everything else read-only: the root strictly, the mounts below it where
    // the kernel lets us (not the command's own /proc, nor what is covered).
    script.push_str(&format!(
        "mount -o remount,bind,ro /; for mp in $(cut -d' ' -f5 /proc/self/mountinfo); do \
         case \"$mp\" in {ws}|/|/proc|/proc/*|/sys/fs/cgroup|/sys/fs/cgroup/*) ;; \
         *) mount -o remount,bind,ro \"$mp\" 2>/dev/null || true;; esac; done; "
    ));
    script.push_str("unset PWD OLDPWD mp; exec \"$@\"");
    script
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_each_hidden_path_once_and_mounts_the_workspace_back() {
        let temp = tempfile::tempdir().unwrap();
        let data = temp.path().join("data");
        let ws = data.join("workspaces/t/i");
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::write(temp.path().join("avm.toml"), "").unwrap();
        let hide = vec![
            data.clone(),
            data.join("workspaces"),
            temp.path().join("avm.toml"),
            temp.path().join("missing"),
            PathBuf::from("relative"),
        ];
        let script = setup_script(&hide, &ws);
        assert_eq!(script.matches("mount -t tmpfs -o size=64k").count(), 1, "{script}");
        assert_eq!(script.matches("mount --bind /dev/null").count(), 1, "{script}");
        assert!(script.contains("--bind /proc/self/cwd"), "{script}");
        assert!(script.contains("mount -o remount,bind,ro /;"), "{script}");
        assert!(!script.contains("missing") && !script.contains("relative"), "{script}");
        assert_eq!(quoted(Path::new("/a'b")), r"'/a'\''b'");
        let open = SandboxLimits {
            isolate: false,
            ..SandboxLimits::default()
        };
        assert!(words(&open, &ws).is_empty());
    }
}
