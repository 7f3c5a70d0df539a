"""The one-shot kernel built each way (``experiments.one_shot_builds``, timed by ``bench expand``) against the spec."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.experiments.one_shot_builds import OneShotBuild, moe_lora_built
from moelora_lab.op.dispatch import choose_config
from moelora_lab.routing.device import make_blocks
from utils import assert_close, lora_case

BUILDS = [dict(both_slices=True), dict(prefetch_out=True, expand_stages=1), dict(clamp_ranks=True, prefetch_out=False),
          dict(prefetch_out=False, expand_stages=0), dict(), dict(both_slices=True, clamp_ranks=True, expand_stages=2)]


def op_inputs(device, rank=12, lora_ranks=None):
    """w13 (token rows, two slices, no routing weight) and w2 (pair rows, one slice, routing weights) of one
    problem with tokens without an adapter."""
    p = lora_case(7, device=device, seed=3, rank=rank, no_adapter_fraction=0.3)
    h = torch.randn(p.topk_ids.numel(), p.w2_lora_a[0].shape[-1], generator=torch.Generator().manual_seed(1))
    w2 = dict(x=h.to(device), topk_ids=p.topk_ids, topk_weights=p.topk_weights, token_lora=p.token_lora,
              lora_a=p.w2_lora_a, lora_b=p.w2_lora_b)
    return p, [(p.w13_lora_inputs(), False), (w2, True)]


def blocks_and_config(inputs, device):
    M, k = inputs["topk_ids"].shape
    L, E, R, K = inputs["lora_a"][0].shape
    N, S = inputs["lora_b"][0].shape[2], len(inputs["lora_a"])
    cfg = choose_config("one_shot", M * k, min(M * k, L * E), N, S, torch.device(device), rank=R)
    return make_blocks(inputs["topk_ids"], inputs["token_lora"], E, L, cfg.block_m), cfg


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_computes_the_reference(device, build):
    """Each way of building the one-shot kernel gives the reference's answer into a poisoned output and
    leaves the rows of tokens without an adapter alone, on both ops (w2: one slice, so both_slices
    changes nothing there), with a rank that is not a power of two."""
    p, cases = op_inputs(device)
    for inputs, mul in cases:
        want = ml.moe_lora_reference(**inputs, mul_routed_weight=mul)
        blocks, cfg = blocks_and_config(inputs, device)
        got = moe_lora_built(OneShotBuild(**build), **inputs, output=torch.full_like(want, float("nan")),
                             blocks=blocks, config=cfg, mul_routed_weight=mul, add_inputs=False)
        owned = p.token_lora >= 0                    # rows of tokens without an adapter are left as they were
        assert bool(owned.any()) and bool((~owned).any()) and bool(got[~owned].isnan().all())
        assert_close(got[owned], want[owned], torch.float32)


@pytest.mark.parametrize("build", [dict(), dict(both_slices=True, clamp_ranks=True)])
def test_builds_add_into_the_output_and_read_only_each_slots_rank(device, build):
    """add_inputs=True adds the delta to what the output held; per-slot ranks read no weight past a slot's
    rank (NaN there would poison the output) over rank tiles narrower than r."""
    _, cases = op_inputs(device, rank=40)
    ranks = torch.tensor([40, 3, 17], dtype=torch.int32)
    for inputs, mul in cases:
        nan_past = dict(inputs)
        for name, axis in (("lora_a", 2), ("lora_b", 3)):
            ws = [w.clone() for w in inputs[name]]
            for w in ws:
                for slot, r in enumerate(ranks.tolist()):
                    w[slot].narrow(axis - 1, r, w.shape[axis] - r).fill_(float("nan"))
            nan_past[name] = ws
        cut = {n: [w.nan_to_num(0.0) for w in nan_past[n]] for n in ("lora_a", "lora_b")}
        want = ml.moe_lora_reference(**dict(inputs, **cut), mul_routed_weight=mul)
        blocks, cfg = blocks_and_config(inputs, device)
        start = torch.randn(want.shape, generator=torch.Generator().manual_seed(4)).to(device)
        got = moe_lora_built(OneShotBuild(**build), **nan_past, output=start.clone(), blocks=blocks,
                             config=cfg.replace(max_block_r=16), mul_routed_weight=mul,
                             lora_ranks=ranks.to(device))
        assert_close(got, start + want, torch.float32)


def test_the_default_build_is_the_products(device):
    """Built as the product builds it, the experiment's kernel computes what ``moe_lora(path="one_shot")`` does,
    bit for bit."""
    _, cases = op_inputs(device)
    for inputs, mul in cases:
        blocks, cfg = blocks_and_config(inputs, device)
        want = ml.moe_lora(**inputs, path="one_shot", mul_routed_weight=mul, blocks=blocks, config=cfg)
        got = moe_lora_built(OneShotBuild(), **inputs, output=torch.zeros_like(want), blocks=blocks, config=cfg,
                             mul_routed_weight=mul)
        assert torch.equal(got, want)


def test_build_refuses_what_it_cannot_build():
    with pytest.raises(TypeError, match="unexpected keyword argument 'stages'"):
        OneShotBuild(stages=2)
    with pytest.raises(TypeError, match="OneShotBuild: both_slices must be True or False, got 1"):
        OneShotBuild(both_slices=1)
    with pytest.raises(TypeError, match="OneShotBuild: prefetch_out must be True or False or None \\(the rule\\)"):
        OneShotBuild(prefetch_out="yes")
    with pytest.raises(ValueError, match="expand_stages"):
        OneShotBuild(expand_stages=-1)
