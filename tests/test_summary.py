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
