"""The table of LoRA paths: the op, auto, the layer, the benchmarks and the README read it."""
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import moelora_lab as ml
from moelora_lab.op import paths
from moelora_lab.op.paths import PATH_CHOICES, PATHS, TRITON_PATHS, get_path, paths_markdown, resolve_path
from utils import assert_close, lora_case, shrink_spec

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_the_table():
    text = README.read_text()
    block = re.search(r"<!-- paths-table -->\n(.*?)\n<!-- /paths-table -->", text, re.S)
    assert block, "README.md lost its paths table markers"
    assert block.group(1).strip() == paths_markdown(), "README's paths table is stale: paste paths_markdown()"


def test_every_entry_is_complete():
    assert set(PATHS) == {"reference", "two_kernel", "one_shot", "small_batch"}
    for name, p in PATHS.items():
        assert p.name == name and callable(p.launch) and Path(README.parent / p.kernels).exists()
        assert p.status in paths.STATUSES
    assert PATH_CHOICES == tuple(PATHS) + ("auto",)
    assert TRITON_PATHS == ("two_kernel", "one_shot", "small_batch")
    assert [n for n, p in PATHS.items() if p.status == "experiment"] == ["small_batch"]


def test_experiment_rows_name_their_launcher_by_import_path():
    """An experiment row's launcher is a "module:function" string, imported on first use, so that the
    product's table never imports ``moelora_lab.experiments``; a malformed row is refused when built."""
    row = PATHS["small_batch"]
    assert row.launcher == "moelora_lab.experiments.small_batch:launch"
    assert row.kernels == "moelora_lab/experiments/kernels/small_batch.py"
    from moelora_lab.experiments import small_batch
    assert row.launch is small_batch.launch
    assert PATHS["one_shot"].launch is paths.launch_one_shot          # a product row may hold the function itself
    with pytest.raises(ValueError, match="status 'lost' is not one of product, experiment"):
        replace(row, status="lost")
    with pytest.raises(ValueError, match="launcher must be a function or 'module:function'"):
        replace(row, launcher="moelora_lab.experiments.small_batch.launch")


def test_auto_never_resolves_to_an_experiment_row(monkeypatch):
    """``auto`` picks among product rows only: not when the rule names an experiment row, not as the next
    path that runs a call the rule's pick cannot, and not beside the base GEMMs; by name, it runs."""
    kw = dict(num_experts=128, num_loras=4, add_inputs=True, token_rows=True)
    picks = {resolve_path("auto", num_pairs=pairs, rank=rank, n_out=n_out, side_stream=side, **kw)
             for pairs in (1, 2, 8, 16, 64, 512, 4096, 65536) for rank in (4, 16, 64, 128, 256, 512)
             for n_out in (None, 768, 4096) for side in (False, True)}
    assert picks and all(PATHS[n].status == "product" for n in picks)
    monkeypatch.setattr(paths, "choose_path", lambda *a: "small_batch")              # a rule that names one
    assert resolve_path("auto", num_pairs=4, rank=16, **kw) == "two_kernel"
    capped = {n: replace(p, max_rank=8) if n in ("two_kernel", "one_shot") else p for n, p in PATHS.items()}
    monkeypatch.setattr(paths, "PATHS", capped)              # only the experiment row runs r=16: the spec does
    assert resolve_path("auto", num_pairs=4, rank=16, **kw) == "reference"
    assert resolve_path("small_batch", num_pairs=4, rank=16, **kw) == "small_batch"


def test_unknown_names_list_the_table():
    with pytest.raises(ValueError, match="path: 'fast' is not one of 'reference', 'two_kernel', 'one_shot', "
                                         "'small_batch', 'auto'"):
        get_path("fast")
    with pytest.raises(ValueError, match="path: 3 is not one of"):
        get_path(3)


def test_auto_skips_paths_that_cannot_run_the_call(monkeypatch):
    """A path with a rank cap (vLLM's fused kernel stops at 128) is never picked past its cap, and
    asking for it explicitly says why."""
    capped = dict(PATHS)
    capped["one_shot"] = replace(PATHS["one_shot"], max_rank=128)
    monkeypatch.setattr(paths, "PATHS", capped)
    kw = dict(num_pairs=8192, num_experts=128, num_loras=4, add_inputs=True, token_rows=True)
    assert resolve_path("auto", rank=64, **kw) == "one_shot"              # the measured rule's pick
    assert resolve_path("auto", rank=256, **kw) == "two_kernel"           # the next path that runs it
    with pytest.raises(ValueError, match="path: 'one_shot' supports ranks up to 128 \\(this call has r=256\\)"):
        resolve_path("one_shot", rank=256, **kw)


def test_bench_and_layer_choices_come_from_the_table():
    from moelora_lab.bench import cli
    args = cli.parse_args(["kernels", "--paths", *TRITON_PATHS, "auto"])
    assert args.paths == list(TRITON_PATHS) + ["auto"]
    with pytest.raises(SystemExit):
        cli.parse_args(["kernels", "--paths", "naive"])
    p = ml.make_problem(ml.MoEShape(48, 40, 6, 2, "t"), ml.LoRAShape(2, 4), 3, seed=0)
    with pytest.raises(ValueError, match="lora_path: 'fast' is not one of 'two_kernel', 'one_shot', 'small_batch', "
                                         "'auto'"):
        ml.moe_lora_layer(**p.layer_inputs(), lora_path="fast")


@pytest.mark.parametrize("name", list(PATHS))
def test_every_path_of_the_table_runs(device, name):
    p = lora_case(6, device=device, seed=41, no_adapter_fraction=0.3)
    out = ml.moe_lora(**p.w13_lora_inputs(), path=name)
    assert_close(out, ml.moe_lora_reference(**p.w13_lora_inputs()), torch.float32)


def test_one_shot_launch_wants_contiguous_output_columns(device):
    """The one-shot kernel takes the output's columns as contiguous (the op's output always has them): a
    launch on any other layout is refused, not computed wrong."""
    from moelora_lab.op.face import run_lora
    from moelora_lab.routing.device import make_blocks
    p = lora_case(4, device=device, seed=2)
    kw = p.w13_lora_inputs()
    M, k = p.topk_ids.shape
    out = torch.zeros(M, k, 2 * p.w13_lora_b[0].shape[2], 2, device=device)[..., 0]    # column stride 2
    blocks = make_blocks(p.topk_ids, p.token_lora, p.w13_lora_a[0].shape[1], p.w13_lora_a[0].shape[0], 16)
    with pytest.raises(ValueError, match="output: the one-shot path needs contiguous columns \\(column stride 2\\)"):
        run_lora(kw["x"], p.topk_ids, kw["topk_weights"], p.token_lora, kw["lora_a"], kw["lora_b"], out, blocks,
                 "one_shot")


def test_auto_picks_by_the_real_ranks_given_on_the_cpu():
    from moelora_lab.op.dispatch import choice_rank
    assert choice_rank(128, None) == 128
    assert choice_rank(128, torch.tensor([8, 4, 0])) == 8
    assert choice_rank(16, torch.tensor([99])) == 16                     # never past the weights' rank
    assert choice_rank(128, torch.tensor([8], device="meta")) == 128     # a device tensor is not read (no sync)
    kw = dict(num_pairs=64, num_experts=128, num_loras=4, add_inputs=False, token_rows=True)
    assert resolve_path("auto", rank=128, **kw) == "two_kernel"
    assert resolve_path("auto", rank=128, choice_rank=8, **kw) == "one_shot"
    assert resolve_path("two_kernel", rank=128, choice_rank=8, **kw) == "two_kernel"   # an explicit path stays


@pytest.mark.parametrize("slices, token_rows, ranks", [(2, True, None), (3, True, (5, 8, 0)), (1, False, None)])
def test_shrink_reads_x_once_for_both_slices(device, slices, token_rows, ranks):
    """``launch_shrink(one_read=True)`` writes what one program per slice writes, and what the spec says:
    T[s, p, :r_l] = A_s[l, e_p] x_row(p) for every pair with an adapter (poisoned T elsewhere stays NaN)."""
    from moelora_lab.routing.device import make_blocks
    from moelora_lab.op.dispatch import choose_config

    p = lora_case(7, device=device, seed=5, no_adapter_fraction=0.3)
    L, E, r, K = p.w13_lora_a[0].shape
    M, k = p.topk_ids.shape
    gen = torch.Generator().manual_seed(1)
    a = [torch.randn(L, E, r, K, generator=gen).to(device) for _ in range(slices)]
    x = p.x if token_rows else torch.randn(M * k, K, generator=gen).to(device)
    lora_ranks = None if ranks is None else torch.tensor(ranks, dtype=torch.int32, device=device)
    cfg = choose_config("two_kernel", M * k, L * E, 40, slices, x.device, rank=r)
    blocks = make_blocks(p.topk_ids, p.token_lora, E, L, cfg.block_m)
    got = {}
    for one_read in (False, True):
        t = torch.full((slices, M * k, r), float("nan"), device=device)
        paths.launch_shrink(x, a, t, blocks, cfg, top_k=k, token_rows=token_rows, lora_ranks=lora_ranks,
                            one_read=one_read)
        got[one_read] = t.cpu()
    assert torch.equal(got[True].nan_to_num(7.0), got[False].nan_to_num(7.0))
    full = torch.tensor(ranks or (r,) * L, dtype=torch.int32)
    want = shrink_spec(p, x, a, full).cpu()                     # NaN where nothing may be written
    assert torch.equal(got[True].isnan(), want.isnan())
    assert_close(got[True].nan_to_num(0.0), want.nan_to_num(0.0), torch.float32)


def test_shrink_one_read_wants_a_bool():
    with pytest.raises(TypeError, match="one_read: expected True or False"):
        paths.launch_shrink(None, [], None, None, None, top_k=1, token_rows=True, one_read="yes")
