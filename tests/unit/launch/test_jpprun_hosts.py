"""launch/jpprun on several hosts: hostfiles and host lists, ranks per host, binding and
GPUs decided for the busiest host, and the environment every remote rank is given by
name (pure: no MPI is started here; tests/hosts launches across hosts for real)."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.launch import hosts as launch_hosts
from jaxpp_mpi._src.launch import jpprun as launcher
from jaxpp_mpi._src.launch.hosts import HostSlots


def _plan(n, hosts, host_args=("--hostfile", "hf"), **kw):
    args = dict(threads_per_rank=1, mpirun="/v/bin/mpirun", vendor="openmpi", cores=2,
                is_root=False, base_env={})
    args.update(kw)
    return launcher.build_plan(n, ["python", "t.py"], hosts=hosts, host_args=host_args,
                               **args)


def test_hostfile_format():
    text = "# cluster\nh1 slots=2\n\nh2 slots=1 max_slots=4   # small\nh3\nh2 slots=1\n"
    assert launch_hosts.parse_hostfile(text) == [
        HostSlots("h1", 2), HostSlots("h2", 2), HostSlots("h3", None)]
    with pytest.raises(ValueError, match="hf:1: slots must be a positive integer"):
        launch_hosts.parse_hostfile("h1 slots=0\n", source="hf")
    with pytest.raises(ValueError, match="is not key=value"):
        launch_hosts.parse_hostfile("h1 2\n")
    with pytest.raises(ValueError, match="names no host"):
        launch_hosts.parse_hostfile("# nothing\n")


def test_host_list_format():
    assert launch_hosts.parse_host_list("h1:2,h2:2,h3") == [
        HostSlots("h1", 2), HostSlots("h2", 2), HostSlots("h3", 1)]
    with pytest.raises(ValueError, match="NAME or NAME:SLOTS"):
        launch_hosts.parse_host_list("h1:0")


def test_ranks_fill_each_host_s_slots_in_order():
    hosts = [HostSlots("h1", 1), HostSlots("h2", 2), HostSlots("h3", None)]
    assert launch_hosts.ranks_per_host(None, hosts, cores=4) == [1, 2, 4]
    assert launch_hosts.ranks_per_host(4, hosts, cores=4) == [1, 2, 1]
    assert launch_hosts.ranks_per_host(2, hosts, cores=4) == [1, 1, 0]
    with pytest.raises(ValueError, match="-n 8 is more than the 7 slots"):
        launch_hosts.ranks_per_host(8, hosts, cores=4)


def test_two_hosts_of_two_bind_cores_like_one_host_of_two():
    """4 ranks on 2 two-core hosts fit (2 per host): bound to cores, not oversubscribed."""
    plan = _plan(4, [HostSlots("h1", 2), HostSlots("h2", 2)])
    argv = plan.argv
    assert argv[:5] == ("/v/bin/mpirun", "-n", "4", "--hostfile", "hf")
    assert "--oversubscribe" not in argv and "slot:PE=1" in argv
    assert argv[argv.index("--bind-to") + 1] == "core"
    assert plan.layout == "4 ranks on 2 host(s): h1 2, h2 2"
    # The busiest host decides: 3 ranks on a two-core host are oversubscribed.
    argv = _plan(4, [HostSlots("h1", 1), HostSlots("h2", 3)]).argv
    assert "--oversubscribe" in argv and argv[argv.index("--bind-to") + 1] == "none"


def test_gpus_shared_per_host_not_per_job():
    """8 visible GPUs per host, 4 ranks on each of 2 hosts: 2 GPUs per rank (not 1)."""
    plan = _plan(8, [HostSlots("h1", 4), HostSlots("h2", 4)], gpus_per_rank=None,
                 visible_gpus=8, cores=8, python="/v/bin/python")
    assert dict(plan.env)["JAXPP_MPI_GPUS_PER_RANK"] == "2"
    with pytest.raises(ValueError, match="need 10 GPUs, 8 visible"):
        _plan(6, [HostSlots("h1", 1), HostSlots("h2", 5)], gpus_per_rank=2,
              visible_gpus=8, cores=8)


def test_remote_ranks_get_every_variable_jpprun_sets_and_the_user_s_settings():
    base = {"XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu",
            "JAXPP_MPI_STEP_TIMEOUT": "30", "MPI4JAX_USE_CUDA_MPI": "0",
            "PYTHONPATH": "/src", "JAXPP_MPI_LOCAL_RANK": "0", "HOME": "/root",
            "CUDA_VISIBLE_DEVICES": "0,1"}
    plan = _plan(4, [HostSlots("h1", 2), HostSlots("h2", 2)], base_env=base)
    named = {b for a, b in zip(plan.argv, plan.argv[1:]) if a == "-x"}
    assert set(dict(plan.env)) <= named
    assert {"XLA_FLAGS", "JAX_PLATFORMS", "JAXPP_MPI_STEP_TIMEOUT",
            "MPI4JAX_USE_CUDA_MPI", "PYTHONPATH"} <= named
    # Facts of one process or one host are not forced onto the others.
    assert not named & {"JAXPP_MPI_LOCAL_RANK", "HOME", "CUDA_VISIBLE_DEVICES"}
    assert sum(1 for a in plan.argv if a == "XLA_FLAGS") == 1  # named once


def test_user_mapping_replaces_jpprun_s():
    argv = _plan(4, [HostSlots("h1", 2), HostSlots("h2", 2)],
                 extra_mpi_args=["--map-by", "node"]).argv
    assert argv.count("--map-by") == 1 and argv[argv.index("--map-by") + 1] == "node"
    assert argv[argv.index("--bind-to") + 1] == "core"


def test_hydra_gets_its_own_host_list():
    argv = _plan(4, [HostSlots("h1", 2), HostSlots("h2", None)], vendor="mpich",
                 cores=4).argv
    assert ("-hosts", "h1:2,h2:4") in zip(argv, argv[1:])
    assert "--hostfile" not in argv


def test_command_line_hosts_and_default_rank_count(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")
    rc = launcher.main(["--hostfile", str(hostfile), "--mpirun", "/bin/false", "--dry-run",
                        "python", "t.py"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "4 ranks on 2 host(s): h1 2, h2 2" in err
    assert f"-n 4 --hostfile {hostfile}" in err
    rc = launcher.main(["--host", "a:1,b:3", "-n", "3", "--mpirun", "/bin/false",
                        "--dry-run", "python", "t.py"])
    err = capsys.readouterr().err
    assert rc == 0 and "-n 3 --host a:1,b:3" in err and "3 ranks on 2 host(s): a 1, b 2" in err


def test_command_line_refusals(tmp_path, capsys):
    assert launcher.main(["--mpirun", "/bin/false", "--dry-run", "python", "t.py"]) == 2
    assert "-n N is required" in capsys.readouterr().err
    assert launcher.main(["--hostfile", str(tmp_path / "none"), "--mpirun", "/bin/false",
                          "--dry-run", "python", "t.py"]) == 2
    assert "cannot read --hostfile" in capsys.readouterr().err
    assert launcher.main(["--host", "a:1", "-n", "2", "--mpirun", "/bin/false",
                          "--dry-run", "python", "t.py"]) == 2
    assert "-n 2 is more than the 1 slots" in capsys.readouterr().err
