"""The public LoRA-on-MoE op: validate, build the routing metadata, dispatch to a path.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
P = M*k pairs, B blocks.

    out[t, j, s*N:(s+1)*N] (+)= (w_tj if mul_routed_weight) * B_s[l, e] @ (A_s[l, e] @ x_row)

for every pair (t, j) whose token has an adapter l = token_lora[t] >= 0 (and an enabled slot),
with e = topk_ids[t, j]; x_row = x[t] (x is [M, K]) or x[t*k + j] (x is [M*k, K]).
The paths (``paths.PATHS``) compute the same delta with different memory traffic.
"""
from __future__ import annotations

import torch

from .._backend import INTERPRET, on_device
from ..routing.device import make_blocks
from ..blocks import BlockList
from .dispatch import KernelConfig, choice_rank, choose_config
from .paths import PATHS, LoRACall, resolve_path
from ..validate import (check_blocks, check_bool, check_enabled, check_lora_ranks, check_op_inputs, check_output,
                       check_tensor, check_values, routing_ranges, wants_grad)


def pack_lora_b(lora_b):
    """LoRA B with N fastest in memory: same shape, same values, another memory order.

    Parameters
    ----------
    lora_b : torch.Tensor or list of torch.Tensor
        B [L, E, N, r] of one slice, or a list/tuple of slices (each packed).

    Returns
    -------
    torch.Tensor or list of torch.Tensor
        The same values with stride 1 along N (dim 2), in a list or tuple where ``lora_b`` is one.

    Notes
    -----
    The expand multiplies the rank tile by a [r, BLOCK_N] tile of B. In the usual layout (r fastest)
    that tile is BLOCK_N runs of r elements (32 bytes at r = 16, bf16); with N fastest it is r runs of
    BLOCK_N elements. Both are whole DRAM sectors, and since the kernels build their rank offsets as
    one contiguous run the two layouts run at about the same speed (``bench expand``); before that the
    rank-fastest tile was loaded 2 bytes at a time and packing paid. Every path and the layer accept
    either layout (the kernels take strides).

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> b = p.w13_lora_b[0]                                   # [L, E, N, r] = [2, 8, 32, 4], r fastest
    >>> packed = ml.pack_lora_b(b)
    >>> packed.shape == b.shape, torch.equal(packed, b), b.stride(3), packed.stride(2)
    (True, True, 1, 1)
    >>> delta = ml.moe_lora(**(p.w13_lora_inputs() | dict(lora_b=ml.pack_lora_b(p.w13_lora_b))))
    >>> torch.allclose(delta, ml.moe_lora(**p.w13_lora_inputs()), rtol=1e-5, atol=1e-5)
    True
    """
    if isinstance(lora_b, (list, tuple)):
        return type(lora_b)(pack_lora_b(b) for b in lora_b)
    check_tensor("lora_b", lora_b, ndim=4, legend="[L, E, N, r]")
    return lora_b.transpose(2, 3).contiguous().transpose(2, 3)


def moe_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, path: str = "auto",
             mul_routed_weight: bool = False, output: torch.Tensor | None = None, add_inputs: bool = True,
             blocks: BlockList | None = None, config: KernelConfig | None = None,
             enabled: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None,
             validate: bool = True) -> torch.Tensor:
    """LoRA delta of every routed pair, added into (or written to) ``output`` [M, k, S*N].

    Parameters
    ----------
    x : torch.Tensor
        [M, K] token rows (every slot of a token reads its row: the w13 input) or [M*k, K] pair rows
        (the w2 input); float32, float16 or bfloat16.
    topk_ids : torch.Tensor
        [M, k] int32/int64 expert of each (token, slot) pair, in [0, E).
    topk_weights : torch.Tensor or None
        [M, k] routing weights (float); read only with ``mul_routed_weight``.
    token_lora : torch.Tensor
        [M] int32/int64 adapter slot of each token in [0, L); -1 = no adapter (its rows are left alone).
    lora_a, lora_b : list of torch.Tensor
        One tensor per slice (2 for w13's gate and up, 1 for w2): A [L, E, r, K] and B [L, E, N, r],
        in x's dtype, scaling alpha/r folded into B; B may be packed N-fastest (:func:`pack_lora_b`).
    path : str
        'auto' (the measured rule), or a name of ``moelora_lab.PATHS``: 'reference', 'two_kernel',
        'one_shot', 'small_batch'.
    mul_routed_weight : bool
        Scale each pair's delta by its routing weight (w2's LoRA does, w13's does not).
    output : torch.Tensor, optional
        [M, k, S*N] in x's dtype, rows contiguous, not sharing memory with any input; a zero-filled
        one is allocated when omitted.
    add_inputs : bool
        True: add into ``output``; False: overwrite the rows of pairs with an adapter. Rows of tokens
        without an adapter are never touched.
    blocks : BlockList, optional
        Routing metadata from :func:`moelora_lab.block_list` to reuse (e.g. for w13 and w2 of one
        layer); it must have been built from these very ``topk_ids`` and ``token_lora``, unchanged.
    config : KernelConfig, optional
        Tiles; chosen from the shapes and the device by default.
    enabled : torch.Tensor, optional
        [L] bool: slots marked False are treated as "no adapter".
    lora_ranks : torch.Tensor, optional
        [L] int: the actual rank of each slot (<= r); the Triton paths read only that many rows of A
        and columns of B (weights past it are never read). Rank 0 (a slot, or r itself) adds nothing.
        Given on the CPU, ``path="auto"`` picks by the largest real rank instead of r (a device
        tensor would cost a synchronisation to read: there it picks by r).
    validate : bool
        False skips the id-range checks (one device synchronisation per call) for ids you have
        checked; shapes, dtypes, devices and reused ``blocks`` are always checked.

    Returns
    -------
    torch.Tensor
        ``output``. When grad is enabled and x, a slice of ``lora_a`` or ``lora_b``, or (with
        ``mul_routed_weight``) ``topk_weights`` requires grad, the delta is recorded for autograd: its
        backward is ``moelora_lab.moe_lora_backward`` ('reference' after ``path="reference"``, else
        'auto'); ``output`` then receives the delta by a recorded in-place add (or copy, with
        ``add_inputs=False``), through which the gradient flows.

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> delta = ml.moe_lora(**p.w13_lora_inputs())          # w13's two slices (gate, up), path="auto"
    >>> tuple(delta.shape)                                   # [M, k, 2*I]
    (8, 2, 64)
    >>> torch.allclose(delta, ml.moe_lora_reference(**p.w13_lora_inputs()), rtol=1e-4, atol=1e-4)
    True
    >>> # x one feature short: the error names the argument and says what it expects
    >>> ml.moe_lora(**(p.w13_lora_inputs() | dict(x=p.x[:, :-1])))   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: lora_a[0]: expects K=64 input features (dim 3) but x has 63 features (dim 1); ...
    """
    if wants_grad(x, topk_weights if mul_routed_weight else None, lora_a, lora_b):
        from .grad import lora_with_grad            # training: the op recorded with its backward
        check_bool("add_inputs", add_inputs)
        delta = lora_with_grad(moe_lora, x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                               grad_path="reference" if path == "reference" else "auto", path=path,
                               mul_routed_weight=mul_routed_weight, blocks=blocks, config=config, enabled=enabled,
                               lora_ranks=lora_ranks, validate=validate)
        if output is None:
            return delta
        check_output(output, topk_ids.shape[0], topk_ids.shape[1], delta.shape[2], x, topk_ids=topk_ids,
                     topk_weights=topk_weights, token_lora=token_lora, lora_a=lora_a, lora_b=lora_b, enabled=enabled,
                     lora_ranks=lora_ranks)
        if add_inputs:                              # in place, recorded: the delta's gradient flows through
            return output.add_(delta)
        owned = token_lora >= 0                     # overwrite the rows of pairs with an adapter, as the kernels do
        if enabled is not None:
            owned &= enabled.to(token_lora.device)[token_lora.clamp(min=0).long()]
        return output.copy_(torch.where(owned.view(-1, 1, 1), delta, output))
    check_bool("add_inputs", add_inputs)
    check_bool("validate", validate)
    M, k, L, E, R, K, N, S = check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                             mul_routed_weight=mul_routed_weight, values=False, same_dtype=True)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    check_enabled(enabled, L)
    ranges = check_lora_ranks(lora_ranks, L, R)
    checked = False
    if blocks is not None:
        block_m = check_blocks(blocks, topk_ids, token_lora, E, L)
        checked = blocks.routing.values_checked
        if config is not None and config.block_m != block_m:
            raise ValueError(f"config.block_m={config.block_m} differs from the blocks' block size {block_m}")
    if output is None:
        output = torch.zeros(M, k, S * N, dtype=x.dtype, device=x.device)
    else:
        check_output(output, M, k, S * N, x, topk_ids=topk_ids, topk_weights=topk_weights, token_lora=token_lora,
                     lora_a=lora_a, lora_b=lora_b, enabled=enabled, lora_ranks=lora_ranks)
    token_rows = not (x.shape[0] == M * k and k > 1)
    path = resolve_path(path, num_pairs=M * k, num_experts=E, num_loras=L, rank=R, add_inputs=add_inputs,
                        token_rows=token_rows, choice_rank=choice_rank(R, lora_ranks), n_out=N)
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L)))
    if M == 0:
        return output
    if PATHS[path].triton and x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the Triton paths need CUDA tensors (got {x.device}); set MOELORA_INTERPRET=1 "
                         "before importing moelora_lab to run them on the CPU, or use path='reference'")
    if PATHS[path].triton and INTERPRET and x.dtype == torch.bfloat16:    # the interpreter mis-computes bf16
        out32 = output.float()
        moe_lora(x.float(), topk_ids, topk_weights, token_lora, [w.float() for w in lora_a],
                 [w.float() for w in lora_b], path=path, mul_routed_weight=mul_routed_weight, output=out32,
                 add_inputs=add_inputs, blocks=blocks, config=config, enabled=enabled, lora_ranks=lora_ranks,
                 validate=False)
        return output.copy_(out32)

    with on_device(x):
        if lora_ranks is not None:
            lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        if enabled is not None:                     # disabled slots become "no adapter"; -1 stays -1
            enabled = enabled.to(x.device)
            on = (token_lora >= 0) & enabled[token_lora.clamp(min=0).long()]
            token_lora = torch.where(on, token_lora, torch.full_like(token_lora, -1))
            if blocks is not None:
                blocks = blocks.with_slots_disabled(enabled)
        if blocks is None and PATHS[path].uses_blocks:
            cfg = config or choose_config(path, M * k, min(M * k, L * E), N, S, x.device, rank=R)
            blocks = make_blocks(topk_ids, token_lora, E, L, cfg.block_m, values_checked=validate)
        run_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, blocks, path, config,
                 mul_routed_weight=mul_routed_weight, add_inputs=add_inputs, lora_ranks=lora_ranks)
    return output


def run_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, blocks, path, config=None, *,
             mul_routed_weight=False, add_inputs=True, lora_ranks=None, side_stream=False):
    """Launch one path (a key of ``PATHS``) on inputs that were already validated (no host sync).

    ``blocks`` is the :class:`BlockList` for paths that use one; ``config=None`` picks tiles from the
    shapes (``side_stream``: the tiles for a launch beside the base GEMMs, on the two-stream layer's side
    stream). Used by :func:`moe_lora` and by the layer, which validates once and shares one BlockList
    between w13 and w2. Rank 0 is the zero delta on every path.
    """
    call = LoRACall(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, blocks, lora_ranks,
                    mul_routed_weight, add_inputs, side_stream)
    if lora_a[0].shape[2] == 0:                       # rank 0: nothing to add; owned rows get zeros
        if not add_inputs:
            owned = (token_lora >= 0).view(-1, 1, 1)
            output.masked_fill_(owned, 0)
        return None
    return PATHS[path].launch(call, config)
