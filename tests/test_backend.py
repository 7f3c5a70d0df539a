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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only switched on without a GPU")
def test_triton_imported_first_fails_with_the_fix():
    env = {k: v for k, v in os.environ.items() if k not in ("MOELORA_INTERPRET", "TRITON_INTERPRET")}
    code = "import triton, moelora_lab"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "moelora_lab must be imported before triton" in res.stderr
    ok = subprocess.run([sys.executable, "-c", code], env=env | {"MOELORA_INTERPRET": "1", "TRITON_INTERPRET": "1"},
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_public_api():
    for name in ("moe_lora", "moe_lora_layer", "block_list", "block_list_device", "KernelConfig", "make_problem"):
        assert hasattr(moelora_lab, name)
