"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#fragment`` names a heading
of the target (GitHub's anchors). Links inside fenced code blocks and inline code are not links."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: str) -> set[str]:
    """GitHub's anchor of every heading of the Markdown file ``path`` (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", open(path, encoding="utf-8").read(), flags=re.M | re.S)
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: str) -> list[str]:
    """The relative links of ``page`` that do not resolve, each with the reason."""
    broken = []
    for target in _LINK.findall(_prose(open(page, encoding="utf-8").read())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
            continue
        path, _, fragment = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target}: no file {os.path.relpath(resolved, ROOT)}")
        elif fragment and resolved.endswith(".md") and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{fragment} in {os.path.relpath(resolved, ROOT)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: os.path.relpath(page, ROOT))
def test_relative_links_resolve(page):
    assert not broken_links(page), broken_links(page)


def test_every_docs_page_is_linked_from_the_readme():
    readme = _prose(open(PAGES[0], encoding="utf-8").read())
    linked = {os.path.normpath(target.partition("#")[0]) for target in _LINK.findall(readme)}
    missing = [os.path.relpath(page, ROOT) for page in PAGES[1:] if os.path.relpath(page, ROOT) not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_checker_catches_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one `x`\n\n[ok](a.md#title-one-x) [gone](b.md) [anchor](a.md#nope)\n"
                                   "`[code](c.md)`\n```\n[fenced](d.md)\n```\n")
    assert broken_links(str(tmp_path / "a.md")) == [f"b.md: no file {os.path.relpath(tmp_path / 'b.md', ROOT)}",
                                                    f"a.md#nope: no heading with anchor #nope in "
                                                    f"{os.path.relpath(tmp_path / 'a.md', ROOT)}"]


def test_readme_python_blocks_compile_and_define_world_size_where_they_use_it():
    """A reader copies a block as it is: it must parse, and the process count it computes with must be defined in it
    (the tests that run the blocks in-process would otherwise hide a missing definition)."""
    text = open(PAGES[0], encoding="utf-8").read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert len(blocks) >= 4, f"README.md has {len(blocks)} python blocks"
    for code in blocks:
        compile(code, "README.md", "exec")
        if re.search(r"\bWORLD_SIZE\b", code):
            assert re.search(r"^WORLD_SIZE = ", code, re.M), f"WORLD_SIZE used but not defined in:\n{code}"
