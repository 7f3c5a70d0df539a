import os
import subprocess
import sys

import pytest
import torch

import moelora_lab


def _probe(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MOELORA_INTERPRET", "TRITON_INTERPRET")}
    env.update(env_extra)
    code = "import os, moelora_lab; print(moelora_lab.INTERPRET, os.environ.get('TRITON_INTERPRET'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_switch_overrides():
    on = _probe({"MOELORA_INTERPRET": "1"})
    assert on.stdout.split() == ["True", "1"]
    off = _probe({"MOELORA_INTERPRET": "0"})
    assert off.stdout.split() == ["False", "0"]
    bad = _probe({"MOELORA_INTERPRET": "yes"})
    assert bad.returncode != 0 and "MOELORA_INTERPRET: 'yes' is not accepted" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_cpu_default_is_the_interpreter():
    auto = _probe({})
    assert auto.stdout.split() == ["True", "1"]
    assert moelora_lab.INTERPRET and "interpreter" in moelora_lab.describe()
    assert moelora_lab.kernel_device().type == "cpu"
