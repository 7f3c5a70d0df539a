"""The README's measured section is written from the data, never by hand."""
import re
from pathlib import Path

from moelora_lab import results
from moelora_lab.summary import measured_markdown

README = Path(__file__).parent.parent / "README.md"


def test_readme_measured_section_is_the_data():
    block = re.search(r"<!-- measured -->\n(.*?)\n?<!-- /measured -->", README.read_text(), re.S)
    assert block, "README.md lacks the <!-- measured --> ... <!-- /measured --> section"
    assert block.group(1).strip() == measured_markdown(), \
        "README's measured section is stale: paste the output of `python -m moelora_lab.summary`"


def test_summary_states_the_data():
    text = measured_markdown()
    layer = results.load("layer")
    no_lora_1 = next(r for r in layer if (r["M"], r["rank"], r["variant"]) == (1, 16, "no_lora"))
    assert f"| no LoRA [µs] | {no_lora_1['us_median']:.1f} |" in text
    kernels = results.load("kernels")
    assert f"code {kernels[0]['code']}" in text and kernels[0]["gpu"] in text


def test_auto_line_counts_the_cells_within_the_slack():
    from moelora_lab.summary import AUTO_SLACK, _auto_line, auto_over_best

    rows = [dict(preset="p", op="w2", rank=16, M=m, path=path, us_median=us)
            for m, times in ((1, dict(auto=10.0, one_shot=10.0, two_kernel=12.0)),
                             (8, dict(auto=11.0, one_shot=10.0, two_kernel=11.0)),
                             (32, dict(auto=10.2, one_shot=10.0, two_kernel=10.5)))
            for path, us in times.items()]
    ratios = auto_over_best(rows)
    assert ratios[("p", "w2", 16, 8)] == 1.1 and ratios[("p", "w2", 16, 32)] <= 1 + AUTO_SLACK
    line = _auto_line(rows)
    assert "within 3% of the fastest in 2 of 3 cells" in line and "largest loss is 10% (p w2 r=16 M=8)" in line
