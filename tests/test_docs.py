"""The docs stay true to the code and the results: the generated API reference and benchmark tables
are up to date (each script's --check), and every relative link in README.md and docs/ points to a
file that exists. They are the project's alone: every result file under docs/bench and docs/log/data
is named by a page or a script, the results stay under 3 MB, and nothing cites what a reader of the
repository cannot open (a tracker's numbers, a design file kept elsewhere)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
# [text](target) and ![alt](target), not inside inline code; the target up to a space, ')' or '#'
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]*)(#[^)\s]*)?\)")


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.torch
def test_api_reference_is_current() -> None:
    done = _run("gen_reference.py")
    assert done.returncode == 0, done.stderr + "\nrun `make docs`"


def test_benchmark_tables_are_current() -> None:
    done = _run("bench_tables.py")
    assert done.returncode == 0, done.stderr + "\nrun `make docs`"


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in LINK.finditer(text) if m.group(1)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page: Path) -> None:
    missing = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_every_docs_page_is_linked_from_somewhere() -> None:
    """A page no other page links to is a page no reader finds."""
    linked = {(page.parent / t).resolve() for page in PAGES for t in _links(page)}
    orphans = [str(p.relative_to(ROOT)) for p in PAGES[2:] if p.resolve() not in linked]
    assert not orphans, f"pages nothing links to: {orphans}"


# -- the docs are the project's alone: data a page names, and no references a reader cannot open ----------

DATA = [ROOT / "docs" / "bench", ROOT / "docs" / "log" / "data"]
SOURCES = ["README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "aggregator", "csrc", "deploy", "docker",
           "docs", "examples", "omnireduce", "scripts", "tests", "worker"]
TEXT = {".md", ".py", ".sh", ".cu", ".cuh", ".cpp", ".h", ".yaml", ".yml", ".toml", ".sbatch"}


def _texts() -> dict[Path, str]:
    """The repository's own text: pages, code, scripts, tests and configuration, and the logs and
    summaries kept with the results (not the results' JSON, nor the training text under scripts/data)."""
    files: list[Path] = []
    for name in SOURCES:
        top = ROOT / name
        files += [top] if top.is_file() else [p for p in sorted(top.rglob("*")) if p.is_file()]
    docs = ROOT / "docs"
    return {p: p.read_text(errors="replace") for p in files
            if (p.suffix in TEXT or p.name == "Makefile" or p.name.startswith("Dockerfile.")
                or (p.suffix in (".txt", ".log") and docs in p.parents))
            and "__pycache__" not in p.parts}


def _named(path: str, text: str) -> bool:
    """Whether ``text`` names ``path`` whole (not as the tail of a longer path, nor the head of a longer name)."""
    return re.search(rf"(?<![\w./-]){re.escape(path)}(?![\w/-])", text) is not None


def test_every_result_file_is_named_by_a_page_or_a_script() -> None:
    """Each file under docs/bench and docs/log/data is named by its path: from the repository's root
    anywhere (a page, or a script or test that reads or writes it), or from a page's folder in that page
    (a link). A file nothing names is a file no reader finds: drop it or cite it."""
    texts = _texts()
    pages = {p: t for p, t in texts.items() if p.suffix == ".md"}
    data = [f for d in DATA for f in sorted(d.rglob("*")) if f.is_file() and f.suffix != ".md"]
    assert data, "no result files found"
    orphans = []
    for f in data:
        rel = f.relative_to(ROOT).as_posix()
        if any(_named(rel, t) for p, t in texts.items() if p != f):
            continue
        if any(_named(Path(os.path.relpath(f, p.parent)).as_posix(), t) for p, t in pages.items()):
            continue
        orphans.append(rel)
    assert not orphans, f"result files no page or script names (cite them by path, or drop them): {orphans}"


def test_results_stay_small() -> None:
    """docs/bench and docs/log together stay under 3 MB: results and their summaries, not raw dumps."""
    total = sum(f.stat().st_size for d in (ROOT / "docs" / "bench", ROOT / "docs" / "log") for f in d.rglob("*")
                if f.is_file())
    assert total < 3_000_000, f"docs/bench + docs/log hold {total / 1e6:.2f} MB (scripts/compact_results.py " \
                              "shrinks JSON and plots without changing what they say; drop what no page needs)"


# References a reader of the repository cannot follow: tracker numbers ("issue 12", "stop 7", "(#12)"; a
# public "owner/repo#12" is fine), a design file that lives outside the repository, and the tools of the
# place the work was done in (which lent it a GPU machine, say) rather than what was measured on it.
OUTSIDE = re.compile(r"\bissues? #?\d+\b|\bstop #?\d+\b|(?:^|[\s(\[])#\d+\b|\bDESIGN\.md\b|\bdesign card\b"
                     r"|\bdevice tool\b|\bcan_start_another\b|\bfarm-\w+", re.IGNORECASE | re.MULTILINE)


def test_no_reference_outside_the_repository() -> None:
    here = Path(__file__).resolve()  # (this file's examples below are what the check must find)
    found = [f"{p.relative_to(ROOT)}:{t.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
             for p, t in _texts().items() if p.resolve() != here for m in OUTSIDE.finditer(t)]
    assert not found, "references to what a reader of the repository cannot open (say the thing itself):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("text", ["as issue 53 asked", "stop 57", "see #61.", "(#7)", "the design card's",
                                  "section 4 of DESIGN.md",
                                  "a machine lent by the device tool", "status says can_start_another: false"])
def test_the_outside_reference_check_finds(text: str) -> None:
    assert OUTSIDE.search(text), text


@pytest.mark.parametrize("text", ["pytorch/pytorch#147114", "a '#1' label", "issued 53 calls",
                                  "the issue's cause", "it stops 2 ranks", "color #1f77b4"])
def test_the_outside_reference_check_spares(text: str) -> None:
    assert not OUTSIDE.search(text), text
