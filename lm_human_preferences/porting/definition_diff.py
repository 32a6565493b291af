"""Ours: the original's definitions paired with ours, and a line diff inside each pair (beside_original.py's page).

A file's definitions are its functions, classes (their own lines), methods and closures: the original's trainers
define their steps as closures inside __init__, ours as methods of the same names, which pair by the rule of
PortingMap.target; renamed and moved definitions and the reasons for what was not ported come from
porting_map.py.
"""

import ast
import difflib
import io
import itertools
import re
import tokenize
from dataclasses import dataclass, field


def _code_without_comments(text):
    """{line number: the line without its comment}: what the pair similarity compares."""
    code = dict(enumerate(text.splitlines(), 1))
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT:
            code[t.start[0]] = code[t.start[0]][:t.start[1]]
    return code


@dataclass
class Segment:
    """A definition's own lines: a function's or method's (its closures cut out), a class's header and fields, a
    closure's, or module code."""
    name: str  # 'f', 'Class', 'Class.method', 'Class.method.<locals>.closure'; module code: ''
    lines: list  # [(1-based line number, text)]: its decorators and the comment lines right above it included
    kind: str = 'function'  # 'module', 'class', 'function', 'closure'

    @property
    def start(self):
        return self.lines[0][0]

    @property
    def end(self):
        return self.lines[-1][0]

    @property
    def text(self):
        return '\n'.join(line for _, line in self.lines)


def _start_line(node, lines):
    start = min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', [])])
    while start > 1 and lines[start - 2].lstrip().startswith('#'):
        start -= 1
    return start


_DEFINES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _nested_definitions(function):
    """The functions and classes defined in a function's body (inside its if/with/for blocks too, not inside
    another definition)."""
    found, todo = [], list(function.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, _DEFINES):
            found.append(node)
        elif not isinstance(node, ast.Lambda):
            todo[:0] = list(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def segments(text):
    """The file's segments in order: every top-level function and class, each method, each closure (a function
    defined in a function: the original's trainers define their steps so), and the module code between them."""
    lines = text.splitlines()
    out = []

    def numbered(start, end, holes=()):
        return [(n, lines[n - 1]) for n in range(start, end + 1) if not any(a <= n <= b for a, b in holes)]

    def function(node, name, kind):
        nested = _nested_definitions(node)
        holes = [(_start_line(n, lines), n.end_lineno) for n in nested]
        out.append(Segment(name, numbered(_start_line(node, lines), node.end_lineno, holes), kind))
        for n in nested:
            inner = f'{name}.<locals>.{n.name}'
            if isinstance(n, ast.ClassDef):
                out.append(Segment(inner, numbered(_start_line(n, lines), n.end_lineno), 'closure'))
            else:
                function(n, inner, 'closure')

    position = None  # the first line of module code not yet in a segment
    for node in ast.parse(text).body:
        if not isinstance(node, _DEFINES):
            position = node.lineno if position is None else position
            continue
        start = _start_line(node, lines)
        if position is not None:
            out.append(Segment('', numbered(position, start - 1), 'module'))
        position = None
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            head_end = _start_line(methods[0], lines) - 1 if methods else node.end_lineno
            out.append(Segment(node.name, numbered(start, head_end), 'class'))
            for method in methods:
                function(method, f'{node.name}.{method.name}', 'function')
        else:
            function(node, node.name, 'function')
    if position is not None:
        out.append(Segment('', numbered(position, len(lines)), 'module'))
    return [s for s in out if s.lines and s.text.strip()]


def names(text):
    """The functions, classes, methods and closures a file defines, in order ('Class.method',
    'f.<locals>.closure')."""
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


@dataclass
class PortingMap:
    mirrored: dict  # {original path: our path}
    renames: dict = field(default_factory=dict)  # {(original path, name): 'Name' or 'our/path.py:Name'}
    not_ported: dict = field(default_factory=dict)  # {(original path, name): why}

    @classmethod
    def of(cls, module):
        """The map a module of porting_map.py's form holds."""
        not_ported = {(path, name): why for path, by_reason in module.NOT_PORTED.items()
                      for why, names_ in by_reason.items() for name in names_}
        return cls({o: u for o, u, _ in module.MIRRORED}, dict(module.RENAMES), not_ported)

    def target(self, path, name, original_names, our_names):
        """Where the original `name` of `path` is in ours: (our path or None for our file of it, our name), or
        None. A closure `Q.<locals>.g` that keeps its name is the method `Class.g` of Q's class, else the
        function `g` (where the original defines no such name itself)."""
        if (path, name) in self.renames:
            our_path, _, ours = self.renames[(path, name)].rpartition(':')
            return our_path or None, ours
        if name in our_names:
            return None, name
        if '.<locals>.' in name:
            enclosing, _, short = name.rpartition('.<locals>.')
            owner = enclosing.split('.')[0] if '.' in enclosing and '<locals>' not in enclosing else None
            for candidate in ([f'{owner}.{short}'] if owner else []) + [short]:
                if candidate in our_names and candidate not in original_names:
                    return None, candidate
        return None


@dataclass
class Row:
    """One entry of a file's diff: an original segment beside ours, or one of them alone."""
    theirs: Segment = None
    ours: Segment = None
    note: str = ''  # where ours is, when it is not the same name in our file of it
    reason: str = None  # why the original's is not ported (porting_map.NOT_PORTED)

    @property
    def kind(self):
        return ('ours' if self.theirs is None else 'paired' if self.ours is not None else
                'not-ported' if self.reason else 'unpaired' if self.theirs.name else 'module-code')


def pairs(original_text, our_text, *, path, pmap, other_files=None):
    """Rows setting each original segment beside ours, in the original's order; our segments that no original one
    names follow the paired one before them in our file. other_files(path) -> our text of another file, for
    definitions that moved there."""
    theirs, ours = segments(original_text), segments(our_text)
    original_names = [s.name for s in theirs if s.name]
    by_name = {s.name: s for s in ours if s.name}
    matched = set()  # id() of our paired segments
    rows = []
    for i, seg in enumerate(theirs):
        if not seg.name:
            partner = ours[0] if i == 0 and ours and not ours[0].name else None
            rows.append(Row(seg, partner))
            matched |= {id(partner)} if partner is not None else set()
            continue
        target = pmap.target(path, seg.name, original_names, list(by_name))
        reason = pmap.not_ported.get((path, seg.name))
        if target is not None and target[0] is not None:  # moved to another of our files
            moved = {s.name: s for s in segments(other_files(target[0])) if s.name}.get(target[1])
            rows.append(Row(seg, moved, f'in {target[0]} as {target[1]}', reason))
            continue
        partner = by_name.get(target[1]) if target is not None else None
        partner = None if partner is not None and id(partner) in matched else partner
        matched |= {id(partner)} if partner is not None else set()
        note = f'ours: {partner.name}' if partner is not None and partner.name != seg.name else ''
        rows.append(Row(seg, partner, note, reason if partner is None else None))
    # Ours alone: after the paired segment that comes before it in our file.
    after, anchor = {}, None
    for seg in ours:
        if id(seg) in matched:
            anchor = id(seg)
        else:
            after.setdefault(anchor, []).append(seg)
    out = [Row(None, s) for s in after.get(None, [])]
    for row in rows:
        out.append(row)
        if row.ours is not None and id(row.ours) in matched:
            out += [Row(None, s) for s in after.get(id(row.ours), [])]
    return out


def line_diff(theirs, ours):
    """[(mark, (line number, text) or None, (line number, text) or None)], mark one of ' ' (the same but for
    indentation), '~' (changed: the original's line beside the one that replaced it), '-' (only the original's),
    '+' (only ours)."""
    a, b = theirs.lines if theirs else [], ours.lines if ours else []
    matcher = difflib.SequenceMatcher(None, [t.strip() for _, t in a], [t.strip() for _, t in b], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == 'equal':
            out += [(' ', x, y) for x, y in zip(a[i1:i2], b[j1:j2])]
            continue
        # A changed block: its most alike lines set beside each other (_alike_pairs); between them, the rest
        # beside each other in order, the surplus of one side alone.
        anchors = _alike_pairs([t.strip() for _, t in a[i1:i2]], [t.strip() for _, t in b[j1:j2]])
        i, j = i1, j1
        for x, y in anchors + [(i2 - i1, j2 - j1)]:
            for left, right in itertools.zip_longest(a[i:i1 + x], b[j:j1 + y]):
                out.append(('~' if left and right else '-' if left else '+', left, right))
            if i1 + x < i2:
                out.append(('~', a[i1 + x], b[j1 + y]))
            i, j = i1 + x + 1, j1 + y + 1
    return out


def _alike_pairs(x, y, least=0.5):
    """[(i, j)]: lines x[i] and y[j] set beside each other, in order, the pairs' likeness (difflib's ratio, each
    at least `least`) the largest in total."""
    alike = [[difflib.SequenceMatcher(None, u, v).ratio() for v in y] for u in x]
    best = [[0.0] * (len(y) + 1) for _ in range(len(x) + 1)]  # best[i][j]: of x[i:] and y[j:]
    for i in range(len(x) - 1, -1, -1):
        for j in range(len(y) - 1, -1, -1):
            paired = best[i + 1][j + 1] + alike[i][j] if alike[i][j] >= least else -1
            best[i][j] = max(best[i + 1][j], best[i][j + 1], paired)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        if alike[i][j] >= least and best[i][j] == best[i + 1][j + 1] + alike[i][j]:
            out.append((i, j))
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return out


def _tokens(seg, code):
    return re.findall(r'[A-Za-z_]\w*|\d+|\S', '\n'.join(code.get(n, '') for n, _ in seg.lines)) if seg else []


def similarity(rows, original_text, our_text):
    """(the file's similarity, {id(row): the pair's}): difflib's ratio of the code tokens (comments left out) of
    each pair, and 2 x the tokens the pairs share / all code tokens of both files (ours alone included)."""
    code_o, code_u = _code_without_comments(original_text), _code_without_comments(our_text)
    shared, per_pair, total = 0, {}, 0
    for row in rows:
        a = _tokens(row.theirs, code_o)
        b = _tokens(row.ours, code_u) if row.theirs is None or not row.note.startswith('in ') else []
        total += len(a) + len(b)
        if row.kind == 'paired' and a and b:
            matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
            matching = sum(m.size for m in matcher.get_matching_blocks())
            shared += matching
            per_pair[id(row)] = 2 * matching / (len(a) + len(b))
    return (2 * shared / total if total else 1.0), per_pair
