"""Helpers shared by the tests: tolerances, poisoned buffers, small problems."""
import torch

from moelora_lab import LoRAShape, MoEShape, make_problem, moe_layer_reference, moe_lora_layer

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def assert_close(out, ref, dtype):
    """Relative check scaled by the reference's magnitude; NaN (an unwritten element) never passes."""
    out = out.float()
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} output elements were never written"
    tol = TOL[dtype]
    scale = max(float(ref.abs().max()), 1e-3)
    torch.testing.assert_close(out, ref.float(), rtol=tol, atol=tol * scale)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def lora_case(M, *, hidden=48, inter=40, experts=8, top_k=2, loras=3, rank=8, dtype=torch.float32,
              device="cpu", seed=0, **kw):
    """A small problem whose sizes are not multiples of 16 by default (K=48 vs BLOCK_K=32, N=40)."""
    shape = MoEShape(hidden, inter, experts, top_k, "test")
    return make_problem(shape, LoRAShape(loras, rank), M, dtype=dtype, device=device, seed=seed,
                        with_base=False, **kw)


def join_rows():
    """Layer rows of a made-up preset "p" at rank 16: both joins on one and two streams at M = 1, 16, 256,
    and at M = 512 a one-stream row whose vLLM-join partner was not timed (empty fields)."""
    out = []
    for M, seq, vjoin in ((1, 10.0, 11.0), (16, 20.0, 20.0), (256, 100.0, 130.0)):
        for variant, t in (("sequential", seq), ("sequential_vllm_join", vjoin), ("dual_stream", seq - 1),
                           ("dual_stream_vllm_join", vjoin - 2)):
            out.append(dict(preset="p", M=M, rank=16, variant=variant, us_median=t, us_p20=t, us_p80=t))
    out.append(dict(preset="p", M=512, rank=16, variant="sequential", us_median=5.0, us_p20=5.0, us_p80=5.0))
    out.append(dict(preset="p", M=512, rank=16, variant="sequential_vllm_join", us_median="", us_p20="",
                    us_p80=""))
    return out


def shrink_spec(p, x, lora_a, ranks):
    """T [S, P, r] = A x per pair with an adapter, below its slot's rank; NaN everywhere else, so a read
    of anything the shrink does not write fails."""
    M, k = p.topk_ids.shape
    rows = x.float().repeat_interleave(k, 0) if x.shape[0] == M else x.float()
    t = torch.full((len(lora_a), M * k, lora_a[0].shape[2]), float("nan"), device=x.device)
    lora = p.token_lora.long().repeat_interleave(k)
    for q in range(M * k):
        l, e = int(lora[q]), int(p.topk_ids.reshape(-1)[q])
        if l >= 0:
            for s, a in enumerate(lora_a):
                t[s, q, :ranks[l]] = a[l, e, :ranks[l]].float() @ rows[q]
    return t.to(x.dtype)


def check_layer_schedule(device, schedule, shape, rank, M, seed, **kw):
    """The layer run with ``schedule`` against the reference (3 adapters), in fp32 and fp16 (bf16 too on a GPU)."""
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else []):
        p = make_problem(shape, LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)
        assert_close(moe_lora_layer(**p.layer_inputs(), schedule=schedule), moe_layer_reference(**p.layer_inputs()),
                     dtype)
