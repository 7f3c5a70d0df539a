"""The expert-parallel combine's last step: each token's k returned rows, found in arrival order, summed.

Shape legend: M tokens, k top-k, H hidden, P = M*k pairs.

After the combine's all-to-all a rank holds its pairs' weighted outputs in the order it sent them
(sorted by destination rank). Putting them back in pair order first would be one more pass over
[P, H]; this kernel reads each pair's row where it arrived instead, through ``pos`` (the inverse of
the send order), and adds the k rows of a token in fp32.
"""
import triton
import triton.language as tl


@triton.jit
def gather_sum_kernel(
    # ---- pointers
    rows_ptr,          # [P, H] returned rows, in send order; fp32/fp16/bf16
    pos_ptr,           # [P] int64: pos[t*k + j] = the row of pair (t, j)
    y_ptr,             # [M, H] output, rows' dtype
    # ---- sizes
    top_k, H,
    # ---- strides (the columns of both are contiguous)
    stride_r, stride_y,
    # ---- meta-parameters
    BLOCK: tl.constexpr,
):
    """Program (token, column tile): y[t] = sum_j rows[pos[t*k + j]]."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        row = tl.load(pos_ptr + token * top_k + j)
        acc += tl.load(rows_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + token.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)
