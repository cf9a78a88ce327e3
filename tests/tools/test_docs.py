"""The README is a front door and every link in the docs resolves: each relative link in README.md
and docs/*.md names a file that exists and, for a Markdown file, a heading it has (GitHub's anchor
rule: lower case, punctuation dropped, spaces to hyphens, a repeated heading numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(markdown: str) -> set[str]:
    out, seen = set(), {}
    for line in _without_code(markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def test_anchor_rule_matches_githubs():
    assert anchors("## The demo (`make demo`)\n## Status, conditions and reasons\n## A\n## A") == {
        "the-demo-make-demo", "status-conditions-and-reasons", "a", "a-1"}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_resolves(page):
    broken = []
    for label, target in LINK.findall(_without_code(page.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        if not dest.exists():
            broken.append(f"[{label}]({target}): no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"[{label}]({target}): no heading with that anchor in {dest.name}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 16 * 1024, "README.md grew past 16 KB: move the detail to docs/"
    first = text.split("```", 2)[1]
    assert "make demo" in first and "make test" in first  # the two commands for a fresh machine
