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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_interpreter_off_without_a_gpu_says_which_variable():
    code = ("import moelora_lab\nprint(moelora_lab.describe())\n"
            "try:\n    moelora_lab.kernel_device()\nexcept RuntimeError as e:\n    print('raised:', e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"MOELORA_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    described, raised = res.stdout.strip().splitlines()
    assert "MOELORA_INTERPRET=0 turned the Triton interpreter off" in described
    assert raised.startswith("raised: MOELORA_INTERPRET=0 turned the Triton interpreter off, but no CUDA GPU")


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


# ---- several GPUs: kernels and streams follow the inputs' device -----------------------------------------

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs")


def second_gpu_problem(seed):
    return moelora_lab.make_problem("qwen3-30b-a3b", moelora_lab.LoRAShape(4, 16), 24, dtype=torch.bfloat16,
                                    device="cuda:1", seed=seed)


def with_current_gpu(index, fn):
    """fn() with GPU ``index`` current; the call must leave it current."""
    with torch.cuda.device(index):
        out = fn()
        assert torch.cuda.current_device() == index
    return out


@two_gpus
@pytest.mark.parametrize("path", ["one_shot", "two_kernel", "small_batch"])
def test_op_runs_on_the_inputs_gpu_not_the_current_one(path):
    p = second_gpu_problem(5)
    want = with_current_gpu(1, lambda: moelora_lab.moe_lora(**p.w13_lora_inputs(), path=path))
    got = with_current_gpu(0, lambda: moelora_lab.moe_lora(**p.w13_lora_inputs(), path=path))
    assert got.device == torch.device("cuda:1") and torch.equal(got, want)
    blocks = with_current_gpu(0, lambda: moelora_lab.block_list_device(p.topk_ids, p.token_lora, 128, 4, 16))
    spec = moelora_lab.block_list(p.topk_ids, p.token_lora, 128, 4, 16)
    assert all(a.device == torch.device("cuda:1") and torch.equal(a, b) for a, b in zip(blocks.tensors, spec.tensors))


@two_gpus
@pytest.mark.parametrize("schedule", ["sequential", "dual_stream", "fused"])
def test_layer_runs_on_the_inputs_gpu_not_the_current_one(schedule):
    p = second_gpu_problem(6)
    want = with_current_gpu(1, lambda: moelora_lab.moe_lora_layer(**p.layer_inputs(), schedule=schedule))
    torch.cuda.synchronize(1)
    for _ in range(20):                              # a race between the streams would move the result
        got = with_current_gpu(0, lambda: moelora_lab.moe_lora_layer(**p.layer_inputs(), schedule=schedule))
        assert torch.equal(got, want)
    ref = moelora_lab.moe_layer_reference(**p.layer_inputs())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_optional_module_names_what_needs_it_and_how_to_install():
    from moelora_lab._backend import optional_module
    assert optional_module("json", needed_for="x", install="y").dumps([]) == "[]"
    with pytest.raises(ImportError, match=r"^the thing needs no_such_pkg, which is not installed: pip install it$"):
        optional_module("no_such_pkg.sub", needed_for="the thing", install="pip install it")


def test_interpreter_breaks_with_numpy_2_4_under_triton_3_6(monkeypatch):
    import importlib.metadata

    import numpy as np

    from moelora_lab._backend import interpreter_breaks
    for triton, numpy, broken in (("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, t=triton: t)
        monkeypatch.setattr(np, "__version__", numpy)
        assert bool(interpreter_breaks()) == broken, (triton, numpy)
