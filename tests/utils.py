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


# ---- odd-but-valid inputs and poisoned memory ----------------------------------------------------

def poison_value(t: torch.Tensor):
    """What fills memory nothing may read: NaN for floats, an id no routing has for ints, False for flags."""
    if t.dtype.is_floating_point:
        return float("nan")
    return False if t.dtype == torch.bool else -7


def strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``t`` in another memory layout, the gaps poisoned: "gapped" (every other element of a
    twice-as-wide last dim), "transposed" (the last two dims stored the other way round; 1-D: gapped) or
    "padded" (rows three elements longer than their width; 1-D: gapped)."""
    if how == "gapped" or t.dim() < 2:
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), poison_value(t), dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]
    if how == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "padded":
        buf = torch.full((*t.shape[:-1], t.shape[-1] + 3), poison_value(t), dtype=t.dtype, device=t.device)
        buf[..., :t.shape[-1]] = t
        return buf[..., :t.shape[-1]]
    raise ValueError(f"how: {how!r}")


STRIDED_KINDS = ("gapped", "transposed", "padded")


def strided_inputs(inputs: dict, how: str) -> dict:
    """Every tensor (and every tensor of a list) of ``inputs`` as a strided view with the same values."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            out[name] = strided(value, how)
        elif isinstance(value, (list, tuple)):
            out[name] = [strided(v, how) for v in value]
        else:
            out[name] = value
    return out


class poisoned_allocations:
    """Inside the block, every tensor made by torch.empty, torch.empty_like or Tensor.new_empty starts
    filled with NaN (floats) or a sentinel (ints): a kernel that reads a buffer before writing it, or
    reads memory it never wrote, shows it. On CUDA the fill is a kernel on the stream current at the
    allocation: work on another stream sees it only after an event recorded there after the allocation
    (the layer's side stream waits on one)."""

    def __enter__(self):
        self.saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
        empty, empty_like, new_empty = self.saved

        def fill(t):
            return t.fill_(poison_value(t)) if t.numel() else t

        torch.empty = lambda *a, **k: fill(empty(*a, **k))
        torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))
        torch.Tensor.new_empty = lambda self, *a, **k: fill(new_empty(self, *a, **k))
        return self

    def __exit__(self, *exc):
        torch.empty, torch.empty_like, torch.Tensor.new_empty = self.saved
        return False
