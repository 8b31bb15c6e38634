"""README's links to its own sections (the contents line, the results' index and headline table)
point at headings that exist, named as GitHub names their anchors."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lowercased, all but letters, digits, spaces, '-' and '_' dropped, spaces
    as '-', a repeat suffixed -1, -2, ...; headings inside code blocks are not headings."""
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m and not fenced:
            base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            slug, n = base, 0
            while slug in out:
                n += 1
                slug = f"{base}-{n}"
            out.add(slug)
    return out


def test_github_anchor_rule():
    assert anchors("## What works\n```\n# not a heading\n```\n### MoE: `a`, b's (c)\n### MoE: `a`, b's (c)") == {
        "what-works", "moe-a-bs-c", "moe-a-bs-c-1"}


def test_readme_section_links_resolve():
    text = README.read_text()
    targets = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert len(targets) > 60  # the contents line, the results' index and headline table
    assert not targets - anchors(text), sorted(targets - anchors(text))
