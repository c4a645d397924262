"""The README stays a page a newcomer reads in five minutes, and the documents it leads to hold
together: its first section shows the two set-up commands before any other, and every
relative link in it and in the design documents reaches a file (and a heading, for an
`#anchor` into a markdown file). No database: these read files only."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINKED_DOCUMENTS = ("README.md", "docs/architecture.md", "docs/reliability.md")
MAX_README_LINES = 150

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the target ends at whitespace or ')'.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[^)]*)?\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(1)
            elif fence.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield number, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text lowercased, every
    character but letters, marks, digits, connector punctuation ('_'), spaces and '-'
    dropped, then each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    kept = "".join(char for char in text if char in " -" or _kept_category(char))
    return kept.replace(" ", "-")


def _kept_category(char: str) -> bool:
    category = unicodedata.category(char)
    return category[0] in "LMN" or category == "Pc"


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, a repeated one numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading.group(2))
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        found.add(slug)
    return found


def links(path: Path):
    """(line number, target) of every link in a markdown file's prose (not in code)."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1)
            continue
        prose = CODE_SPAN.sub("", line)
        for link in INLINE_LINK.finditer(prose):
            yield number, link.group(1)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of a markdown file: a missing file, or an
    anchor no heading of the markdown file it names has."""
    problems = []
    for number, target in links(path):
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where} (no heading with that anchor in {linked.name})")
    return problems


def first_section(text: str) -> str:
    """The README's text before its first second-level heading (one outside code blocks)."""
    section = []
    fenced = None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fence:
            fenced = fence.group(1) if fenced is None else None
        elif fenced is None and re.match(r"^##\s", line):
            break
        section.append(line)
    return "\n".join(section)


def commands(section: str) -> list[str]:
    """In order, every line of a fenced code block and every inline code span of a section:
    what a reader would type."""
    shown = []
    fenced = None
    for line in section.splitlines():
        fence = FENCE.match(line)
        if fence:
            fenced = fence.group(1) if fenced is None else None
            continue
        if fenced is not None:
            command = line.split("#", 1)[0].strip()
            if command:
                shown.append(command)
        else:
            shown.extend(span.group(2).strip() for span in CODE_SPAN.finditer(line))
    return shown


def test_the_readme_is_at_most_150_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details to "
        "docs/architecture.md, docs/reliability.md or docs/performance.md and link them"
    )


def test_the_readmes_first_section_shows_make_run_and_make_test_before_any_other_command():
    shown = commands(first_section(README.read_text(encoding="utf-8")))
    assert len(shown) >= 2, f"the first section shows no set-up commands: {shown}"
    assert shown[0].split() == ["make", "run"], f"the first command shown is {shown[0]!r}"
    assert shown[1].split() == ["make", "test"], f"the second command shown is {shown[1]!r}"


def test_the_readme_leads_to_the_design_reliability_and_performance_documents():
    linked = {target.partition("#")[0] for _, target in links(README)}
    for document in ("docs/architecture.md", "docs/reliability.md", "docs/performance.md"):
        assert document in linked, f"README.md does not link {document}"


@pytest.mark.parametrize("document", LINKED_DOCUMENTS)
def test_every_relative_link_reaches_a_file_and_heading(document):
    path = ROOT / document
    assert path.exists(), f"{document} is missing"
    assert broken_links(path) == []


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Test suite wall time — `make test`", "test-suite-wall-time--make-test"),
        ("The gateway's path", "the-gateways-path"),
        ("5. Upstreams and the model registry", "5-upstreams-and-the-model-registry"),
        (
            "Large answers — `bench/gateway.py --large-answers`",
            "large-answers--benchgatewaypy---large-answers",
        ),
        ("snake_case [a link](x.md) kept", "snake_case-a-link-kept"),
    ],
)
def test_anchors_follow_githubs_slug_rule(heading, slug):
    assert github_slug(heading) == slug


def test_a_broken_link_or_anchor_is_found(tmp_path):
    """The checker fails what it should: a missing file, a missing heading, a repeated
    heading's second anchor taken as the first's; and skips links in code and absolute ones."""
    (tmp_path / "other.md").write_text("# Title\n\n## Part\n\n## Part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#part-1) [ok](other.md#title) [ok](#here) [web](https://example.com/x)\n"
        "`[code](missing.md)`\n\n```\n[block](missing.md)\n```\n\n## Here\n\n"
        "[gone](missing.md) [no anchor](other.md#part-2) [self](#nowhere)\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md:10: missing.md (no such file)",
        "page.md:10: other.md#part-2 (no heading with that anchor in other.md)",
        "page.md:10: #nowhere (no heading with that anchor in page.md)",
    ]
