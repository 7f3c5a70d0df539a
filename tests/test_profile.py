"""profile.report and profile.timing: the occupancy arithmetic by hand, and what they do without a GPU.

Also documents the committed H200 register data and the benchmark CLI's answer on the CPU.
"""
import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelora_lab import results
import triton

from moelora_lab.results import read_csv
from moelora_lab.profile.report import (
    BLOCKS_PER_SM,
    REGS_PER_SM,
    SMEM_PER_SM,
    WARPS_PER_SM,
    KernelReport,
    occupancy,
    one_shot_report,
    report,
)
from moelora_lab.profile.timing import (Timing, copy_bandwidth, interleave, pooled, provenance, time_cuda,
                                       time_cuda_interleaved)

ROOT = Path(__file__).resolve().parent.parent
REGISTERS_CSV = ROOT / "moelora_lab" / "data" / "h200" / "registers.csv"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def test_hopper_limits():
    assert (REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM) == (65536, 233472, 64, 32)


# Registers are allocated per warp in units of 256: ceil(n_regs * 32 / 256) * 256 per warp.
@pytest.mark.parametrize("n_regs, shared, warps, blocks, occ", [
    # 168 * 32 = 5376 = 21 * 256 per warp, x4 = 21504; 65536 // 21504 = 3 (shared allows 6)
    (168, 36864, 4, 3, 12 / 64),
    # 56 * 32 = 1792 per warp, x4 = 7168; 65536 // 7168 = 9 (shared allows 28)
    (56, 8192, 4, 9, 36 / 64),
    # 255 * 32 = 8160 rounds up to 8192 per warp, x4 = 32768: 2 blocks
    (255, 0, 4, 2, 8 / 64),
    # 127 * 32 = 4064 -> 4096, x4 = 16384: 4 blocks
    (127, 30720, 4, 4, 16 / 64),
    # shared-memory-limited: registers allow 16 (32 * 32 * 4 = 4096), 233472 // 102400 = 2
    (32, 100 * 1024, 4, 2, 8 / 64),
    # warp-limited: registers allow 16 blocks of 8 warps (16 * 32 * 8 = 4096), warp slots 64 // 8 = 8
    (16, 0, 8, 8, 1.0),
    # block-limited: 1-warp blocks, registers allow 128 and warps 64, but at most 32 blocks per SM
    (16, 0, 1, 32, 0.5),
    # one block needs more than the register file: 255 regs x 32 warps = 262144 > 65536
    (255, 0, 32, 0, 0.0),
    # exactly the whole shared memory: one block
    (64, 228 * 1024, 4, 1, 4 / 64),
])
def test_occupancy_hand_computed(n_regs, shared, warps, blocks, occ):
    b, o = occupancy(n_regs, shared, warps)
    assert b == blocks
    assert o == pytest.approx(occ)


def test_occupancy_zero_registers_counts_as_one():
    assert occupancy(0, 0, 4) == occupancy(1, 0, 4) == (16, 1.0)


def test_occupancy_matches_every_committed_row():
    for row in read_csv(REGISTERS_CSV):
        blocks, occ = occupancy(row["n_regs"], row["shared_bytes"], row["num_warps"])
        assert (blocks, occ) == (row["blocks_per_sm"], pytest.approx(row["occupancy"])), row


def test_kernel_report_as_dict():
    rep = KernelReport("k", 168, 0, 36864, 4, 3, 0.1875)
    assert rep.as_dict() == dict(name="k", n_regs=168, n_spills=0, shared_bytes=36864, num_warps=4,
                                 blocks_per_sm=3, occupancy=0.1875)


def test_report_without_a_compiled_kernel_asks_for_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        report(None, 4)


@cpu_only
def test_one_shot_report_on_cpu_asks_for_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        one_shot_report(16)


@cpu_only
@pytest.mark.parametrize("call", [lambda: time_cuda(lambda: None), lambda: copy_bandwidth(1 << 20),
                                  lambda: time_cuda_interleaved({"a": lambda: None})],
                         ids=["time_cuda", "copy_bandwidth", "time_cuda_interleaved"])
def test_timing_on_cpu_raises_instead_of_timing_the_interpreter(call):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*committed H200 data"):
        call()


def test_interleave_takes_the_names_in_turn_and_pools_their_rounds():
    order = []

    def sample(name, rnd):
        order.append((rnd, name))
        if name == "broken" and rnd == 1:
            raise RuntimeError("no such op")
        return [1.0 + rnd, 2.0 + rnd] if name == "a" else [5.0]

    got = interleave(["a", "b", "broken"], 3, sample)
    # forward, backward, forward: no name always follows the same one; "broken" fails in round 1, then rests
    assert order == [(0, "a"), (0, "b"), (0, "broken"), (1, "broken"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert got["a"] == pooled([1.0, 2.0, 2.0, 3.0, 3.0, 4.0]) and got["a"].median_us == pytest.approx(2500.0)
    assert got["b"] == Timing(5000.0, 5000.0, 5000.0)
    assert isinstance(got["broken"], RuntimeError)                  # recorded, not raised; tried no more
    with pytest.raises(ValueError, match="rounds"):
        interleave(["a"], 0, sample)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_cuda_interleaved_times_every_callable_and_keeps_failures():
    small, big = (torch.empty(n, device="cuda") for n in (1 << 10, 1 << 26))

    def broken():
        raise RuntimeError("no such op")

    got = time_cuda_interleaved({"small": lambda: small.add_(1), "big": lambda: big.add_(1), "broken": broken},
                                rounds=2, rep_ms=20)
    assert got["small"].p20_us <= got["small"].median_us <= got["small"].p80_us
    assert got["big"].median_us > 10 * got["small"].median_us           # 65536x the bytes
    assert isinstance(got["broken"], RuntimeError)


def test_pooled_quantiles_interpolate_like_do_bench():
    t = pooled([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (t.median_us, t.p20_us, t.p80_us) == pytest.approx((3000.0, 1800.0, 4200.0))
    with pytest.raises(ValueError, match="samples_ms"):
        pooled([])


def test_timing_fields():
    t = Timing(1.0, 0.5, 1.5)
    assert (t.median_us, t.p20_us, t.p80_us) == (1.0, 0.5, 1.5)


def test_provenance_keys_and_values():
    p = provenance("python -m moelora_lab.bench kernels")
    assert list(p) == ["gpu", "torch", "triton", "python", "date", "command", "schema", "config", "code"]
    assert (p["schema"], p["config"]) == (results.DATA_SCHEMA, results.config_fingerprint())
    assert p["torch"] == torch.__version__ and p["triton"] == triton.__version__
    assert p["python"] == ".".join(map(str, sys.version_info[:3]))
    assert datetime.date.fromisoformat(p["date"]) == datetime.date.today()
    assert p["command"] == "python -m moelora_lab.bench kernels"
    if not torch.cuda.is_available():
        assert p["gpu"] == "none (CPU)"


@cpu_only
@pytest.mark.parametrize("what", ["kernels", "registers"])
def test_bench_cli_on_cpu_points_at_the_committed_csvs(what):
    proc = subprocess.run([sys.executable, "-m", "moelora_lab.bench", what], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "needs a GPU" in proc.stderr and "committed CSVs" in proc.stderr
    assert str(Path("moelora_lab") / "data" / "h200") in proc.stderr
    assert proc.stdout == ""


def test_bench_cli_rejects_an_unknown_subcommand():
    proc = subprocess.run([sys.executable, "-m", "moelora_lab.bench", "nonsense"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "invalid choice: 'nonsense'" in proc.stderr


# The committed compile data (one-shot kernel on an H200, triton 3.6): what the register notebook says.
def _registers():
    return read_csv(REGISTERS_CSV)


def test_committed_registers_cover_the_sweep():
    rows = _registers()
    assert {r["rank"] for r in rows} == {16, 32, 64, 128, 192, 256, 512}
    assert {r["block_m"] for r in rows} == {16, 64} and {r["max_block_r"] for r in rows} == {128, 512}
    assert len(rows) == 28 and not any(r["error"] for r in rows)
    assert {r["gpu"] for r in rows} == {"NVIDIA H200"} and {r["triton"] for r in rows} == {"3.6.0"}


def test_committed_registers_rank_tiling_never_spills():
    tiled = [r for r in _registers() if r["max_block_r"] == 128]
    assert all(r["n_spills"] == 0 and r["n_regs"] <= 255 for r in tiled)
    assert {r["blocks_per_sm"] for r in tiled if r["rank"] >= 128} == {2, 3, 4}


def test_committed_registers_one_tile_spills_at_rank_512():
    """One 512-wide tile spills; one 256-wide tile (r 192, 256) comes within 8 registers of the cap at BLOCK_M 64
    without spilling, and holds the SM alone, where four tiles of 128 leave room for two programs."""
    rows = _registers()
    untiled = [r for r in rows if r["max_block_r"] == 512]
    assert all(r["n_spills"] == 0 for r in untiled if r["rank"] <= 256)
    spills = {(r["rank"], r["block_m"]): r["n_spills"] for r in untiled if r["rank"] == 512}
    assert spills == {(512, 16): 28, (512, 64): 330}
    wide = {(r["rank"], r["max_block_r"]): r for r in rows if r["block_m"] == 64 and r["rank"] in (192, 256)}
    assert all(247 <= wide[r, 512]["n_regs"] <= 255 and wide[r, 512]["blocks_per_sm"] == 1 for r in (192, 256))
    assert all(wide[r, 128]["blocks_per_sm"] == 2 for r in (192, 256))


def test_committed_registers_tiling_changes_nothing_up_to_rank_128():
    rows = _registers()
    key = lambda r: (r["rank"], r["block_m"])  # noqa: E731
    tiled = {key(r): r for r in rows if r["max_block_r"] == 128}
    for r in rows:
        if r["max_block_r"] == 512 and r["rank"] <= 128:
            assert (r["n_regs"], r["shared_bytes"]) == (tiled[key(r)]["n_regs"], tiled[key(r)]["shared_bytes"])
