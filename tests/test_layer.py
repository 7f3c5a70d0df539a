"""The MoE layer with LoRA against the reference, and the two schedules against each other."""
import warnings

import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import moe_lora_layer, plan_layer
from utils import TOL, check_layer_schedule

SHAPE = ml.MoEShape(48, 40, 6, 2, "layer-test")


def problem(device, dtype=torch.float32, M=9, seed=1, rank=8, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)


def close(y, ref, dtype):
    assert not torch.isnan(y).any()
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.parametrize("join", ["fold", "vllm"])
def test_layer_matches_reference(device, join):
    for dtype in dtypes(device):
        p = problem(device, dtype, no_adapter_fraction=0.3, seed=2)
        ref = ml.moe_layer_reference(**p.layer_inputs())
        y = moe_lora_layer(**p.layer_inputs(), join=join, schedule="sequential")
        assert y.shape == (9, SHAPE.hidden) and y.dtype == dtype
        close(y, ref, dtype)


@pytest.mark.parametrize("schedule", ["sequential", "dual_stream", "fused", "epilogue", "in_join"])
def test_layer_with_packed_lora_b(device, schedule):
    """LoRA B stored N-fastest (pack_lora_b): same values, other strides; every schedule reads it."""
    for dtype in dtypes(device):
        p = problem(device, dtype, no_adapter_fraction=0.3, seed=4)
        inputs = p.layer_inputs()
        ref = ml.moe_layer_reference(**inputs)
        packed = {n: ml.pack_lora_b(inputs[n]) for n in ("w13_lora_b", "w2_lora_b")}
        assert packed["w2_lora_b"][0].stride(2) == 1 and torch.equal(packed["w2_lora_b"][0], inputs["w2_lora_b"][0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # the CPU says dual_stream runs on one stream
            close(moe_lora_layer(**(inputs | packed), schedule=schedule), ref, dtype)


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {})])
def test_fused_layer_matches_reference(device, rank, M, kw):
    """The LoRA computed inside the grouped GEMMs: no LoRA kernels, no delta buffers, no join."""
    check_layer_schedule(device, "fused", SHAPE, rank, M, rank + M, **kw)


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {})])
def test_epilogue_layer_matches_reference(device, rank, M, kw):
    """Each op shrinks once per pair (the two-kernel path's shrink) and expands in its GEMM's epilogue."""
    check_layer_schedule(device, "epilogue", SHAPE, rank, M, rank + M + 1, **kw)


def test_epilogue_layer_with_actual_adapter_ranks_and_its_plan(device):
    p = problem(device, rank=16, seed=13, adapter_ranks=(3, 16, 5), no_adapter_fraction=0.3)
    ranks = torch.tensor(p.adapter_ranks, device=device)
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 16, schedule="epilogue")
    assert plan.schedule == "epilogue" and plan.lora_path == "two_kernel" and plan.lora_blocks is not None
    out = moe_lora_layer(**p.layer_inputs(), lora_ranks=ranks, schedule="epilogue", plan=plan)
    close(out, ml.moe_layer_reference(**p.layer_inputs()), torch.float32)
    with pytest.raises(TypeError, match="plan: made for another schedule"):
        moe_lora_layer(**p.layer_inputs(), plan=plan, schedule="fused")
    with pytest.raises(ValueError, match="join: 'vllm' has no meaning with schedule='epilogue'"):
        moe_lora_layer(**p.layer_inputs(), schedule="epilogue", join="vllm")
    wide = problem(device, rank=48, seed=11)
    with pytest.raises(ValueError, match="schedule='epilogue': its LoRA needs L\\*r <= 128"):
        moe_lora_layer(**wide.layer_inputs(), schedule="epilogue")


def test_auto_schedule_and_fused_limits(device):
    from moelora_lab.layer import gpu_schedule, resolve_schedule
    E = SHAPE.num_experts
    dev = torch.device(device)
    assert {gpu_schedule(p, E) for p in (0, 1, 32 * E, 512 * E)} == {"dual_stream"}          # on any machine
    with pytest.raises(ValueError, match="num_experts"):
        gpu_schedule(8, 0)
    for pairs in (1, 512 * E):
        for L, r in ((3, 8), (3, 48)):                  # the experiments' L*r limit does not bind auto
            assert resolve_schedule("auto", dev, num_pairs=pairs, num_experts=E, num_loras=L, rank=r) == (
                "dual_stream" if device == "cuda" else "sequential")
    assert resolve_schedule("fused", dev, num_loras=3, rank=8) == "fused"
    with pytest.raises(ValueError, match="schedule='fused': its LoRA needs L\\*r <= 128"):
        resolve_schedule("fused", dev, num_loras=3, rank=48)
    p = problem(device, rank=48, seed=11)              # 3 adapters x rank 48: 256 stacked columns
    with pytest.raises(ValueError, match="schedule='fused': its LoRA needs L\\*r <= 128"):
        moe_lora_layer(**p.layer_inputs(), schedule="fused")
    q = problem(device, rank=8, seed=11)
    with pytest.raises(ValueError, match="join: 'vllm' has no meaning with schedule='fused'"):
        moe_lora_layer(**q.layer_inputs(), schedule="fused", join="vllm")
    plan = plan_layer(p.topk_ids, p.token_lora, E, 3, 48)
    assert plan.schedule != "fused" and plan.lora_blocks is not None
    close(moe_lora_layer(**p.layer_inputs(), plan=plan), ml.moe_layer_reference(**p.layer_inputs()), torch.float32)


def test_fused_layer_with_actual_adapter_ranks(device):
    p = problem(device, rank=16, seed=12, adapter_ranks=(3, 16, 8))
    ranks = torch.tensor(p.adapter_ranks, device=device)
    close(moe_lora_layer(**p.layer_inputs(), lora_ranks=ranks, schedule="fused"),
          ml.moe_layer_reference(**p.layer_inputs()), torch.float32)


def test_layer_without_lora_is_the_base_layer(device):
    p = problem(device, seed=3)
    inputs = p.layer_inputs()
    zero_lora = dict(inputs, w13_lora_b=[torch.zeros_like(t) for t in p.w13_lora_b],
                     w2_lora_b=[torch.zeros_like(p.w2_lora_b[0])])
    ref = ml.moe_layer_reference(**zero_lora)
    base = {k: v for k, v in inputs.items() if "lora_" not in k}
    close(moe_lora_layer(**base), ref, torch.float32)


@pytest.mark.parametrize("rank", [4, 48])
def test_sequential_equals_dual_stream_bitwise(device, rank):
    p = problem(device, rank=rank, M=12, seed=4, no_adapter_fraction=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        seq = moe_lora_layer(**p.layer_inputs(), schedule="sequential")
        duals = [moe_lora_layer(**p.layer_inputs(), schedule="dual_stream", side_priority=prio)
                 for prio in ("highest", "default")]
    assert all(torch.equal(seq, dual) for dual in duals)       # the side stream's priority changes timing only
    close(seq, ml.moe_layer_reference(**p.layer_inputs()), torch.float32)


def test_layer_with_actual_adapter_ranks(device):
    p = problem(device, rank=16, seed=10, adapter_ranks=(3, 16, 8))
    ref = ml.moe_layer_reference(**p.layer_inputs())
    ranks = torch.tensor(p.adapter_ranks, device=device)
    close(moe_lora_layer(**p.layer_inputs(), lora_ranks=ranks), ref, torch.float32)
    with pytest.raises(ValueError, match="lora_ranks: expected shape \\(3,\\)"):
        moe_lora_layer(**p.layer_inputs(), lora_ranks=ranks[:2])


def test_plan_picks_the_lora_path_by_the_real_ranks(device):
    p = problem(device, seed=5)
    E = SHAPE.num_experts
    assert plan_layer(p.topk_ids, p.token_lora, E, 3, 128).lora_path == "two_kernel"        # by r = 128
    ranks = torch.tensor([8, 4, 16])                                                         # on the CPU: read
    plan = plan_layer(p.topk_ids, p.token_lora, E, 3, 128, lora_ranks=ranks, schedule="sequential")
    assert plan.lora_path == "one_shot"                                                      # by r = 16, 18 pairs
    with pytest.raises(ValueError, match="lora_ranks: expected shape \\(3,\\)"):
        plan_layer(p.topk_ids, p.token_lora, E, 3, 128, lora_ranks=ranks[:2])


def test_a_plan_for_two_streams_picks_the_path_by_the_side_stream_rule(device):
    """40 pairs at r 8: one-shot on one stream (``choose_path``), two kernels beside the base GEMMs
    (``choose_side_path``); ``auto`` plans for two streams where it runs them (on a GPU)."""
    from moelora_lab.op.dispatch import choose_path, choose_side_path

    p = problem(device, M=20, seed=5)
    E, I, P = SHAPE.num_experts, SHAPE.intermediate, p.topk_ids.numel()
    assert choose_path(P, E, 3, 8, I) == "one_shot" and choose_side_path(P, E, 3, 8, I) == "two_kernel"
    paths = {s: plan_layer(p.topk_ids, p.token_lora, E, 3, 8, intermediate=I, schedule=s).lora_path
             for s in ("sequential", "dual_stream", "auto")}
    two = device == "cuda" and not ml.INTERPRET
    assert paths == {"sequential": "one_shot", "dual_stream": "two_kernel", "auto": "two_kernel" if two else "one_shot"}
    ref = ml.moe_layer_reference(**p.layer_inputs())
    for s in ("sequential", "dual_stream"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)          # CPU: two streams run as one
            close(moe_lora_layer(**p.layer_inputs(), schedule=s), ref, torch.float32)


def test_two_streams_ask_for_the_side_streams_tiles(device, monkeypatch):
    """With two streams the layer's LoRA launches ask the tile rule for the side stream's tiles (``side_stream``:
    fewer one-shot programs beside the base GEMMs) for w13 (I columns, 2 slices) and w2 (H, 1), on either path;
    on one stream they ask for the op's."""
    import moelora_lab.layer.face as face
    import moelora_lab.layer.two_kernel as two_kernel
    import moelora_lab.op.paths as paths_module

    asked = []
    rule, streams = paths_module.choose_config, two_kernel.Streams
    monkeypatch.setattr(paths_module, "choose_config",
                        lambda *a, **kw: asked.append((a[0], a[3], a[4], kw)) or rule(*a, **kw))
    # the schedule as asked, as if streams ran, its launches on one stream (the CPU has no streams; on a GPU
    # the same kernels)
    monkeypatch.setattr(face, "resolve_schedule", lambda schedule, device, **kw: schedule)
    monkeypatch.setattr(face, "_streams_run", lambda device: True)
    monkeypatch.setattr(two_kernel, "Streams", lambda dual, *a, **kw: streams(False, *a, **kw))
    p = problem(device, seed=5)
    ref = ml.moe_layer_reference(**p.layer_inputs())
    P, H, I = p.topk_ids.numel(), SHAPE.hidden, SHAPE.intermediate
    for schedule, path in (("sequential", "one_shot"), ("dual_stream", "one_shot"), ("dual_stream", "two_kernel"),
                           ("sequential", "two_kernel")):
        asked.clear()
        close(moe_lora_layer(**p.layer_inputs(), schedule=schedule, lora_path=path), ref, torch.float32)
        side = dict(rank=8, side_stream=schedule == "dual_stream")
        assert asked == [(path, I, 2, side), (path, H, 1, side)], (schedule, path, P)


def test_plan_is_reused_and_validated(device):
    p = problem(device, seed=5)
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, intermediate=SHAPE.intermediate)
    y = moe_lora_layer(**p.layer_inputs(), plan=plan)
    assert torch.equal(y, moe_lora_layer(**p.layer_inputs()))
    base_plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, None, None)
    with pytest.raises(ValueError, match="token_lora: value 2 is out of range"):
        plan_layer(p.topk_ids, p.token_lora.clamp(min=0) * 0 + 2, SHAPE.num_experts, 2, 8)
    with pytest.raises(TypeError, match="plan: expected a LayerPlan"):
        moe_lora_layer(**p.layer_inputs(), plan="plan")
    with pytest.raises(ValueError, match="plan: made for a layer without LoRA, but this call is with 3 adapters"):
        moe_lora_layer(**p.layer_inputs(), plan=base_plan, schedule="sequential")
    fused_plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, schedule="fused")
    assert fused_plan.lora_blocks is None and fused_plan.lora_path is None and fused_plan.schedule == "fused"
    with pytest.raises(TypeError, match="plan: made for another schedule"):
        moe_lora_layer(**p.layer_inputs(), plan=fused_plan, schedule="sequential")
    assert torch.equal(moe_lora_layer(**p.layer_inputs(), plan=fused_plan, schedule="fused"),
                       moe_lora_layer(**p.layer_inputs(), schedule="fused"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_cpu_dual_stream_says_it_runs_sequentially():
    p = problem("cpu", seed=6)
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):
        moe_lora_layer(**p.layer_inputs(), schedule="dual_stream")
    with pytest.raises(TypeError, match="bfloat16 is mis-computed by the Triton interpreter"):
        q = problem("cpu", torch.bfloat16, seed=6)
        moe_lora_layer(**q.layer_inputs())


@pytest.mark.parametrize("change, exc, match", [
    (dict(schedule="fast"), ValueError, "schedule: 'fast' is not one of"),
    (dict(side_priority="urgent"), ValueError, "side_priority: 'urgent' is not one of 'highest', 'default'"),
    (dict(join="add"), ValueError, "join: 'add' is not one of 'fold', 'vllm'"),
    (dict(w2_lora_b=None), ValueError, "give all four or none"),
    (dict(w2=torch.zeros(6, 48, 40, dtype=torch.float16)), TypeError, "w2: dtype torch.float16"),
    (dict(validate="no"), TypeError, "validate: expected True or False"),
])
def test_layer_validation(change, exc, match):
    p = problem("cpu", seed=7)
    with pytest.raises(exc, match=match):
        moe_lora_layer(**(p.layer_inputs() | change))


@pytest.mark.parametrize("change, match", [
    (dict(schedule="fused", lora_path="one_shot"), "lora_path: 'one_shot' has no meaning with schedule='fused' .* "
                                                   "launches no LoRA path"),
    (dict(schedule="epilogue", lora_path="small_batch"), "lora_path: 'small_batch' has no meaning"),
    (dict(schedule="in_join", join="vllm"), "join: 'vllm' has no meaning with schedule='in_join'"),
])
def test_a_schedule_refuses_the_arguments_it_would_ignore(device, change, match):
    p = problem(device, seed=7)
    with pytest.raises(ValueError, match=match):
        moe_lora_layer(**(p.layer_inputs() | change))


@pytest.mark.gpu
def test_dual_stream_is_race_free_over_repetitions():
    """A moving result would be a race between the streams: 100 dual-stream runs equal the sequential one."""
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(4, 16), 64, dtype=torch.bfloat16, device="cuda", seed=8)
    seq = moe_lora_layer(**p.layer_inputs(), schedule="sequential")
    for _ in range(100):
        assert torch.equal(moe_lora_layer(**p.layer_inputs(), schedule="dual_stream"), seq)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sequential", "dual_stream", "fused", "epilogue"])
def test_cuda_graph_replay_equals_eager(schedule):
    rank = 16 if schedule in ("fused", "epilogue") else 64          # 4 x 64 stacked columns would not fit in the GEMM
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(4, rank), 32, dtype=torch.bfloat16, device="cuda", seed=9)
    eager = moe_lora_layer(**p.layer_inputs(), schedule=schedule)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_lora_layer(**p.layer_inputs(), schedule=schedule)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_lora_layer(**p.layer_inputs(), schedule=schedule)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
