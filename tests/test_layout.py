"""The repo's top-level datasets/ cache dir must never shadow the Hugging Face `datasets` library."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_datasets_dir_is_not_a_package():
    assert not (REPO_ROOT / 'datasets' / '__init__.py').exists()


@pytest.mark.slow
def test_import_datasets_from_repo_root_gets_the_library():
    # `python -c` puts the current directory first on sys.path: exactly where shadowing would happen.
    out = subprocess.run([sys.executable, '-c', "import datasets; print(datasets.__file__); print(hasattr(datasets, 'load_dataset'))"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, has_load = out.stdout.split()
    # installed wherever (site-packages, a --target dir on PYTHONPATH), but not our datasets/ (a venv may
    # live inside the repo)
    assert not path.startswith(str(REPO_ROOT / 'datasets') + os.sep), path
    assert has_load == 'True'


def test_our_warnings_fail_the_tests_that_do_not_expect_them(pytestconfig):
    """Every warning class of the library is an error under pytest (pyproject's filterwarnings, as pytest read them:
    Python 3.10 has no tomllib): a test that triggers one must say so (pytest.warns), so a green run shows no
    warnings summary of expected ones."""
    import re
    classes = set()
    for path in (REPO_ROOT / 'lm_human_preferences').rglob('*.py'):
        module = '.'.join(path.relative_to(REPO_ROOT).with_suffix('').parts)
        classes |= {f'{module}.{name}' for name in re.findall(r'^class (\w+Warning)\(', path.read_text(), re.MULTILINE)}
    assert len(classes) >= 3, classes
    assert {f'error::{c}' for c in classes} <= set(pytestconfig.getini('filterwarnings')), sorted(classes)


@pytest.mark.slow
def test_a_clone_without_shared_files_runs_every_test_but_one_that_says_how_to_get_them(tmp_path):
    """The tests that read OpenAI's BPE files or the books use the copies that ship with the package; the one
    that needs more of OpenAI's public GPT-2 files skips saying which files and where to download them."""
    tests = ['tests/test_encodings.py', 'tests/test_datasets.py::test_shipped_books_with_gpt2',
             'tests/test_lm_tasks.py::test_query_sampler_on_shipped_books', 'tests/test_converter.py::test_gpt2_124m_name_map']
    env = dict(os.environ, LMHP_TEST_SHARED_DIR=str(tmp_path / 'no-shared'))
    out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-rs', '-p', 'no:cacheprovider', *tests], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True, timeout=300).stdout
    skips = [line for line in out.splitlines() if line.startswith('SKIPPED')]
    assert len(skips) == 1 and '9 passed, 1 skipped' in out, out[-3000:]
    assert (f"needs OpenAI's public GPT-2 124M files hparams.json, model.ckpt.index in {tmp_path / 'no-shared' / 'gpt2-124M'}: "
            f"download them from https://openaipublic.blob.core.windows.net/gpt-2/models/124M/<file>") in skips[0]
    assert 'or point $LMHP_TEST_SHARED_DIR at a folder whose gpt2-124M/ holds them' in skips[0]


def test_license_names_every_bundled_notice():
    """The LICENSE covers this code and points at the notice of every bundled file under other terms: the files
    it names exist, and every license file shipped in the package is named."""
    import re
    text = (REPO_ROOT / 'LICENSE').read_text()
    assert text.startswith('MIT License') and 'OpenAI' in text
    named = set(re.findall(r'(lm_human_preferences/[\w/.-]*(?:LICENSE[\w-]*))', text.replace('\n  ', '')))
    shipped = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / 'lm_human_preferences').rglob('LICENSE*')}
    assert named == shipped and all((REPO_ROOT / n).is_file() for n in named), (named, shipped)
