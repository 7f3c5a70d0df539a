"""The spec of the MoE-LoRA layer on FP8 base experts (moelora_lab.quant.reference) and the ``base_input`` hook of
moe_layer_reference it is built on.

The tolerance against float32. e4m3 rounding to nearest has a relative error uniform in +-ulp/2, ulp/|v| between
2^-4 and 2^-3: its RMS over log-uniform mantissas is 2^-3 sqrt(0.541 / 12) = 2.65%. A GEMM's output on random
data carries the RMS relative error of each quantized operand, added in quadrature: W13 x -> 3.75%; h = silu(g) *
up carries both halves' -> 5.3%; W2 h adds W2's and h's own rounding -> sqrt(5.3^2 + 2 * 2.65^2) = 6.5% of the
output's norm (weight-only: 2.65%, 3.75%, 4.6%). The tests bound these from both sides (quantization did
happen, and no more error than FP8 rounding explains).
"""
import pytest
import torch
import torch.nn.functional as F

from moelora_lab import LoRAShape, MoEShape, make_problem
from moelora_lab.quant.format import quantize_activation, quantize_experts
from moelora_lab.quant.reference import (fp8_codes, lora_fed_quantized_reference, moe_layer_reference_fp8,
                                         quantize_dequantize_activation)
from moelora_lab.reference import moe_layer_reference, moe_lora_reference

SHAPE = MoEShape(256, 128, 4, 2, "fp8")


def _problem(seed=0, shape=SHAPE, M=32, dtype=torch.float32, **kw):
    kw.setdefault("no_adapter_fraction", 0.3)
    return make_problem(shape, LoRAShape(3, 8), M, seed=seed, dtype=dtype, **kw)


def _zero_lora(inputs):
    return inputs | {n: tuple(torch.zeros_like(t) for t in inputs[n]) for n in ("w13_lora_b", "w2_lora_b")}


def _fp8_inputs(p, block=(128, 128), inputs=None):
    inputs = p.layer_inputs() if inputs is None else inputs
    rest = {k: v for k, v in inputs.items() if k not in ("w13", "w2")}
    return rest | {"experts": quantize_experts(inputs["w13"], inputs["w2"], block)}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _old_layer(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
    """moe_layer_reference as it was before ``base_input``, op for op."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    M, k = topk_ids.shape
    I = w2.shape[2]
    experts = topk_ids.reshape(-1).long()
    xs = x.to(acc).repeat_interleave(k, dim=0)
    c1 = torch.zeros(M * k, 2 * I, dtype=acc)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        c1[sel] = xs[sel] @ w13[e].to(acc).T
    c1 += moe_lora_reference(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b).view(M * k, 2 * I)
    h = F.silu(c1[:, :I]) * c1[:, I:]
    c3 = torch.zeros(M * k, w2.shape[1], dtype=acc)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        c3[sel] = h[sel] @ w2[e].to(acc).T
    c3 = c3 * topk_weights.reshape(-1, 1).to(acc)
    c3 += moe_lora_reference(h, topk_ids, topk_weights, token_lora, w2_lora_a, w2_lora_b,
                             mul_routed_weight=True).view(M * k, -1)
    return c3.view(M, k, -1).sum(dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_input_none_is_the_old_layer(dtype):
    p = _problem(seed=1, dtype=dtype)
    y = moe_layer_reference(**p.layer_inputs())
    assert torch.equal(y, _old_layer(**p.layer_inputs()))
    assert torch.equal(y, moe_layer_reference(**p.layer_inputs(), base_input=None))
    assert torch.equal(y, moe_layer_reference(**p.layer_inputs(), base_input=lambda t: t.clone()))


def test_base_input_reaches_the_base_gemms_only():
    p = _problem(seed=2, no_adapter_fraction=0.5)
    seen = []

    def nothing(t):                           # the base reads zeros: only the LoRA path is left
        seen.append((tuple(t.shape), t.dtype))
        return torch.zeros_like(t)
    y = moe_layer_reference(**p.layer_inputs(), base_input=nothing)
    M, k, H, I = 32, SHAPE.top_k, SHAPE.hidden, SHAPE.intermediate
    assert seen == [((M, H), torch.float32), ((M * k, I), torch.float32)]
    has = p.token_lora >= 0
    assert has.any() and (~has).any()
    assert torch.equal(y[~has], torch.zeros_like(y[~has]))            # no adapter, no base: exactly zero
    assert (y[has].abs().sum(-1) > 0).all()                            # the LoRA read the real x and h


def test_base_input_refusals():
    p = _problem()
    with pytest.raises(TypeError, match=r"^base_input: expected a function of the GEMM's input or None, got str"):
        moe_layer_reference(**p.layer_inputs(), base_input="fp8")
    with pytest.raises(TypeError, match=r"^lora_input: expected a function of the GEMM's input or None, got int"):
        moe_layer_reference(**p.layer_inputs(), lora_input=3)
    with pytest.raises(ValueError, match=r"^base_input: returned \(32, 255\) torch.float32 for an input of \(32, 256\) "
                                         r"torch.float32; it must return a tensor of the same shape and dtype"):
        moe_layer_reference(**p.layer_inputs(), base_input=lambda t: t[:, 1:])
    with pytest.raises(ValueError, match=r"^base_input: returned .* torch.float16 for an input"):
        moe_layer_reference(**p.layer_inputs(), base_input=lambda t: t.half())


@pytest.mark.parametrize("shape, group", [(SHAPE, 128), (MoEShape(200, 96, 4, 2), 128), (SHAPE, 64)])
def test_fp8_spec_is_close_to_float32(shape, group):
    p = _problem(seed=3, shape=shape)
    inputs = _zero_lora(p.layer_inputs())           # the base alone: the LoRA path is not quantized at all
    ref = moe_layer_reference(**inputs)
    full = _rel(moe_layer_reference_fp8(**_fp8_inputs(p, inputs=inputs), group_size=group), ref)
    weight_only = _rel(moe_layer_reference_fp8(**_fp8_inputs(p, inputs=inputs), quantize_inputs=False), ref)
    assert 0.04 < full < 0.10, full                          # the model: 6.5%
    assert 0.03 < weight_only < 0.07, weight_only            # the model: 4.6%
    with_lora = moe_layer_reference_fp8(**_fp8_inputs(p), group_size=group)
    assert _rel(with_lora, moe_layer_reference(**p.layer_inputs())) < 0.10


def test_weight_only_is_the_layer_on_dequantized_weights():
    p = _problem(seed=4)
    fp8 = _fp8_inputs(p)
    w13, w2 = fp8["experts"].dequantize()
    plain = moe_layer_reference(**(p.layer_inputs() | {"w13": w13, "w2": w2}))
    assert torch.equal(moe_layer_reference_fp8(**fp8, quantize_inputs=False), plain)
    assert not torch.equal(moe_layer_reference_fp8(**fp8), plain)


def test_tokens_without_adapter_get_exactly_the_quantized_base():
    p = _problem(seed=5, no_adapter_fraction=0.5)
    y = moe_layer_reference_fp8(**_fp8_inputs(p))
    base = moe_layer_reference_fp8(**_fp8_inputs(p, inputs=_zero_lora(p.layer_inputs())))
    none = p.token_lora < 0
    assert none.any() and torch.equal(y[none], base[none])
    assert ((y[~none] - base[~none]).abs().sum(-1) > 0).all()


def test_the_lora_path_never_sees_quantization():
    # a zero base is exactly zero in FP8: the layer is its LoRA path alone, which the spec leaves unquantized
    p = _problem(seed=6)
    inputs = p.layer_inputs() | {"w13": torch.zeros_like(p.w13), "w2": torch.zeros_like(p.w2)}
    ref = moe_layer_reference(**inputs)
    assert ref.abs().sum() > 0
    assert torch.equal(moe_layer_reference_fp8(**_fp8_inputs(p, inputs=inputs)), ref)
    mistaken = lora_fed_quantized_reference(**_fp8_inputs(p, inputs=inputs))
    assert _rel(mistaken, ref) > 0.02                         # FP8 rounding of x and h: about 2.65% each
    codes = lora_fed_quantized_reference(**_fp8_inputs(p, inputs=inputs), scaled=False)
    assert _rel(codes, ref) > 10                              # x / scale: every group's max magnified to 448


def test_fp8_codes_are_the_activation_without_its_scales():
    t = torch.randn(6, 300) * torch.logspace(-3, 1, 6)[:, None]
    codes, scale = fp8_codes(t), quantize_activation(t)[1]
    assert codes.dtype == t.dtype and codes.abs().amax(1).tolist() == [448.0] * 6
    torch.testing.assert_close(codes * scale.repeat_interleave(128, 1)[:, :300], quantize_dequantize_activation(t),
                               rtol=0, atol=0)
    assert fp8_codes(t.double()).dtype == torch.float64


def test_the_mistake_adds_error_to_the_lora_term():
    # with a real base, the LoRA term (the layer minus the layer without LoRA) moves with the base's own
    # quantization (h changes); feeding the LoRA quantized activations adds an independent error on top of that
    p = _problem(seed=7)
    zero = _zero_lora(p.layer_inputs())
    term32 = moe_layer_reference(**p.layer_inputs()) - moe_layer_reference(**zero)
    right = moe_layer_reference_fp8(**_fp8_inputs(p)) - moe_layer_reference_fp8(**_fp8_inputs(p, inputs=zero))
    base_wrong = lora_fed_quantized_reference(**_fp8_inputs(p, inputs=zero))
    assert torch.equal(base_wrong, moe_layer_reference_fp8(**_fp8_inputs(p, inputs=zero)))   # same base
    wrong = lora_fed_quantized_reference(**_fp8_inputs(p)) - base_wrong
    assert _rel(wrong, right) > 0.02
    assert _rel(wrong, term32) > 1.1 * _rel(right, term32), (_rel(wrong, term32), _rel(right, term32))
    weight_only = lora_fed_quantized_reference(**_fp8_inputs(p), quantize_inputs=False)
    assert torch.equal(weight_only, moe_layer_reference_fp8(**_fp8_inputs(p), quantize_inputs=False))


def test_float64_inputs_and_the_activation_round_trip():
    p = _problem(seed=8)
    y32 = moe_layer_reference_fp8(**_fp8_inputs(p))
    inputs = _fp8_inputs(p) | {"x": p.x.double()}
    y64 = moe_layer_reference_fp8(**inputs)
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), y32, rtol=1e-4, atol=1e-4 * float(y32.abs().max()))
    t = torch.randn(5, 300, dtype=torch.float64)
    back = quantize_dequantize_activation(t)
    assert back.dtype == torch.float64 and 0 < _rel(back, t) < 0.04


def test_refusals():
    p = _problem()
    inputs = _fp8_inputs(p)
    with pytest.raises(TypeError, match=r"^experts: expected a QuantizedExperts .* got tuple"):
        moe_layer_reference_fp8(**(inputs | {"experts": (p.w13, p.w2)}))
    with pytest.raises(ValueError, match=r"^group_size: must be >= 1, got 0"):
        moe_layer_reference_fp8(**inputs, group_size=0)
    with pytest.raises(TypeError, match=r"^quantize_inputs: expected True or False, got str 'no'"):
        lora_fed_quantized_reference(**inputs, quantize_inputs="no")
    with pytest.raises(TypeError, match=r"^scaled: expected True or False, got int 0"):
        lora_fed_quantized_reference(**inputs, scaled=0)
    with pytest.raises(ValueError, match=r"^x: has 255 features but w13 expects H=256"):
        lora_fed_quantized_reference(**(inputs | {"x": p.x[:, 1:]}))
