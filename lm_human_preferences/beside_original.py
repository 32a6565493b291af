"""Ours: the port beside the original, file by file and function by function.

    python -m lm_human_preferences.beside_original ORIGINAL --out beside.html    # the page
    python -m lm_human_preferences.beside_original ORIGINAL --record tests/original_files.json
    python -m lm_human_preferences.beside_original --table tests/original_files.json

ORIGINAL is a checkout of openai/lm-human-preferences (nothing is downloaded). Which of our files translates
each original file, and which name each renamed function took, is PORTING.md's: its module map and its table
of renamed names. The page sets each original function, class and method beside ours; what we add to a file
follows the function it comes after in our file. --record writes the original's names and non-blank line
counts (with its commit), which --table and tests/test_beside_original.py hold our files against.
"""

import argparse
import ast
import html
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def nonblank_lines(text):
    return sum(1 for line in text.splitlines() if line.strip())


@dataclass
class Segment:
    """A piece of a file: a function, a class's own lines (its header and fields), a method, or module code."""
    name: str  # 'f', 'Class', 'Class.method'; module code: '' (never paired but the first)
    start: int  # 1-based, inclusive: its decorators and the comment lines right above it included
    end: int
    text: str


def _start_line(node, lines):
    start = min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', [])])
    while start > 1 and lines[start - 2].lstrip().startswith('#'):
        start -= 1
    return start


def segments(text):
    """The file's segments in order: every top-level function and class (each method a segment of its own),
    and the module code between them."""
    lines = text.splitlines()
    out = []

    def add(name, start, end):
        out.append(Segment(name, start, end, '\n'.join(lines[start - 1:end])))

    def walk(body, prefix, stop):
        position = None  # the first line of the module code not yet in a segment
        for node in body:
            defines = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            start = _start_line(node, lines) if defines else node.lineno
            if not defines:
                position = start if position is None else position
                continue
            if position is not None and not prefix:
                add('', position, start - 1)
            position = None
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                head_end = _start_line(methods[0], lines) - 1 if methods else node.end_lineno
                add(prefix + node.name, start, head_end)
                walk(node.body, prefix + node.name + '.', node.end_lineno)
            else:
                add(prefix + node.name, start, node.end_lineno)
        if position is not None and not prefix:
            add('', position, stop)

    walk(ast.parse(text).body, '', len(lines))
    return [s for s in out if s.text.strip()]


def names(text):
    """The functions, classes and methods a file defines, in order ('Class.method' for a method)."""
    return [s.name for s in segments(text) if s.name]


def in_order(original, ours):
    """How many of the names both lists hold keep the original's order: the longest common subsequence."""
    shared = set(original) & set(ours)
    a, b = [n for n in original if n in shared], [n for n in ours if n in shared]
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b):
            diagonal, row[j + 1] = row[j + 1], diagonal + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


# ---------------------------------------------------------------------------------------------------
# PORTING.md: the module map and the renamed names

def _cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


def _table(porting, heading):
    """The rows of the first table under `## heading` in PORTING.md, as lists of cells."""
    section = porting.split(f'\n## {heading}\n', 1)
    if len(section) < 2:
        raise ValueError(f'PORTING.md has no section "## {heading}"')
    rows = [line for line in section[1].split('\n## ', 1)[0].splitlines() if line.startswith('|')]
    return [_cells(r) for r in rows[2:]]  # past the header and its rule


def _paths(cell):
    """The paths a module-map cell names: `a/{b,c}.py` is a/b.py and a/c.py; patterns (`*`) name none."""
    paths = []
    for code in re.findall(r'`([^`]+)`', cell):
        m = re.fullmatch(r'(.*)\{([^}]*)\}(.*)', code)
        expanded = [m.group(1) + part + m.group(3) for part in m.group(2).split(',')] if m else [code]
        paths += [p for p in expanded if p.endswith('.py') and '*' not in p]
    return paths


def module_map(porting):
    """{original path: our path} from PORTING.md's module map ('same': the same path)."""
    mapping = {}
    for cells in _table(porting, 'Module map'):
        originals = _paths(cells[0])
        if not originals:
            continue
        ours = originals if cells[1] == 'same' else _paths(cells[1])
        if len(ours) == len(originals):
            mapping.update(zip(originals, ours))
    return mapping


def renames(porting):
    """{(original path, original name): (our path or None for the same file, our name)} from PORTING.md's
    table of renamed names: `path` | `name` | `ours` where ours is `Name` or `our/path.py:Name`."""
    out = {}
    for cells in _table(porting, 'Renamed names'):
        path, name, ours = (re.sub(r'`', '', c) for c in cells[:3])
        our_path, _, our_name = ours.rpartition(':')
        out[(path, name)] = (our_path or None, our_name)
    return out


def our_name(renamed, path, name):
    """The name the original `name` of `path` has in our file of it (None where it moved to another file)."""
    target = renamed.get((path, name))
    if target is None:
        return name
    return target[1] if target[0] is None else None


# ---------------------------------------------------------------------------------------------------
# The table: non-blank lines and names, ours against the original's

def record(original_root):
    """The original's mirrored files (those of PORTING.md's module map): their non-blank lines and names, and
    the commit they come from."""
    porting = (REPO_ROOT / 'PORTING.md').read_text()
    commit = subprocess.run(['git', '-C', str(original_root), 'rev-parse', 'HEAD'], capture_output=True,
                            text=True).stdout.strip() or None
    files = {}
    for path in sorted(module_map(porting)):
        text = (Path(original_root) / path).read_text()
        files[path] = dict(nonblank=nonblank_lines(text), names=names(text))
    return dict(repository='openai/lm-human-preferences', commit=commit, files=files)


def table(recorded, repo_root=REPO_ROOT):
    """One row per mirrored file: its original's and our non-blank lines, the ratio, the original's names our
    file holds (renames applied) and how many of them keep the original's order."""
    porting = (Path(repo_root) / 'PORTING.md').read_text()
    mapping, renamed = module_map(porting), renames(porting)
    rows = []
    for path, theirs in recorded['files'].items():
        text = (Path(repo_root) / mapping[path]).read_text()
        ours_names = names(text)
        wanted = [n for n in (our_name(renamed, path, n) for n in theirs['names']) if n]
        found = [n for n in wanted if n in ours_names]
        rows.append(dict(file=path, ours=mapping[path], original_lines=theirs['nonblank'],
                         our_lines=nonblank_lines(text), ratio=nonblank_lines(text) / theirs['nonblank'],
                         names=len(theirs['names']), found=len(found), in_order=in_order(found, ours_names)))
    return rows


def format_table(rows):
    lines = ['| file | original | ours | ratio | names found / in order |', '|---|---:|---:|---:|---|']
    for r in rows:
        lines.append(f"| {r['file']} | {r['original_lines']} | {r['our_lines']} | {r['ratio']:.2f}x | "
                     f"{r['found']}/{r['names']}, {r['in_order']} in order |")
    total_o, total_u = sum(r['original_lines'] for r in rows), sum(r['our_lines'] for r in rows)
    lines.append(f'| all {len(rows)} mirrored files | {total_o:,} | {total_u:,} | {total_u / total_o:.2f}x | |')
    return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------------
# The page

def pairs(original_text, our_text, *, path, renamed, other_files):
    """Rows (original segment or None, our segment or None, note) setting each original segment beside ours,
    in the original's order; our segments that no original one names follow the paired one before them in
    our file. other_files(path) -> our text of another file, for names that moved there."""
    theirs, ours = segments(original_text), segments(our_text)
    by_name = {s.name: s for s in ours if s.name}
    matched = {}  # id(our segment) -> original segment
    rows = []
    for i, seg in enumerate(theirs):
        target = renamed.get((path, seg.name)) if seg.name else None
        if not seg.name:
            partner = ours[0] if i == 0 and ours and not ours[0].name else None
            note = ''
        elif target is not None and target[0] is not None:  # moved to another of our files
            moved = {s.name: s for s in segments(other_files(target[0])) if s.name}.get(target[1])
            rows.append((seg, moved, f'in {target[0]} as {target[1]}'))
            continue
        else:
            name = seg.name if target is None else target[1]
            partner = by_name.get(name)
            note = '' if target is None or partner is None else f'ours: {name}'
        if partner is not None and id(partner) in matched:
            partner = None
        if partner is not None:
            matched[id(partner)] = seg
        rows.append((seg, partner, note))
    # Ours alone: after the paired segment that comes before it in our file.
    after, anchor = {}, None
    for seg in ours:
        if id(seg) in matched:
            anchor = id(seg)
        else:
            after.setdefault(anchor, []).append(seg)
    out = [(None, s, 'ours') for s in after.get(None, [])]
    for theirs_seg, ours_seg, note in rows:
        out.append((theirs_seg, ours_seg, note))
        if ours_seg is not None and id(ours_seg) in matched:
            out += [(None, s, 'ours') for s in after.get(id(ours_seg), [])]
    return out


_STYLE = """
body { font-family: sans-serif; margin: 1em; }
table.side { border-collapse: collapse; width: 100%; table-layout: fixed; margin-bottom: 2em; }
table.side td { vertical-align: top; border-top: 1px solid #ccc; padding: 0; width: 50%; }
table.side td.note { width: auto; }
pre { margin: 0; padding: 2px 4px; font-size: 12px; white-space: pre-wrap; word-break: break-word; }
.name { background: #eef; font-family: monospace; font-size: 12px; padding: 1px 4px; }
.ours-only pre, .ours-only .name { background: #f4fff4; }
.missing { color: #888; font-style: italic; padding: 4px; font-size: 12px; }
.ln { color: #aaa; user-select: none; }
table.summary td, table.summary th { padding: 1px 8px; text-align: right; }
table.summary td:first-child { text-align: left; }
"""


def _code(seg):
    if seg is None:
        return ''
    width = len(str(seg.end))
    body = '\n'.join(f'<span class="ln">{n:>{width}}</span> {html.escape(line)}'
                     for n, line in zip(range(seg.start, seg.end + 1), seg.text.splitlines()))
    return f'<div class="name">{html.escape(seg.name or "module code")}</div><pre>{body}</pre>'


def page(original_root, repo_root=REPO_ROOT):
    """The HTML page setting each mirrored original file beside ours (PORTING.md's map)."""
    original_root, repo_root = Path(original_root), Path(repo_root)
    porting = (repo_root / 'PORTING.md').read_text()
    mapping, renamed = module_map(porting), renames(porting)
    missing = [p for p in mapping if not (original_root / p).is_file()]
    if len(missing) == len(mapping):
        raise ValueError(f'{original_root} holds none of the original files PORTING.md maps (e.g. {missing[0]}): '
                         f'is it a checkout of openai/lm-human-preferences?')
    summary, sections = [], []
    for path, ours_path in mapping.items():
        if path in missing:
            continue
        original_text, our_text = (original_root / path).read_text(), (repo_root / ours_path).read_text()
        rows = pairs(original_text, our_text, path=path, renamed=renamed,
                     other_files=lambda p: (repo_root / p).read_text())
        theirs_names = names(original_text)
        wanted = [n for n in (our_name(renamed, path, n) for n in theirs_names) if n]
        our_names = names(our_text)
        found = [n for n in wanted if n in our_names]
        o, u = nonblank_lines(original_text), nonblank_lines(our_text)
        anchor = re.sub(r'\W', '-', path)
        summary.append(f'<tr><td><a href="#{anchor}">{html.escape(path)}</a></td><td>{o}</td><td>{u}</td>'
                       f'<td>{u / o:.2f}x</td><td>{len(found)}/{len(theirs_names)}</td>'
                       f'<td>{in_order(found, our_names)}</td></tr>')
        cells = []
        for theirs, ours, note in rows:
            left = _code(theirs) if theirs is not None else ''
            right = _code(ours) if ours is not None else '<div class="missing">not in ours (PORTING.md says why)</div>'
            if note and note != 'ours':
                right = f'<div class="missing">{html.escape(note)}</div>' + right
            cls = ' class="ours-only"' if theirs is None else ''
            cells.append(f'<tr{cls}><td>{left}</td><td>{right}</td></tr>')
        sections.append(f'<h2 id="{anchor}">{html.escape(path)} &harr; {html.escape(ours_path)}</h2>'
                        f'<p>{o} non-blank lines &harr; {u} ({u / o:.2f}x)</p>'
                        f'<table class="side"><tr><th>original</th><th>ours</th></tr>{"".join(cells)}</table>')
    commit = subprocess.run(['git', '-C', str(original_root), 'rev-parse', '--short', 'HEAD'], capture_output=True,
                            text=True).stdout.strip()
    head = (f'<h1>lm-human-preferences beside its PyTorch port</h1><p>original: {html.escape(str(original_root))}'
            + (f' at {html.escape(commit)}' if commit else '') + '; each original function beside ours, by '
            'PORTING.md (green: ours alone, after the function it follows in our file).</p>'
            '<table class="summary"><tr><th>file</th><th>original</th><th>ours</th><th>ratio</th>'
            f'<th>names found</th><th>in order</th></tr>{"".join(summary)}</table>')
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>beside the original</title>'
            f'<style>{_STYLE}</style></head><body>{head}{"".join(sections)}</body></html>')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('original', nargs='?', help='a checkout of openai/lm-human-preferences')
    parser.add_argument('--out', help='write the side-by-side page here')
    parser.add_argument('--record', help="write the original's names and line counts here (JSON)")
    parser.add_argument('--table', help='print our files against the names and counts recorded here')
    args = parser.parse_args(argv)
    if args.table:
        print(format_table(table(json.loads(Path(args.table).read_text()))))
        return
    if args.original is None or not os.path.isdir(args.original):
        parser.error(f'ORIGINAL {args.original!r}: give the folder of a checkout of openai/lm-human-preferences')
    if args.record:
        Path(args.record).write_text(json.dumps(record(args.original), indent=1) + '\n')
        print(args.record)
    if args.out or not args.record:
        out = args.out or 'beside_original.html'
        try:
            Path(out).write_text(page(args.original))
        except ValueError as e:
            sys.exit(f'error: {e}')
        print(out)


if __name__ == '__main__':
    main()
