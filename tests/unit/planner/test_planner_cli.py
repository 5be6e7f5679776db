"""`python -m jaxpp_mpi.schedules plan`: bad input is one line and status 2, before JAX."""

import subprocess
import sys

from jaxpp_mpi.schedules.__main__ import main


def test_bad_input_is_reported_on_one_line(capsys, tmp_path):
    assert main(["plan"]) == 2
    assert "error: the following arguments are required: model" in capsys.readouterr().err
    assert main(["plan", "model.py"]) == 2
    assert "FILE.py:FUNCTION" in capsys.readouterr().err
    assert main(["plan", f"{tmp_path}/none.py:inputs"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_viewer_still_takes_a_schedule(capsys):
    assert main(["GPipe", "--stages", "2", "--microbatches", "2"]) == 0
    assert capsys.readouterr().out.startswith("GPipe(num_stages=2) with 2 microbatches")


def test_a_bad_runtime_cost_is_refused_before_jax(capsys):
    assert main(["plan", "some_module:inputs", "--runtime-cost", "1,2"]) == 2
    assert "RUN_MS,MESSAGE_MS,FREE_MS" in capsys.readouterr().err
    assert main(["plan", "some_module:inputs", "--runtime-cost=-1,0,0"]) == 2
    assert "run_ms must be a finite number of ms >= 0" in capsys.readouterr().err


def test_bad_plan_arguments_load_no_jax():
    code = ("import sys; from jaxpp_mpi.schedules.__main__ import main; "
            "status = main(['plan', 'x']) + main(['plan', 'm:f', '--runtime-cost', '1']); "
            "sys.exit(10 + status if 'jax' in sys.modules "
            "else status)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 4
