#!/usr/bin/env bash
# Runs launch/slurm/train.sbatch for real on a single-node SLURM set up on this machine.
#
#   tests/slurm/run_single_node_slurm.sh        (what `make test-slurm` runs; needs root)
#
# 1. installs Debian's slurm-wlm, munge and libpmix2 (Slurm's pmix plugin loads
#    libpmix at run time) unless slurmctld is already there;
# 2. writes a minimal slurm.conf for this host (one CPU-only node, $SLURM_TEST_CPUS CPUs)
#    under $SLURM_TEST_DIR, nothing under /etc/slurm;
# 3. starts munged, slurmctld and slurmd, and stops them again on exit, however it exits;
# 4. submits the template unchanged (`sbatch --wait`, CPU-only settings given as
#    command-line options and environment, which override its #SBATCH lines), running
#    examples/train.py on 2 tasks per replica (JPP_REPLICAS=$SLURM_TEST_REPLICAS), once
#    for each launch method (srun, mpirun);
# 5. checks each job's state and output: a loss on every step and the jax.jit parity line.
#
# Settings (environment): SLURM_TEST_DIR (default /tmp/jaxpp_mpi_slurm), SLURM_TEST_CPUS
# (default: the tasks, at least 2), SLURM_TEST_LAUNCHERS (default "srun mpirun"),
# SLURM_TEST_TIMEOUT (seconds per job, default 300), SLURM_TEST_SCRIPT (the training
# script, default examples/train.py),
# SLURM_TEST_REPLICAS (pipeline replicas, default 1: 2 x R tasks; the node is declared
# with at least that many CPUs, more than it has if need be (config_overrides), and
# tasks that outnumber its cores run unbound: JPP_CPU_BIND=none).
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
dir=${SLURM_TEST_DIR:-/tmp/jaxpp_mpi_slurm}
launchers=${SLURM_TEST_LAUNCHERS:-srun mpirun}
job_timeout=${SLURM_TEST_TIMEOUT:-300}
script=${SLURM_TEST_SCRIPT:-$here/examples/train.py}
replicas=${SLURM_TEST_REPLICAS:-1}
tasks=$(( 2 * replicas ))
cpus=${SLURM_TEST_CPUS:-$(( tasks > 2 ? tasks : 2 ))}
bind=cores  # the template's JPP_CPU_BIND: none where the tasks outnumber the cores
(( tasks <= $(nproc) )) || bind=none
node=$(hostname -s)

say() { printf '[test-slurm] %s\n' "$*"; }
die() { printf '[test-slurm] FAIL: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (installs packages, starts munged/slurmctld/slurmd)"
[ -x "$here/.venv/bin/python" ] || die "no $here/.venv: run 'make install' first"

# 1. Packages.
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null \
    || [ ! -e /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so.2 ]; then
  say "installing slurm-wlm, munge, libpmix2 (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge libpmix2 >/dev/null
fi
# Slurm's mpi/pmix plugin dlopens <pmix2>/lib/libpmix.so; Debian ships only libpmix.so.2
# there (the unversioned name is in libpmix-dev, which would pull in a compiler toolchain).
pmixlib=/usr/lib/x86_64-linux-gnu/pmix2/lib
[ -e "$pmixlib/libpmix.so" ] || ln -s libpmix.so.2 "$pmixlib/libpmix.so"

# 2. Configuration, all under $dir.
rm -rf "$dir"
mkdir -p "$dir"/{state,spool,log,run,munge}
chown munge:munge "$dir/munge"
chmod 755 "$dir/munge"  # munged: socket dir must be searchable by all
cat > "$dir/slurm.conf" <<EOF
ClusterName=jaxppmpi
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=5
SlurmdParameters=config_overrides
MinJobAge=600
NodeName=$node CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=30 State=UP
EOF
export SLURM_CONF="$dir/slurm.conf"

# 3. Daemons, stopped on exit (by their own pid files: nothing else is touched).
stop_daemons() {
  local f pids=()
  for f in "$dir/run/slurmd.pid" "$dir/run/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
  done
  [ ${#pids[@]} = 0 ] && return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 30); do  # slurmctld saves its state first: wait until all are gone
    kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.5
  done
}
trap stop_daemons EXIT
say "starting munged, slurmctld, slurmd (config $SLURM_CONF)"
runuser -u munge -- /usr/sbin/munged --socket="$dir/munge/munge.socket.2" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
  --seed-file="$dir/munge/munged.seed"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 1
done
[ "$state" = idle ] || { tail -20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log"; die "node $node is '$state', not idle"; }
say "node $node idle: $(sinfo -h -o '%P %D %c %t')"

# 4-5. One job per launch method, each checked; every method runs even if one fails.
train_args="--schedule 1f1b --steps 2 --layers 2 --hidden 32 --heads 2 --seq 16 --vocab 64 --microbatches 4 --microbatch-size 2"
check_job() {  # launcher, output file, sbatch status
  local launcher=$1 out=$2 rc=$3 i n
  [ "$rc" = 0 ] || { echo "job failed (status $rc)"; return 1; }
  # Exactly one line per step: rank 0 of one 2-rank job printed it. Two copies would
  # mean two separate one-process runs (the MPI world not wired up).
  # (Both forms: `step   0  loss 5.5432 ...` and an aligned table row `    0    5.5432 ...`.)
  for i in 0 1; do
    n=$(grep -Ec "^ *(step +)?$i +(loss +)?[0-9]+\.[0-9]{4}( |\$)" "$out" || true)
    [ "$n" = 1 ] || { echo "$n loss lines for step $i, expected 1 (from rank 0)"; return 1; }
  done
  grep -Eq '^1f1b: 2 stages on 2 groups' "$out" || { echo "not 2 groups"; return 1; }
  if (( replicas > 1 )); then
    grep -Eq "^1f1b: 2 stages on 2 groups .* x $replicas replicas" "$out" \
      || { echo "not $replicas replicas"; return 1; }
  fi
  grep -Eq '^max \|loss - jax.jit loss\| over 2 steps: .*\(tolerance' "$out" \
    || { echo "no parity line"; return 1; }
  ! grep -q 'MISMATCH' "$out" || { echo "losses differ from jax.jit"; return 1; }
}
failed=()
for launcher in $launchers; do
  out="$dir/log/train-$launcher.out"
  say "sbatch launch/slurm/train.sbatch with JPP_LAUNCHER=$launcher"
  start=$(date +%s)
  set +e
  JPP_LAUNCHER=$launcher JPP_REPO="$here" JPP_SCRIPT="$script" JPP_TRAIN_ARGS="$train_args" \
  JPP_THREADS_PER_RANK=1 MPI4JAX_USE_CUDA_MPI=0 JPP_REPLICAS=$replicas JPP_CPU_BIND=$bind \
    timeout "$job_timeout" sbatch --wait --parsable --nodes=1 --ntasks-per-node="$tasks" \
      --cpus-per-task=1 --gpus-per-task=0 --time=10 --job-name="jpp-$launcher" \
      --output="$out" --chdir="$here" "$here/launch/slurm/train.sbatch" > "$dir/log/jobid"
  rc=$?
  set -e
  job=$(cat "$dir/log/jobid" 2>/dev/null || true)
  say "job ${job:-?} ended with status $rc after $(( $(date +%s) - start )) s; output $out"
  sed 's/^/    | /' "$out" 2>/dev/null || true
  if why=$(check_job "$launcher" "$out" "$rc"); then
    say "$launcher: OK"
  else
    say "$launcher: FAILED: $why"
    failed+=("$launcher")
  fi
done
[ ${#failed[@]} = 0 ] || die "launch method(s) failed: ${failed[*]}"
say "PASS"
