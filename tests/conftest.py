"""Shared pytest fixtures and helpers: the command line runs of launch.py that several test files start (their
tiny task, its label files and corpus, killing a run mid-way), and a headless Chromium."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
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



def load_script(name, filename):
    """The repository's script `filename` (launch.py, sample.py) as a module of its own named `name`."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

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


# ---------------------------------------------------------------------------------------------------
# launch.py's command lines, run as a user runs them (subprocesses) or in this process

NAME = 'run'  # launch.py saves into <--save_dir>/<name>



def tiny_task(dataset='test'):
    """The experiments' task shrunk onto the test model."""
    return ['--task.policy.initial_model', 'test', '--task.query_dataset', dataset, '--task.query_length', '2',
            '--task.response_length', '3', '--task.start_text=', '--task.end_text=', '--task.truncate_after', '2']


TEST_TASK = tiny_task()


def write_corpus(directory, n_passages=400, *, seed=0):
    """A `local:` query dataset: its queries are a fixed shuffled array, so a resumed run gets the right
    ones only if the query position is restored (the `test` dataset draws from the restored RNG)."""
    rng = np.random.RandomState(seed)
    letters = np.array(list('abcdefghijklmnopqrstuvwxyz.'))
    words = [''.join(rng.choice(letters, size=rng.randint(1, 9))) for _ in range(n_passages * 200)]
    directory.mkdir()
    (directory / 'corpus.txt').write_text(' '.join(words))
    return f'local:{directory}'


def policy_args(dataset):
    """The sentiment policy experiment (adaptive KL on) with its reward model trained first, shrunk."""
    task = tiny_task(dataset)
    return [
        '--rewards.train_new_model.labels.source', 'test', '--rewards.train_new_model.labels.num_train', '48',
        '--rewards.train_new_model.batch_size', '8', '--rewards.train_new_model.rollout_batch_size', '8',
        '--rewards.train_new_model.normalize_samples', '16', '--rewards.train_new_model.run.log_interval', '1000',
        *[a.replace('--task.', '--rewards.train_new_model.task.') for a in task],
        *task, '--ppo.batch_size', '8', '--ppo.total_episodes', '240', '--ppo.noptepochs', '1',
        '--run.save_interval', '1', '--run.seed', '1', '--run.log_interval', '1000']


def env():
    e = dict(os.environ)
    # One thread on the CPU: the test model is tiny, and runs to compare must compute alike.
    e.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', CUDA_VISIBLE_DEVICES='')
    return e


def cli_argv(command, save_root, args, exp='sentiment'):
    return [command, exp, NAME, '--save_dir', str(save_root), '--mpi', '1', *map(str, args)]


def launch_cli(command, save_root, args, *, driver=None, exp='sentiment'):
    """Start `python launch.py command exp run --save_dir save_root args...` (or the same argv under a
    python driver script that patches something first); stdout and stderr are captured."""
    prefix = [sys.executable, 'launch.py'] if driver is None else [sys.executable, '-c', driver, 'launch.py']
    return subprocess.Popen(prefix + cli_argv(command, save_root, args, exp), cwd=REPO_ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_in_process(command, save_root, args, exp='sentiment'):
    """The same command line run in this process (launch.py's main; --mpi 1 runs the trainer here), on
    one CPU thread as the subprocesses: the uninterrupted reference run, while a subprocess is killed."""
    import torch
    import launch as top_launch  # the top-level launch.py
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch('torch.cuda.is_available', return_value=False):  # CPU even on a GPU machine
            top_launch.launch.main(dict(train_policy=top_launch.launch_train_policy,
                                        train_reward=top_launch.launch_train_reward),
                                   argv=cli_argv(command, save_root, args, exp))
    finally:
        torch.set_num_threads(threads)


def finish(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


WATCHER = """
import os, signal, sys, time
pid, path, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
start = time.time()
while not os.path.exists(path) and time.time() - start < timeout:
    time.sleep(0.002)
os.kill(pid, signal.SIGKILL)
"""


def kill_when_exists(proc, path, timeout=120):
    """SIGKILL proc as soon as path exists, from a small watcher process (this one may be busy running
    the reference run, holding the GIL). Returns the watcher; pass it to assert_killed."""
    return subprocess.Popen([sys.executable, '-c', WATCHER, str(proc.pid), str(path), str(timeout)])


def assert_killed(proc, watcher):
    watcher.wait()
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f'the run was not killed mid-way (exit code {proc.returncode}): {err[-2000:]}'


def last_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ''


def write_labels(path, n, *, seed=0):
    """best_of_4 records for the test encoding (27 tokens, padding token 27)."""
    rng = np.random.RandomState(seed)

    def tokens(length, min_real):
        real = rng.randint(min_real, length + 1)
        return rng.randint(0, 27, size=real).tolist() + [27] * (length - real)
    records = [dict(query=tokens(2, 1), **{f'sample{i}': tokens(3, 0) for i in range(4)}, best=int(rng.randint(4)))
               for _ in range(n)]
    Path(path).write_text(json.dumps(records))
    return path


# ---------------------------------------------------------------------------------------------------
# Original-style TF checkpoints (the converter's and the parity tests' inputs)

# A tiny model in the test encoding's vocabulary (27 tokens, padding token 27).
TINY = dict(n_vocab=27, n_ctx=32, n_embd=16, n_head=2, n_layer=2)


def tiny_hparams(**overrides):
    from lm_human_preferences.language import model
    hp = model.HParams()
    hp.override_from_dict({**TINY, **overrides})
    return hp


def tf_model_variables(rng, prefix, *, heads=(), hp=TINY):
    """{TF name: value} of a transformer under `prefix` (e.g. 'policy/model'), with non-trivial random
    values: layer-norm gains around 1 and biases around 0 but not equal to them, head biases nonzero."""
    e, n_layer = hp['n_embd'], hp['n_layer']
    f32 = lambda *shape, scale=1.0, loc=0.0: (loc + scale * rng.randn(*shape)).astype(np.float32)
    v = {'wte': f32(hp['n_vocab'], e, scale=0.3), 'wpe': f32(hp['n_ctx'], e, scale=0.1),
         'ln_f/g': f32(e, scale=0.2, loc=1.0), 'ln_f/b': f32(e, scale=0.1)}
    for i in range(n_layer):
        v.update({
            f'h{i}/ln_1/g': f32(e, scale=0.2, loc=1.0), f'h{i}/ln_1/b': f32(e, scale=0.1),
            f'h{i}/attn/c_attn/w': f32(1, e, 3 * e, scale=0.3), f'h{i}/attn/c_attn/b': f32(3 * e, scale=0.1),
            f'h{i}/attn/c_proj/w': f32(1, e, e, scale=0.2), f'h{i}/attn/c_proj/b': f32(e, scale=0.1),
            f'h{i}/ln_2/g': f32(e, scale=0.2, loc=1.0), f'h{i}/ln_2/b': f32(e, scale=0.1),
            f'h{i}/mlp/c_fc/w': f32(1, e, 4 * e, scale=0.3), f'h{i}/mlp/c_fc/b': f32(4 * e, scale=0.1),
            f'h{i}/mlp/c_proj/w': f32(1, 4 * e, e, scale=0.1), f'h{i}/mlp/c_proj/b': f32(e, scale=0.1),
        })
    for head in heads:
        v[f'heads/{head}/w'] = f32(e, scale=0.3)
        v[f'heads/{head}/b'] = np.float32(rng.uniform(0.2, 0.8))
    return {f'{prefix}/{k}': val for k, val in v.items()}


def adam_slots(variables):
    """The original's AdamOptimizer(name='adam') slots and counters for these variables."""
    slots = {}
    for name, value in variables.items():
        slots[f'{name}/adam'] = np.full_like(value, 0.01)
        slots[f'{name}/adam_1'] = np.full_like(value, 0.02)
    slots.update({'beta1_power': np.float32(0.9), 'beta2_power': np.float32(0.999)})
    return slots


def write_tf_checkpoint(tf, prefix, variables, *, global_step=None):
    """Save {name: value} with a TF1 Saver (relative paths, as the original's trainers) under prefix;
    writes the `checkpoint` state file beside it. Returns the saved prefix."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with tf.Graph().as_default():
        tf_vars = [tf.compat.v1.get_variable(name, initializer=tf.constant(value)) for name, value in variables.items()]
        saver = tf.compat.v1.train.Saver(var_list=tf_vars, save_relative_paths=True)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return saver.save(sess, prefix, global_step=global_step)


def write_model_dir_files(model_dir, hp=TINY, *, encoding=None, full_hparams=True):
    os.makedirs(model_dir, exist_ok=True)
    hparams = tiny_hparams(**hp).to_nested_dict() if full_hparams else dict(hp)
    with open(os.path.join(model_dir, 'hparams.json'), 'w') as f:
        json.dump(hparams, f, indent=2)
    if encoding is not None:
        with open(os.path.join(model_dir, 'encoding'), 'w') as f:
            json.dump(encoding, f, indent=2)  # as the original trainers wrote it


def write_release(tf, model_dir, rng, hp=TINY):
    """A GPT-2 release dir: hparams.json (5 keys), checkpoint, model.ckpt.{index,data,meta}."""
    variables = tf_model_variables(rng, 'model', hp=hp)
    write_model_dir_files(model_dir, hp, full_hparams=False)
    write_tf_checkpoint(tf, os.path.join(model_dir, 'model.ckpt'), variables)
    return variables


def write_original_save_dirs(tf, root, rng):
    """The save dirs the original's train_reward and train_policy wrote: <root>/reward_model (one
    checkpoint with ref_policy, reward_model and optimizer state) and <root>/policy (policy,
    ref_policy, the score model's reward_model, global_step 7). Returns the dirs and their variables."""
    ref_policy = tf_model_variables(rng, 'ref_policy/model', heads=['value'])
    reward = tf_model_variables(rng, 'reward_model/model', heads=['reward'])
    reward.update({'reward_model/reward_norm/gain': np.float32(1.7), 'reward_model/reward_norm/bias': np.float32(-0.4)})
    reward_dir = os.path.join(root, 'reward_model')
    write_model_dir_files(reward_dir, encoding='test')
    write_tf_checkpoint(tf, os.path.join(reward_dir, 'checkpoints', 'model.ckpt'), {
        **ref_policy, **reward, **adam_slots(reward),
        'global_step': np.int64(0), 'train_step': np.int64(12)})

    policy = tf_model_variables(rng, 'policy/model', heads=['value'])
    score = {k: v + np.float32(0.05) for k, v in reward.items()}  # the score model: a different copy
    policy_dir = os.path.join(root, 'policy')
    write_model_dir_files(policy_dir, encoding='test')
    write_tf_checkpoint(tf, os.path.join(policy_dir, 'checkpoints', 'model.ckpt'), {
        **policy, **ref_policy, **score, **adam_slots(policy), 'global_step': np.int64(7)}, global_step=7)
    return dict(reward_dir=reward_dir, policy_dir=policy_dir, reward=reward, policy=policy, score=score,
                ref_policy=ref_policy)


def expected_state(variables, scope):
    """Our keys and values for the variables of one scope: what conversion must produce."""
    from lm_human_preferences.language import convert_tf
    out = {}
    for name, value in variables.items():
        rel = name[len(scope) + 1:] if scope else name
        value = np.asarray(value)
        out[convert_tf.torch_name(rel)] = value[0] if value.ndim == 3 else value
    return out
