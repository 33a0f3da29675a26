//! The fence a command runs behind (util-linux: `unshare`, `mount`,
//! `pivot_root`, `setpriv`).
//!
//! An allow-list, not a deny-list: the command's root is a fresh tmpfs that
//! holds only what a command needs — the system directories and a few files
//! of `/etc` (read-only), what `[runtime.sandbox] expose` lists (read-only),
//! the image's workspace at `/workspace` (its one writable directory besides
//! a private `/tmp`), a `/proc` of its own PID namespace (read-only) and a
//! handful of devices — entered with `pivot_root`, the host's root detached.
//! Nothing of the server's (its data directory, its configuration file, its
//! home, `/sys`) is there to uncover, and the command starts without any
//! capability (bounding, inheritable and ambient sets empty, no new
//! privileges), so it can make no mount or unmount at all. It runs in user,
//! mount and PID namespaces of its own (its root is the server's user, no
//! more; it sees only its own processes, and they all end with it) and,
//! in a network namespace of its own: without network, that is all; with
//! it, a relay in the namespace is its only way out, to the proxy of
//! `egress.rs`, which lets through what `fetch_url` may reach.
//!
//! The setup is a shell script run by `unshare` rather than system calls
//! made here: the workspace forbids `unsafe`, and making namespaces and
//! mounts between `fork` and `exec` takes it (`pre_exec`).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;

use tokio::process::Command;

use crate::SandboxLimits;
use crate::egress::{self, Egress};

/// Says why a command cannot be isolated here.
pub(super) const NO_ISOLATION: &str = "this server cannot isolate commands (no user, mount or PID \
    namespaces, or no util-linux `mount`, `pivot_root` and `setpriv`: making a command's root failed), so nothing \
    was run; an operator may run commands without isolation ([runtime.sandbox] isolate = false), where they see \
    the server's files";

/// Says why a command needing no network cannot run here.
pub(super) const NO_NETWORK_ISOLATION: &str = "this agent's sandbox has no network (network: false), and this \
    server cannot take the network away from a command (no user or network namespaces): nothing was run";

/// Where the workspace is in a command's root (its working directory and `HOME`).
pub(super) const WORKSPACE: &str = "/workspace";
/// The command's private temporary directory (`TMPDIR`).
pub(super) const TMP: &str = "/tmp";

/// The system directories a command's root holds, read-only, where the host
/// has them (a merged `/usr`'s links, such as `/bin → usr/bin`, as links).
const SYSTEM: [&str; 7] = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"];

/// What of `/etc` a command's root holds, read-only, where the host has it:
/// what programs need to find users, resolve names, load libraries, trust
/// certificates and tell the time. Nothing that holds a secret (`shadow`,
/// `ssl/private`, tools' own configuration).
const ETC: [&str; 22] = [
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/resolv.conf",
    "/etc/nsswitch.conf",
    "/etc/gai.conf",
    "/etc/services",
    "/etc/protocols",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/alternatives",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/pki/tls/certs",
    "/etc/pki/ca-trust/extracted",
    "/etc/os-release",
];

/// The devices a command's root holds (no disk, no console, no `/dev/kmsg`,
/// and no `/dev/tty`: the command shares the server's session, so that node
/// would open the operator's terminal, where `TIOCSTI` types into its shell).
const DEVICES: [&str; 5] = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"];

/// The links of `/dev` into the command's own `/proc`, copied as they are.
const DEVICE_LINKS: [&str; 4] = ["/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr"];

/// Where no path may be exposed: the places of the command's root that are
/// its own (an exposed path there would be covered, or would cover them).
const OWN: [&str; 4] = [WORKSPACE, TMP, "/proc", "/dev"];

/// Refuses `[runtime.sandbox] expose` paths that are not absolute, hold
/// `..`, or would expose the whole host or cover the command's own places.
pub fn check_config(limits: &SandboxLimits) -> Result<(), String> {
    for path in &limits.expose {
        let plain = path.is_absolute() && path.components().all(|part| !matches!(part, Component::ParentDir));
        let why = if !plain {
            Some("must be an absolute path without `..`")
        } else if path.parent().is_none() {
            Some("would expose the whole host")
        } else if OWN.iter().any(|own| path.starts_with(own)) {
            Some("is the command's own (/workspace, /tmp, /proc, /dev)")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(format!(
                "[runtime.sandbox] expose: {:?} {why}",
                path.display().to_string()
            ));
        }
    }
    Ok(())
}

/// Returns whether the whole fence can be made here: `unshare` makes the
/// namespaces and the setup script the root, for a command that does nothing,
/// in `dir`. Says why not in the log.
async fn probe(words: Vec<String>, dir: &Path) -> bool {
    let Some((program, args)) = words.split_first() else {
        return true;
    };
    let output = Command::new(program)
        .args(args)
        .arg("true")
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await;
    match output {
        Ok(output) if output.status.success() => true,
        Ok(output) => {
            let said = String::from_utf8_lossy(&output.stderr);
            tracing::warn!(status = %output.status, said = %said.trim(), "the command fence cannot be made here");
            false
        }
        Err(err) => {
            tracing::warn!(error = %err, "the command fence cannot be made here");
            false
        }
    }
}

/// Refuses a command these limits cannot be kept for on this server; `dir`
/// is its workspace, made already (the first call makes a command there
/// that does nothing, once).
pub async fn check(limits: &SandboxLimits, dir: &Path) -> Result<(), String> {
    static ISOLATED: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    static RELAYED: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    static OFFLINE: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    if limits.isolate {
        let offline = SandboxLimits {
            network: false,
            ..limits.clone()
        };
        if !*ISOLATED.get_or_init(|| probe(words(&offline, dir, None), dir)).await {
            tracing::warn!("{NO_ISOLATION}");
            return Err(NO_ISOLATION.to_owned());
        }
        if limits.network {
            let relayed = async {
                match Egress::open(std::sync::Arc::new(avm_common::address::AddressGuard::default())) {
                    Ok(egress) => probe(words(limits, dir, Some(&egress)), dir).await,
                    Err(err) => {
                        tracing::warn!(error = %err, "the command fence's network proxy cannot be opened");
                        false
                    }
                }
            };
            if !*RELAYED.get_or_init(|| relayed).await {
                return Err(no_relay(limits));
            }
        }
    } else if !limits.network {
        let offline = SandboxLimits {
            isolate: false,
            ..limits.clone()
        };
        if !*OFFLINE.get_or_init(|| probe(words(&offline, dir, None), dir)).await {
            return Err(NO_NETWORK_ISOLATION.to_owned());
        }
    }
    Ok(())
}

/// Why a fenced command cannot have network here.
fn no_relay(limits: &SandboxLimits) -> String {
    format!(
        "this server cannot give fenced commands network: its relay ({} sandbox-relay) does not start \
         (see the server's log); an operator sets [runtime.sandbox] relay to the avm executable, or the \
         agent's sandbox asks for network: false",
        limits.relay_binary().display()
    )
}

/// Quotes a word for `/bin/sh`.
fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Quotes a path for `/bin/sh`.
fn quoted_path(path: &Path) -> String {
    quoted(&path.display().to_string())
}

/// Returns the words that run the rest of a command line behind the fence
/// `limits` ask for, in its workspace `dir` (none when nothing is asked);
/// `egress` is the command's way out when it is fenced with network.
pub(super) fn words(limits: &SandboxLimits, dir: &Path, egress: Option<&Egress>) -> Vec<String> {
    let mut flags: Vec<&str> = Vec::new();
    if limits.isolate {
        flags.extend([
            "--user",
            "--map-root-user",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--net",
        ]);
    } else if !limits.network {
        flags.extend(["--user", "--map-root-user", "--net"]);
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
            Root::plan(limits, egress).script(dir),
            "avm-sandbox".to_owned(),
        ]);
    }
    words
}

/// What a command's root holds besides the workspace, as found on this host.
#[derive(Debug, Default)]
struct Root {
    /// Directories made in the new root (paths as the command sees them).
    dirs: Vec<PathBuf>,
    /// Empty files made in it, where files are mounted.
    files: Vec<PathBuf>,
    /// The host's symbolic links copied into it, by the directory they go in.
    links: BTreeMap<&'static str, Vec<&'static str>>,
    /// What is mounted in it, as fstab lines with the new root's paths
    /// relative (the script puts the root's mount point before them).
    mounts: Vec<(String, PathBuf, &'static str, String)>,
    /// The executable of the network relay, when the command has a way out.
    relay: Option<PathBuf>,
}

impl Root {
    /// Plans the root of a command under `limits`, from what this host has,
    /// with the proxy's socket when the command has `egress`.
    fn plan(limits: &SandboxLimits, egress: Option<&Egress>) -> Self {
        let mut root = Root {
            dirs: [WORKSPACE, TMP, "/proc", "/dev/shm", "/etc"]
                .map(PathBuf::from)
                .to_vec(),
            ..Root::default()
        };
        for dir in SYSTEM {
            match std::fs::symlink_metadata(dir) {
                Ok(meta) if meta.is_symlink() => root.links.entry("/").or_default().push(dir),
                Ok(meta) if meta.is_dir() => root.bind(Path::new(dir), true, "ro,nosuid,nodev"),
                _ => {}
            }
        }
        for entry in ETC {
            root.bind_existing(Path::new(entry), "ro,nosuid,nodev,noexec");
        }
        for device in DEVICES {
            use std::os::unix::fs::FileTypeExt;
            if std::fs::metadata(device).is_ok_and(|meta| meta.file_type().is_char_device()) {
                root.bind(Path::new(device), false, "nosuid,noexec");
            }
        }
        for link in DEVICE_LINKS {
            if std::fs::symlink_metadata(link).is_ok_and(|meta| meta.is_symlink()) {
                root.links.entry("/dev").or_default().push(link);
            }
        }
        // Memory, so bounded like the command's memory (counted in its cgroup, where it has one).
        let size = format!("size={}m", limits.memory_mb.max(1));
        root.mount("avm-tmp", TMP, "tmpfs", format!("nosuid,nodev,mode=1777,{size}"));
        root.mount(
            "avm-shm",
            "/dev/shm",
            "tmpfs",
            format!("nosuid,nodev,noexec,mode=1777,{size}"),
        );
        // Read-only: no sysctl or trigger written by a root that may be the host's.
        root.mount("proc", "/proc", "proc", "ro,nosuid,nodev,noexec".to_owned());
        let mut exposed: Vec<&PathBuf> = limits.expose.iter().collect();
        exposed.sort();
        exposed.dedup();
        for path in exposed {
            root.bind_existing(path, "ro,nosuid,nodev");
        }
        if let Some(egress) = egress {
            root.relay = Some(limits.relay_binary());
            let inside = Path::new(egress::SOCKET_INSIDE);
            root.dirs.extend(inside.parent().map(Path::to_owned));
            root.files.push(inside.to_owned());
            root.mounts.push((
                egress.socket().display().to_string(),
                inside.to_owned(),
                "none",
                "bind,nosuid,nodev,noexec".to_owned(),
            ));
        }
        root.dirs.sort();
        root.dirs.dedup();
        root
    }

    /// Binds `path` (a directory or a file, followed if a link) where the host has it.
    fn bind_existing(&mut self, path: &Path, options: &str) {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => self.bind(path, true, options),
            Ok(meta) if meta.is_file() => self.bind(path, false, options),
            _ => {}
        }
    }

    /// Binds the host's `path` at the same place in the new root.
    fn bind(&mut self, path: &Path, directory: bool, options: &str) {
        if directory {
            self.dirs.push(path.to_owned());
        } else {
            self.dirs.extend(path.parent().map(Path::to_owned));
            self.files.push(path.to_owned());
        }
        let source = path.display().to_string();
        self.mounts
            .push((source, path.to_owned(), "none", format!("bind,{options}")));
    }

    fn mount(&mut self, source: &str, target: &str, kind: &'static str, options: String) {
        self.mounts
            .push((source.to_owned(), PathBuf::from(target), kind, options));
    }

    /// Returns the script that makes this root over the workspace `dir`
    /// (the shell's working directory), starts the network relay when the
    /// command has a way out, enters the root and runs its arguments
    /// without any capability.
    fn script(&self, dir: &Path) -> String {
        // The root's mount point is the workspace's own path: it surely
        // exists, and the shell still stands in the directory it covers.
        let inside = |path: &Path| quoted_path(&dir.join(path.strip_prefix("/").unwrap_or(path)));
        // `pivot_root` is in sbin, out of the command's own `PATH`.
        let mut script = String::from("set -e; command_path=$PATH; PATH=/usr/sbin:/usr/bin:/sbin:/bin; ");
        script.push_str(&format!(
            "mount -t tmpfs -o mode=0755,size=1m,nr_inodes=4096 avm-root {}; ",
            quoted_path(dir)
        ));
        let dirs: Vec<String> = self.dirs.iter().map(|path| inside(path)).collect();
        script.push_str(&format!("mkdir -p {}; ", dirs.join(" ")));
        if !self.files.is_empty() {
            let files: Vec<String> = self.files.iter().map(|path| inside(path)).collect();
            script.push_str(&format!("touch {}; ", files.join(" ")));
        }
        for (to, links) in &self.links {
            let links: Vec<String> = links.iter().map(|link| quoted(link)).collect();
            script.push_str(&format!("cp -P {} {}; ", links.join(" "), inside(Path::new(to))));
        }
        // The directory the shell stands in (the magic link, not its name,
        // which leads into the new root now).
        script.push_str(&format!(
            "mount --no-canonicalize --bind -o nosuid,nodev /proc/self/cwd {}; ",
            inside(Path::new(WORKSPACE))
        ));
        // One `mount` makes every other mount, from a table: one process
        // rather than one per mount, which is most of a command's start.
        let mut table = String::new();
        for (source, target, kind, options) in &self.mounts {
            let target = dir.join(target.strip_prefix("/").unwrap_or(target));
            table.push_str(&format!(
                "{} {} {kind} {options} 0 0\n",
                fstab_escaped(source),
                fstab_escaped(&target.display().to_string())
            ));
        }
        let table_file = quoted_path(&dir.join(".fstab"));
        script.push_str(&format!(
            "printf %s {} > {table_file}; mount --all --fstab {table_file}; rm {table_file}; ",
            quoted(&table)
        ));
        script.push_str(&format!("cd {}; ", quoted_path(dir)));
        if let Some(relay) = &self.relay {
            // The relay, standing in the new root with one capability (to
            // bring the loopback up); the command starts once it listens.
            script.push_str(&format!(
                "mkfifo .relay; setpriv --bounding-set=-all,+net_admin --inh-caps=-all --ambient-caps=-all \
                 --no-new-privs -- {} sandbox-relay {} > .relay & read ready < .relay; rm .relay; \
                 [ \"$ready\" = ready ]; ",
                quoted_path(relay),
                quoted(egress::SOCKET_INSIDE)
            ));
        }
        // In, with the host's root detached: nothing of it is left to reach.
        script.push_str(&format!(
            "pivot_root . .; umount -l .; cd {WORKSPACE}; mount -o remount,bind,ro /; "
        ));
        script.push_str(
            "PATH=$command_path; unset PWD OLDPWD command_path; exec setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all \
             --no-new-privs -- \"$@\"",
        );
        script
    }
}

/// Escapes a path for an fstab line (spaces, tabs, newlines, backslashes).
fn fstab_escaped(path: &str) -> String {
    let mut escaped = String::with_capacity(path.len());
    for character in path.chars() {
        match character {
            ' ' => escaped.push_str("\\040"),
            '\t' => escaped.push_str("\\011"),
            '\n' => escaped.push_str("\\012"),
            '\\' => escaped.push_str("\\134"),
            other => escaped.push(other),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_holds_the_system_the_workspace_and_what_is_exposed_only() {
        let temp = tempfile::tempdir().unwrap();
        let tools = temp.path().join("opt tools");
        std::fs::create_dir_all(&tools).unwrap();
        let ws = temp.path().join("data/workspaces/t/i");
        let limits = SandboxLimits {
            expose: vec![tools.clone(), tools.clone(), temp.path().join("missing")],
            ..SandboxLimits::default()
        };
        let root = Root::plan(&limits, None);
        let targets: Vec<&Path> = root.mounts.iter().map(|(_, target, _, _)| target.as_path()).collect();
        assert!(targets.contains(&Path::new("/proc")) && targets.contains(&Path::new(TMP)));
        assert_eq!(
            targets.iter().filter(|target| **target == tools).count(),
            1,
            "{targets:?}"
        );
        assert!(!targets.iter().any(|target| target.ends_with("missing")));
        for secret in [
            "/etc/shadow",
            "/etc/ssl/private",
            "/sys",
            "/home",
            "/root",
            "/var",
            "/run",
        ] {
            assert!(!targets.iter().any(|target| target.starts_with(secret)), "{secret}");
        }
        let script = root.script(&ws);
        assert!(script.contains("opt\\040tools"), "fstab escapes spaces: {script}");
        assert!(script.contains("pivot_root . .; umount -l .;"), "{script}");
        assert!(script.ends_with("--no-new-privs -- \"$@\""), "{script}");
        assert_eq!(quoted("/a'b"), r"'/a'\''b'");
        let open = SandboxLimits {
            isolate: false,
            ..SandboxLimits::default()
        };
        assert!(words(&open, &ws, None).is_empty());
    }

    #[tokio::test]
    async fn a_command_with_a_way_out_gets_the_proxys_socket_and_its_relay_before_the_root_is_entered() {
        let limits = SandboxLimits {
            relay: Some(PathBuf::from("/opt/avm/bin/avm")),
            ..SandboxLimits::default()
        };
        let egress = Egress::open(std::sync::Arc::new(avm_common::address::AddressGuard::default())).unwrap();
        let root = Root::plan(&limits, Some(&egress));
        assert!(root.mounts.iter().any(
            |(source, target, _, _)| *source == egress.socket().display().to_string()
                && target == Path::new(egress::SOCKET_INSIDE)
        ));
        let script = root.script(Path::new("/data/workspaces/t/i"));
        let relay = script
            .find("'/opt/avm/bin/avm' sandbox-relay '/run/avm/egress.sock'")
            .unwrap();
        assert!(relay < script.find("pivot_root").unwrap(), "{script}");
        assert!(script.contains("--bounding-set=-all,+net_admin"), "{script}");
        let without = Root::plan(&limits, None).script(Path::new("/data/workspaces/t/i"));
        assert!(!without.contains("sandbox-relay"), "{without}");
        let flags = words(&limits, Path::new("/w"), Some(&egress));
        assert!(flags.contains(&"--net".to_owned()), "{flags:?}");
    }

    #[test]
    fn exposed_paths_are_checked() {
        let with = |path: &str| SandboxLimits {
            expose: vec![PathBuf::from(path)],
            ..SandboxLimits::default()
        };
        assert!(check_config(&with("/opt/tools")).is_ok());
        for refused in ["opt", "/", "/opt/../etc", "/workspace/x", "/tmp", "/proc/1"] {
            assert!(check_config(&with(refused)).is_err(), "{refused}");
        }
    }
}
