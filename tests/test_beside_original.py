"""Each mirrored file holds the translation of its original (non-blank lines, code tokens and names against the
original's, recorded in tests/original_files.json), every original definition is paired with ours or has its
reason (lm_human_preferences/porting/porting_map.py, which PORTING.md's tables are printed from), and the side-by-side
page, on an original-like checkout made here, is a reviewer's diff."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.porting import beside_original, definition_diff, porting_map
from lm_human_preferences.porting.definition_diff import PortingMap

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO_ROOT / 'tests' / 'original_files.json').read_text())
PORTING = (REPO_ROOT / 'PORTING.md').read_text()

# Ours / the original's, at most, in non-blank lines and in code tokens both (issue #48). Lines alone rewarded
# long lines; characters would charge the port for the comment the guide asks at each TF -> torch difference
# and for torch's longer names; code tokens (comments and layout aside) measure the code whatever its line
# lengths, and the lines (comments included) with our lines past 120 columns no more than the original's bound
# the rest. The trainers and core.py are held to 1.3x (train_reward.py to 1.25x, issue #59); the files below
# hold named additions (PORTING.md).
MAX_RATIO = {
    'lm_human_preferences/train_policy.py': 1.3,
    'lm_human_preferences/train_reward.py': 1.25,
    'lm_human_preferences/utils/core.py': 1.3,
    'sample.py': 1.5,
    'launch.py': 1.6,
    'lm_human_preferences/utils/launch.py': 3,
    'lm_human_preferences/language/datasets.py': 2,
    'lm_human_preferences/language/trained_models.py': 2,
}
TRAINERS = ('lm_human_preferences/train_policy.py', 'lm_human_preferences/train_reward.py')


def test_the_recorded_original_is_whole():
    """The record names its commit and every mirrored file of porting_map.py (the original's tests and setup.py
    have no mirror of their own), with the closures its trainers define their steps in."""
    assert re.fullmatch(r'[0-9a-f]{40}', RECORDED['commit'])
    mapped = PortingMap.of(porting_map).mirrored
    assert set(RECORDED['files']) == set(mapped) and len(mapped) == 21
    assert RECORDED['files']['lm_human_preferences/train_policy.py']['nonblank'] == 404
    assert RECORDED['files']['lm_human_preferences/utils/core.py']['names'][:3] == [
        'nvidia_gpu_count', 'get_local_rank_size', 'gpu_devices']
    reward_names = RECORDED['files']['lm_human_preferences/train_reward.py']['names']
    assert reward_names.index('RewardModelTrainer.__init__') + 1 == reward_names.index(
        'RewardModelTrainer.__init__.<locals>.train_batch')


def test_mirrored_files_hold_the_translation():
    rows = beside_original.table(RECORDED)
    print('\n' + beside_original.format_table(rows))
    too_long = [f"{r['file']} {r['ratio']:.2f}x lines, {r['token_ratio']:.2f}x tokens > {MAX_RATIO[r['file']]}x"
                for r in rows if r['file'] in MAX_RATIO and max(r['ratio'], r['token_ratio']) > MAX_RATIO[r['file']]]
    wide = [f"{r['file']}: {r['our_long']} lines past {beside_original.LONG_LINE} columns, the original "
            f"{r['original_long']}" for r in rows if r['our_long'] > r['original_long']]
    # Of the original's names each file pairs in it, at least 85 % in the original's order.
    out_of_order = [f"{r['file']}: {r['in_order']} of {r['here']} in order" for r in rows
                    if r['in_order'] < 0.85 * r['here']]
    assert not too_long and not wide and not out_of_order, (too_long, wide, out_of_order)
    core = next(r for r in rows if r['file'] == 'lm_human_preferences/utils/core.py')
    assert core['in_order'] == core['here'], "utils/core.py: the original's functions in the original's order"


def test_an_f_string_is_one_code_token_under_every_python():
    """Python 3.12+ tokenizes an f-string into its parts (PEP 701): counted so, datasets.py read 2.09x its original
    under 3.12 for 1.86x under 3.11. The bound counts an f-string as one token, as 3.10 and 3.11 tokenize it
    (the recorded counts' Python), nested ones and all: the same ratios under every Python (CI runs 3.10 and 3.13)."""
    assert beside_original.code_tokens('x = f\'{a + b!r:>{width}} and {f"{c}"}\' \'d\'\n') == 4  # x = f'...' 'd'


def test_every_original_definition_is_paired_or_has_its_reason():
    """Every function, class, method and closure the original's mirrored files define (the trainers' closures
    included) is one of ours or porting_map.py says why not; every reason names a definition the original has,
    and no definition is both paired and not ported."""
    rows = beside_original.table(RECORDED)
    assert {r['file']: r['unexplained'] for r in rows if r['unexplained']} == {}
    pmap = PortingMap.of(porting_map)
    stale = [key for key in pmap.not_ported if key[1] not in RECORDED['files'].get(key[0], {}).get('names', ())]
    stale += [key for key in pmap.renames if key[1] not in RECORDED['files'].get(key[0], {}).get('names', ())]
    assert not stale, stale
    for path in TRAINERS:
        our_names = definition_diff.names((REPO_ROOT / path).read_text())
        theirs = RECORDED['files'][path]['names']
        both = [n for n in theirs if (path, n) in pmap.not_ported and pmap.target(path, n, theirs, our_names)]
        assert not both, both
    # The reward trainer's closures are our methods of the same names.
    theirs = RECORDED['files']['lm_human_preferences/train_reward.py']['names']
    ours = definition_diff.names((REPO_ROOT / 'lm_human_preferences/train_reward.py').read_text())
    closures = [n for n in theirs if n.startswith('RewardModelTrainer.__init__.<locals>.')]
    assert len(closures) == 9 and all(
        pmap.target('lm_human_preferences/train_reward.py', n, theirs, ours) ==
        (None, 'RewardModelTrainer.' + n.rpartition('.')[2]) for n in closures)


def test_porting_md_holds_the_map():
    """PORTING.md's module map, renamed names and not-ported tables are porting_map.py's, as it prints them; the
    rest of PORTING.md is explanation. No line, printed or written, over 400 bytes (the full rows are
    docs/porting_notes.md's)."""
    tables = porting_map.markdown().split('\n\n')
    assert len(tables) == 3
    missing = [t.splitlines()[0] for t in tables if t not in PORTING]
    assert not missing, f'PORTING.md differs from `python -m lm_human_preferences.porting.porting_map`: {missing}'
    assert not [line[:80] for line in PORTING.splitlines() if len(line.encode()) > 400]


def _table(porting, heading):
    """The rows of the first table under `## heading` in PORTING.md, as lists of cells."""
    section = porting.split(f'\n## {heading}\n', 1)
    assert len(section) == 2, f'PORTING.md has no section "## {heading}"'
    rows = [line for line in section[1].split('\n## ', 1)[0].splitlines() if line.startswith('|')]
    return [[c.strip() for c in r.strip().strip('|').split('|')] for r in rows[2:]]  # past the header and rule


def _paths(cell):
    """The paths a cell names: `a/{b,c}.py` is a/b.py and a/c.py; patterns (`*`) name none."""
    paths = []
    for code in re.findall(r'`([^`]+)`', cell):
        m = re.fullmatch(r'(.*)\{([^}]*)\}(.*)', code)
        expanded = [m.group(1) + part + m.group(3) for part in m.group(2).split(',')] if m else [code]
        paths += [p for p in expanded if p.endswith('.py') and '*' not in p]
    return paths


def test_porting_names_files_that_exist():
    """Every file PORTING.md names is in the repository: a path from the root or from lm_human_preferences/, a
    bare file name somewhere in it (the original's own files aside)."""
    ours = {p.name for p in REPO_ROOT.rglob('*.py') if '.venv' not in p.parts}
    original_only = set(RECORDED['files']) - set(PortingMap.of(porting_map).mirrored.values())
    missing = []
    for code in {c for line in PORTING.splitlines() for c in re.findall(r'`([^`\s]+)`', line)}:
        for path in _paths(f'`{code.partition(":")[0]}`'):
            if path in original_only:
                continue
            exists = (any((root / path).is_file() for root in (REPO_ROOT, REPO_ROOT / 'lm_human_preferences'))
                      if '/' in path else path in ours)
            if not exists:
                missing.append(path)
    assert not missing, sorted(missing)


def test_porting_names_functions_that_exist():
    """Every `module.name` of ours in PORTING.md's tables (their column of ours: a file's stem or path, then a name)
    is defined there: a stale name after a move fails here. Stems that are also hparam groups (`run.seed`,
    `ppo.lr`) are read as hparams."""
    ours_column = {'Module map': 1, 'Renamed names': 2, 'Bugs of the original': 1, 'Deliberate differences, by module': 1,
                   'Checks the original did not have': 1}
    cells = [row[column] for heading, column in ours_column.items() for row in _table(PORTING, heading)]
    files = [p for p in REPO_ROOT.rglob('*.py') if not {'.venv', 'tests'} & set(p.relative_to(REPO_ROOT).parts)]
    by_stem = {}
    for p in files:
        by_stem.setdefault(p.stem, []).append(p)
    hparam_groups = {'run', 'labels', 'rewards', 'policy', 'ppo', 'task', 'online', 'sample', 'datasets', 'model', 'test',
                     'main', 'books', 'local', 'utils'}
    stale = set()
    for code in {c for cell in cells for c in re.findall(r'`([^`]+)`', cell)}:
        for m in re.finditer(r'(?<![\w.])((?:\w+/)*)([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)', code):
            folder, stem, name = m.group(1).rstrip('/'), m.group(2), m.group(3)
            if stem not in by_stem or (not folder and stem in hparam_groups) or name in ('py', 'json', 'txt', 'md'):
                continue
            defined = set()
            for p in by_stem[stem]:
                if not folder or p.parent.as_posix().endswith(folder):
                    text = p.read_text()
                    defined |= set(definition_diff.names(text)) | set(re.findall(r'^\s*(\w+)\s*[:=]', text, re.M))
            if name not in defined:
                stale.add(m.group(0))
    assert len(cells) > 100 and not stale, sorted(stale)


# ---------------------------------------------------------------------------------------------------
# The side-by-side page, on a small original-like checkout and port made here

ORIGINAL_MODEL = '''\
import tensorflow as tf


def gelu(x):
    return 0.5 * x * (1 + tf.tanh(x))


def attn(x, scope, n_state):
    # the original's attention
    with tf.variable_scope(scope):
        return tf.matmul(x, x)


def tf_only():
    return tf.no_op()


class Model:
    def __init__(self, hparams):
        self.hparams = hparams

    def __call__(self, X):
        return attn(X, 'attn', 3)
'''

OUR_MODEL = '''\
import torch


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(x))


def added_helper(x):
    return x + 1


class Attention(torch.nn.Module):
    def forward(self, x):
        return x @ x


class Model(torch.nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams

    def forward(self, X):
        return Attention()(added_helper(X))
'''

# A trainer as the original writes them: its steps are closures inside __init__.
ORIGINAL_TRAINER = '''\
import tensorflow as tf


def round_down(n, divisor):
    return n - n % divisor


class Trainer():
    def __init__(self, *, model, hparams):
        self.model = model
        self.hparams = hparams

        with tf.name_scope('train'):
            @utils.graph_function(indices=Schema(tf.int32, (None,)))
            def train_batch(indices, lr):
                loss = tf.reduce_mean(self.model(indices))
                return tf.train.AdamOptimizer(lr).minimize(loss)
            self.train_batch = train_batch

        if hparams.normalize:
            def stats(rewards):
                mean, var = tf.nn.moments(rewards, axes=[0])
                return mean, tf.sqrt(var)
            self.stats = stats

        def graph_only():
            return tf.no_op()
        self.graph_only = graph_only

    def train(self):
        for i in range(10):
            self.train_batch(i, 0.1)


def make_score_fn(hparams):
    def score_fn(x):
        return x * hparams.scale
    return score_fn
'''

OUR_TRAINER = '''\
import torch


class Trainer():
    def __init__(self, *, model, hparams):
        self.model = model
        self.hparams = hparams
        self.optimizer = torch.optim.Adam(model.parameters())

    def train_batch(self, indices, lr):
        loss = self.model(indices).mean()
        loss.backward()
        self.optimizer.step()

    def stats(self, rewards):
        var, mean = torch.var_mean(rewards, correction=0)
        return mean, torch.sqrt(var)

    def save(self):
        torch.save(self.model.state_dict(), 'model.pt')

    def train(self):
        for i in range(10):
            self.train_batch(i, 0.1)


def make_score_fn(hparams):
    def score_fn(x):
        return x * hparams.scale
    return score_fn
'''

MODEL, TRAINER = 'lm_human_preferences/language/model.py', 'lm_human_preferences/train_reward.py'
FIXTURE_MAP = PortingMap(
    mirrored={MODEL: MODEL, TRAINER: TRAINER},
    renames={(MODEL, 'attn'): 'Attention.forward', (MODEL, 'Model.__call__'): 'Model.forward'},
    not_ported={(MODEL, 'tf_only'): 'a TF no-op', (TRAINER, 'round_down'): 'unused by the original',
                (TRAINER, 'Trainer.__init__.<locals>.graph_only'): 'TF graph plumbing'})
URL = 'https://github.com/openai/lm-human-preferences'


@pytest.fixture
def original_and_port(tmp_path):
    original, port = tmp_path / 'original', tmp_path / 'port'
    for root, files in ((original, {MODEL: ORIGINAL_MODEL, TRAINER: ORIGINAL_TRAINER}),
                        (port, {MODEL: OUR_MODEL, TRAINER: OUR_TRAINER})):
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
    subprocess.run(['git', 'init', '-q', str(original)], check=True)
    subprocess.run(['git', '-C', str(original), 'add', '.'], check=True)
    subprocess.run(['git', '-C', str(original), '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q',
                    '-m', 'fixture'], check=True)
    return original, port


def test_segments_and_names_of_a_file():
    segments = definition_diff.segments(ORIGINAL_MODEL)
    assert [s.name for s in segments] == ['', 'gelu', 'attn', 'tf_only', 'Model', 'Model.__init__',
                                          'Model.__call__']
    attn = segments[2]
    assert attn.text.startswith('def attn(') and '# the original' in attn.text and attn.start == 8
    assert definition_diff.names(OUR_MODEL) == ['gelu', 'added_helper', 'Attention', 'Attention.forward', 'Model',
                                                'Model.__init__', 'Model.forward']
    assert definition_diff.in_order(['a', 'b', 'c', 'd'], ['b', 'a', 'c', 'x', 'd']) == 3


def test_closures_are_segments_of_their_own():
    """The original's __init__ keeps its own lines, its closures (with their decorators, inside `with` and `if`
    blocks) are cut out into segments named as Python's __qualname__ names them."""
    by_name = {s.name: s for s in definition_diff.segments(ORIGINAL_TRAINER)}
    assert list(by_name)[3:8] == ['Trainer.__init__', 'Trainer.__init__.<locals>.train_batch',
                                  'Trainer.__init__.<locals>.stats', 'Trainer.__init__.<locals>.graph_only',
                                  'Trainer.train']
    init, train_batch = by_name['Trainer.__init__'], by_name['Trainer.__init__.<locals>.train_batch']
    assert 'self.train_batch = train_batch' in init.text and 'def train_batch' not in init.text
    assert train_batch.text.lstrip().startswith('@utils.graph_function') and 'minimize(loss)' in train_batch.text
    assert [n for n, _ in init.lines][:4] == [9, 10, 11, 12] and 15 not in [n for n, _ in init.lines]
    assert 'make_score_fn.<locals>.score_fn' in by_name


def test_the_trainer_s_closures_pair_with_our_methods():
    rows = definition_diff.pairs(ORIGINAL_TRAINER, OUR_TRAINER, path=TRAINER, pmap=FIXTURE_MAP)
    shown = [(r.theirs.name if r.theirs else None, r.ours.name if r.ours else None, r.kind) for r in rows]
    assert shown == [
        ('', '', 'paired'), ('round_down', None, 'not-ported'), ('Trainer', 'Trainer', 'paired'),
        ('Trainer.__init__', 'Trainer.__init__', 'paired'),
        ('Trainer.__init__.<locals>.train_batch', 'Trainer.train_batch', 'paired'),
        ('Trainer.__init__.<locals>.stats', 'Trainer.stats', 'paired'), (None, 'Trainer.save', 'ours'),
        ('Trainer.__init__.<locals>.graph_only', None, 'not-ported'), ('Trainer.train', 'Trainer.train', 'paired'),
        ('make_score_fn', 'make_score_fn', 'paired'),
        ('make_score_fn.<locals>.score_fn', 'make_score_fn.<locals>.score_fn', 'paired')]
    assert rows[1].reason == 'unused by the original'
    stats = rows[5]
    marks = [(mark, left[1].strip() if left else None, right[1].strip() if right else None)
             for mark, left, right in definition_diff.line_diff(stats.theirs, stats.ours)]
    assert marks == [('~', 'def stats(rewards):', 'def stats(self, rewards):'),
                     ('~', 'mean, var = tf.nn.moments(rewards, axes=[0])',
                      'var, mean = torch.var_mean(rewards, correction=0)'),
                     ('~', 'return mean, tf.sqrt(var)', 'return mean, torch.sqrt(var)')]
    marks = [(mark, left[1].strip() if left else None, right[1].strip() if right else None)
             for mark, left, right in definition_diff.line_diff(rows[4].theirs, rows[4].ours)]
    assert marks == [('-', '@utils.graph_function(indices=Schema(tf.int32, (None,)))', None),
                     ('~', 'def train_batch(indices, lr):', 'def train_batch(self, indices, lr):'),
                     ('~', 'loss = tf.reduce_mean(self.model(indices))', 'loss = self.model(indices).mean()'),
                     ('~', 'return tf.train.AdamOptimizer(lr).minimize(loss)', 'loss.backward()'),
                     ('+', None, 'self.optimizer.step()')]  # the alike lines beside each other, then in order
    train = rows[8]
    assert {m for m, _, _ in definition_diff.line_diff(train.theirs, train.ours)} == {' '}
    alike, per_pair = definition_diff.similarity(rows, ORIGINAL_TRAINER, OUR_TRAINER)
    assert per_pair[id(train)] == 1.0 and 0.3 < per_pair[id(stats)] < 1 and 0 < alike < 1


def test_the_page_sets_each_original_function_beside_ours(original_and_port):
    original, port = original_and_port
    rows = definition_diff.pairs(ORIGINAL_MODEL, OUR_MODEL, path=MODEL, pmap=FIXTURE_MAP)
    shown = [(r.theirs.name if r.theirs else None, r.ours.name if r.ours else None) for r in rows]
    assert shown == [('', ''), ('gelu', 'gelu'), (None, 'added_helper'), (None, 'Attention'),
                     ('attn', 'Attention.forward'), ('tf_only', None), ('Model', 'Model'),
                     ('Model.__init__', 'Model.__init__'), ('Model.__call__', 'Model.forward')]

    page = beside_original.page(original, port, pmap=FIXTURE_MAP, original_url=URL)
    assert f'<h2 id="{beside_original._anchor(MODEL)}">{MODEL}</h2>' in page
    attn = page.split('id="lm_human_preferences-language-model.py--attn"', 1)[1].split('<div class="pair', 1)[0]
    assert 'def attn(x, scope, n_state):' in attn and 'return x @ x' in attn and 'Attention.forward' in attn
    commit = subprocess.run(['git', '-C', str(original), 'rev-parse', 'HEAD'], capture_output=True,
                            text=True).stdout.strip()
    assert f'href="{URL}/blob/{commit}/{MODEL}#L8-L11"' in attn and f'href="{URL}/blob/{commit}/{MODEL}#L10"' in attn
    assert 'not ported: a TF no-op' in page and 'porting_map.py gives no reason' not in page


def test_the_command_writes_the_page_and_records_the_original(original_and_port, tmp_path, monkeypatch):
    original, port = original_and_port
    monkeypatch.setattr(beside_original, 'REPO_ROOT', port)
    monkeypatch.setattr(beside_original, 'porting_map', lambda: FIXTURE_MAP)
    out, recorded = tmp_path / 'beside.html', tmp_path / 'original.json'
    beside_original.main([str(original), '--out', str(out), '--record', str(recorded)])
    assert out.read_text().startswith('<!DOCTYPE html>') and 'def tf_only' in out.read_text()
    data = json.loads(recorded.read_text())
    assert re.fullmatch(r'[0-9a-f]{40}', data['commit'])
    model = data['files'][MODEL]
    assert model == dict(nonblank=14, tokens=beside_original.code_tokens(ORIGINAL_MODEL), long_lines=0,
                         names=['gelu', 'attn', 'tf_only', 'Model', 'Model.__init__', 'Model.__call__'])
    rows = {r['file']: r for r in beside_original.table(data, port)}
    assert (rows[MODEL]['found'], rows[MODEL]['in_order'], rows[MODEL]['our_lines']) == (5, 5, 14)
    assert rows[MODEL]['unexplained'] == [] and rows[TRAINER]['unexplained'] == []
    assert rows[TRAINER]['found'] == 7  # all but round_down and graph_only, which have their reasons


def test_the_command_never_downloads_and_says_what_it_needs(tmp_path):
    """A folder that is no checkout of the original is one line (exit 1); no argument is argparse's usage."""
    out = subprocess.run([sys.executable, '-m', 'lm_human_preferences.porting.beside_original', str(tmp_path), '--out',
                          str(tmp_path / 'x.html')], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith('error: ') and 'is it a checkout of' in out.stderr
    assert out.stderr.count('\n') == 1 and not (tmp_path / 'x.html').exists()
    out = subprocess.run([sys.executable, '-m', 'lm_human_preferences.porting.beside_original'], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and 'ORIGINAL None' in out.stderr
    out = subprocess.run([sys.executable, '-m', 'lm_human_preferences.porting.beside_original', str(tmp_path),
                          '--original-url', 'github.com/x'], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "--original-url 'github.com/x'" in out.stderr


def test_a_renamed_name_in_another_file_is_shown_from_there():
    original = 'def load_hparams(file):\n    return file\n'
    ours = 'def other():\n    pass\n'
    pmap = PortingMap({'a.py': 'a.py'}, renames={('a.py', 'load_hparams'): 'b.py:load_hparams'})
    rows = definition_diff.pairs(original, ours, path='a.py', pmap=pmap,
                                 other_files=lambda p: 'def load_hparams(path):\n    return path\n')
    alone, moved = rows  # ours alone, before any paired segment: first
    assert alone.kind == 'ours' and alone.ours.name == 'other'
    assert moved.theirs.name == moved.ours.name == 'load_hparams' and 'return path' in moved.ours.text
    assert moved.note == 'in b.py as load_hparams' and moved.kind == 'paired'


@pytest.mark.slow
def test_the_page_in_a_browser(original_and_port, tmp_path, chromium):
    """The page as a reviewer opens it in the suite's headless Chromium: every original definition is paired or
    shows its reason, no definition of ours shown as ours alone translates an original closure, a pair's anchor
    scrolls to it, and the changed lines are marked beside each other."""
    original, port = original_and_port
    out = tmp_path / 'beside.html'
    out.write_text(beside_original.page(original, port, pmap=FIXTURE_MAP, original_url=URL))
    driver = chromium
    anchor = beside_original._anchor(TRAINER, 'Trainer.__init__.<locals>.stats')
    driver.get(out.as_uri() + '#' + anchor)
    pairs = driver.execute_script(
        "return [...document.querySelectorAll('.pair')].map(p => [p.dataset.kind, p.dataset.original, "
        "p.dataset.ours, p.querySelector('.reason') ? p.querySelector('.reason').innerText : null])")
    assert not [p for p in pairs if p[0] == 'unpaired'], pairs
    assert all(p[3].startswith('not ported: ') for p in pairs if p[0] == 'not-ported')
    closures = {p[1].rpartition('.')[2] for p in pairs if '<locals>' in p[1]}
    ours_alone = [p[2] for p in pairs if p[0] == 'ours']
    assert ours_alone and not [n for n in ours_alone if n.rpartition('.')[2] in closures], ours_alone
    top, scrolled, height = driver.execute_script(
        f"return [document.getElementById('{anchor}').getBoundingClientRect().top, window.scrollY, "
        "window.innerHeight]")
    assert scrolled > 0 and 0 <= top < height / 2, (top, scrolled)  # the anchor scrolled to its pair
    changed = driver.execute_script(
        f"return [...document.getElementById('{anchor}').querySelectorAll('tr.changed')].map(r => "
        "[r.cells[1].innerText, r.cells[3].innerText, getComputedStyle(r.cells[1]).backgroundColor])")
    assert [c.strip() for c in changed[1][:2]] == ['mean, var = tf.nn.moments(rewards, axes=[0])',
                                                   'var, mean = torch.var_mean(rewards, correction=0)']
    assert changed[0][2] != 'rgba(0, 0, 0, 0)'  # marked
    summary = driver.execute_script("return [...document.querySelectorAll('table.summary tr')].map(r => "
                                    "[...r.cells].map(c => c.innerText))")
    assert summary[0][:2] == ['file', 'lines: original'] and len(summary) == 3
    trainer_row = next(r for r in summary if r[0] == TRAINER)
    assert trainer_row[6:] == ['7', '2', '0', '1']  # pairs, not ported, unpaired, ours alone
    driver.save_screenshot(str(tmp_path / 'beside.png'))
