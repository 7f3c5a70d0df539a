"""The FP8 base MoE layer's kernels: grouped GEMM of e4m3 activations and weights with block scales (w8a8),
and the per-row, per-group activation quantization that feeds it.

Shape legend: M tokens, k top-k, E experts, K in, N out, P = M*k pairs, BM = BLOCK_M pairs per block,
BN = BLOCK_N, BK = BLOCK_K, B blocks, G the activation group (columns per x scale), SBN x SBK the weight's
scale block, SKx = ceil(K / G), SN = ceil(N / SBN), SK = ceil(K / SBK).

The GEMM runs on the bf16 base GEMM's routing plan and its pieces (``kernels/base_moe``: program numbering,
block rows, x and W tiles, the store); what it adds is the scales: every K step multiplies FP8 tiles into a
float32 partial product, which is scaled by the x scale of each row and the W scale of each column before it
joins the accumulator. One K step therefore lies inside one activation group and one weight block along K
(the launcher picks such a BLOCK_K).

The Triton interpreter keeps FP8 tensors as their bytes and decodes them exactly (finite values; the NaN bytes
0x7f / 0xff read as +-480), and its FP8 dot is exact; its float-to-FP8 cast misrounds (ties away from zero, a
carry into the exponent dropped: 31.6 becomes 16, not 32; wrong subnormals), on triton 3.6 and 3.7 alike. So
the GEMM runs unchanged under the interpreter, and the quantization kernel encodes its bytes itself there
(``EMULATE_FP8``: the output viewed as uint8), the same kernel casting natively on a GPU.
"""
import triton
import triton.language as tl

from .base_moe import half_tile, store_tile, tile_operands, w_tile, x_tile
from .common import gemm_tile

FP8_MAX = tl.constexpr(448.0)        # the largest finite float8_e4m3fn


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def moe_gemm_fp8_kernel(
    # pointers
    xq_ptr,            # [M, K] (TOKEN_ROWS) or [P, K] float8_e4m3fn
    x_scale_ptr,       # [M, SKx] or [P, SKx] fp32: x = xq * x_scale of its row and group
    w_ptr,             # [E, N, K] float8_e4m3fn
    w_desc,            # TMA descriptor of W viewed [E*N, K], box [BN, BK] (read if W_TMA)
    w_scale_ptr,       # [E, SN, SK] fp32: W = data * w_scale of its block
    out_ptr,           # [P, N] one row per pair, fp32/fp16/bf16
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused
    # sizes
    num_pairs, top_k, K, N, num_blocks,
    group_k,           # G: x columns per activation scale (BK divides it, or G >= K)
    scale_bn, scale_bk,  # SBN, SBK: W's scale block (BK divides SBK, or SBK >= K)
    # strides
    stride_xm, stride_xk, stride_sxm, stride_sxk, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_om, stride_on,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,              # W tiles through the tensor memory accelerator (Hopper and later)
    HALF_TAIL: tl.constexpr = False,  # a block whose second half is padding runs a BM / 2 tile
):
    """Program (block, N tile): out[rows, n-tile] = (w *) Xd[rows] @ Wd[e, n-tile]^T, Xd and Wd the values the
    FP8 operands and their scales stand for, accumulated in fp32 one K step at a time:
    acc += dot(xq, wq^T) * x_scale[rows, k-group][:, None] * w_scale[e, n-block(cols), k-block][None, :].

    Numbering, rows, tiles and the store are those of ``moe_gemm_kernel`` (one slice: N tiles cover N).
    """
    block, _, n0 = gemm_tile(tl.program_id(0), N, N, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = block * BLOCK_M
    if half_tile(sorted_pairs_ptr, start, num_pairs, BLOCK_M, HALF_TAIL):
        _block_tile_fp8(start, expert, n0, xq_ptr, x_scale_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr,
                        topk_weights_ptr, sorted_pairs_ptr, num_pairs, top_k, K, N, group_k, scale_bn, scale_bk,
                        stride_xm, stride_xk, stride_sxm, stride_sxk, stride_we, stride_wn, stride_wk, stride_se,
                        stride_sn, stride_sk, stride_om, stride_on, BLOCK_M // 2, BLOCK_N, BLOCK_K, TOKEN_ROWS,
                        MUL_ROUTED_WEIGHT, EVEN_K, W_TMA)
    else:
        _block_tile_fp8(start, expert, n0, xq_ptr, x_scale_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr,
                        topk_weights_ptr, sorted_pairs_ptr, num_pairs, top_k, K, N, group_k, scale_bn, scale_bk,
                        stride_xm, stride_xk, stride_sxm, stride_sxk, stride_we, stride_wn, stride_wk, stride_se,
                        stride_sn, stride_sk, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_K, TOKEN_ROWS,
                        MUL_ROUTED_WEIGHT, EVEN_K, W_TMA)


@triton.jit
def _block_tile_fp8(start, expert, n0, xq_ptr, x_scale_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr, topk_weights_ptr,
                    sorted_pairs_ptr, num_pairs, top_k, K, N, group_k, scale_bn, scale_bk, stride_xm, stride_xk,
                    stride_sxm, stride_sxk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                    stride_om, stride_on, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                    W_TMA: tl.constexpr):
    """One output tile of ``moe_gemm_fp8_kernel``: the BM pairs from slot ``start`` of ``expert``'s blocks."""
    pairs, valid, x_rows, n_local, n_ok, offs_n, offs_k, x_base, w_base, w_row0 = tile_operands(
        start, expert, 0, n0, xq_ptr, w_ptr, sorted_pairs_ptr, num_pairs, top_k, N, N, stride_xm, stride_we,
        stride_wn, BM, BLOCK_N, BLOCK_K, TOKEN_ROWS)
    xs_base = x_scale_ptr + x_rows.to(tl.int64) * stride_sxm                                  # [BM]
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // scale_bn) * stride_sn  # [BN]
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        xk = x_tile(x_base, ks, valid, K, stride_xk, EVEN_K)                                  # [BM, BK] fp8
        wk = w_tile(w_base, w_desc, w_row0, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)        # [BK, BN] fp8
        xs = tl.load(xs_base + (k0 // group_k) * stride_sxk, mask=valid, other=0.0)            # [BM]
        ws = tl.load(ws_base + (k0 // scale_bk) * stride_sk, mask=n_ok, other=0.0)             # [BN]
        acc += tl.dot(xk, wk) * xs[:, None] * ws[None, :]
    store_tile(acc, pairs, valid, offs_n, n_ok, out_ptr, topk_weights_ptr, stride_om, stride_on, MUL_ROUTED_WEIGHT)


@triton.jit
def quantize_rows_kernel(
    # pointers
    x_ptr,             # [M, K] fp32/fp16/bf16
    xq_ptr,            # [M, K] float8_e4m3fn; with EMULATE_FP8 the same bytes viewed as uint8
    scale_ptr,         # [M, SKx] fp32
    # sizes
    M, K, group_size,  # group_size: G, x columns per scale
    # strides
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    # meta-parameters
    BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr,  # BLOCK_G: min(G, K) up to a power of two
    EMULATE_FP8: tl.constexpr,        # encode the e4m3 bytes with integer arithmetic (the interpreter)
):
    """Program (row tile, group), groups numbered fastest: for each of BLOCK_ROWS rows, the group's largest
    magnitude amax gives scale = amax / 448 (1 where amax is 0); xq = x / scale (clamped to +-448) as e4m3,
    rounded to nearest even. Both divisions are IEEE (``div_rn``: a GPU's ``/`` on fp32 is approximate), so
    the result equals ``quant.quantize_activation`` bit for bit on finite input."""
    groups = tl.cdiv(K, group_size)
    rows = (tl.program_id(0) // groups) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(0) % groups
    offs = tl.arange(0, BLOCK_G)
    cols = group * group_size + offs
    ok = (rows < M)[:, None] & ((offs < group_size) & (cols < K))[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=ok, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)                                                             # [ROWS]
    scale = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if EMULATE_FP8:
        q = e4m3_bits(q)
    else:
        q = q.to(xq_ptr.dtype.element_ty)
    tl.store(xq_ptr + rows64[:, None] * stride_qm + cols[None, :] * stride_qk, q, mask=ok)
    tl.store(scale_ptr + rows64 * stride_sm + group * stride_sk, scale, mask=rows < M)


@triton.jit
def e4m3_bits(v):
    """The float8_e4m3fn bytes (uint8) of fp32 ``v``, |v| <= 448, rounded to nearest even, from v's bits:
    normal results (|v| >= 2^-6) drop 20 of the 23 mantissa bits (a carry may bump the exponent) and rebias
    the exponent from 127 to 7; subnormal ones are multiples of 2^-9, the significand with its leading one
    shifted right by 141 - exponent."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exp, 31)
    sub = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    return (tl.where(exp >= 121, normal, sub) | sign).to(tl.uint8)
