"""The self-contained examples in docs/decoder.md run as written."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "decoder.md"


def test_multi_layer_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    example = [b for b in blocks if "dec.transaction(1)" in b]
    assert example, "docs/decoder.md lost its multi-layer example"
    exec(compile(example[0], str(DOC), "exec"), {})


def test_batch_extend_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    example = [b for b in blocks if "batch_extend(" in b]
    assert example, "docs/decoder.md lost its batch_extend example"
    exec(compile(example[0], str(DOC), "exec"), {})
