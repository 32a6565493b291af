"""Shared pytest fixtures."""
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# `../shared` beside the checkout holds read-only reference files. The tests need only its copy of OpenAI's
# GPT-2 124M checkpoint index (the BPE files and the books ship with the package): a clone without it
# skips that test, saying how to provide the public files. $LMHP_TEST_SHARED_DIR moves it (a test of the
# skip reasons hides it that way).
SHARED_DIR = Path(os.environ.get('LMHP_TEST_SHARED_DIR', REPO_ROOT.parent / 'shared'))
GPT2_124M_URL = 'https://openaipublic.blob.core.windows.net/gpt-2/models/124M'

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The TF converter sets these before it imports tensorflow (quiet, no oneDNN rewrites); set here too, so
# that the tests comparing with TF's own ops run TF the same way whichever test imports it first.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


@pytest.fixture
def gpt2_124m_dir() -> Path:
    """The dir of OpenAI's GPT-2 124M release files that describe its variables (no weights): hparams.json
    and model.ckpt.index."""
    d = SHARED_DIR / 'gpt2-124M'
    missing = [f for f in ('hparams.json', 'model.ckpt.index') if not (d / f).is_file()]
    if missing:
        pytest.skip(f"needs OpenAI's public GPT-2 124M files {', '.join(missing)} in {d}: download them from "
                    f"{GPT2_124M_URL}/<file> (a few KB; the weights are not needed), or point "
                    f"$LMHP_TEST_SHARED_DIR at a folder whose gpt2-124M/ holds them")
    return d


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path_factory, monkeypatch):
    """Keep every test's downloads, prepared data and converted checkpoints out of the repo."""
    cache = tmp_path_factory.getbasetemp() / 'caches'
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(cache / 'datasets'))
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(cache / 'saved_models'))


@pytest.fixture
def gloo(monkeypatch):
    """CPU collectives even on a GPU machine (NCCL would need one GPU per worker process)."""
    monkeypatch.setenv('LMHP_DIST_BACKEND', 'gloo')


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


CHROMIUM, CHROMEDRIVER = '/usr/bin/chromium', '/usr/bin/chromedriver'


def headless_chromium(window_size='1100,900'):
    """Debian's chromium driven by Selenium (nothing downloaded); skips where either is missing."""
    webdriver = pytest.importorskip('selenium.webdriver', reason='needs selenium (the [test-full] extra)')
    from selenium.webdriver.chrome.service import Service
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (apt install chromium chromium-driver: .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ('--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                 '--disable-component-update', '--disable-sync', '--no-first-run', f'--window-size={window_size}'):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def chromium():
    """A headless Chromium for one test, quit after it."""
    driver = headless_chromium()
    yield driver
    driver.quit()
