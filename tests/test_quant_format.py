"""moelora_lab.quant.format: FP8 e4m3 block-scaled weights and per-token-group activations.

The error bound. e4m3 has 3 mantissa bits: a normal value v (|v| >= 2^-6) sits between neighbours 2^(e-3)
apart, e = floor(log2 |v|), so round-to-nearest moves it by at most 2^(e-4) <= 2^-4 |v|; below 2^-6 the
subnormals are 2^-9 apart, so it moves by at most 2^-10. A weight w of a block with scale s = amax / 448 is
stored as round(w / s), hence

    |dequantized - w| <= max(2^-4 |w|, 2^-10 s)      (<= 2^-4 amax, since |w| <= amax and s = amax / 448)

up to the float32 roundings of w / s and q * s (relative 2^-24 each: the slack below). Truncation instead of
rounding would give up to 2^-3 |w| and fail.
"""
import pytest
import torch

from moelora_lab.quant.format import (BLOCK_SIZE, FP8_DTYPE, FP8_MAX, FP8Weight, QuantizedExperts,
                                      dequantize_activation, quantize_activation, quantize_experts, quantize_weight)

SLACK = 1 + 2**-16                  # the float32 roundings around the FP8 one


def _expand(scale, block, shape):
    """Each element's block scale, [E, N, K] (the test's own expansion, by index arithmetic)."""
    E, N, K = shape
    n, k = torch.arange(N) // block[0], torch.arange(K) // block[1]
    return scale[:, n[:, None], k[None, :]]


def _bound(w, s):
    return torch.maximum(2**-4 * w.abs(), 2**-10 * s) * SLACK


def _weights(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-12 .. 2^6 so blocks hold normal and subnormal FP8 values alike
    w = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 7, shape, generator=g).float())
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [(128, 128), (16, 32), None])
def test_round_trip_within_the_e4m3_bound(dtype, block):
    w = _weights((3, 200, 160), dtype=dtype)
    q = quantize_weight(w, block)
    wf = w.float()
    BN, BK = q.block_size
    s = _expand(q.scale, (BN, BK), w.shape)
    err = (q.dequantize() - wf).abs()
    assert (err <= _bound(wf, s)).all(), float((err / _bound(wf, s)).max())
    amax = wf.abs().amax()
    assert float(err.max()) <= 2**-4 * float(amax)
    assert float(err.max()) > 0                       # it did quantize
    # the bound is nearly reached: rounding is to nearest, not something coarser or finer by accident
    normal = wf.abs() >= 2**-6 * s
    assert float((err[normal] / wf.abs()[normal]).max()) > 2**-5


def test_rounding_is_to_nearest_not_toward_zero():
    # 1.0625 * s and 1.1875 * s are ties between FP8 neighbours (1, 1.125, 1.25): nearest-even gives 1 and 1.25
    w = torch.tensor([[[448.0, 1.0625, 1.1875, 1.2]]])
    q = quantize_weight(w, None)
    assert q.scale.item() == 1.0
    assert q.dequantize().tolist() == [[[448.0, 1.0, 1.25, 1.25]]]


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 1e4])
def test_no_saturation_and_full_range(magnitude):
    w = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(1)) * magnitude
    w[0, 5, 7] = 50 * magnitude                         # an outlier only stretches its own block's scale
    q = quantize_weight(w)
    data = q.data.float()
    assert not torch.isnan(data).any()
    amax = data.abs().view(2, 2, 128, 2, 128).amax(dim=(2, 4))
    assert torch.equal(amax, torch.full_like(amax, FP8_MAX))           # every block's largest maps onto 448
    torch.testing.assert_close(q.scale, w.abs().view(2, 2, 128, 2, 128).amax(dim=(2, 4)) / FP8_MAX,
                               rtol=0, atol=0)
    s = _expand(q.scale, BLOCK_SIZE, w.shape)
    assert ((q.dequantize() - w).abs() <= _bound(w, s)).all()
    assert q.dequantize()[0, 5, 7] == 50 * torch.tensor(magnitude, dtype=torch.float32)


def test_all_zero_blocks_get_scale_one():
    w = torch.randn(2, 256, 256)
    w[0, :128, 128:] = 0
    w[1] = 0
    q = quantize_weight(w)
    assert q.scale[0, 0, 1] == 1 and torch.equal(q.scale[1], torch.ones(2, 2))
    assert (q.scale[0].flatten()[[0, 2, 3]] != 1).all()
    assert not q.data.float()[0, :128, 128:].any() and not q.data.float()[1].any()
    assert torch.equal(q.dequantize()[1], torch.zeros(256, 256))


def test_partial_edge_blocks():
    w = _weights((2, 200, 130), seed=3)                    # 200 = 128 + 72 rows, 130 = 128 + 2 columns
    q = quantize_weight(w)
    assert q.scale.shape == (2, 2, 2) and q.data.shape == (2, 200, 130)
    # each edge block's scale comes from its own elements only (the padding does not count)
    for i, rows in enumerate((slice(0, 128), slice(128, 200))):
        for j, cols in enumerate((slice(0, 128), slice(128, 130))):
            assert torch.equal(q.scale[:, i, j], w[:, rows, cols].abs().amax(dim=(1, 2)) / FP8_MAX)
    assert (q.data[:, 128:, 128:].float().abs().amax(dim=(1, 2)) == FP8_MAX).all()
    s = _expand(q.scale, BLOCK_SIZE, w.shape)
    assert ((q.dequantize() - w).abs() <= _bound(w, s)).all()


def test_per_tensor_is_one_block_per_expert():
    w = _weights((3, 40, 24), seed=4)
    q = quantize_weight(w, None)
    assert q.block_size == (40, 24) and q.scale.shape == (3, 1, 1)
    assert torch.equal(q.scale.flatten(), w.abs().amax(dim=(1, 2)) / FP8_MAX)
    assert torch.equal(quantize_weight(w, (40, 24)).data.view(torch.uint8), q.data.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_dtype_and_experts(dtype):
    w13, w2 = _weights((2, 64, 48), 5), _weights((2, 48, 32), 6)
    qe = quantize_experts(w13.to(dtype), w2.to(dtype), (32, 16))
    assert isinstance(qe, QuantizedExperts) and qe.w13.block_size == qe.w2.block_size == (32, 16)
    a, b = qe.dequantize(dtype)
    assert a.dtype == b.dtype == dtype and a.shape == w13.shape and b.shape == w2.shape
    assert torch.equal(a, qe.w13.dequantize().to(dtype))
    assert qe.w13.shape == (2, 64, 48) and qe.w13.device == torch.device("cpu")


def test_nbytes():
    q = quantize_weight(torch.randn(3, 200, 130))
    assert q.nbytes() == 3 * 200 * 130 + 4 * 3 * 2 * 2
    assert quantize_weight(torch.randn(3, 200, 130), None).nbytes() == 3 * 200 * 130 + 4 * 3


@pytest.mark.parametrize("K, G", [(256, 128), (300, 128), (100, 128), (7, 3)])
def test_activation_round_trip(K, G):
    x = _weights((5, K), seed=7)
    x[2] = 0                                                       # an all-zero row
    xq, xs = quantize_activation(x, G)
    SK = -(-K // G)
    assert xq.dtype == FP8_DTYPE and xq.shape == (5, K) and xs.dtype == torch.float32 and xs.shape == (5, SK)
    assert torch.equal(xs[2], torch.ones(SK))
    for j in range(SK):                                            # each group's own amax, the last one partial
        group = x[:, j * G:(j + 1) * G].abs().amax(dim=1)
        assert torch.equal(xs[:, j], torch.where(group > 0, group / FP8_MAX, torch.ones_like(group)))
    back = dequantize_activation(xq, xs, G)
    assert back.shape == (5, K)
    s = xs.repeat_interleave(G, 1)[:, :K]
    assert ((back - x).abs() <= _bound(x, s)).all()
    assert dequantize_activation(xq, xs, G, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_activation_scale_follows_the_group_not_the_neighbours():
    x = torch.ones(1, 256)
    x[0, 200] = 1000.0                     # only the second group of 128 has the outlier
    xq, xs = quantize_activation(x)
    assert torch.equal(xs, torch.tensor([[1.0, 1000.0]]) / FP8_MAX)
    back = dequantize_activation(xq, xs)
    assert torch.equal(back[0, :128], torch.ones(128))


def _fp8(shape):
    return torch.zeros(shape, dtype=FP8_DTYPE)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: quantize_weight(torch.ones(2, 4, 4, dtype=torch.int32)), TypeError,
     r"^w: dtype torch.int32 is not supported; use one of float32, float16, bfloat16"),
    (lambda: quantize_weight(torch.ones(4, 4)), ValueError, r"^w: expected a 3-D tensor \[E, N, K\]"),
    (lambda: quantize_weight(torch.ones(2, 4, 4), (4,)), TypeError, r"^block_size: expected a pair \(BN, BK\)"),
    (lambda: quantize_weight(torch.ones(2, 4, 4), 128), TypeError, r"^block_size: expected a pair"),
    (lambda: quantize_weight(torch.ones(2, 4, 4), (0, 4)), ValueError, r"^block_size\[0\]: must be >= 1, got 0"),
    (lambda: quantize_weight(torch.ones(2, 4, 4), (4, 2.0)), TypeError, r"^block_size\[1\]: expected an int"),
    (lambda: FP8Weight(torch.zeros(1, 4, 4), torch.ones(1, 1, 1), (4, 4)), TypeError,
     r"^data: dtype torch.float32 is not supported; use one of float8_e4m3fn"),
    (lambda: FP8Weight(_fp8((1, 4, 4)), torch.ones(1, 1, 1, dtype=torch.float16), (4, 4)), TypeError,
     r"^scale: dtype torch.float16 is not supported; use one of float32"),
    (lambda: FP8Weight(_fp8((1, 200, 130)), torch.ones(1, 1, 2), (128, 128)), ValueError,
     r"^scale: expected shape \(1, 2, 2\) \[E, ceil\(N / 128\), ceil\(K / 128\)\], got \(1, 1, 2\)"),
    (lambda: FP8Weight(_fp8((1, 4, 4)), torch.ones(1, 2, 2), None), ValueError,
     r"^scale: expected shape \(1, 1, 1\)"),
    (lambda: FP8Weight(_fp8((1, 4, 4)), torch.ones(1, 1, 1), (4, -1)), ValueError, r"^block_size\[1\]: must be >= 1"),
    (lambda: quantize_activation(torch.ones(2, 8, dtype=torch.float64)), TypeError,
     r"^x: dtype torch.float64 is not supported"),
    (lambda: quantize_activation(torch.ones(2, 8, 1)), ValueError, r"^x: expected a 2-D tensor \[M, K\]"),
    (lambda: quantize_activation(torch.ones(2, 8), 0), ValueError, r"^group_size: must be >= 1, got 0"),
    (lambda: quantize_activation(torch.ones(2, 8), 64.0), TypeError, r"^group_size: expected an int"),
    (lambda: dequantize_activation(torch.ones(2, 8), torch.ones(2, 1)), TypeError,
     r"^xq: dtype torch.float32 is not supported; use one of float8_e4m3fn"),
    (lambda: dequantize_activation(_fp8((2, 300)), torch.ones(2, 2)), ValueError,
     r"^x_scale: expected shape \(2, 3\) \[M, ceil\(K / 128\)\], got \(2, 2\)"),
    (lambda: dequantize_activation(_fp8((2, 8)), torch.ones(2, 1, dtype=torch.bfloat16), 8), TypeError,
     r"^x_scale: dtype torch.bfloat16 is not supported; use one of float32"),
    (lambda: dequantize_activation(_fp8((2, 8)), torch.ones(2, 1), True), TypeError, r"^group_size: expected an int"),
])
def test_error_messages(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
