"""The documents' links, and the run records behind their figures.

Every relative link in the docs points at a file that exists (the raw outputs the records cite
are committed beside them). The two pages users read first, README.md and docs/VLLM.md, stay
short, and every paragraph, list item or table row of theirs that quotes a measured figure (a
ratio such as ``1.33 x``, tok/s, ms, us, GB/s, GiB/s, a percentage) links the file under
docs/records/ of the run it comes from. docs/records/README.md indexes every record, newest
first. Each checker is shown to catch a page seeded with the fault it looks for.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "records"
INDEX = RECORDS / "README.md"
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *RECORDS.glob("*.md"),
        *(ROOT / "spec").glob("*.md"),
    ]
)
GUIDES = {ROOT / "README.md": 170, ROOT / "docs" / "VLLM.md": 450}
"""The pages users read first, and the most lines each may have."""

LINK = re.compile(r"\]\(([^)\s]+)\)")
FIGURE = re.compile(
    r"\d(?:\.\d+)?\s?x\b(?!\s*\d)"  # a ratio: 1.33 x, 1.44x (not a shape: 128 x 128)
    r"|tok/s|GB/s|GiB/s"
    r"|\d\s?(?:ms|us)\b"  # a time
    r"|\d\s?%"  # a percentage
)
"""A measured figure in prose."""
CODE_SPAN = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^\s*```")
TABLE_RULE = re.compile(r"^\|?\s*:?-{3,}")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def relative_links(page: Path) -> list[str]:
    links = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        links.append(target.split("#", 1)[0])
    return [t for t in links if t]


def units(text: str) -> list[tuple[int, str]]:
    """The paragraphs, list items, headings and table rows of a markdown page, each with the
    line it starts on. Fenced and indented code blocks are skipped, and so are a table's
    header row and its rule."""
    lines = text.splitlines()
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    fenced = False

    def flush() -> None:
        if current:
            found.append((start, "\n".join(current)))
            current.clear()

    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            flush()
            fenced = not fenced
            continue
        stripped = line.strip()
        if fenced or not stripped:
            flush()
            continue
        if stripped.startswith("|"):
            flush()
            following = lines[number].strip() if number < len(lines) else ""
            if not TABLE_RULE.match(stripped) and not TABLE_RULE.match(following):
                found.append((number, stripped))
            continue
        if stripped.startswith("#"):
            flush()
            found.append((number, stripped))
            continue
        if LIST_ITEM.match(line):
            flush()
        elif not current and line.startswith(("    ", "\t")):
            continue  # an indented code block
        if not current:
            start = number
        current.append(line)
    flush()
    return found


def cites_record(page: Path, unit: str, records: Path) -> bool:
    """Whether ``unit`` (text of ``page``) links a run record under ``records`` that exists
    (the index does not count)."""
    for target in LINK.findall(unit):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if path.parent == records.resolve() and path.name != "README.md" and path.is_file():
            return True
    return False


def unsourced_figures(page: Path, records: Path = RECORDS) -> list[str]:
    """Every paragraph, list item or table row of ``page`` that quotes a measured figure (code
    aside) without linking the record it comes from."""
    problems = []
    for line, unit in units(page.read_text()):
        if FIGURE.search(CODE_SPAN.sub("", unit)) and not cites_record(page, unit, records):
            problems.append(f"{page.name}:{line}: {' '.join(unit.split())[:100]}")
    return problems


def index_problems(index: Path) -> list[str]:
    """What is wrong with a records index: a row whose record is missing, a record in its
    folder that no row lists, a record listed twice, rows not newest first."""
    folder = index.parent
    records = {p.name for p in folder.glob("*.md") if p != index}
    problems, listed, dates = [], [], []
    for line in index.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not DATE.match(cells[0]):
            continue
        dates.append(cells[0])
        linked = [t for t in LINK.findall(line) if t.endswith(".md") and "/" not in t]
        if len(linked) != 1:
            problems.append(f"row {cells[0]} links {len(linked)} records: {line[:80]}")
        for name in linked:
            if not (folder / name).is_file():
                problems.append(f"listed but missing: {name}")
            listed.append(name)
    problems += [f"not listed: {name}" for name in sorted(records - set(listed))]
    problems += [f"listed twice: {n}" for n in sorted({n for n in listed if listed.count(n) > 1})]
    if dates != sorted(dates, reverse=True):
        problems.append("rows are not newest first")
    return problems


def too_long(page: Path, limit: int) -> str | None:
    count = len(page.read_text().splitlines())
    return f"{page.name} has {count} lines, more than {limit}" if count > limit else None


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_a_missing_target_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [the log](records/absent.log) and [site](https://example.com)")
    assert relative_links(page) == ["records/absent.log"]
    assert not (page.parent / "records/absent.log").exists()


def test_the_records_are_checked() -> None:
    assert INDEX in DOCS and len([p for p in DOCS if p.parent == RECORDS]) > 1


@pytest.mark.parametrize("page", sorted(GUIDES), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_guides_stay_short(page: Path) -> None:
    assert too_long(page, GUIDES[page]) is None, too_long(page, GUIDES[page])


def test_a_long_page_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "GUIDE.md"
    page.write_text("line\n" * 171)
    assert too_long(page, 170) == "GUIDE.md has 171 lines, more than 170"
    page.write_text("line\n" * 170)
    assert too_long(page, 170) is None


@pytest.mark.parametrize("page", sorted(GUIDES), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_figure_in_the_guides_links_its_record(page: Path) -> None:
    problems = unsourced_figures(page)
    assert not problems, "figures without a link to docs/records/:\n" + "\n".join(problems)


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """A records folder with one record and its index, beside where a guide page goes."""
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "2026-01-01-run.md").write_text("# a run\n")
    (folder / "README.md").write_text("# index\n")
    return folder


@pytest.mark.parametrize(
    "text",
    [
        "`row` decodes 1.33 x UVA at 2.25 GiB.",
        "It decodes 1.44x as fast.",
        "No offload ran at 488.1 tok/s,\nin one run.",
        "- the prompt took 163.67 ms\n  in full graphs",
        "The copy reached 47.7 GB/s.",
        "An all-hit call took 14.8 us.",
        "The copy stream reached 92.3% of the ceiling.",
        "| engine | b1 |\n|---|---|\n| `row32dev.full` | 139.0 tok/s |",
        "It decodes 1.33 x UVA ([record](records/2026-01-02-absent.md)).",
        "It decodes 1.33 x UVA ([the index](records/README.md)).",
        "It decodes 1.33 x UVA ([raw](vllm/run/records.jsonl)).",
    ],
)
def test_a_figure_without_its_record_is_caught(records: Path, text: str) -> None:
    page = records.parent / "GUIDE.md"
    page.write_text(f"# Guide\n\nAn intro.\n\n{text}\n\nThe end.\n")
    assert len(unsourced_figures(page, records)) == 1


@pytest.mark.parametrize(
    "text",
    [
        "`row` decodes 1.33 x UVA ([record](records/2026-01-01-run.md)).",
        "- the prompt took 163.67 ms\n  ([record](records/2026-01-01-run.md#figures))",
        "| `row32dev.full` | 139.0 tok/s | [run](records/2026-01-01-run.md) |",
        "| engine | tok/s |\n|---|---|",
        "```\nINFO 12.5 ms, 1.33 x\n```",
        "    bash run.sh --wait 5ms",
        "FP8 with 128 x 128 block scales, `slots / 128 x 9.0` GiB, 4 prompts x 32 tokens.",
        "The knob `b1 >= 1 x row32host` names a target.",
    ],
)
def test_a_cited_figure_or_no_figure_passes(records: Path, text: str) -> None:
    page = records.parent / "GUIDE.md"
    page.write_text(f"# Guide\n\n{text}\n")
    assert unsourced_figures(page, records) == []


def test_the_index_lists_every_record() -> None:
    assert index_problems(INDEX) == []


def _index(folder: Path, rows: list[tuple[str, str]], records: list[str]) -> Path:
    folder.mkdir()
    for name in records:
        (folder / name).write_text(f"# {name}\n")
    table = ["| date | what ran | record |", "|---|---|---|"]
    table += [f"| {date} | a run | [{name}]({name}) |" for date, name in rows]
    index = folder / "README.md"
    index.write_text("# Records\n\n" + "\n".join(table) + "\n")
    return index


def test_an_index_missing_a_record_is_caught(tmp_path: Path) -> None:
    a, b = "2026-01-02-a.md", "2026-01-01-b.md"
    assert (
        index_problems(_index(tmp_path / "ok", [("2026-01-02", a), ("2026-01-01", b)], [a, b]))
        == []
    )
    index = _index(tmp_path / "unlisted", [("2026-01-02", a)], [a, b])
    assert index_problems(index) == [f"not listed: {b}"]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            [("2026-01-02", "2026-01-02-a.md"), ("2026-01-01", "gone.md")],
            "listed but missing: gone.md",
        ),
        (
            [("2026-01-01", "2026-01-01-b.md"), ("2026-01-02", "2026-01-02-a.md")],
            "rows are not newest first",
        ),
    ],
)
def test_an_index_listing_wrongly_is_caught(
    tmp_path: Path, rows: list[tuple[str, str]], expected: str
) -> None:
    index = _index(tmp_path / "records", rows, ["2026-01-02-a.md", "2026-01-01-b.md"])
    assert expected in index_problems(index)
