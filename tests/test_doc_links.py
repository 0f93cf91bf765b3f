"""Every relative link in the docs points at a file that exists (the raw records the prose
cites are committed beside it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "spec").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    links = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        links.append(target.split("#", 1)[0])
    return [t for t in links if t]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_a_missing_target_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [the log](records/absent.log) and [site](https://example.com)")
    assert relative_links(page) == ["records/absent.log"]
    assert not (page.parent / "records/absent.log").exists()
