//! titan-obs's exit codes and message prefix, defined once (the titan-cli conventions): every
//! command returns one of these codes and prints its errors and warnings through [`TITAN_OBS`];
//! `--help` lists the same table.

use titan_cli::{Bin, ExitCode};

pub const OK: ExitCode = ExitCode::new(0, "success");
// A RUN path that does not exist is a run that could not be read (exit 1), not a usage error:
// it may be a run yet to start or a mount that is not there, and titan-ckpt answers a missing
// path the same way (issue 39 asked; the table says it so nobody has to guess).
pub const FAILED: ExitCode = ExitCode::new(
    1,
    "the run could not be read (a RUN path that does not exist included) or the output not \
     written",
);
pub const USAGE: ExitCode = ExitCode::new(
    2,
    "usage error (bad flags, nothing to write, no terminal for the interactive view, RUN is \
     not a run, a misspelt command)",
);
pub const INCOMPLETE: ExitCode = ExitCode::new(
    3,
    "with --strict: the result was printed/written but ranks were missing or parts corrupt",
);

/// The `titan-obs` binary: message prefix and exit-code table.
pub const TITAN_OBS: Bin = Bin::new("titan-obs", &[OK, FAILED, USAGE, INCOMPLETE]);
