//! What the kernel says a process spends: CPU time, resident memory and
//! wakeups, read from `/proc`.

use anyhow::Context;
use serde_json::{Value, json};

/// Clock ticks per second of `/proc/<pid>/stat` CPU times.
pub fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|output| String::from_utf8_lossy(&output.stdout).trim().parse::<f64>().ok())
            .filter(|ticks| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

/// Returns a process's user + system CPU time, in seconds.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("process {pid} is gone"))?;
    // Fields after the command name (which may hold spaces) start at its closing parenthesis.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("unreadable /proc stat")?
        .1
        .split_whitespace()
        .collect();
    let field =
        |index: usize| -> anyhow::Result<u64> { Ok(fields.get(index).context("short /proc stat")?.parse::<u64>()?) };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
    Ok((field(11)? + field(12)?) as f64 / clock_ticks_per_second())
}

/// Returns the summed CPU seconds of `pids`.
pub fn cpu_seconds_of(pids: &[u32]) -> anyhow::Result<f64> {
    pids.iter().map(|&pid| cpu_seconds(pid)).sum()
}

/// Returns this process's own user + system CPU time, in seconds.
pub fn own_cpu_seconds() -> f64 {
    cpu_seconds(std::process::id()).unwrap_or(0.0)
}

/// Returns a process's resident set, in KiB.
pub fn rss_kib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS")?
        .parse::<f64>()?)
}

/// Returns how many times the threads of a process were switched in
/// (voluntary and not): each is a wakeup.
pub fn context_switches(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(status) = std::fs::read_to_string(task?.path().join("status")) else {
            continue; // a thread that just ended
        };
        for line in status.lines() {
            if line.starts_with("voluntary_ctxt_switches:") || line.starts_with("nonvoluntary_ctxt_switches:") {
                total += line
                    .split_whitespace()
                    .nth(1)
                    .and_then(|count| count.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    Ok(total)
}

/// The machine the figures were taken on.
pub fn machine() -> Value {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_default();
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("MemTotal:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| (kib / 1024.0 / 1024.0).round());
    json!({"cpus": cpus, "cpu": model, "memoryGiB": memory_gib})
}
