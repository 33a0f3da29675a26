//! `avm`: runs all of AgentVM in one process (`avm serve`) or one component per process.

/// jemalloc rather than glibc's `malloc`: glibc kept what 1,000 closed
/// keep-alive connections had used (33–54 MB) in its per-thread arenas for
/// the process's life; jemalloc returns freed pages within a second
/// (settings in `.cargo/config.toml`; issue 26 item 19).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    avm::main()
}
