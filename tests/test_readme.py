"""The README's example runs as written on 4 ranks (gloo and MPI)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    m = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README lost its tested example"
    return m.group(1)


def _run(code: str) -> tuple:
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return tuple(scope["y"].local.shape), scope["root"].active


def test_readme_example(cluster, backend):
    res = cluster.run(4, _run, _example(), backend=backend)
    assert [r[0] for r in res] == [(8, 16, 16, 16)] * 4
    assert [r[1] for r in res] == [True, False, False, False]
