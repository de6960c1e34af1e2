"""The documentation's own links: every relative link in README.md, docs/, results/README.md and the role's README
names a file that exists and, with ``#anchor``, a heading of that file (GitHub's anchors), so that moving a section
cannot leave a reader at a dead link."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "results" / "README.md", *REPO.glob("docs/*.md"),
                *REPO.glob("ansible/**/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, each space a hyphen.
    Usage: ``github_anchor('`job_share = "auto"`: the part') == 'job_share--auto-the-part'``"""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a linked heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = github_anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_the_anchor_rule():
    assert github_anchor('`job_share = "auto"`: the part from the link\'s load') == \
        "job_share--auto-the-part-from-the-links-load"
    assert github_anchor("The benchmark (`bench/jobs.py`)") == "the-benchmark-benchjobspy"
    assert github_anchor("`slowdown`: the job furthest behind first") == "slowdown-the-job-furthest-behind-first"


def test_every_relative_link_resolves():
    assert len(PAGES) > 10
    cache: dict[Path, set[str]] = {}
    broken = []
    for page in PAGES:
        for line in _prose(page.read_text()):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_python_examples_of_the_policies_run():
    """The README's and docs' Python examples that use only the policies (pure, no agent, no torch) run as
    written: an example that no longer runs is a newcomer's first error."""
    ran = 0
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if block.lstrip().startswith("from tensorlane.policies") and "torch" not in block:
                exec(compile(block, f"{page.name} example", "exec"), {})
                ran += 1
    assert ran >= 1
