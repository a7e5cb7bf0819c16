"""The README is a short guide and docs/ holds the rest: sizes, links, commands, citations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
REQUIRED = ["dashboard", "generate", "eval", "serving", "vllm", "algorithm", "benchmarks"]
SETUP_COMMANDS = [
    "bash scripts/setup.sh && .venv/bin/esamp-tui",
    "bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def run_in_headings(path: Path) -> str:
    """The bold lead-ins that start paragraphs and list items (``**3. Groups belong to the server.**``)."""
    text = path.read_text(encoding="utf-8")
    return " ".join(m.group(1).lower() for m in re.finditer(r"(?m)^(?:- )?\*\*([^*]+)\*\*", text))


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


def test_readme_is_a_short_guide():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 15_000
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
    for command in SETUP_COMMANDS:  # exactly as a newcomer copies them
        assert any(block.strip() == command for block in blocks), command
    for command in ("esamp-tui", "esamp generate", "esamp eval", "esamp serve", "esamp bench"):
        assert any(line.startswith(command) for block in blocks for line in block.splitlines()), command


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(link.split("#")[0]).as_posix() for link in links(README)}
    assert {f"docs/{name}.md" for name in REQUIRED} <= {p.relative_to(ROOT).as_posix() for p in PAGES}
    for page in PAGES:
        assert page.relative_to(ROOT).as_posix() in linked, f"README does not link {page.name}"
    assert "benchmarks/README.md" in linked


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_links_and_pictures_resolve(path):
    for link in links(path):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not checked offline
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: {link} does not exist"
        if anchor:
            assert file.suffix == ".md" and anchor in anchors(file), f"{path.name}: no heading for {link}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_no_machine_paths(path):
    assert "/work/" not in path.read_text(encoding="utf-8")


def test_code_cites_docs_pages_that_exist():
    """``docs/PAGE.md, "Heading"`` in code and tests names a page and a heading it has (a section
    heading, or a bold lead-in such as ``**3. Groups belong to the server.**``)."""
    cited = re.compile(r'docs/([\w-]+\.md), \\?"([^"\\]+)\\?"')
    named = re.compile(r"docs/([\w-]+\.md)")
    found = 0
    sources = [*ROOT.glob("esamp/**/*.py"), *ROOT.glob("esamp_tui/**/*.py"), *ROOT.glob("tests/**/*.py")]
    for source in (s for s in sources if s != Path(__file__).resolve()):
        text = source.read_text(encoding="utf-8")
        for page in named.findall(text):
            found += 1
            assert (DOCS / page).is_file(), f"{source}: names {page}, which does not exist"
        for page, heading in cited.findall(text):
            assert slug(heading) in anchors(DOCS / page) or heading.lower() in run_in_headings(DOCS / page), (
                f"{source}: {page} has no heading {heading!r}"
            )
    assert found
