"""The README is a user's page (install, run, what to expect, results with their commands): the detail lives in
docs/, a link away, so the links must lead somewhere: every relative link of the README and of docs/ names a file of
the repository, and its #anchor a heading there."""
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / 'README.md'
PAGES = [README, *sorted((REPO_ROOT / 'docs').glob('*.md'))]


def _prose(path):
    """The page's lines outside fenced code blocks (a `#` there is a shell comment, not a heading)."""
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith('```'):
            fenced = not fenced
        elif not fenced:
            yield line


def _anchors(path):
    """GitHub's anchors of the page's headings: lower case, every character but letters, digits, '_', '-' and spaces
    dropped, spaces made '-'."""
    return {re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
            for m in (re.match(r'#{1,6} (.+)', line) for line in _prose(path)) if m}


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in re.findall(r'\]\(([^)\s]+)\)', '\n'.join(_prose(page))):
        if re.match(r'[a-z]+:', target):  # https:, mailto:: not the repository's
            continue
        file, _, anchor = target.partition('#')
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            broken.append(f'{target}: no file {linked.relative_to(REPO_ROOT)}')
        elif anchor and linked.suffix == '.md' and anchor not in _anchors(linked):
            broken.append(f'{target}: no heading #{anchor} in {linked.relative_to(REPO_ROOT)}')
    assert not broken, f'{page.relative_to(REPO_ROOT)}: ' + '; '.join(broken)


MAX_README_LINES = 400


def test_the_readme_is_at_most_400_lines():
    """The README is for users (install, run, what to expect, results with commands); the detail lives in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f'README.md: {lines} lines, at most {MAX_README_LINES}: move the detail to docs/'
