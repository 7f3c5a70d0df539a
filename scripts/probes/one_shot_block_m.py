"""Probe: the one-shot kernel at other BLOCK_M and N chunks, beside the rule's tiles and two kernels.

`python -m moelora_lab.bench kernels` with its variants replaced; every variant of a case is checked against
the reference, then all are timed in interleaved rounds. Arguments are the sweep's, for example (on a GPU,
from the repository root):

    PYTHONPATH=. python scripts/probes/one_shot_block_m.py kernels --presets deepseek-v2-lite qwen3-30b-a3b \
        --ops w2 --ranks 64 --tokens 1024 2048 4096 --name one_shot_block_m --out /tmp/probe

The rows' ``command`` starts with ``probe:`` (see data/history/README.md). The first ``one_shot`` row of a
case is the rule's tiles.
"""
import sys

import moelora_lab.bench.kernels_sweep as sweep
from moelora_lab.bench.cli import main
from moelora_lab.profile import timing

VARIANTS = [("one_shot", {}), ("one_shot", dict(block_m=16, n_chunks=1)), ("one_shot", dict(block_m=32, n_chunks=1)),
            ("one_shot", dict(block_m=32, n_chunks=2)), ("one_shot", dict(block_m=64, n_chunks=1)),
            ("two_kernel", {})]

if __name__ == "__main__":
    sweep._variants = lambda args: VARIANTS
    sweep.save_plots = lambda rows, args: []
    provenance = timing.provenance
    timing.provenance = lambda command: provenance(
        "probe: " + command.replace("python -m moelora_lab.bench", "python scripts/probes/one_shot_block_m.py"))
    sys.exit(main(sys.argv[1:]))
