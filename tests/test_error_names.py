"""A wrong LoRA A is reported as A, and a wrong input width names the input, in the op and in the layer."""
import pytest

import moelora_lab as ml


@pytest.fixture(scope="module")
def problem():
    return ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)


def _op(p, **change):
    return ml.moe_lora(**(p.w13_lora_inputs() | change), path="reference")


def _layer(p, **change):
    return ml.moe_lora_layer(**(p.layer_inputs() | change))


def _other_layout(w):
    """The same values with rank and K swapped in memory (another stride pattern)."""
    return w.transpose(2, 3).contiguous().transpose(2, 3)


def test_op_names_lora_a_when_lora_a_is_wrong(problem):
    a = problem.w13_lora_a
    with pytest.raises(TypeError, match=r"^lora_a\[0\]: dtype torch.float16 must equal x's dtype torch.float32"):
        _op(problem, lora_a=[w.half() for w in a])
    with pytest.raises(ValueError, match=r"^lora_a\[0\]: is on meta but x is on cpu"):
        _op(problem, lora_a=[w.to("meta") for w in a])
    with pytest.raises(ValueError, match=r"^lora_a: the slices have different memory layouts .*make them all "
                                         r"contiguous$") as err:
        _op(problem, lora_a=[a[0], _other_layout(a[1])])
    assert "lora_b" not in str(err.value)


def test_op_names_lora_b_when_lora_b_is_wrong(problem):
    b = problem.w13_lora_b
    with pytest.raises(ValueError, match=r"^lora_b\[0\]: is on meta but x is on cpu"):
        _op(problem, lora_b=[w.to("meta") for w in b])
    with pytest.raises(ValueError, match=r"^lora_b: the slices have different memory layouts .*pack_lora_b"):
        _op(problem, lora_b=[b[0], ml.pack_lora_b(b[1])])


def test_op_width_error_names_x(problem):
    H = problem.shape.hidden
    with pytest.raises(ValueError, match=rf"^lora_a\[0\]: expects K={H} input features \(dim 3\) but x has {H - 1} "
                                         r"features \(dim 1\)"):
        _op(problem, x=problem.x[:, :-1])


def test_layer_names_the_weight_and_the_input(problem):
    H, I = problem.shape.hidden, problem.shape.intermediate
    a13, a2 = problem.w13_lora_a, problem.w2_lora_a
    with pytest.raises(ValueError, match=rf"^w13_lora_a\[0\]: expects K={H - 1} input features \(dim 3\) but x has "
                                         rf"{H} features"):
        _layer(problem, w13_lora_a=[w[..., :-1] for w in a13])
    with pytest.raises(ValueError, match=rf"^w2_lora_a\[0\]: expects K={I - 1} input features \(dim 3\) but the "
                                         rf"activation w2 reads has {I} features \(I, dim 2 of w2\)"):
        _layer(problem, w2_lora_a=[w[..., :-1] for w in a2])
    with pytest.raises(ValueError, match=r"^w2_lora_a\[0\]: is on meta but x is on cpu"):
        _layer(problem, w2_lora_a=[w.to("meta") for w in a2])
    with pytest.raises(ValueError, match=r"^w13_lora_a: the slices have different memory layouts") as err:
        _layer(problem, w13_lora_a=[a13[0], _other_layout(a13[1])])
    assert "w13_lora_b" not in str(err.value)
    with pytest.raises(TypeError, match=r"^w13_lora_a\[0\]: dtype torch.float16 must equal x's dtype"):
        _layer(problem, w13_lora_a=[w.half() for w in a13])
