"""The documentation stays true: the ``python`` code blocks of the README and of docs/ run (on
the CPU), the README stays short, and the benchmark tables quote the committed result sets.

A code block that cannot run here (it needs a CUDA GPU) is preceded by a line
``<!-- skip: why -->``; the blocks of one page run in order, in one namespace, in a temporary
directory.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from conftest import import_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP = re.compile(r"<!-- skip: \S.* -->")


def code_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, source) of each ``python`` block of ``path`` not marked to be skipped."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = lines[i - 1].strip() if i else ""
            assert not marker.startswith("<!-- skip") or SKIP.fullmatch(marker), (
                f"{path.name}:{i}: a skip marker needs a reason: <!-- skip: why -->"
            )
            if not SKIP.fullmatch(marker):
                blocks.append((i + 2, textwrap.dedent("\n".join(lines[i + 1 : end]))))
            i = end
        i += 1
    return blocks


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p)], ids=_name)
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for line, source in code_blocks(page):
        exec(compile(source, f"{_name(page)}:{line}", "exec"), namespace)


def test_code_blocks_are_found_and_skipped_only_with_a_reason(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
        "\n  ```python\n  z = 3\n  ```\n"
    )
    assert code_blocks(page) == [(2, "x = 1"), (11, "z = 3")]
    page.write_text("<!-- skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"):
        code_blocks(page)


def test_the_readme_is_short_and_has_a_hello_world() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert code_blocks(ROOT / "README.md")
    assert "./dev train" in readme and "./dev test" in readme


def test_benchmark_tables_quote_the_committed_result_sets() -> None:
    """Regenerated from the CSV files, every table appears on the benchmark page as it is, and
    the README's headline table too."""
    tables = import_script("benchmarks/tables.py")
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for gpu in ("h200", "h100"):
        folder = ROOT / "benchmarks" / gpu
        for table in (
            tables.e2e_table(folder, "fp32"),
            tables.e2e_table(folder, "bf16"),
            tables.neuron_table(folder),
            *(
                tables.e2e_table(folder / "zoo", dtype, tables.ZOO_MODELS)
                for dtype in ("fp32", "bf16")
                if (folder / "zoo").is_dir()
            ),
        ):
            assert table in page, f"docs/benchmarks.md lacks this table of {gpu}:\n{table}"
    for gpu in ("h200", "h100"):
        user_loop = tables.user_loop_table(ROOT / "benchmarks" / gpu)
        assert user_loop in page, (
            f"docs/benchmarks.md lacks the {gpu} user-loop table:\n{user_loop}"
        )
    headline = tables.headline_table(ROOT / "benchmarks" / "h200")
    assert headline in (ROOT / "README.md").read_text()
