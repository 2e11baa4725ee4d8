#!/usr/bin/env bash
# One-time, idempotent setup: a Python venv with the libtorch tch 0.26 links against (torch 2.13.0)
# and the pinned test packages, a .libtorch link to it, and .cargo/config.toml pointing LIBTORCH there.
# After this, plain `cargo build` / `cargo test` work from the repo root.
#
#   scripts/setup.sh          everything
#   scripts/setup.sh build    only what `cargo build` needs (torch 2.13's libtorch, .cargo/config.toml)
#   scripts/setup.sh test     the rest: the test packages, .venv-tt (torch 2.15 + torchtitan), tmux
set -euo pipefail
part=${1:-all}
case "$part" in
  all | build | test) ;;
  *) echo "usage: scripts/setup.sh [build|test]  (got '$part')" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

TORCH_VERSION=2.13.0
# torchtitan 0.3.0 and torch 2.15 in .venv-tt; transformers 4 beside .venv's 5.x in .venv/tf4 (below).
TT_TORCH_VERSION=2.15.0
TT_VERSION=0.3.0
TF4_VERSION=4.57.6
PY=${PYTHON:-python3}

log() { printf '[setup] %s\n' "$*" >&2; }

# Warn up front when the disk looks too small, before pip's "No space left on device" half-way through.
need_gb=${TITAN_SETUP_NEED_GB:-10}
free_kb=$(df -Pk "$root" | awk 'NR==2 {print $4}')
if [ ! -x .venv/bin/python ] && [ -n "$free_kb" ] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
  log "warning: only $((free_kb / 1024 / 1024)) GB free under $root; torch (~5.3 GB) and the debug build (~2 GB) need about ${need_gb} GB"
fi

VPY="$root/.venv/bin/python"

# --- what the build needs -------------------------------------------------------------------
build_deps() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PY --version 2>&1)"
    "$PY" -m venv .venv
  fi

  have_torch=$("$VPY" -c "import torch,sys; sys.stdout.write(torch.__version__)" 2>/dev/null || true)
  if [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
    log "installing torch==$TORCH_VERSION (about 4.5 GB with its NVIDIA runtime wheels; a few minutes)"
    "$VPY" -m pip install --quiet --disable-pip-version-check --upgrade pip
    # --no-cache-dir: the wheels are ~4.5 GB; a second copy in pip's cache can fill a small CI disk.
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch==$TORCH_VERSION"
  else
    log "torch $have_torch already installed"
  fi

  torch_dir=$("$VPY" -c "import torch,os; print(os.path.dirname(torch.__file__))")
  ln -sfn "$torch_dir" .libtorch
  log ".libtorch -> $torch_dir"

  mkdir -p .cargo
  cat > .cargo/config.toml <<TOML
# Written by scripts/setup.sh: points torch-sys at the libtorch inside .venv (torch $TORCH_VERSION).
[env]
# The real path, not the .libtorch link: libtorch finds its NVIDIA libraries through
# \$ORIGIN-relative rpaths, which only resolve from the package's own location.
LIBTORCH = "$torch_dir"
TITAN_PYTHON = { value = ".venv/bin/python", relative = true }
# torch $TT_TORCH_VERSION + torchtitan $TT_VERSION, and transformers $TF4_VERSION (use as PYTHONPATH with TITAN_PYTHON).
TITAN_TT_PYTHON = { value = ".venv-tt/bin/python", relative = true }
TITAN_TF4_PATH = { value = ".venv/tf4", relative = true }
TOML
  log "done: LIBTORCH=$root/.libtorch"
}

# --- what the tests need besides ------------------------------------------------------------
test_deps() {
  [ -x "$VPY" ] || { log "no .venv yet: run scripts/setup.sh build first"; exit 2; }
  stamp=.venv/.requirements-dev.sha
  want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing requirements-dev.txt"
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-cache-dir -r requirements-dev.txt
    echo "$want" > "$stamp"
  else
    log "requirements-dev.txt already installed"
  fi

  # torchtitan 0.3.0 and torch 2.15 in a second venv: the interop tests make fixtures with torchtitan's own code
  # (its models, state-dict adapters, checkpointer and structured logger) and read what titan writes with the newest
  # torch. A separate venv because tch needs exactly torch 2.13 in .venv.
  tt_stamp=.venv-tt/.titan-tt-versions
  # tensorboard (a torchtitan dependency) and tbparse read titan-train's TensorBoard event files in the tests.
  tt_want="torch==$TT_TORCH_VERSION torchtitan==$TT_VERSION $(grep -E '^transformers==' requirements-dev.txt) tensorboard==2.21.0 tbparse==0.0.9 torchao==0.18.0"
  if [ "$(cat "$tt_stamp" 2>/dev/null)" != "$tt_want" ]; then
    [ -x .venv-tt/bin/python ] || { log "creating .venv-tt (torch $TT_TORCH_VERSION + torchtitan $TT_VERSION)"; "$PY" -m venv .venv-tt; }
    log "installing $tt_want into .venv-tt (about 5 GB; a few minutes)"
    # shellcheck disable=SC2086
    .venv-tt/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir $tt_want
    echo "$tt_want" > "$tt_stamp"
  else
    log ".venv-tt already has $tt_want"
  fi

  # transformers 4 beside the 5.x in .venv, for the config.json compatibility tests (PYTHONPATH=.venv/tf4).
  if [ "$(cat .venv/tf4/.version 2>/dev/null)" != "$TF4_VERSION" ]; then
    log "installing transformers==$TF4_VERSION into .venv/tf4"
    rm -rf .venv/tf4
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-cache-dir --target .venv/tf4 "transformers==$TF4_VERSION"
    echo "$TF4_VERSION" > .venv/tf4/.version
  fi

  # The titan-obs TUI test (tests/tests/tui_tmux.rs) drives the gantt inside tmux.
  if ! command -v tmux >/dev/null 2>&1; then
    log "installing tmux (for the titan-obs TUI test)"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null
  fi
  log "done: test packages"
}

case "$part" in
  build) build_deps ;;
  test) test_deps ;;
  all) build_deps; test_deps ;;
esac
