# jaxpp_mpi — the two commands a new user runs: `make example` and `make test` (each installs
# everything into .venv on first use; `make install` does only that).
#
# Knobs (make VAR=value):  PYTHON (interpreter for the venv), JAXPP_MPI_MPI=wheel|system,
# JAXPP_MPI_CUDA=auto|off|on|/path, JAX_EXTRA=cpu|cuda12|cuda13 (see tools/install.sh);
# MPI_TIMEOUT (hard limit in seconds for each mpirun test run), TEST_WORKERS, PYTEST_ARGS.

VENV        ?= .venv
PY          := $(VENV)/bin/python
JPPRUN      := launch/jpprun
# launch/jpprun starts ranks with this interpreter (its default is ./.venv's): the VENV's.
JAXPP_MPI_PYTHON ?= $(abspath $(PY))
export JAXPP_MPI_PYTHON
MPI_TIMEOUT ?= 900
PYTEST_ARGS ?=
# Processes for the single-process tests (pytest-xdist): each runs one XLA compile or one
# trace at a time and waits between them, so 2 left a 2-core machine ~40% idle (tests/unit
# + tests/local with a warm compilation cache: 5:41 with 2, 4:35 with 3, the same load). A
# venv from before xdist was a test dependency runs them in one process (`make install`).
TEST_WORKERS ?= 3
XDIST        = $$($(PY) -c 'import xdist' 2>/dev/null && printf -- '-n %s %s' $(TEST_WORKERS) "$(1)" || \
                 echo "pytest-xdist missing (make install adds it): one process" >&2)
# Each MPI test run: pytest-mpi on every rank, a per-test timeout, a hard outer timeout;
# a failure on any rank aborts the whole job (tests/conftest.py, "MPI harness"). The last
# run gives every rank a group mesh of 2 devices (values move shard by shard); the tests of
# multi-device groups (`sharded_groups`) run there only: on one device they repeat the parity tests.
MPI_PYTEST   = timeout -k 10 $(MPI_TIMEOUT) $(JPPRUN) -n $(1) python -m pytest tests/mpi \
               --with-mpi -p no:cacheprovider --timeout=300 --color=no -q $(PYTEST_ARGS)

.PHONY: install test test-unit test-jobs test-jobs-mpi test-mpi test-hosts test-hosts-long fuzz test-slurm example bench lint clean

install:
	VENV=$(VENV) bash tools/install.sh

# The single-process tests run side by side with the jobs' tests and then the mpirun runs
# (each stream's output printed whole when it ends): the jobs end first, and the mpirun runs
# take up the cores the single-process tests' last minutes leave. From a fresh clone on the
# 2-core machine: `make test` 12:02-14:38 (the jobs 5:51-7:34, then the mpirun runs; the
# single-process tests 10:30 beside them; side by side with the jobs alone, 8:57).
test: lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-jobs-mpi

test-jobs-mpi:
	$(MAKE) --no-print-directory test-jobs
	$(MAKE) --no-print-directory test-mpi

test-unit: $(PY)
	$(PY) -m pytest tests/unit tests/local -q $(call XDIST) $(PYTEST_ARGS)

# tests/jobs and tests/hosts start MPI jobs of their own, whose ranks mostly wait (on a
# deadline, a signal, a peer, a link): they run side by side, a test file per worker (a
# file's tests may share hosts or build on each other's checkpoints). From a fresh clone:
# 5:42 + 2:31 one at a time, 5:21 side by side; every time bound still met.
test-jobs: $(PY)
	timeout -k 10 1800 $(PY) -m pytest tests/jobs tests/hosts --ignore=tests/hosts/long -q \
	  $(call XDIST,--dist loadfile) $(PYTEST_ARGS)

# -n 4 repeats what more ranks change (pipelines, transport, meshes, reshard, keys across
# stages, fuzz); bad input, the call surface, constraints, arrays, traces, task times and
# mismatched programs and the checkpoint lock's refusal check each rank's own view or the
# agreement of all ranks, already
# whole at -n 2; the shard-by-shard exchange uses ranks 0 and 1 only; the MLP's parity is
# the transformer's on a smaller model, and the fuzz runs random MLP pipelines at -n 4.
# Of the transformer's every-schedule parity, -n 4 keeps 1F1B, Interleaved (two stages
# per rank), DualPipeV (the V) and ZeroBubble: MPI mode on CPU lowers for posted sends,
# which gives ZeroBubble and DualPipeV other programs than tests/local's 4-group runs
# (on the schedules' task graphs GPipe, Eager1F1B and KimiK2 get the same ones).
# Dropout keys cross 4 ranks under 1F1B (every schedule at -n 2). Staged messages (their
# threads, order and donation guard are per rank and per channel) and messages past MPI's
# eager limit (its rendezvous protocol is a matter of each pair of ranks) run at -n 2 only.
N4_SKIP = bad_input_mpi or call_surface_mpi or sharding_constraint_mpi or array_mpi or \
          trace_mpi or task_times or mismatched_programs or values_move or mlp_parity or \
          sharded_replicas or donated_later or checkpoint_lock or rendezvous_sized or \
          (transformer_parity_every_schedule and (gpipe or eager1f1b or kimik2)) or \
          (random_dropout_parity_mpi and (interleaved or zerobubble)) or \
          staged
# JaxPP's programs also run on 3 ranks (a group on each, meshes that agree across them;
# with 4 devices per rank, its one-process tests on every rank and MPI against local mode).
# Pipeline replicas need 4 ranks (2 replicas x 2 groups): they run in the -n 4 runs, the
# last one with 2 devices per rank (values split inside each group, shard by shard
# across replicas too).
# At -n 2 the MLP runs every schedule and the transformer (every schedule, and tied, at
# -n 4, where the tied embedding's first and last stages are not neighbours) does not.
N2_SKIP = transformer_parity_every_schedule or tied_transformer
test-mpi: $(PY)
	$(call MPI_PYTEST,2) -k "not sharded_groups and not ($(N2_SKIP))"
	$(call MPI_PYTEST,4) -k "not sharded_groups and not ($(N4_SKIP))"
	$(call MPI_PYTEST,3) -k "jaxpp_programs and not sharded_groups"
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(call MPI_PYTEST,3) \
	  -k "jaxpp_programs and sharded_groups"
	XLA_FLAGS=--xla_force_host_platform_device_count=2 $(call MPI_PYTEST,2) \
	  -k "(shard or mismatch or (parity and not transformer and (1f1b or interleaved))) and not replicas"
	XLA_FLAGS=--xla_force_host_platform_device_count=2 $(call MPI_PYTEST,4) \
	  -k "test_replicas_mpi and (sharded or share or layout)"

# Jobs across hosts made on this machine: network namespaces joined by a bridge, Open MPI
# over TCP between them (tests/hosts/netns.py; root needed, else skipped naming why). The
# faults (a link cut inside and between steps, a host lost) run here and in test-jobs;
# every schedule across hosts, uneven hosts and 8 and 16 ranks under test-hosts-long (~11 min).
test-hosts: $(PY)
	timeout -k 10 900 $(PY) -m pytest tests/hosts -q --ignore=tests/hosts/long $(PYTEST_ARGS)
test-hosts-long: $(PY)
	timeout -k 10 3600 $(PY) -m pytest tests/hosts/long -q $(PYTEST_ARGS)

# The program fuzzer's long run (tests/fuzz/programs.py): 300 generated training steps per
# schedule, 2,100 in all, each against jax.jit in local mode (make test runs 2 per schedule).
fuzz: $(PY)
	JAXPP_MPI_FUZZ_EXAMPLES=300 $(PY) -m pytest tests/local/test_fuzz_programs.py -q $(call XDIST) $(PYTEST_ARGS)

# launch/slurm/train.sbatch for real on a single-node SLURM installed and started here
# (root, Debian/apt; ~2-4 min); not part of `test`. See tests/slurm/run_single_node_slurm.sh.
test-slurm: $(PY)
	bash tests/slurm/run_single_node_slurm.sh

# The example also writes the traced step (build/trace.json, open it in Perfetto), its
# Gantt chart (build/trace.png) and the schedule's planned chart (build/schedule.png).
example: $(PY)
	$(JPPRUN) -n 4 python examples/train.py --schedule 1f1b --steps 10 --trace build/trace.json
	$(PY) -m jaxpp_mpi.schedules --from-trace build/trace.json --png build/trace.png
	$(PY) -m jaxpp_mpi.schedules Std1F1B --stages 4 --microbatches 8 --png build/schedule.png

bench: $(PY)
	$(JPPRUN) -n 2 python bench/p2p.py --out bench/results/p2p.json
	$(JPPRUN) -n 2 python bench/pipeline.py --schedule 1f1b --out bench/results/pipeline_1f1b.json
	$(PY) bench/spmd.py --out bench/results/spmd.json

# ruff, pinned in setup.cfg's dev extra and installed by tools/install.sh.
lint: $(PY)
	$(PY) -m ruff check jaxpp_mpi tests bench examples

# The first command that needs the venv creates it.
$(PY):
	VENV=$(VENV) bash tools/install.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
