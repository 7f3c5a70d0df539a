"""Analytic minimum-HBM-bytes and FLOP model of MoE-LoRA kernels and of one MoE layer.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices;
pair = (token, slot), flat index p = t*k + j.

Every byte count is a *lower bound* for the chosen formulation: each tensor a kernel must
touch is counted once per time the formulation has to read or write it from HBM, assuming
perfect caching inside one kernel and none across kernels. b is the element size in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base_moe import rows_as_tile
from ..op.paths import TRITON_PATHS
from ..quant.format import BLOCK_SIZE, GROUP_SIZE, check_block_size
from ..validate import check_choice, check_int
from .workload import Workload, count_workload  # noqa: F401  (count_workload: re-exported with the model)

# the Triton paths of ``paths.PATHS`` plus a modelled PyTorch baseline (gather each pair's weights, then bmm)
LORA_PATHS = TRITON_PATHS + ("gather_bmm",)
X_ROWS = ("token", "pair")
# the layer's base weights: in the activations' dtype (dtype_bytes each), or FP8 e4m3 with float32 block scales
BASES = ("dtype", "fp8")


@dataclass(frozen=True)
class Traffic:
    """HBM bytes, FLOPs and kernel launches of one step; ``parts`` is ((name, bytes), ...)."""

    bytes_read: int
    bytes_written: int
    flops: int
    launches: int
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def bytes(self) -> int:
        """bytes_read + bytes_written."""
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity flops / bytes (0.0 when no bytes move)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def part(self, name: str) -> int:
        """Bytes of the part called ``name`` (0 when absent)."""
        return dict(self.parts).get(name, 0)

    def floor_us(self, bandwidth_bytes_per_s: float) -> float:
        """Memory-bound time floor in microseconds: bytes / bandwidth * 1e6."""
        if isinstance(bandwidth_bytes_per_s, bool) or not isinstance(bandwidth_bytes_per_s, (int, float)):
            raise TypeError(f"bandwidth_bytes_per_s: expected a number, got {type(bandwidth_bytes_per_s).__name__}")
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s: must be > 0, got {bandwidth_bytes_per_s}")
        return self.bytes / bandwidth_bytes_per_s * 1e6

    def __add__(self, other: "Traffic") -> "Traffic":
        """Sum every field; parts with the same name are merged (first-seen order kept)."""
        if not isinstance(other, Traffic):
            return NotImplemented
        merged: dict[str, int] = dict(self.parts)
        for name, nbytes in other.parts:
            merged[name] = merged.get(name, 0) + nbytes
        return Traffic(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                       self.flops + other.flops, self.launches + other.launches, tuple(merged.items()))

    def __radd__(self, other) -> "Traffic":
        """Lets ``sum(traffics)`` start from 0."""
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented


def _traffic(reads: list[tuple[str, int]], writes: list[tuple[str, int]], flops: int, launches: int) -> Traffic:
    """Traffic whose bytes_read / bytes_written are the sums of the named read / written parts."""
    return Traffic(sum(n for _, n in reads), sum(n for _, n in writes), flops, launches, tuple(reads + writes))


def _check_workload(workload) -> Workload:
    if not isinstance(workload, Workload):
        raise TypeError(f"workload: expected a Workload (see count_workload / Workload.dense), got {type(workload).__name__}")
    return workload


def lora_op_traffic(
    path: str,
    workload: Workload,
    *,
    in_features: int,
    out_features: int,
    num_slices: int,
    rank: int,
    x_rows: str = "token",
    dtype_bytes: int = 2,
    add_inputs: bool = True,
    intermediate_bytes: int | None = None,
) -> Traffic:
    """Traffic of the MoE-LoRA op out[t,j,s*N:(s+1)*N] (+)= B_s[l,e] @ (A_s[l,e] @ x_row).

    With P = pairs_with_adapter, X = tokens_with_adapter (x_rows "token") or P (x_rows "pair"),
    T = touched_adapter_experts, W1 = S*r*K + S*N*r weight elements per (adapter, expert):

    common      x read X*K*b; out written P*S*N*b (and read P*S*N*b when add_inputs);
                FLOPs 2*P*S*r*(K+N) (+ P*S*N when add_inputs).
    one_shot    weights T*W1*b, 1 launch.
    two_kernel  weights T*W1*b; intermediate [S, M, k, r] of bi = intermediate_bytes or b, allocated
                uninitialised: shrink writes P*S*r*bi, expand reads P*S*r*bi; 2 launches.
    small_batch one program per pair, weights P*W1*b, 1 launch.
    gather_bmm  (a PyTorch baseline, not a path of the op) gather + bmm: weights read P*W1*b, per-pair copy written P*W1*b and read again
                P*W1*b; fp32 intermediate (bi = intermediate_bytes or 4) written and read P*S*r*bi.
                Launches 4*S + 1: one to build the per-pair weight index, then per slice a
                gather of A, a gather of B, the shrink bmm and the expand baddbmm (add fused).
    """
    check_choice("path", path, LORA_PATHS)
    wl = _check_workload(workload)
    k_in = check_int("in_features", in_features, low=1)
    n_out = check_int("out_features", out_features, low=1)
    s = check_int("num_slices", num_slices, low=1)
    r = check_int("rank", rank, low=1)
    check_choice("x_rows", x_rows, X_ROWS)
    b = check_int("dtype_bytes", dtype_bytes, low=1)
    if not isinstance(add_inputs, bool):
        raise TypeError(f"add_inputs: expected a bool, got {type(add_inputs).__name__} {add_inputs!r}")
    if intermediate_bytes is not None:
        check_int("intermediate_bytes", intermediate_bytes, low=1)

    p = wl.pairs_with_adapter
    x = wl.tokens_with_adapter if x_rows == "token" else p
    out_bytes = p * s * n_out * b
    flops = 2 * p * s * r * (k_in + n_out) + (p * s * n_out if add_inputs else 0)
    a_elems, b_elems = s * r * k_in, s * n_out * r
    copies = wl.touched_adapter_experts if path in ("one_shot", "two_kernel") else p

    reads = [("x", x * k_in * b), ("lora_a", copies * a_elems * b), ("lora_b", copies * b_elems * b)]
    writes: list[tuple[str, int]] = []
    launches = 1
    if path == "two_kernel":
        bi = intermediate_bytes or b
        writes.append(("intermediate_write", p * s * r * bi))
        reads.append(("intermediate_read", p * s * r * bi))
        launches = 2
    elif path == "gather_bmm":
        bi = intermediate_bytes or 4
        writes += [
            ("lora_a_copy_write", p * a_elems * b),
            ("lora_b_copy_write", p * b_elems * b),
            ("intermediate_write", p * s * r * bi),
        ]
        reads += [
            ("lora_a_copy_read", p * a_elems * b),
            ("lora_b_copy_read", p * b_elems * b),
            ("intermediate_read", p * s * r * bi),
        ]
        launches = 4 * s + 1
    if add_inputs:
        reads.append(("out_read", out_bytes))
    writes.append(("out_write", out_bytes))
    return _traffic(reads, writes, flops, launches)


def _shape_int(shape, attr: str) -> int:
    if not hasattr(shape, attr):
        raise TypeError(f"shape: expected an object with hidden, intermediate, num_experts, top_k; missing {attr!r}")
    return check_int(f"shape.{attr}", getattr(shape, attr), low=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_weight_bytes(n: int, k: int, block: tuple[int, int]) -> int:
    """Bytes of one expert's FP8 weight [N, K]: one per element plus four per (BN, BK) scale block."""
    return n * k + 4 * _cdiv(n, block[0]) * _cdiv(k, block[1])


def _fp8_rows_bytes(rows: int, k: int, group: int) -> int:
    """Bytes of ``rows`` FP8 activation rows of K columns: one per element plus four per group scale."""
    return rows * (k + 4 * _cdiv(k, group))


def _quantize_stage(name: str, rows: int, k: int, b: int, group: int) -> Traffic:
    """The activation quantization of ``rows`` x [rows, K]: read in its dtype, write the FP8 rows and their
    scales; FLOPs 2 per element (the magnitude's max, the scaling)."""
    return _traffic([(name, rows * k * b)], [(f"{name}q", _fp8_rows_bytes(rows, k, group))], 2 * rows * k, 1)


def layer_traffic(
    shape,
    rank: int,
    workload: Workload,
    *,
    dtype_bytes: int = 2,
    lora_path: str = "one_shot",
    with_lora: bool = True,
    base: str = "dtype",
    fp8_block: tuple[int, int] = BLOCK_SIZE,
    fp8_group: int = GROUP_SIZE,
) -> dict[str, Traffic]:
    """Traffic of one MoE layer with LoRA, stage by stage (H hidden, I intermediate).

    The LoRA stages write their deltas d13, d2 for the P_a pairs with an adapter (``add_inputs``
    False: the layer's folded join) and the activation and the top-k sum read them back:

    base_w13  read x M*H*b and touched_experts*2I*H*b, write c1 M*k*2I*b; FLOPs 2*M*k*2I*H.
    lora_w13  lora_op_traffic(K=H, N=I, S=2, x_rows "token", add_inputs False): writes d13.
    act       h = silu(c1g + d13g) * (c1u + d13u): read c1 M*k*2I*b and d13 P_r*2I*b, write
              M*k*I*b; FLOPs 5*M*k*I (silu as x/(1+exp(-x)): 4, the product: 1) + P_a*2I (adds).
    base_w2   read h M*k*I*b and touched_experts*H*I*b, write c3 M*k*H*b;
              FLOPs 2*M*k*H*I + M*k*H (routing weight).
    lora_w2   lora_op_traffic(K=I, N=H, S=1, x_rows "pair", add_inputs False): writes d2.
    sum       y = sum over k of c3 + d2: read c3 M*k*H*b and d2 P_r*H*b, write M*H*b;
              FLOPs M*(k-1)*H + P_a*H. P_r, the delta rows the joins read: P_a, or every pair's row
              up to ``rules.SUM_TILE_MAX_PAIRS`` pairs (there the joins load a row before they know its
              token's adapter, one round trip instead of two: ``moe.rows_as_tile``).
    total     sum of the stages above.
    floor     fully fused: x read once, every touched base weight (T_e*3*I*H*b) and touched
              LoRA weight (T*(W1_w13 + W1_w2)*b) read once, y written once; FLOPs of total, 1 launch.
    Without LoRA the lora stages are left out (and no LoRA weights enter the floor).

    ``base="fp8"``: the base weights are FP8 (``quant``): a weight [N, K] is N*K bytes plus 4 per
    ``fp8_block`` (BN, BK) scale block, and each base GEMM's input rows are quantized first, per group of
    ``fp8_group`` columns (SKx = ceil(K / G) scales a row), by a stage of their own:
    quant_x   read x M*H*b, write xq M*H + its scales M*SKx*4; FLOPs 2*M*H, 1 launch.
    base_w13  reads xq and its scales (M*(H + SKx*4)) instead of x, and T_e FP8 w13 instead of bf16.
    quant_h   read h M*k*I*b, write hq M*k*I + M*k*SKx*4; FLOPs 2*M*k*I, 1 launch.
    base_w2   reads hq and its scales instead of h, and T_e FP8 w2. c1, c3, the LoRA stages and the joins
              keep the activations' dtype (b). The floor reads x once in its dtype (fused, the quantization
              never reaches HBM) and the touched FP8 base weights with their scales.
    """
    h_dim, i_dim = _shape_int(shape, "hidden"), _shape_int(shape, "intermediate")
    n_experts, k = _shape_int(shape, "num_experts"), _shape_int(shape, "top_k")
    r = check_int("rank", rank, low=1)
    wl = _check_workload(workload)
    b = check_int("dtype_bytes", dtype_bytes, low=1)
    check_choice("lora_path", lora_path, LORA_PATHS)
    if not isinstance(with_lora, bool):
        raise TypeError(f"with_lora: expected a bool, got {type(with_lora).__name__} {with_lora!r}")
    check_choice("base", base, BASES)
    block = check_block_size("fp8_block", fp8_block)
    if block is None:
        raise TypeError(f"fp8_block: expected a pair (BN, BK) such as {BLOCK_SIZE}; the model counts block scales")
    group = check_int("fp8_group", fp8_group, low=1)
    if wl.top_k != k:
        raise ValueError(f"workload: top_k is {wl.top_k} but shape.top_k is {k}; count the workload with the layer's top_k")
    if wl.touched_experts > n_experts:
        raise ValueError(f"workload: touched_experts is {wl.touched_experts}, more than shape.num_experts = {n_experts}")

    m, te = wl.num_tokens, wl.touched_experts
    fp8 = base == "fp8"
    # one expert's base weights in bytes, and the base GEMMs' input reads (FP8 rows and scales, or x / h as given)
    w13_bytes = _fp8_weight_bytes(2 * i_dim, h_dim, block) if fp8 else 2 * i_dim * h_dim * b
    w2_bytes = _fp8_weight_bytes(h_dim, i_dim, block) if fp8 else h_dim * i_dim * b
    x_in = ("xq", _fp8_rows_bytes(m, h_dim, group)) if fp8 else ("x", m * h_dim * b)
    h_in = ("hq", _fp8_rows_bytes(m * k, i_dim, group)) if fp8 else ("h", m * k * i_dim * b)
    stages: dict[str, Traffic] = {}
    if fp8:
        stages["quant_x"] = _quantize_stage("x", m, h_dim, b, group)
    stages["base_w13"] = _traffic(
        [x_in, ("w13", te * w13_bytes)],
        [("c1", m * k * 2 * i_dim * b)],
        2 * m * k * 2 * i_dim * h_dim, 1,
    )
    if with_lora:
        stages["lora_w13"] = lora_op_traffic(
            lora_path, wl, in_features=h_dim, out_features=i_dim, num_slices=2, rank=r,
            x_rows="token", dtype_bytes=b, add_inputs=False,
        )
    pa = wl.pairs_with_adapter if with_lora else 0
    pr = m * k if with_lora and rows_as_tile(m * k) else pa          # delta rows the joins read
    d13 = [("d13", pr * 2 * i_dim * b)] if with_lora else []
    stages["act"] = _traffic([("c1", m * k * 2 * i_dim * b)] + d13, [("h", m * k * i_dim * b)],
                             5 * m * k * i_dim + pa * 2 * i_dim, 1)
    if fp8:
        stages["quant_h"] = _quantize_stage("h", m * k, i_dim, b, group)
    stages["base_w2"] = _traffic(
        [h_in, ("w2", te * w2_bytes)],
        [("c3", m * k * h_dim * b)],
        2 * m * k * h_dim * i_dim + m * k * h_dim, 1,
    )
    if with_lora:
        stages["lora_w2"] = lora_op_traffic(
            lora_path, wl, in_features=i_dim, out_features=h_dim, num_slices=1, rank=r,
            x_rows="pair", dtype_bytes=b, add_inputs=False,
        )
    d2 = [("d2", pr * h_dim * b)] if with_lora else []
    stages["sum"] = _traffic([("c3", m * k * h_dim * b)] + d2, [("y", m * h_dim * b)],
                             m * (k - 1) * h_dim + pa * h_dim, 1)

    total = sum(stages.values())
    lora_elems = (2 * r * h_dim + 2 * i_dim * r) + (r * i_dim + h_dim * r)
    floor_reads = [("x", m * h_dim * b), ("base_weights", te * (w13_bytes + w2_bytes))]
    if with_lora:
        floor_reads.append(("lora_weights", wl.touched_adapter_experts * lora_elems * b))
    stages["total"] = total
    stages["floor"] = _traffic(floor_reads, [("y", m * h_dim * b)], total.flops, 1)
    return stages
