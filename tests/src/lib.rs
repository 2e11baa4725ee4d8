//! Helpers for titan's end-to-end tests: where the built binaries and the test Python live.
//!
//! The tests run the real binaries (`cargo build --workspace --bins` first; `scripts/test.sh`
//! does) and the Python from `.venv` that `scripts/setup.sh` creates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};

/// The workspace root (the folder holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives inside the workspace")
        .to_path_buf()
}

/// Path of a workspace binary built into the same target directory as this test.
///
/// Panics with an actionable message when it has not been built.
pub fn bin(name: &str) -> PathBuf {
    // Test executables live in <target>/<profile>/deps; binaries in <target>/<profile>.
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary is inside <target>/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run `cargo build --workspace --bins` first (scripts/test.sh does)",
        path.display()
    );
    path
}

/// `titan-train` started from the workspace root, without the launch variables (RANK,
/// WORLD_SIZE, MASTER_*, SLURM_*, ...) of whoever runs the tests, so it trains as one process
/// unless a test says otherwise.
pub fn titan_train() -> Command {
    let mut c = Command::new(bin("titan-train"));
    c.current_dir(workspace_root());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let launch = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
        if launch.contains(&k.as_ref())
            || k.starts_with("MASTER_")
            || k.starts_with("SLURM_")
            || k.starts_with("TORCHELASTIC_")
        {
            c.env_remove(k.as_ref());
        }
    }
    c
}

/// [`titan_ckpt`] with `--quiet` (no progress bars on stderr), as the ckpt tests run it.
pub fn ckpt() -> Command {
    let mut c = titan_ckpt();
    c.arg("--quiet");
    c
}

/// `titan-ckpt` without the launch variables of whoever runs the tests (RANK/WORLD_SIZE and SLURM's
/// split `consolidate`/`convert` across processes), so it works alone unless a test says otherwise.
pub fn titan_ckpt() -> Command {
    let mut c = Command::new(bin("titan-ckpt"));
    for k in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"] {
        c.env_remove(k);
    }
    c
}

/// titan-train flags for a small, fast, deterministic run that logs every step.
/// `decay_ratio 0` makes the lr schedule independent of `training.steps`, so a 10-step run is
/// exactly the first half of a 20-step run. fp32, not the default bf16 autocast: without
/// AVX-512 (CI's CPUs) libtorch has no fast bf16 matmul, and a bf16 step took 2-3x an fp32 one;
/// the tests about bf16 itself say `--training.mixed_precision_param bfloat16`.
pub const SMALL_DETERMINISTIC_RUN: &[&str] = &[
    "--training.mixed_precision_param",
    "float32",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--validation.enable=false",
    "--metrics.log_freq",
    "1",
    "--observability.enable=false",
    "--debug.seed",
    "42",
    "--debug.deterministic",
    "--lr_scheduler.decay_ratio",
    "0",
];

/// [`titan_train`] for a [`SMALL_DETERMINISTIC_RUN`] writing into `dump` (`--job.dump_folder`),
/// with `extra` flags after those.
pub fn small_run(dump: &Path, extra: &[&str]) -> Command {
    let mut c = titan_train();
    c.args(SMALL_DETERMINISTIC_RUN)
        .arg("--job.dump_folder")
        .arg(dump)
        .args(extra);
    c
}

/// Runs titan-train with `args` for one step; asserts it exits 2 with `key` in its stderr (how a
/// setting titan refuses is reported).
pub fn exit_2_naming(args: &[&str], key: &str) {
    let o = titan_train()
        .args(args)
        .args(["--training.steps", "1"])
        .output()
        .expect("run titan-train");
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", output_text(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains(key), "{args:?} must name {key}: {stderr}");
}

/// The `kind` lines (`train`, `validation`, ...) of `dump/metrics.jsonl`, parsed.
pub fn metrics(dump: &Path, kind: &str) -> Vec<serde_json::Value> {
    let path = dump.join("metrics.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .filter(|v| v["kind"] == kind)
        .collect()
}

/// Each training step `dump/metrics.jsonl` logged: (step, loss, grad norm).
pub fn logged_steps(dump: &Path) -> Vec<(u64, f64, f64)> {
    metrics(dump, "train")
        .iter()
        .map(|v| {
            (
                v["step"].as_u64().expect("a step"),
                v["loss"].as_f64().expect("a loss"),
                v["grad_norm"].as_f64().expect("a grad norm"),
            )
        })
        .collect()
}

/// Copies `from`'s checkpoint of `step` into a fresh run folder `to`, which then resumes it.
pub fn seed_run_with(from: &Path, step: usize, to: &Path) {
    std::fs::create_dir_all(to.join("checkpoint")).expect("the run folder");
    let ok = Command::new("cp")
        .arg("-r")
        .arg(from.join(format!("checkpoint/step-{step}")))
        .arg(to.join("checkpoint"))
        .status()
        .expect("cp");
    assert!(ok.success(), "copying {}'s step {step}", from.display());
}

/// A DCP sharded safetensors file (as torch's HuggingFaceStorageWriter writes one rank's) from
/// `(name, dtype, local shape, saved_offsets)` entries, written by hand (not by titan-ckpt's
/// writer) so the tests read what they meant; byte `i` of the data is `fill(i)`.
pub fn dcp_hf_shard(entries: &[(&str, &str, &[u64], &[u64])], fill: impl Fn(u64) -> u8) -> Vec<u8> {
    use serde_json::json;
    let size = |d: &str| match d {
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        _ => 8,
    };
    let mut header = serde_json::Map::new();
    let mut info = serde_json::Map::new();
    let mut pos = 0u64;
    for (name, dtype, shape, offsets) in entries {
        let n = shape.iter().product::<u64>() * size(dtype);
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}),
        );
        info.insert(name.to_string(), json!({ "saved_offsets": offsets }));
        pos += n;
    }
    header.insert(
        "__metadata__".into(),
        json!({"DCP_SHARDING_INFO": serde_json::to_string(&info).unwrap(), "DCP_VERSION": "1.0", "format": "pt"}),
    );
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend((0..pos).map(fill));
    out
}

/// stdout and stderr of a finished command, for assertion messages.
pub fn output_text(o: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `cmd` to the end; panics with the command and its output unless it exits 0.
pub fn run_ok(cmd: &mut Command) -> Output {
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    assert!(o.status.success(), "{cmd:?} failed:\n{}", output_text(&o));
    o
}

/// How many spans named `name` rank `rank` of the titan-obs run in `dump` recorded per step, read
/// with pyarrow from the raw Parquet parts (not through titan-obs, so a test of the trainer does
/// not trust the reader it would also be testing).
pub fn span_counts(dump: &Path, rank: u32, name: &str) -> std::collections::BTreeMap<u64, u64> {
    let script = r#"
import glob, json, sys
import pyarrow.parquet as pq
counts = {}
for f in glob.glob(sys.argv[1] + "/obs/rank-" + sys.argv[2] + "/*.parquet"):
    for r in pq.read_table(f, columns=["kind", "name", "step"]).to_pylist():
        if r["kind"] == "span" and r["name"] == sys.argv[3]:
            counts[r["step"]] = counts.get(r["step"], 0) + 1
print(json.dumps(counts))
"#;
    let out = run_ok(
        Command::new(python())
            .args(["-c", script])
            .arg(dump)
            .arg(rank.to_string())
            .arg(name),
    );
    let counts: std::collections::BTreeMap<String, u64> =
        serde_json::from_slice(&out.stdout).expect("the script prints a JSON object");
    counts
        .into_iter()
        .map(|(step, n)| (step.parse().expect("a step number"), n))
        .collect()
}

/// Runs a check script to the end; panics with its output unless it exits 0 and its stdout
/// starts with `ok` (how the Python checks report success). Returns that stdout.
pub fn run_says_ok(cmd: &mut Command) -> String {
    let o = run_ok(cmd);
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(stdout.starts_with("ok"), "{cmd:?}:\n{}", output_text(&o));
    stdout
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for servers a test starts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// The Python interpreter of `.venv` (with torch, safetensors, transformers, pyarrow).
pub fn python() -> PathBuf {
    venv_python("TITAN_PYTHON", ".venv/bin/python")
}

/// A `Command` for the `.venv` Python running `script` (a path relative to the workspace root).
pub fn python_script(script: &str) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(workspace_root().join(script));
    cmd
}

/// The Python of `.venv-tt`: torch 2.15 + torchtitan 0.3.0 + transformers 5 (scripts/setup.sh makes it),
/// for fixtures written by torchtitan's own code and for reading what titan writes with the newest torch.
pub fn tt_python() -> PathBuf {
    venv_python("TITAN_TT_PYTHON", ".venv-tt/bin/python")
}

/// A `Command` for the `.venv-tt` Python running `script` (a path relative to the workspace root).
pub fn tt_python_script(script: &str) -> Command {
    let mut cmd = Command::new(tt_python());
    cmd.arg(workspace_root().join(script));
    cmd
}

/// A `Command` for the `.venv` Python (torch 2.13) with transformers 4.57 in front of the 5.x one
/// (`pip install --target .venv/tf4`, made by scripts/setup.sh), running `script`.
pub fn tf4_python_script(script: &str) -> Command {
    let mut cmd = python_script(script);
    cmd.env("PYTHONPATH", tf4_path());
    cmd
}

/// transformers 4.57 for `PYTHONPATH` (`TITAN_TF4_PATH`, else `.venv/tf4`).
pub fn tf4_path() -> PathBuf {
    let tf4 = match std::env::var_os("TITAN_TF4_PATH") {
        Some(p) => workspace_root().join(p),
        None => workspace_root().join(".venv/tf4"),
    };
    assert!(
        tf4.exists(),
        "{} is missing; run scripts/setup.sh first",
        tf4.display()
    );
    tf4
}

/// The interpreter `var` names (a relative path is taken from the workspace root, as
/// `.cargo/config.toml` writes it), else `default` under the workspace root.
fn venv_python(var: &str, default: &str) -> PathBuf {
    let p = match std::env::var_os(var) {
        Some(p) => workspace_root().join(p),
        None => workspace_root().join(default),
    };
    assert!(
        p.exists(),
        "{} is missing; run scripts/setup.sh first",
        p.display()
    );
    p
}

/// A local S3-compatible server (`moto_server` from `.venv`, moto[server] in
/// requirements-dev.txt) on a free loopback port; killed when dropped.
pub struct MotoServer {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`, for `AWS_ENDPOINT`.
    pub endpoint: String,
    /// The bucket [`MotoServer::s3`] works on (created by [`MotoServer::start`]).
    pub bucket: String,
    /// The server's request log (its stderr: one line per request, the method quoted).
    log: tempfile::NamedTempFile,
}

impl MotoServer {
    /// Starts the server, waits (up to 60 s) until it accepts connections, and creates `bucket`.
    pub fn start(bucket: &str) -> MotoServer {
        use std::net::TcpStream;
        use std::process::Stdio;
        use std::time::{Duration, Instant};
        let port = free_port();
        let log = tempfile::NamedTempFile::new().expect("a temporary file for moto's log");
        let child = Command::new(workspace_root().join(".venv/bin/moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(log.reopen().expect("moto's log"))
            .spawn()
            .expect("start .venv/bin/moto_server (pip install 'moto[server]')");
        let server = MotoServer {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: bucket.to_string(),
            log,
        };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "moto_server did not start"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server.s3(&["mkbucket"]);
        server
    }

    /// Runs `tests/python/s3_client.py ENDPOINT BUCKET args...` (mkbucket, put, get, ls); its stdout.
    pub fn s3(&self, args: &[&str]) -> String {
        let o = run_ok(
            python_script("tests/python/s3_client.py")
                .arg(&self.endpoint)
                .arg(&self.bucket)
                .args(args),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The requests the server has answered so far, by method (GET, PUT, HEAD, ...), from
    /// its request log: what a client's run of commands cost is the difference of two calls.
    pub fn requests(&self) -> BTreeMap<String, usize> {
        let log = std::fs::read_to_string(self.log.path()).unwrap_or_default();
        let mut by_method = BTreeMap::new();
        for line in log.lines() {
            // `127.0.0.1 - - [date] "GET /bucket/key HTTP/1.1" 200 -`, colour-coded.
            let line = strip_colours(line);
            let Some((_, request)) = line.split_once('"') else {
                continue;
            };
            if let Some((method, rest)) = request.split_once(' ')
                && rest.contains(" HTTP/")
            {
                *by_method.entry(method.to_string()).or_default() += 1;
            }
        }
        by_method
    }

    /// The variables that point an object_store client at this server (dummy credentials,
    /// plain HTTP).
    pub fn aws_vars(&self) -> [(&'static str, String); 5] {
        [
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Points `cmd`'s object_store client at this server ([`MotoServer::aws_vars`]).
    pub fn aws_env<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.envs(self.aws_vars())
    }
}

/// A private tmux server (its own socket) running `cmd` in one `width` x `height` pane: the
/// terminal the TUI tests drive (keys in, `capture-pane` out). When `cmd` exits the pane shows
/// [`Tmux::EXIT`] and its exit status, and stays. Killed on drop.
pub struct Tmux {
    socket: String,
}

impl Tmux {
    /// What the pane prints when the command has exited, followed by its exit status.
    pub const EXIT: &'static str = "TITAN_OBS_EXIT=";

    pub fn start(cmd: &str, width: u16, height: u16) -> Tmux {
        let have = Command::new("tmux").arg("-V").output();
        assert!(
            have.is_ok_and(|o| o.status.success()),
            "tmux is required for this test: apt-get install -y tmux (scripts/setup.sh installs it)"
        );
        // One server per session: tests run in parallel.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = Tmux {
            socket: format!("titan-e2e-{}-{n}", std::process::id()),
        };
        let (w, h) = (width.to_string(), height.to_string());
        // The pane outlives the command, so that a test reads its last screen and exit status.
        let cmd = format!("{cmd}; echo {}$?; sleep 60", Tmux::EXIT);
        let out = t.run(&["new-session", "-d", "-s", "tui", "-x", &w, "-y", &h, &cmd]);
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            output_text(&out)
        );
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .env_remove("TMUX")
            .output()
            .expect("running tmux")
    }

    /// Types `keys` one at a time, as a user does: each is handled and drawn before the next.
    pub fn keys(&self, keys: &[&str]) {
        for k in keys {
            let out = self.run(&["send-keys", "-t", "tui", k]);
            assert!(
                out.status.success(),
                "tmux send-keys: {}",
                output_text(&out)
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// The pane's text now.
    pub fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "tui"]).stdout).into_owned()
    }

    /// Waits (up to 30 s) until the screen satisfies `ok` and returns it, or fails naming
    /// `what` with the last screen, at once if the command has exited.
    pub fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                !s.contains(Tmux::EXIT),
                "no {what}: the command exited:\n{s}"
            );
            assert!(std::time::Instant::now() < deadline, "no {what}:\n{s}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Waits (up to 30 s) for the command to exit; returns its exit status and the last screen.
    pub fn wait_for_exit(&self) -> (i32, String) {
        let screen = self.wait_for("the exit", |s| s.contains(Tmux::EXIT));
        let status = screen
            .split(Tmux::EXIT)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no exit status after {}:\n{screen}", Tmux::EXIT));
        (status, screen)
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// `p` (a path or a string) quoted for a POSIX shell command line.
pub fn shell_quote(p: impl AsRef<std::ffi::OsStr>) -> String {
    format!("'{}'", p.as_ref().to_string_lossy().replace('\'', "'\\''"))
}

/// Starts the recorder of a child process that records like the trainer (rank `rank` of
/// `world`, its own rank as local rank) into `run`.
pub fn init_trainer_recorder(
    run: String,
    rank: u32,
    world: u32,
    flush: std::time::Duration,
    rotate: std::time::Duration,
) {
    titan_obs_core::init_with(
        titan_obs_core::InitOptions {
            run,
            source: titan_obs_core::Source::Trainer,
            rank,
            local_rank: rank,
            world_size: world,
            flush_interval: flush,
        },
        titan_obs_core::Tuning {
            rotate_interval: rotate,
            ..Default::default()
        },
    )
    .expect("init");
}

/// `s` without its ANSI colour sequences (`ESC [ ... m`).
fn strip_colours(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|&d| d == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

static BINARY_TEMPDIR: OnceLock<PathBuf> = OnceLock::new();

unsafe extern "C" {
    /// libc's: libtest ends a test binary with `std::process::exit`, which runs these.
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

extern "C" fn remove_binary_tempdir() {
    if let Some(dir) = BINARY_TEMPDIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A temporary folder for the fixtures a test binary's tests share, removed when the binary
/// exits. (A `TempDir` held in a static is never dropped: fixtures kept that way stayed in
/// /tmp after every run, gigabytes a day on a CI machine.)
pub fn binary_tempdir() -> &'static Path {
    BINARY_TEMPDIR.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("titan-tests-")
            .tempdir()
            .expect("a temporary folder")
            .keep();
        // SAFETY: registers a plain function; it only reads a set OnceLock and removes files.
        if unsafe { atexit(remove_binary_tempdir) } != 0 {
            eprintln!("note: {} will not be removed at exit", dir.display());
        }
        dir
    })
}

/// A new empty folder `name` inside [`binary_tempdir`] (one per shared fixture): emptied first,
/// so a fixture whose first making failed (a test's `OnceLock` init panicked, and the next test
/// tries again) starts over.
pub fn binary_subdir(name: &str) -> PathBuf {
    let dir = binary_tempdir().join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("emptying a fixture folder");
    }
    std::fs::create_dir_all(&dir).expect("a fixture folder");
    dir
}

/// The folder a fixture script's `make DIR FLAVOR` filled (`runner(script)` is the script's
/// command, before `make`), made on first use, once per test binary: one lock per (script,
/// flavor), so different fixtures are made in parallel and each once.
pub fn fixture_made_once(
    script: &str,
    flavor: &str,
    runner: impl FnOnce(&str) -> Command,
) -> PathBuf {
    static MADE: Mutex<BTreeMap<String, Arc<OnceLock<PathBuf>>>> = Mutex::new(BTreeMap::new());
    let root = binary_tempdir();
    let stem = Path::new(script)
        .file_stem()
        .map_or("fixture".into(), |s| s.to_string_lossy());
    let name = format!("{stem}-{flavor}");
    let cell = MADE
        .lock()
        .unwrap()
        .entry(name.clone())
        .or_default()
        .clone();
    cell.get_or_init(|| {
        let d = root.join(&name);
        // What a failed first try left (its test panicked; this is the next one's try).
        if d.exists() {
            std::fs::remove_dir_all(&d).expect("emptying a fixture folder");
        }
        run_ok(runner(script).arg("make").arg(&d).arg(flavor));
        d
    })
    .clone()
}

/// The name libtest gives test `name` of the module `module_path` (pass `module_path!()`), to
/// run it alone with `--exact` from its own test binary (tests that start themselves as a
/// child process): `obs_journal::journal_child` in the one binary of tests/e2e.rs.
pub fn test_name(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// The pids of `parent`'s child processes (Linux /proc): the ranks a titan-train launcher
/// started.
pub fn children(parent: u32) -> Vec<u32> {
    let path = format!("/proc/{parent}/task/{parent}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The RANK variable of process `pid`.
pub fn rank_of(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Waits (at most `timeout`) until `ready()` while the titan-train `launcher` runs, then returns
/// the pid of its rank `rank` (to stop or kill it mid-run).
pub fn running_rank(
    launcher: &mut std::process::Child,
    rank: &str,
    timeout: std::time::Duration,
    ready: impl Fn() -> bool,
) -> u32 {
    let deadline = std::time::Instant::now() + timeout;
    while !ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "the run was not ready within {timeout:?}"
        );
        assert!(
            launcher.try_wait().unwrap().is_none(),
            "launcher ended early"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    children(launcher.id())
        .into_iter()
        .find(|&p| rank_of(p).as_deref() == Some(rank))
        .unwrap_or_else(|| panic!("rank {rank} among the launcher's children"))
}
