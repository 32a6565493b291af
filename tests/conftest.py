"""Shared pytest fixtures."""
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# `../shared` beside the checkout holds read-only reference files (GPT-2 BPE files, the 124M
# checkpoint index, public-domain books). A user's clone has none: tests that need it skip.
SHARED_DIR = REPO_ROOT.parent / 'shared'

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The TF converter sets these before it imports tensorflow (quiet, no oneDNN rewrites); set here too, so
# that the tests comparing with TF's own ops run TF the same way whichever test imports it first.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.skip(f'{SHARED_DIR} is absent (it exists only beside the CI checkout)')
    return SHARED_DIR


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path_factory, monkeypatch):
    """Keep every test's downloads, prepared data and converted checkpoints out of the repo."""
    cache = tmp_path_factory.getbasetemp() / 'caches'
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(cache / 'datasets'))
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(cache / 'saved_models'))


@pytest.fixture
def forward_rows(monkeypatch):
    """The number of sequences of every model pass (GPT-2 forward: sampling steps, logprobs, scores,
    losses) run in this process, in order."""
    from lm_human_preferences.language import model
    rows = []
    forward = model.Model.forward

    def counting(self, X, *args, **kwargs):
        rows.append(X.shape[0])
        return forward(self, X, *args, **kwargs)
    monkeypatch.setattr(model.Model, 'forward', counting)
    return rows
