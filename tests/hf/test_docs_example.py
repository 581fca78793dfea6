"""The example of docs/transformers.md runs as written and goes through the paged path."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


def test_example_runs():
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    scope = {}
    exec(compile(block, str(DOC), "exec"), scope)
    out, cache = scope["out"], scope["cache"]
    assert out.shape == (2, 25)
    assert cache.stats["kernel_calls"] == 2 * 20 and cache.lengths() == [3 + 19, 5 + 19]


def test_first_lines_say_import_decode_hf_registers_pagedkv():
    head = "\n".join(DOC.read_text().splitlines()[:5])
    assert "`import decode.hf`" in head and "pagedkv" in head and "registers" in head
