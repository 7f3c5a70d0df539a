"""Problem shapes, named presets and seeded problem construction.

Shape legend (used in every module): M tokens, E experts, k top-k, L adapters, r rank,
K in, N out, H hidden, I expert intermediate, S slices (2 for gate/up, 1 for down).

Layouts (vLLM's, so results compare tensor for tensor):
    x            [M, H]          activations
    router_logits[M, E]  fp32
    topk_weights [M, k]  fp32    topk_ids [M, k] int32
    token_lora   [M]     int32   adapter slot of each token, -1 = no adapter
    w13          [E, 2I, H]      base gate (rows :I) and up (rows I:) projections
    w2           [E, H, I]       base down projection
    w13_lora_a   2 x [L, E, r, H]   w13_lora_b  2 x [L, E, I, r]
    w2_lora_a    1 x [L, E, r, I]   w2_lora_b   1 x [L, E, H, r]
LoRA scaling (alpha / r) is folded into B. Adapters of rank < r are zero-padded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .validate import FLOAT_DTYPES, check_bool, check_choice, check_int
from .op.face import pack_lora_b
from .routing.host import route


@dataclass(frozen=True)
class MoEShape:
    """One routed-expert MoE layer: hidden size H, expert intermediate size I, E experts, top-k."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    name: str = "custom"

    def __post_init__(self):
        for arg in ("hidden", "intermediate", "num_experts", "top_k"):
            check_int(f"MoEShape.{arg}", getattr(self, arg), low=1)
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEShape.top_k: {self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_name(cls, name: str) -> "MoEShape":
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]

    def op_dims(self, op: str) -> tuple[int, int, int]:
        """(K, N, S) of a LoRA op: w13 reads H and writes I in 2 slices (gate, up); w2 reads I and writes H."""
        if op not in ("w13", "w2"):
            raise ValueError(f"op: expected 'w13' or 'w2', got {op!r}")
        return (self.hidden, self.intermediate, 2) if op == "w13" else (self.intermediate, self.hidden, 1)


@dataclass(frozen=True)
class LoRAShape:
    """L adapter slots of (maximum) rank r."""

    num_loras: int
    rank: int

    def __post_init__(self):
        check_int("LoRAShape.num_loras", self.num_loras, low=1)
        check_int("LoRAShape.rank", self.rank, low=1)


PRESETS: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape(2048, 768, 128, 8, "qwen3-30b-a3b"),
        MoEShape(2048, 1408, 64, 6, "deepseek-v2-lite"),
        MoEShape(4096, 14336, 8, 2, "mixtral-8x7b"),
        MoEShape(2048, 1024, 64, 8, "olmoe-1b-7b"),
        MoEShape(2880, 2880, 32, 4, "gpt-oss-20b"),
        MoEShape(64, 32, 8, 2, "tiny"),  # small enough for the Triton interpreter on a laptop
    )
}

POPULARITIES = ("identical", "distinct", "uniform", "zipf:<a>", "skewed")


@dataclass
class Problem:
    """Every tensor of one MoE-LoRA layer (see the module docstring for layouts)."""

    shape: MoEShape
    lora: LoRAShape
    x: torch.Tensor
    router_logits: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    token_lora: torch.Tensor
    w13_lora_a: tuple[torch.Tensor, ...]
    w13_lora_b: tuple[torch.Tensor, ...]
    w2_lora_a: tuple[torch.Tensor, ...]
    w2_lora_b: tuple[torch.Tensor, ...]
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    adapter_ranks: tuple[int, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def layer_inputs(self) -> dict:
        """Keyword arguments for :func:`moelora_lab.reference.moe_layer_reference`."""
        if self.w13 is None:
            raise ValueError("problem was built with with_base=False; rebuild it with with_base=True")
        names = ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w2",
                 "w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")
        return {n: getattr(self, n) for n in names}

    def w13_lora_inputs(self) -> dict:
        """Keyword arguments of the LoRA op on the w13 input (token rows, 2 slices)."""
        return dict(x=self.x, topk_ids=self.topk_ids, topk_weights=self.topk_weights,
                    token_lora=self.token_lora, lora_a=self.w13_lora_a, lora_b=self.w13_lora_b)


def draw_adapters(num_draws: int, num_loras: int, popularity: str, gen: torch.Generator) -> torch.Tensor:
    """Draw ``num_draws`` adapter slots in [0, L) following Punica's workload families.

    identical: everyone uses slot 0.  distinct: round-robin, every draw a different slot while
    slots last.  uniform: uniform random.  zipf:<a>: P(slot i) ~ 1 / (i+1)^a.  skewed: zipf:1.5.
    """
    if popularity == "identical":
        return torch.zeros(num_draws, dtype=torch.int64)
    if popularity == "distinct":
        return torch.arange(num_draws, dtype=torch.int64) % num_loras
    if popularity == "uniform":
        return torch.randint(0, num_loras, (num_draws,), generator=gen)
    if popularity == "skewed":
        popularity = "zipf:1.5"
    if popularity.startswith("zipf:"):
        try:
            a = float(popularity[5:])
        except ValueError:
            a = -1.0
        if not a > 0:
            raise ValueError(f"adapter_popularity: {popularity!r} needs a positive exponent, e.g. 'zipf:1.2'")
        p = 1.0 / torch.arange(1, num_loras + 1, dtype=torch.float64) ** a
        return torch.multinomial(p / p.sum(), num_draws, replacement=True, generator=gen)
    raise ValueError(f"adapter_popularity: {popularity!r} is not one of {', '.join(POPULARITIES)}")


def make_routing(shape: MoEShape, num_loras: int, num_tokens: int, *, seed: int = 0,
                 adapter_popularity: str = "uniform", no_adapter_fraction: float = 0.0, expert_skew: float = 0.0,
                 num_sequences: int | None = None, renormalize: bool = True) -> dict:
    """Router logits, top-k and the token -> adapter map of one batch (CPU tensors; knobs as in make_problem)."""
    check_int("num_tokens", num_tokens, low=1)
    if not 0.0 <= no_adapter_fraction <= 1.0:
        raise ValueError(f"no_adapter_fraction: must be in [0, 1], got {no_adapter_fraction}")
    if expert_skew < 0:
        raise ValueError(f"expert_skew: must be >= 0 (0 = uniform routing), got {expert_skew}")
    num_sequences = num_tokens if num_sequences is None else check_int("num_sequences", num_sequences, low=1)
    num_sequences = min(num_sequences, num_tokens)
    E = shape.num_experts
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=gen)
    if expert_skew > 0:
        order = torch.randperm(E, generator=gen)
        logits = logits - expert_skew * torch.log1p(order.to(torch.float32))
    topk_weights, topk_ids = route(logits, shape.top_k, renormalize=renormalize)
    seq_lora = draw_adapters(num_sequences, num_loras, adapter_popularity, gen)
    no_adapter = torch.rand(num_sequences, generator=gen) < no_adapter_fraction
    seq_lora = torch.where(no_adapter, torch.full_like(seq_lora, -1), seq_lora)
    seq_of_token = torch.arange(num_tokens) * num_sequences // num_tokens
    return dict(router_logits=logits, topk_weights=topk_weights, topk_ids=topk_ids,
                token_lora=seq_lora[seq_of_token].to(torch.int32))


BENCH_ADAPTERS = ("uniform", "distinct")   # how the benchmarks give their sequences adapters (draw_adapters)


def benchmark_routing(shape, num_loras: int, num_tokens: int, seed: int = 0, adapters: str = "uniform") -> dict:
    """The routing every benchmark of ``python -m moelora_lab.bench`` draws for M tokens (and the
    byte model uses to match its data): ``make_routing`` with seed ``seed + M`` and the tokens in
    min(M, 8) sequences, each sequence with one adapter: a random one ('uniform', the committed data's:
    with 4 adapters and 8 sequences one adapter is often left unused) or sequence i -> adapter i mod L
    ('distinct': every adapter in use once there are L sequences, as vLLM's benchmark assigns them)."""
    if adapters not in BENCH_ADAPTERS:
        raise ValueError(f"adapters: {adapters!r} is not one of {', '.join(BENCH_ADAPTERS)}")
    return make_routing(shape, num_loras, num_tokens, seed=seed + num_tokens, num_sequences=min(num_tokens, 8),
                        adapter_popularity=adapters)


def _lora_pair(gen, num_loras, num_experts, rank, k_in, n_out, ranks, dtype, device):
    """A [L, E, r, K] ~ N(0, 1/K) and B [L, E, N, r] ~ N(0, 1/r); rows/cols past an adapter's rank are 0."""
    a = torch.randn(num_loras, num_experts, rank, k_in, generator=gen) / math.sqrt(k_in)
    b = torch.randn(num_loras, num_experts, n_out, rank, generator=gen) / math.sqrt(rank)
    for slot, r_slot in enumerate(ranks):
        a[slot, :, r_slot:] = 0
        b[slot, :, :, r_slot:] = 0
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def make_problem(
    shape: MoEShape | str,
    lora: LoRAShape,
    num_tokens: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    adapter_popularity: str = "uniform",
    no_adapter_fraction: float = 0.0,
    expert_skew: float = 0.0,
    num_sequences: int | None = None,
    adapter_ranks: tuple[int, ...] | None = None,
    with_base: bool = True,
    renormalize: bool = True,
) -> Problem:
    """Build every tensor of one MoE-LoRA layer; the same arguments give identical tensors.

    Tensors are drawn on the CPU from one seeded generator and then moved, so the device does
    not change the values.

    Parameters
    ----------
    shape : MoEShape or str
        The layer (H hidden, I expert intermediate, E experts, top-k), or a name of ``PRESETS``
        ('qwen3-30b-a3b', 'deepseek-v2-lite', 'mixtral-8x7b', 'olmoe-1b-7b', 'gpt-oss-20b', 'tiny').
    lora : LoRAShape
        L adapter slots of (maximum) rank r.
    num_tokens : int
        M, the tokens of the batch.
    dtype : torch.dtype
        Of x and the weights: float32, float16 or bfloat16 (routing weights stay float32).
    device : str or torch.device
        Where the tensors go (``moelora_lab.kernel_device()`` is where the kernels run).
    seed : int
        Same seed, same tensors.
    adapter_popularity : str
        Which slot each sequence uses, Punica's families: 'identical' (all slot 0), 'distinct'
        (round robin), 'uniform', 'zipf:<a>' (P(slot i) ~ 1/(i+1)^a), 'skewed' (zipf:1.5).
    no_adapter_fraction : float
        Fraction of sequences served without an adapter (their token_lora is -1).
    expert_skew : float
        0 = uniform routing; > 0 adds a zipf-like bias -skew*log(rank_e) to the router logits of a
        random expert order, so a few experts get most pairs.
    num_sequences : int, optional
        Tokens form this many contiguous sequences, each with one adapter (default: every token
        is its own sequence).
    with_base : bool
        Also build the base w13 [E, 2I, H] and w2 [E, H, I] (large for real presets).
    renormalize : bool
        Divide the top-k routing weights by their sum.
    adapter_ranks : sequence of int, optional
        Actual rank of each slot (<= r); A and B past it are zero padding.

    Returns
    -------
    Problem
        x [M, H]; router_logits [M, E] fp32; topk_weights [M, k] fp32; topk_ids [M, k] int32;
        token_lora [M] int32 (-1 = no adapter); w13_lora_a / w13_lora_b: 2 slices (gate, up) of
        A [L, E, r, H] and B [L, E, I, r]; w2_lora_a / w2_lora_b: 1 slice of A [L, E, r, I] and
        B [L, E, H, r] (scaling folded into B); w13, w2 with ``with_base``. ``p.w13_lora_inputs()``
        and ``p.layer_inputs()`` are the keyword arguments of :func:`moelora_lab.moe_lora` and
        :func:`moelora_lab.moe_lora_layer`.

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> tuple(p.x.shape), tuple(p.topk_ids.shape), tuple(p.w13_lora_a[0].shape), tuple(p.w13_lora_b[0].shape)
    ((8, 64), (8, 2), (2, 8, 4, 64), (2, 8, 32, 4))
    >>> torch.equal(p.x, ml.make_problem("tiny", ml.LoRAShape(2, 4), num_tokens=8, seed=0).x)   # same seed
    True
    """
    if isinstance(shape, str):
        shape = MoEShape.from_name(shape)
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape or a preset name, got {type(shape).__name__}")
    if not isinstance(lora, LoRAShape):
        raise TypeError(f"lora: expected a LoRAShape(num_loras, rank), got {type(lora).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: {dtype} is not supported; use torch.float32, torch.float16 or torch.bfloat16")
    check_int("num_tokens", num_tokens, low=1)
    check_int("seed", seed)
    check_bool("with_base", with_base)
    check_bool("renormalize", renormalize)
    L, r, E, H, I = lora.num_loras, lora.rank, shape.num_experts, shape.hidden, shape.intermediate
    ranks = tuple(adapter_ranks) if adapter_ranks is not None else (r,) * L
    if len(ranks) != L or any(not isinstance(v, int) or not 0 <= v <= r for v in ranks):
        raise ValueError(f"adapter_ranks: expected {L} ints in [0, {r}], got {adapter_ranks!r}")

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    routing = make_routing(shape, L, num_tokens, seed=seed + 1, adapter_popularity=adapter_popularity,
                           no_adapter_fraction=no_adapter_fraction, expert_skew=expert_skew,
                           num_sequences=num_sequences, renormalize=renormalize)
    w13_a, w13_b = zip(*(_lora_pair(gen, L, E, r, H, I, ranks, dtype, device) for _ in range(2)))
    w2_a, w2_b = zip(_lora_pair(gen, L, E, r, I, H, ranks, dtype, device))
    w13 = w2 = None
    if with_base:
        w13 = (torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)).to(device=device, dtype=dtype)
        w2 = (torch.randn(E, H, I, generator=gen) / math.sqrt(I)).to(device=device, dtype=dtype)
    return Problem(
        shape=shape, lora=lora,
        x=x.to(device=device, dtype=dtype), **{name: t.to(device) for name, t in routing.items()},
        w13_lora_a=tuple(w13_a), w13_lora_b=tuple(w13_b), w2_lora_a=tuple(w2_a), w2_lora_b=tuple(w2_b),
        w13=w13, w2=w2, adapter_ranks=ranks,
    )


def random_lora_weights(shape: MoEShape, op: str, num_loras: int, rank: int, generator: torch.Generator,
                        dtype: torch.dtype = torch.bfloat16, device=None) -> tuple[list, list]:
    """One op's random LoRA weights, drawn where they live (fast for real presets on a GPU): ``op``
    'w13' gives 2 slices of A [L, E, r, H] and B [L, E, I, r], 'w2' 1 slice of A [L, E, r, I] and
    B [L, E, H, r]; A ~ N(0, 1/K), B ~ N(0, 1/r), B r-fastest. ``device`` defaults to the generator's."""
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape (e.g. MoEShape.from_name('tiny')), got {type(shape).__name__}")
    check_choice("op", op, ("w13", "w2"))
    L, r = check_int("num_loras", num_loras, low=1), check_int("rank", rank, low=1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, e.g. torch.Generator('cuda').manual_seed(0), "
                        f"got {type(generator).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: {dtype} is not supported; use torch.float32, torch.float16 or torch.bfloat16")
    device = generator.device if device is None else device
    H, I, E = shape.hidden, shape.intermediate, shape.num_experts
    k_in, n_out, slices = (H, I, 2) if op == "w13" else (I, H, 1)
    a = [torch.randn(L, E, r, k_in, device=device, generator=generator, dtype=dtype) / k_in ** 0.5
         for _ in range(slices)]
    b = [torch.randn(L, E, n_out, r, device=device, generator=generator, dtype=dtype) / r ** 0.5
         for _ in range(slices)]
    return a, b


def layer_lora_weights(shape: MoEShape, num_loras: int, rank: int, generator: torch.Generator,
                       dtype: torch.dtype = torch.bfloat16, device=None) -> dict:
    """Random LoRA weights of one layer as :func:`moelora_lab.moe_lora_layer` takes them: ``w13_lora_a``,
    ``w13_lora_b``, ``w2_lora_a``, ``w2_lora_b`` (:func:`random_lora_weights`, w13 drawn first), B packed
    N-fastest (:func:`moelora_lab.op.face.pack_lora_b`), as the layer benchmark uses them."""
    out = {}
    for op in ("w13", "w2"):
        a, b = random_lora_weights(shape, op, num_loras, rank, generator, dtype, device)
        out[f"{op}_lora_a"], out[f"{op}_lora_b"] = a, pack_lora_b(b)
    return out
