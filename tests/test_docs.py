"""The docs stay true to the code and the results: the generated API reference and benchmark tables
are up to date (each script's --check), and every relative link in README.md and docs/ points to a
file that exists."""

from __future__ import annotations

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
