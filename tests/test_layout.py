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
    assert 'site-packages' in path.split(os.sep), path
    assert not path.startswith(str(REPO_ROOT / 'datasets') + os.sep)  # (a venv may live inside the repo)
    assert has_load == 'True'
