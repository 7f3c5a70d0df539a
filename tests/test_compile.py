"""Every kernel compiles for an NVIDIA Hopper GPU (sm_90) on a machine without one."""
import os
import pathlib
import subprocess
import sys

import pytest
import triton

PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_kernels_compile_for_hopper_and_rank_tiling_does_not_spill():
    script = pathlib.Path(__file__).with_name("hopper_compile.py")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOELORA_INTERPRET")}
    root = str(pathlib.Path(__file__).parents[1])       # the package, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.count("ok ") == 29
    assert "4 tiles of 128 -> {'regs'" in res.stdout
