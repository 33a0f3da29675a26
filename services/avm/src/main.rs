//! `avm`: runs all of AgentVM in one process (`avm serve`) or one component per process.

fn main() -> std::process::ExitCode {
    avm::main()
}
