"""Ours: the port beside the original, as a reviewer's diff, file by file and definition by definition.

    python -m lm_human_preferences.porting.beside_original ORIGINAL --out beside.html [--original-url URL]
    python -m lm_human_preferences.porting.beside_original ORIGINAL --record tests/original_files.json
    python -m lm_human_preferences.porting.beside_original --table tests/original_files.json

ORIGINAL is a checkout of openai/lm-human-preferences (nothing is downloaded); the map is porting_map.py. The
page pairs each original function, class, method and closure (the original's trainers define their steps
inside __init__, ours as methods) with ours, with a line diff inside each pair. --record writes the original's
names, non-blank lines and code tokens (with its commit), which --table and the tests hold our files against.
"""

import argparse
import html
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from lm_human_preferences.porting import porting_map as map_data
from lm_human_preferences.porting.definition_diff import PortingMap, in_order, line_diff, names, pairs, similarity

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_LINE = 120  # columns: the port's style; lines past it are counted against the original's


def nonblank_lines(text):
    return sum(1 for line in text.splitlines() if line.strip())


def long_lines(text):
    return sum(1 for line in text.splitlines() if len(line) > LONG_LINE)


# Python 3.12+ (PEP 701; 3.14's t-strings too) tokenizes an f-string into its parts: a start, literal pieces, the
# tokens of each expression, an end. 3.10 and 3.11 give one STRING, as the recorded counts were taken.
_STRING_STARTS = {getattr(tokenize, name) for name in ('FSTRING_START', 'TSTRING_START') if hasattr(tokenize, name)}
_STRING_ENDS = {getattr(tokenize, name) for name in ('FSTRING_END', 'TSTRING_END') if hasattr(tokenize, name)}


def code_tokens(text):
    """Python tokens but comments and layout: the volume of code, whatever its line lengths (a docstring is one,
    and so is an f-string, under every Python)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    count = depth = 0  # depth: the f-strings open (nested ones inside an expression's)
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type in _STRING_STARTS:
            count += depth == 0
            depth += 1
        elif t.type in _STRING_ENDS:
            depth -= 1
        elif depth == 0 and t.type not in skip:
            count += 1
    return count


def porting_map():
    return PortingMap.of(map_data)


# ---------------------------------------------------------------------------------------------------
# The table: non-blank lines, code tokens and names, ours against the original's

def _git_commit(root):
    return subprocess.run(['git', '-C', str(root), 'rev-parse', 'HEAD'], capture_output=True,
                          text=True).stdout.strip()


def record(original_root, pmap=None):
    """The original's mirrored files: their non-blank lines, code tokens, lines past LONG_LINE columns and names,
    and the commit they come from."""
    pmap = pmap or porting_map()
    commit, files = _git_commit(original_root) or None, {}
    for path in sorted(pmap.mirrored):
        text = (Path(original_root) / path).read_text()
        files[path] = dict(nonblank=nonblank_lines(text), tokens=code_tokens(text), long_lines=long_lines(text),
                           names=names(text))
    return dict(repository='openai/lm-human-preferences', commit=commit, files=files)


def table(recorded, repo_root=None, pmap=None):
    """One row per mirrored file: its original's and our non-blank lines and code tokens, their ratios, our lines
    past LONG_LINE columns against the original's, the original's names our file pairs, how many keep the
    original's order, and those neither paired nor given a reason."""
    pmap, repo_root = pmap or porting_map(), repo_root or REPO_ROOT
    rows = []
    for path, theirs in recorded['files'].items():
        ours_path = pmap.mirrored[path]
        text = (Path(repo_root) / ours_path).read_text()
        our_names = names(text)
        targets = {n: pmap.target(path, n, theirs['names'], our_names) for n in theirs['names']}
        here = [t[1] for t in targets.values() if t is not None and t[0] is None and t[1] in our_names]
        elsewhere = [n for n, t in targets.items() if t is not None and t[0] is not None]
        unexplained = [n for n, t in targets.items()
                       if (t is None or (t[0] is None and t[1] not in our_names)) and (path, n) not in pmap.not_ported]
        lines, tokens = nonblank_lines(text), code_tokens(text)
        rows.append(dict(file=path, ours=ours_path, original_lines=theirs['nonblank'], our_lines=lines,
                         ratio=lines / theirs['nonblank'], original_tokens=theirs['tokens'], our_tokens=tokens,
                         token_ratio=tokens / theirs['tokens'], original_long=theirs['long_lines'],
                         our_long=long_lines(text), names=len(theirs['names']), found=len(here) + len(elsewhere),
                         in_order=in_order(here, our_names), here=len(here), unexplained=unexplained))
    return rows


def format_table(rows):
    lines = ['| file | lines: original | ours | ratio | code tokens: ratio | names paired / in order |',
             '|---|---:|---:|---:|---:|---|']
    for r in rows:
        lines.append(f"| {r['file']} | {r['original_lines']} | {r['our_lines']} | {r['ratio']:.2f}x | "
                     f"{r['token_ratio']:.2f}x | {r['found']}/{r['names']}, {r['in_order']} in order |")
    total_o, total_u = sum(r['original_lines'] for r in rows), sum(r['our_lines'] for r in rows)
    tokens_o, tokens_u = sum(r['original_tokens'] for r in rows), sum(r['our_tokens'] for r in rows)
    lines.append(f'| all {len(rows)} mirrored files | {total_o:,} | {total_u:,} | {total_u / total_o:.2f}x | '
                 f'{tokens_u / tokens_o:.2f}x | |')
    return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------------
# The page

_STYLE = """
body { font-family: sans-serif; margin: 1em; } .legend span { padding: 0 6px; margin-right: 6px; font-size: 12px; }
table.summary { border-collapse: collapse; margin-bottom: 1em; }
table.summary td, table.summary th { padding: 1px 8px; text-align: right; border-bottom: 1px solid #eee; }
table.summary td:first-child, table.summary th:first-child { text-align: left; }
.pair { margin: 0 0 1em 0; border: 1px solid #ccc; } .pair.ours .head { background: #e8f8e8; }
.head { background: #eef; font-family: monospace; font-size: 12px; padding: 2px 4px; }
.head a.anchor { color: #99a; text-decoration: none; margin-right: 4px; } .head .sim { color: #666; margin-left: 1em; }
.pair.not-ported .head, .pair.unpaired .head { background: #f6f0e0; }
.reason { font-size: 12px; padding: 3px 6px; color: #654; } .pair.unpaired .reason { color: #b00; font-weight: bold; }
table.diff { border-collapse: collapse; width: 100%; table-layout: fixed; }
table.diff td { vertical-align: top; padding: 0 4px; font-family: monospace; font-size: 12px;
  white-space: pre-wrap; word-break: break-word; }
table.diff td.ln { color: #999; text-align: right; user-select: none; } table.diff td.ln a { color: #99c; }
tr.changed td.code { background: #fff6d5; } tr.removed td.left { background: #fdd; }
tr.added td.right { background: #dfd; }
"""

_MARKS = {' ': 'same', '~': 'changed', '-': 'removed', '+': 'added'}


def _anchor(*parts):
    return '--'.join(re.sub(r'[^\w.]+', '-', p.replace('.<locals>.', '.')).strip('-') for p in parts)


def _diff_table(rows, link):
    """link(line number) -> the URL of the original's line, or None."""
    out = []
    for mark, left, right in rows:
        def cells(side, line, linked):
            if line is None:
                return f'<td class="ln {side}"></td><td class="code {side}"></td>'
            n, text = line
            url = link(n) if linked else None
            number = f'<a href="{html.escape(url)}">{n}</a>' if url else str(n)
            return f'<td class="ln {side}">{number}</td><td class="code {side}">{html.escape(text)}</td>'
        out.append(f'<tr class="{_MARKS[mark]}">{cells("left", left, True)}{cells("right", right, False)}</tr>')
    return f'<table class="diff"><colgroup><col style="width:3.5em"><col><col style="width:3.5em"><col></colgroup>' \
           f'{"".join(out)}</table>'


def _pair_html(row, file_anchor, link, alike):
    theirs, ours = row.theirs, row.ours
    name = theirs.name if theirs is not None else ours.name
    anchor = _anchor(file_anchor, ('ours ' if theirs is None else '') + (name or f'module {(theirs or ours).start}'))
    shown = html.escape(name or 'module code')
    head = [f'<a class="anchor" href="#{anchor}">&para;</a><span class="name">{shown}</span>']
    if theirs is not None:
        span = f'original lines {theirs.start}&ndash;{theirs.end}'
        url = link(theirs.start, theirs.end)
        head.append(f' <a href="{html.escape(url)}">{span}</a>' if url else f' {span}')
    if ours is not None and theirs is not None and ours.name != theirs.name:
        head.append(f' &rarr; <span class="ours-name">{html.escape(ours.name)}</span>')
    head.append(f' ({html.escape(row.note)})' if row.note.startswith('in ') else '')
    head.append(f' <span class="ours-lines">ours {ours.start}&ndash;{ours.end}</span>' if ours is not None else '')
    head.append(' <span class="sim">ours alone</span>' if theirs is None else
                f' <span class="sim">{alike:.0%} alike</span>' if alike is not None else '')
    reason = dict(unpaired='not in ours, and porting_map.py gives no reason',
                  **{'not-ported': f'not ported: {html.escape(row.reason or "")}'}).get(row.kind)
    attrs = (f'class="pair {row.kind}" id="{anchor}" data-kind="{row.kind}" '
             f'data-original="{html.escape(theirs.name if theirs else "")}" '
             f'data-ours="{html.escape(ours.name if ours else "")}"')
    reason = f'<div class="reason">{reason}</div>' if reason else ''
    body = _diff_table(line_diff(theirs, ours), link)
    return f'<div {attrs}><div class="head">{"".join(head)}</div>{reason}{body}</div>'


def page(original_root, repo_root=None, pmap=None, original_url=None):
    """The HTML page: each mirrored original file beside ours as a diff by definitions (porting_map.py).
    original_url: the original's repository on the web (its lines are linked at the checkout's commit)."""
    original_root, repo_root = Path(original_root), Path(repo_root or REPO_ROOT)
    pmap = pmap or porting_map()
    missing = [p for p in pmap.mirrored if not (original_root / p).is_file()]
    if len(missing) == len(pmap.mirrored):
        raise ValueError(f'{original_root} holds none of the original files porting_map.py maps (e.g. {missing[0]}): '
                         f'is it a checkout of openai/lm-human-preferences?')
    commit = _git_commit(original_root)
    summary, sections = [], []
    for path, ours_path in pmap.mirrored.items():
        if path in missing:
            continue
        original_text, our_text = (original_root / path).read_text(), (repo_root / ours_path).read_text()
        rows = pairs(original_text, our_text, path=path, pmap=pmap,
                     other_files=lambda p: (repo_root / p).read_text())
        alike, per_pair = similarity(rows, original_text, our_text)

        def link(start, end=None, path=path):
            if not (original_url and commit):
                return None
            return f'{original_url.rstrip("/")}/blob/{commit}/{path}#L{start}' + (f'-L{end}' if end else '')

        file_anchor = _anchor(path)
        counts = {k: sum(1 for r in rows if r.kind == k and (r.theirs or r.ours).name)
                  for k in ('paired', 'not-ported', 'unpaired', 'ours')}
        o, u = nonblank_lines(original_text), nonblank_lines(our_text)
        to, tu = code_tokens(original_text), code_tokens(our_text)
        summary.append(f'<tr><td><a href="#{file_anchor}">{html.escape(path)}</a></td><td>{o}</td><td>{u}</td>'
                       f'<td>{u / o:.2f}x</td><td>{tu / to:.2f}x</td><td>{alike:.0%}</td>'
                       f'<td>{counts["paired"]}</td><td>{counts["not-ported"]}</td><td>{counts["unpaired"]}</td>'
                       f'<td>{counts["ours"]}</td></tr>')
        blocks = ''.join(_pair_html(r, file_anchor, link, per_pair.get(id(r))) for r in rows)
        title = html.escape(path) + ('' if ours_path == path else f' &harr; {html.escape(ours_path)}')
        sections.append(f'<h2 id="{file_anchor}">{title}</h2><p>{o} non-blank lines &harr; {u} ({u / o:.2f}x); '
                        f'code tokens {tu / to:.2f}x; {alike:.0%} alike</p>{blocks}')
    source = html.escape(str(original_root)) + (f' at {html.escape(commit[:12])}' if commit else '')
    legend = ('<p class="legend"><span style="background:#fff6d5">changed</span><span style="background:#fdd">'
              'only the original\'s</span><span style="background:#dfd">only ours</span> unmarked: the same line '
              '(indentation aside). Each original definition (closures included) beside ours; ours alone follow '
              'the pair before them in our file. Alike: the share of code tokens (comments aside) the pair shares; '
              'a file\'s counts ours alone too.</p>')
    head = (f'<h1>lm-human-preferences beside its PyTorch port</h1><p>original: {source}</p>{legend}'
            '<table class="summary"><tr><th>file</th><th>lines: original</th><th>ours</th><th>ratio</th>'
            '<th>code tokens</th><th>alike</th><th>pairs</th><th>not ported (why)</th><th>unpaired</th>'
            f'<th>ours alone</th></tr>{"".join(summary)}</table>')
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>beside the original</title>'
            f'<style>{_STYLE}</style></head><body>{head}{"".join(sections)}</body></html>')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('original', nargs='?', help='a checkout of openai/lm-human-preferences')
    parser.add_argument('--out', help='write the side-by-side page here')
    parser.add_argument('--original-url', help="link the original's lines to this repository's web pages at the "
                        "checkout's commit (e.g. https://github.com/openai/lm-human-preferences)")
    parser.add_argument('--record', help="write the original's names and line counts here (JSON)")
    parser.add_argument('--table', help='print our files against the names and counts recorded here')
    args = parser.parse_args(argv)
    if args.table:
        print(format_table(table(json.loads(Path(args.table).read_text()))))
        return
    if args.original is None or not os.path.isdir(args.original):
        parser.error(f'ORIGINAL {args.original!r}: give the folder of a checkout of openai/lm-human-preferences')
    if args.original_url and not re.match(r'https?://', args.original_url):
        parser.error(f'--original-url {args.original_url!r}: an http(s) URL of the original repository')
    if args.record:
        Path(args.record).write_text(json.dumps(record(args.original), indent=1) + '\n')
        print(args.record)
    if args.out or not args.record:
        out = args.out or 'beside_original.html'
        try:
            Path(out).write_text(page(args.original, original_url=args.original_url))
        except ValueError as e:
            sys.exit(f'error: {e}')
        print(out)


if __name__ == '__main__':
    main()
