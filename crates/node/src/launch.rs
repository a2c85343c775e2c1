//! Ranks started by `mpirun`: telling whether this process is one, and starting a job of this
//! binary. One owner for both, so tests, examples and the CLI launch the same way.

use std::path::Path;
use std::process::Command;

/// Whether this process is a rank of an `mpirun` job (Open MPI sets `OMPI_COMM_WORLD_SIZE`,
/// MPICH and Hydra `PMI_SIZE`).
pub fn under_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// `mpirun -np <ranks> <exe>` on this host: ranks may outnumber the cores (`--oversubscribe`:
/// they then time-share them), and a root user (CI containers) is allowed explicitly, which
/// Open MPI otherwise refuses. Add the program's arguments and run it.
pub fn mpirun_command(ranks: usize, exe: &Path) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", &ranks.to_string()]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(exe);
    cmd
}
