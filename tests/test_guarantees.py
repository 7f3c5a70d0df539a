"""The guarantees of the layer and the op, on every schedule, join and path (the interpreter on the CPU; with
``--gpu`` the same tests run on the GPU):

* strides: any view of every input (transposed, every other element, padded rows, int64 ids) gives the
  result of the contiguous inputs: bit for bit under the interpreter; on a GPU within rounding (a kernel
  compiled for other strides may lay out, and so sum, its elements in another order);
* NaN isolation: memory nothing may read holds NaN (slots no token uses, experts no pair goes to, A rows and
  B columns past a slot's ``lora_ranks``, every buffer until it is written) and the output is still right;
* neutrality: a token without an adapter gets bit-identical output to the layer without LoRA, on every
  schedule and join, whatever the other tokens' adapters are;
* threads: two threads running the op and the layer at once each get their own answer;
* every 1-D tensor a kernel reads element by element (ptr + i) reaches it contiguous.
"""
import threading
import warnings

import pytest
import torch

import moelora_lab as ml
from moelora_lab._backend import INTERPRET
from moelora_lab.layer import AUTO, choices, get_schedule
from moelora_lab.op.paths import PATH_CHOICES
from utils import STRIDED_KINDS, assert_close, poisoned_allocations, strided_inputs

SHAPE = ml.MoEShape(40, 24, 5, 2, "guarantees")       # H, I not multiples of any block; E = 5
L, R = 4, 8
RANKS = [8, 3, 0, 5]                                   # slot 2 has rank 0; slot 3 is used by no token
LORA_KEYS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


def runs():
    """(schedule, join) of every schedule and every join it runs."""
    return [(s, j) for s in choices() for j in (("fold",) if s == AUTO else get_schedule(s).joins)]


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def problem(device, dtype=torch.float32, M=9, seed=3):
    """Layer inputs where slot 3 and expert 4 are used by nobody, a third of the tokens have no adapter."""
    p = ml.make_problem(SHAPE, ml.LoRAShape(L, R), M, dtype=dtype, device=device, seed=seed,
                        no_adapter_fraction=0.3)
    kw = p.layer_inputs()
    kw["token_lora"] = torch.where(kw["token_lora"] == 3, 1, kw["token_lora"])
    kw["topk_ids"] = torch.where(kw["topk_ids"] == 4, (kw["topk_ids"] + 1) % 4, kw["topk_ids"])
    assert (kw["token_lora"] < 0).any() and (kw["token_lora"] >= 0).any()
    return kw


def layer(kw, schedule, join="fold", **extra):
    """moe_lora_layer with ``schedule``; the rows that need a pack and auto get the weights packed for LoRA in K."""
    if (schedule == "auto" or ml.layer.SCHEDULES[schedule].needs_pack) and kw.get("w13_lora_b") is not None:
        pack = ml.pack_in_k(kw["w13"], kw["w2"], kw["w13_lora_b"], kw["w2_lora_b"])
        kw = dict(kw, w13=pack.w13, w2=pack.w2)
        extra["in_k"] = pack
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)        # dual_stream on the CPU runs sequentially
        return ml.moe_lora_layer(**kw, schedule=schedule, join=join, **extra)


def poison_unread(kw, ranks):
    """NaN in every weight nothing may read: slot 3 (no token), expert 4 (no pair), ranks past ``ranks``."""
    out = dict(kw)
    for key in LORA_KEYS:
        ws = [w.clone() for w in kw[key]]
        for w in ws:
            w[3], w[:, 4] = float("nan"), float("nan")
            for slot, r in enumerate(ranks):
                if key.endswith("_a"):
                    w[slot, :, r:] = float("nan")
                else:
                    w[slot, :, :, r:] = float("nan")
        out[key] = ws
    for key in ("w13", "w2"):
        out[key] = kw[key].clone()
        out[key][4] = float("nan")
    return out


def cut_to_ranks(kw, ranks):
    """The spec's weights: zeros past each slot's rank."""
    out = dict(kw)
    for key in LORA_KEYS:
        ws = [w.clone() for w in kw[key]]
        for w in ws:
            for slot, r in enumerate(ranks):
                if key.endswith("_a"):
                    w[slot, :, r:] = 0
                else:
                    w[slot, :, :, r:] = 0
        out[key] = ws
    return out


def plain(kw):
    return {k: v for k, v in kw.items() if k not in LORA_KEYS}


# ---- strides -------------------------------------------------------------------------------------


def same_output(got, want, what, device):
    """Bit for bit under the interpreter; within fp32 rounding on a GPU (see the module docstring)."""
    if device == "cuda":
        assert_close(got, want, torch.float32)
    else:
        assert torch.equal(got, want), f"{what}: max error {(got - want).abs().max()}"


class audited:
    """While active, records every 1-D tensor of more than one element that reaches a kernel with a stride
    other than 1 (the kernels read such vectors, routing ids, adapters, ranks, weights, at ptr + i). Under the
    interpreter only: on a GPU it records nothing."""

    def __enter__(self):
        self.found = []
        if not INTERPRET:
            return self
        from triton.runtime.interpreter import InterpretedFunction

        self.cls, self.run = InterpretedFunction, InterpretedFunction.run
        audit = self

        def run(fn, *args, **kwargs):
            for i, a in enumerate(list(args) + list(kwargs.values())):
                if isinstance(a, torch.Tensor) and a.dim() == 1 and a.numel() > 1 and a.stride(0) != 1:
                    audit.found.append(f"{fn.__name__} argument {i}: stride {a.stride(0)}")
            return audit.run(fn, *args, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        if INTERPRET:
            self.cls.run = self.run
        return False


@pytest.mark.parametrize("schedule, join", runs())
def test_every_schedule_takes_any_view_of_every_input(device, schedule, join):
    kw = problem(device)
    kw["topk_ids"] = kw["topk_ids"].long()
    ranks = torch.tensor(RANKS, device=device)
    want = layer(kw, schedule, join, lora_ranks=ranks)
    for how in STRIDED_KINDS:
        views = strided_inputs(kw, how)
        with audited() as audit:
            got = layer(views, schedule, join, lora_ranks=strided_inputs(dict(r=ranks), how)["r"])
        assert not audit.found, f"{schedule}/{join}, {how} views: {audit.found}"
        same_output(got, want, f"{schedule}/{join}, {how} views", device)


def test_broadcast_routing_views(device):
    # stride-0 views (every token the same adapter and the same weights): read-only inputs may overlap themselves
    kw = problem(device, M=6)
    M, k = kw["topk_ids"].shape
    for lora in (1,):
        views = dict(kw, token_lora=torch.tensor(lora, device=device).expand(M),
                     topk_weights=kw["topk_weights"][:1].expand(M, k))
        dense = dict(views, token_lora=views["token_lora"].contiguous(), topk_weights=views["topk_weights"].contiguous())
        for schedule, join in runs():
            same_output(layer(views, schedule, join), layer(dense, schedule, join), f"{schedule}/{join}", device)


@pytest.mark.parametrize("rows", ["token", "pair"])
def test_every_path_takes_any_view_of_every_input(device, rows):
    p = ml.make_problem(SHAPE, ml.LoRAShape(L, R), 7, device=device, seed=5, no_adapter_fraction=0.3,
                        with_base=False)
    M, k = p.topk_ids.shape
    g = torch.Generator().manual_seed(1)
    x = p.x if rows == "token" else torch.randn(M * k, 24, generator=g).to(device)
    lora_a = list(p.w13_lora_a) if rows == "token" else [torch.randn(L, 5, R, 24, generator=g).to(device)]
    lora_b = list(p.w13_lora_b) if rows == "token" else [torch.randn(L, 5, 40, R, generator=g).to(device)]
    kw = dict(x=x, topk_ids=p.topk_ids.long(), topk_weights=p.topk_weights, token_lora=p.token_lora,
              lora_a=lora_a, lora_b=lora_b, lora_ranks=torch.tensor(RANKS, device=device),
              enabled=torch.tensor([True, False, True, True], device=device))
    for path in PATH_CHOICES:
        want = ml.moe_lora(**kw, path=path, mul_routed_weight=True)
        for how in STRIDED_KINDS:
            with audited() as audit:
                got = ml.moe_lora(**strided_inputs(kw, how), path=path, mul_routed_weight=True)
            assert not audit.found, f"{path}, {how} views: {audit.found}"
            if path == "reference":             # torch's matmuls may round another way for another layout
                assert_close(got, want, torch.float32)
            else:
                same_output(got, want, f"{path}, {how} views", device)


# ---- NaN isolation and neutrality ----------------------------------------------------------------


@pytest.mark.parametrize("schedule, join", runs())
def test_nothing_unread_reaches_the_output_and_tokens_without_an_adapter_are_untouched(device, schedule, join):
    for dtype in dtypes(device):
        kw = problem(device, dtype)
        ranks = torch.tensor(RANKS, device=device)
        want = ml.moe_layer_reference(**cut_to_ranks(kw, RANKS))
        base = ml.moe_lora_layer(**plain(kw))
        with poisoned_allocations():
            got = layer(poison_unread(kw, RANKS), schedule, join, lora_ranks=ranks)
        assert_close(got, want, dtype)
        none = kw["token_lora"] < 0
        assert torch.equal(got[none], base[none]), f"{schedule}/{join} {dtype}: a token without an adapter changed"


def test_neutrality_holds_whatever_the_adapters_hold(device):
    # the tokens without an adapter, bit for bit, with adapters of any size (even huge values) around them
    kw = problem(device, torch.float16)
    base = ml.moe_lora_layer(**plain(kw))
    none = kw["token_lora"] < 0
    for scale in (1.0, 1e3):
        loud = dict(kw, **{key: [w * scale for w in kw[key]] for key in LORA_KEYS})
        for schedule, join in runs():
            y = layer(loud, schedule, join)
            assert torch.equal(y[none], base[none]), f"{schedule}/{join} at scale {scale}"


@pytest.mark.parametrize("path", PATH_CHOICES)
def test_no_path_reads_what_it_should_not(device, path):
    kw = problem(device)
    ranks = torch.tensor(RANKS, device=device)
    bad = poison_unread(kw, RANKS)
    clean = cut_to_ranks(kw, RANKS)
    args = dict(x=kw["x"], topk_ids=kw["topk_ids"], topk_weights=kw["topk_weights"], token_lora=kw["token_lora"])
    want = ml.moe_lora_reference(**args, lora_a=clean["w13_lora_a"], lora_b=clean["w13_lora_b"])
    with poisoned_allocations():
        out = torch.full_like(want, float("nan"))
        ml.moe_lora(**args, lora_a=bad["w13_lora_a"], lora_b=bad["w13_lora_b"], path=path, output=out,
                    add_inputs=False, lora_ranks=ranks)
    owned = kw["token_lora"] >= 0
    assert_close(out[owned], want[owned], torch.float32)
    assert torch.isnan(out[~owned]).all(), f"{path}: rows of tokens without an adapter were written"


# ---- threads -------------------------------------------------------------------------------------


def _in_threads(jobs, device):
    """Run each job in its own thread (on its own CUDA stream on a GPU), all at once; their results."""
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def work(i):
        try:
            stream = torch.cuda.Stream() if device == "cuda" else None
            start.wait()
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                results[i] = [job() for job in jobs[i]]
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:            # noqa: BLE001 -- reported below, with the thread's number
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_two_threads_each_get_their_own_answer(device):
    problems = [problem(device, M=6 + 3 * i, seed=10 + i) for i in range(2)]
    op = [dict(x=p["x"], topk_ids=p["topk_ids"], topk_weights=p["topk_weights"], token_lora=p["token_lora"],
               lora_a=p["w13_lora_a"], lora_b=p["w13_lora_b"]) for p in problems]
    schedules = ["sequential", "dual_stream", "in_k"]
    want = [[ml.moe_lora(**op[i], path="one_shot")] + [layer(problems[i], s) for s in schedules] for i in range(2)]
    jobs = [[lambda i=i: ml.moe_lora(**op[i], path="one_shot")] + [lambda i=i, s=s: layer(problems[i], s)
                                                                   for s in schedules] for i in range(2)]
    for attempt in range(2):
        got = _in_threads(jobs, device)
        for i in range(2):
            for name, g, w in zip(["op"] + schedules, got[i], want[i]):
                assert torch.equal(g, w), f"thread {i}, {name}: max error {(g - w).abs().max()}"

