"""HBM bytes of the LoRA op's backward paths (``op.grad_paths.GRAD_PATHS``), predicted from the shapes and the
routing as :func:`traffic.lora_op_traffic` predicts the forward's.

Shape legend: M tokens, k top-k, E experts, L adapters, R rank of the weights, r_l slot l's rank (<= R),
K in, N out, S slices, P = M*k pairs, BM pairs per block; a group g = (adapter l, expert e) holds P_g pairs
in n_g blocks; P_u = Σ P_g the pairs in used blocks, P_v those of slots with r_l > 0, X the x rows those
read (P_v / k token rows, or P_v pair rows); BN, BK, BR the kernels' N, K and rank tiles, t_l = ⌈r_l/BR⌉
slot l's rank tiles and R_l = min(R, t_l·BR) the slab rows they cover; c bytes per element of x, A, B and
the output's gradient (T and dT too), a bytes per gradient element (4: the op returns float32 gradients,
and takes the routing weights in float32). Sums Σ_g run over the touched groups; L_a = ⌈S/2⌉ launches
(each takes up to two slices).

Convention (that of ``traffic.py``): an input is read from HBM once per kernel that reads it (the caches
serve a kernel's own repeats: A and B per block, x and the gradient per rank tile), nothing survives
between kernels; what a design adds on top is counted as the kernels ask for it, as their docstrings
count it (part of it comes from L2). Left out: the block list's int32 metadata, the launcher's casts (a
gradient of the output in another dtype than x, bf16 upcast on the interpreter) and the autograd
Function's cast of each gradient to its input's dtype.

floor      read x X·K·c, the gradient P_v·S·N·c, A S·Σ_g r_l·K·c and B S·Σ_g N·r_l·c, the routing
           weights P_v·a (mul_routed_weight); write dx M·K·a (pair rows P·K·a), dw P·a
           (mul_routed_weight), dA S·L·E·R·K·a and dB S·L·E·N·R·a: every element of every slot, zeros
           included (the op returns dense gradients and the kernels write every element of dA and dB).
every path x read L_a times per kernel (one-shot: L_a·X·K·c, two_kernel twice that), the gradient
           once per kernel. dx: the launcher's [P, K] rows zeroed (P·K·a), read and written by the
           kernels once per rank tile and launch (L_a·Σ_g P_g·t_l·K·a each way); token rows with k > 1
           then summed over k (read P·K·a; the [M, K] sum is the floor's dx). dw (mul_routed_weight):
           zeroed (the floor's write), then read and written (two_kernel L_a·P_u·a, one-shot
           L_a·Σ_g P_g·t_l·a); the routing weights read L_a·(P_u + P_v)·a (two_kernel) or L_a·P_v·a.
two_kernel the weight kernel reads x and the gradient again; T and dT written once, S·Σ_g P_g·r_l·c
           each, T read back once per N tile of dB (× ⌈N/BN⌉), dT once per K tile of dA (× ⌈K/BK⌉).
one_shot   each group's dA and dB slabs read and written back once per block after the first:
           S·Σ_g (n_g - 1)·R_l·(K + N)·a each way; no T.
one_shot_atomic  dA, dB zeroed by the launcher (the floor's write), then one atomic read-modify-write
           of the group's slabs per block: S·Σ_g n_g·R_l·(K + N)·a each way.
reference  the spec in PyTorch (its temporaries are PyTorch's): not modelled, a ValueError says so.
FLOPs      the kernels' matmuls (T recomputed) 2·S·Σ_g P_g·r_l·(3K + 2N); the floor's, recomputing
           nothing, 4·S·Σ_g P_g·r_l·(K + N).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import rules
from ..blocks import BlockList
from ..tiles import KernelConfig
from ..validate import INDEX_DTYPES, check_bool, check_choice, check_int, check_range, check_tensor
from .traffic import X_ROWS, Traffic

GRAD_TRAFFIC_PATHS = ("two_kernel", "one_shot", "one_shot_atomic")
# the tiles ``grad_paths._launch_args`` gives the kernels on a GPU when the call brings no config
GPU_GRAD_TILES = KernelConfig(block_n=64, block_k=64, max_block_r=64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GradWorkload:
    """The routing as the backward walks it: for each group g = l*E + e its pairs and its blocks.

    Build one from a block list (:meth:`from_blocks`, the blocks the kernels run), from the routing
    (:meth:`from_routing`) or from counts (:meth:`from_counts`); the last two pack each group into
    ⌈P_g / BM⌉ blocks, as :func:`moelora_lab.block_list` does.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_loras: int
    block_size: int
    group_pairs: tuple[int, ...]      # [L*E] pairs of each group, 0 where untouched
    group_blocks: tuple[int, ...]     # [L*E] used blocks of each group

    def __post_init__(self) -> None:
        m = check_int("num_tokens", self.num_tokens, low=0)
        k = check_int("top_k", self.top_k, low=1)
        groups = check_int("num_experts", self.num_experts, low=1) * check_int("num_loras", self.num_loras, low=1)
        bm = check_int("block_size", self.block_size, low=1)
        for name in ("group_pairs", "group_blocks"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or len(value) != groups:
                raise ValueError(f"{name}: expected a tuple of L*E = {groups} ints (one per adapter, expert)")
        for g, (p, n) in enumerate(zip(self.group_pairs, self.group_blocks)):
            check_int(f"group_pairs[{g}]", p, low=0)
            check_int(f"group_blocks[{g}]", n, low=_cdiv(p, bm), high=p)
        check_int("sum(group_pairs)", sum(self.group_pairs), high=m * k)

    @classmethod
    def from_counts(cls, pairs_per_group, *, num_tokens: int, top_k: int, block_size: int) -> "GradWorkload":
        """From pairs_per_group [L, E] (a tensor or nested lists of ints): the pairs of each (adapter, expert)."""
        counts = torch.as_tensor(pairs_per_group)
        if counts.ndim != 2 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
            raise ValueError(f"pairs_per_group: expected [L, E] ints, got {tuple(counts.shape)} {counts.dtype}")
        L, E = counts.shape
        pairs = [int(p) for p in counts.reshape(-1).tolist()]
        bm = check_int("block_size", block_size, low=1)
        blocks = tuple(_cdiv(p, bm) for p in pairs)
        return cls(num_tokens, top_k, E, L, block_size, tuple(pairs), blocks)

    @classmethod
    def from_routing(cls, topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
                     block_size: int) -> "GradWorkload":
        """From topk_ids [M, k] in 0..E-1 and token_lora [M] in -1..L-1 (-1: no adapter, no pairs)."""
        E, L = check_int("num_experts", num_experts, low=1), check_int("num_loras", num_loras, low=1)
        check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, legend="[M, k]")
        M, k = topk_ids.shape
        check_tensor("token_lora", token_lora, dtypes=INDEX_DTYPES, shape=(M,), legend="[M]", device=topk_ids.device)
        check_range("topk_ids", topk_ids, 0, E, "expert ids")
        check_range("token_lora", token_lora, -1, L, "adapter ids, -1 for none")
        has = token_lora.long() >= 0
        keys = token_lora.long()[has, None] * E + topk_ids.long()[has]
        counts = torch.bincount(keys.reshape(-1).cpu(), minlength=L * E).view(L, E)
        return cls.from_counts(counts, num_tokens=M, top_k=k, block_size=block_size)

    @classmethod
    def from_blocks(cls, blocks: BlockList) -> "GradWorkload":
        """From a block list (one device read): its used blocks and the pairs that fill them."""
        if not isinstance(blocks, BlockList):
            raise TypeError(f"blocks: expected a BlockList (moelora_lab.block_list), got {type(blocks).__name__}")
        st, bm = blocks.routing, blocks.block_size
        L, E = st.num_loras, st.num_experts
        lora, expert = blocks.block_lora.long().cpu(), blocks.block_expert.long().cpu()
        used = lora >= 0
        filled = (blocks.sorted_pairs.cpu().view(-1, bm) < st.num_tokens * st.top_k).sum(1)       # [B]
        key = (lora * E + expert)[used]
        pairs = torch.zeros(L * E, dtype=torch.long).index_add_(0, key, filled[used])
        count = torch.zeros(L * E, dtype=torch.long).index_add_(0, key, torch.ones_like(key))
        return cls(st.num_tokens, st.top_k, E, L, bm, tuple(pairs.tolist()), tuple(count.tolist()))

    @property
    def pairs_with_adapter(self) -> int:
        """P_u: the pairs in used blocks."""
        return sum(self.group_pairs)

    @property
    def touched_groups(self) -> int:
        return sum(p > 0 for p in self.group_pairs)


@dataclass(frozen=True)
class GradTraffic:
    """One backward path's bytes: ``total`` what it moves and ``floor`` what every backward must move
    (:class:`Traffic` each, per tensor in ``parts``); ``extra`` what the path moves beyond the floor."""

    path: str
    total: Traffic
    floor: Traffic

    @property
    def extra(self) -> int:
        return self.total.bytes - self.floor.bytes

    def extra_parts(self) -> dict[str, int]:
        """Tensor name -> bytes moved beyond the floor (tensors at the floor left out)."""
        floor = dict(self.floor.parts)
        return {name: n - floor.get(name, 0) for name, n in self.total.parts if n != floor.get(name, 0)}


def grad_tiles(rank: int, *, config: KernelConfig | None = None, interpreter: bool = False) -> tuple[int, int, int]:
    """(BN, BK, BR): the N, K and rank tiles the backward's launcher runs at rank R: ``config`` as given,
    else the interpreter's tiles (``rules.CONFIGS['interpreter']``) or the GPU's (:data:`GPU_GRAD_TILES`)."""
    R = check_int("rank", rank, low=1)
    check_bool("interpreter", interpreter)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    cfg = config or (rules.CONFIGS["interpreter"] if interpreter else GPU_GRAD_TILES)
    return cfg.block_n, cfg.block_k, cfg.rank_tiling(R)[0]


def _slot_ranks(lora_ranks, num_loras: int, rank: int) -> list[int]:
    """r_l of each slot: lora_ranks clamped to R as the launcher clamps them (None: R everywhere)."""
    if lora_ranks is None:
        return [rank] * num_loras
    ranks = [int(r) for r in (lora_ranks.tolist() if isinstance(lora_ranks, torch.Tensor) else lora_ranks)]
    if len(ranks) != num_loras or min(ranks, default=0) < 0:
        raise ValueError(f"lora_ranks: expected {num_loras} ranks >= 0 (one per adapter slot), got {ranks}")
    return [min(r, rank) for r in ranks]


def grad_op_traffic(path: str, workload: GradWorkload, *, in_features: int, out_features: int, num_slices: int,
                    rank: int, x_rows: str = "token", dtype_bytes: int = 2, grad_bytes: int = 4,
                    mul_routed_weight: bool = False, lora_ranks=None, dx_rows: bool = False,
                    config: KernelConfig | None = None, interpreter: bool = False) -> GradTraffic:
    """Bytes of ``moe_lora_backward(path=path)`` computing every gradient (module docstring: the formulas).

    Parameters
    ----------
    path : str
        'two_kernel', 'one_shot' or 'one_shot_atomic' ('reference' is not modelled: a ValueError).
    workload : GradWorkload
        The routing's groups and blocks (block_size: the blocks the kernels run, BM).
    in_features, out_features, num_slices, rank
        K, N, S and the weights' rank R.
    x_rows : str
        'token' (x [M, K], w13) or 'pair' (x [P, K], w2).
    dtype_bytes, grad_bytes : int
        c (x, A, B, the output's gradient) and a (the gradients the op returns: 4, or 8 for float64).
    mul_routed_weight : bool
        Whether the routing weights enter (then they are read and dw is written).
    lora_ranks : sequence of int or tensor, optional
        [L] each slot's rank (None: R).
    dx_rows : bool
        Whether the caller hands its own float32 pair rows for x's gradient (``moe_lora_backward(dx_rows=...)``,
        as the layer does): then the op neither zeroes nor sums a [P, K] buffer, nor writes dx [M, K]; the
        kernels' read-modify-write of the rows stays.
    config, interpreter
        The launch's tiles (:func:`grad_tiles`).

    Returns
    -------
    GradTraffic
        ``total`` and ``floor`` with their parts (name -> bytes), and ``extra``.

    Examples
    --------
    >>> wl = GradWorkload.from_counts([[20, 12]], num_tokens=16, top_k=2, block_size=16)
    >>> t = grad_op_traffic("one_shot", wl, in_features=64, out_features=32, num_slices=2, rank=16)
    >>> t.floor.bytes, t.extra_parts()["da_rmw_read"]     # 1 extra block: 2 slices x 16 x 64 x 4 B
    (47104, 8192)
    """
    if path == "reference":
        raise ValueError("path: 'reference' (the spec in PyTorch, its temporaries PyTorch's) is not modelled; "
                         f"choose one of {', '.join(map(repr, GRAD_TRAFFIC_PATHS))}")
    check_choice("path", path, GRAD_TRAFFIC_PATHS)
    if not isinstance(workload, GradWorkload):
        raise TypeError(f"workload: expected a GradWorkload (GradWorkload.from_blocks / from_routing / from_counts), "
                        f"got {type(workload).__name__}")
    K, N = check_int("in_features", in_features, low=1), check_int("out_features", out_features, low=1)
    S, R = check_int("num_slices", num_slices, low=1), check_int("rank", rank, low=1)
    check_choice("x_rows", x_rows, X_ROWS)
    c, a = check_int("dtype_bytes", dtype_bytes, low=1), check_int("grad_bytes", grad_bytes, low=1)
    check_bool("mul_routed_weight", mul_routed_weight)
    check_bool("dx_rows", dx_rows)
    wl = workload
    M, k, E, L = wl.num_tokens, wl.top_k, wl.num_experts, wl.num_loras
    ranks = _slot_ranks(lora_ranks, L, R)
    BN, BK, BR = grad_tiles(R, config=config, interpreter=interpreter)
    P, launches = M * k, _cdiv(S, 2)

    # (P_g, n_g, r_l, t_l, R_l) of each touched group
    groups = [(p, n, ranks[g // E], _cdiv(ranks[g // E], BR), min(R, _cdiv(ranks[g // E], BR) * BR))
              for g, (p, n) in enumerate(zip(wl.group_pairs, wl.group_blocks)) if p]
    p_used = sum(p for p, *_ in groups)
    p_live = sum(p for p, _, r, *_ in groups if r > 0)
    pr = sum(p * r for p, _, r, *_ in groups)                       # T elements of one slice
    rank_rows = sum(p * t for p, _, _, t, _ in groups)              # dx rows moved per launch
    if x_rows == "token" and p_live % k:
        raise ValueError(f"workload: {p_live} pairs of slots with a rank is not a multiple of top_k = {k}; "
                         "token rows need every slot of a token (or use x_rows='pair')")
    X = p_live // k if x_rows == "token" else p_live
    sum_rows = x_rows == "token" and k > 1                         # the launcher sums dx over k

    floor_reads = [("x", X * K * c), ("grad_out", p_live * S * N * c),
                   ("lora_a", S * sum(r * K for _, _, r, *_ in groups) * c),
                   ("lora_b", S * sum(N * r for _, _, r, *_ in groups) * c)]
    floor_reads += [("topk_weights", p_live * a)] if mul_routed_weight else []
    floor_writes = [("dx", (M if sum_rows else P) * K * a)] + ([("dw", P * a)] if mul_routed_weight else [])
    floor_writes += [("da", S * L * E * R * K * a), ("db", S * L * E * N * R * a)]

    kernels = 2 if path == "two_kernel" else 1                     # kernels of a launch that read x and dY
    again = {"x": kernels * launches, "grad_out": kernels}         # x per kernel and launch, dY per kernel
    reads = [(name, n * again.get(name, 1)) for name, n in floor_reads if name != "topk_weights"]
    writes = [(name, n) for name, n in floor_writes if not (dx_rows and name == "dx")]
    rmw = [("dx_rmw", launches * rank_rows * K * a)]
    if mul_routed_weight:                                          # two kernels: the rank kernel reads P_u
        reads.append(("topk_weights", launches * (p_used + p_live if kernels == 2 else p_live) * a))
        rmw.append(("dw_rmw", launches * (p_used if kernels == 2 else rank_rows) * a))
    if sum_rows and not dx_rows:
        writes.append(("dx_rows_zero", P * K * a))
        reads.append(("dx_rows_sum", P * K * a))
    if path == "two_kernel":
        writes += [("t_write", S * pr * c), ("dt_write", S * pr * c)]
        reads += [("t_read", S * pr * c * _cdiv(N, BN)), ("dt_read", S * pr * c * _cdiv(K, BK))]
    else:                                  # slab rows moved: one_shot's first block of a group stores only
        first = 1 if path == "one_shot" else 0
        rows = sum((n - first) * rows_l for _, n, _, _, rows_l in groups)
        rmw += [("da_rmw", S * rows * K * a), ("db_rmw", S * rows * N * a)]
    reads += [(f"{name}_read", n) for name, n in rmw]
    writes += [(f"{name}_write", n) for name, n in rmw]

    flops = 2 * S * pr * (3 * K + 2 * N)
    total = Traffic(sum(n for _, n in reads), sum(n for _, n in writes), flops, kernels * launches,
                    tuple(reads + writes))
    floor = Traffic(sum(n for _, n in floor_reads), sum(n for _, n in floor_writes), 4 * S * pr * (K + N), 1,
                    tuple(floor_reads + floor_writes))
    return GradTraffic(path, total, floor)
