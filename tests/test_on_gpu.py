"""benchmarks/on_gpu.sh as a GPU machine runs it: that machine receives the tree's tracked and untracked-not-ignored
files plus the ignored folders a call carries, reaches no network and lacks some of the suite's packages. What it
needs comes from `on_gpu.sh prepare` (run where PyPI and git are) in ignored folders inside the tree; here, the
stages that use them, on this machine, without a GPU (no stage is timed or run in full)."""
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'on_gpu.sh'


def on_gpu(*args, env=None, **kw):
    return subprocess.run(['bash', str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, **kw)


def test_what_the_gpu_machine_is_carried_lies_in_ignored_folders_inside_the_tree(tmp_path):
    """The folders to carry are inside the tree and ignored by git (so they travel only when carried, and are never
    committed); the timing stage's BEFORE checkout is one of them, not a checkout beside the tree."""
    carried = on_gpu('carry')
    assert carried.returncode == 0, carried.stdout + carried.stderr
    folders = carried.stdout.split()
    assert folders == ['.whl', '.before', '.shared']
    if shutil.which('git') is None or not (ROOT / '.git').exists():
        pytest.skip('not a git checkout: which paths git ignores is unknown here')
    for folder in folders:
        assert subprocess.run(['git', 'check-ignore', '-q', f'{folder}/any'], cwd=ROOT).returncode == 0, folder
    # The timing stage's default BEFORE is <tree>/.before: with none there it says so; with one, the runs it would
    # start (STAGE_LIMIT 0: none starts, each is named) time this tree and that checkout, one after the other.
    if not (ROOT / '.before' / 'launch.py').exists():
        missing = on_gpu('timing', tmp_path / 'out', env=dict(LMHP_GPU_WHEELS=str(tmp_path)))
        assert missing.returncode == 1 and f'no BEFORE checkout at {ROOT}/.before' in missing.stdout
    before, no_wheels = tmp_path / 'before', tmp_path / 'whl'
    before.mkdir(), no_wheels.mkdir()
    (before / 'launch.py').touch()
    dry = on_gpu('timing', tmp_path / 'out', before, env=dict(STAGE_LIMIT='0', LMHP_GPU_WHEELS=str(no_wheels)))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    log = next((tmp_path / 'out').glob('train_timing_*.log'))
    runs = [line.split('not run: ')[1] for line in log.read_text().splitlines()]
    assert [r.split(' --updates')[0] for r in runs] == [
        'python3 benchmarks/train_timing.py --exp sentiment --model 124M',
        f'python3 benchmarks/train_timing.py --exp sentiment --model 124M --repo {before}',
        'python3 benchmarks/train_timing.py --exp tldr --model 124M',
        f'python3 benchmarks/train_timing.py --exp tldr --model 124M --repo {before}']


def test_the_cuda_tier_names_tests_that_exist():
    """The tests stage's CUDA tier (on_gpu.sh's CUDA_TIER) names files and test functions of the suite: a renamed
    test would leave the tier unseen here, and stop the stage on a GPU machine with pytest's 'not found'."""
    tier = re.search(r'^CUDA_TIER=\((.*?)^\)', SCRIPT.read_text(), re.MULTILINE | re.DOTALL).group(1).split()
    assert len(tier) > 20
    for entry in tier:
        path, _, name = entry.partition('::')
        assert (ROOT / path).is_file(), entry
        assert not name or re.search(rf'^def {name}\(', (ROOT / path).read_text(), re.MULTILINE), entry


def stub_wheel(folder, name, module):
    """A wheel of a package `name` holding one empty module (RECORD with its hashes, as pip reads it)."""
    dist = f'{name}-1.0.dist-info'
    files = {f'{module}/__init__.py': b'', f'{dist}/METADATA': f'Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n'.encode(),
             f'{dist}/WHEEL': b'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n'}
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
    record = ''.join(f'{path},sha256={digest(data)},{len(data)}\n' for path, data in files.items()) + f'{dist}/RECORD,,\n'
    with zipfile.ZipFile(folder / f'{name}-1.0-py3-none-any.whl', 'w') as whl:
        for path, data in {**files, f'{dist}/RECORD': record.encode()}.items():
            whl.writestr(path, data)


def test_the_suites_missing_packages_come_from_the_carried_wheels_offline(tmp_path):
    """A machine whose Python lacks vaderSentiment, ftfy and datasets (this one's, without its site-packages): the
    tests stage stops at once, naming them and what to carry; with their wheels carried it installs them offline
    (pip --no-index) and finds each there."""
    bin_dir, wheels, site = tmp_path / 'bin', tmp_path / 'whl', tmp_path / 'site'
    bin_dir.mkdir(), wheels.mkdir()
    # python3 without site-packages, but for pip itself
    (bin_dir / 'python3').write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then exec {sys.executable} "$@"; fi\nexec {sys.executable} -S "$@"\n')
    (bin_dir / 'python3').chmod(0o755)
    env = dict(PATH=f'{bin_dir}:{os.environ["PATH"]}', LMHP_GPU_WHEELS=str(wheels), LMHP_GPU_SITE=str(site),
               PYTHONPATH='')
    lacking = on_gpu('tests', tmp_path / 'out', env=env)
    assert lacking.returncode == 1, lacking.stdout + lacking.stderr
    assert 'the suite needs vaderSentiment, ftfy, datasets, which this machine lacks' in lacking.stdout
    assert 'carry .whl' in lacking.stdout and not list((tmp_path / 'out').glob('pytest_*.xml'))
    for name in ('vaderSentiment', 'ftfy', 'datasets'):
        stub_wheel(wheels, name, name)
    carried = on_gpu('deps', tmp_path / 'out', env=env)
    assert carried.returncode == 0, carried.stdout + carried.stderr
    assert 'installed datasets-1.0-py3-none-any.whl ftfy-1.0-py3-none-any.whl vaderSentiment-1.0-py3-none-any.whl' \
        in carried.stdout
    for name in ('vaderSentiment', 'ftfy', 'datasets'):
        assert f'{name} {site}/{name}/__init__.py' in carried.stdout
