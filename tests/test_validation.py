"""Bad hyperparameters and options, checked at launch: each ends with exit code 2 and one line naming the
hparam (or option) and what is allowed, before any worker starts or any model is built, and a save dir
already there is left as it was. (Bad files and runs that fail later: tests/test_bad_inputs.py.)"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.language import datasets
from lm_human_preferences.utils import launch
from test_resume import env

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import launch as top_launch  # noqa: E402  (the top-level launch.py)
import sample as top_sample  # noqa: E402  (the top-level sample.py)

COMMANDS = dict(train_reward=top_launch.launch_train_reward, train_policy=top_launch.launch_train_policy)

CASES = [
    # command, extra argv, the error line after 'error: x: '
    ('train_reward', ['--batch_size', '-8'], "hyperparameter 'batch_size' is -8: it must be at least 1"),
    ('train_reward', ['--rollout_batch_size', '0'], "hyperparameter 'rollout_batch_size' is 0: it must be at least 1"),
    ('train_reward', ['--labels.num_train', '0'], "hyperparameter 'labels.num_train' is 0: it must be at least 1"),
    ('train_reward', ['--labels.num_train', '12'],
     "hyperparameter 'labels.num_train' is 12: it must be a multiple of batch_size 8 (one epoch of whole minibatches)"),
    ('train_reward', ['--normalize_samples', '-1'], "hyperparameter 'normalize_samples' is -1: it must be at least 0"),
    ('train_reward', ['--lr', 'nan'], "hyperparameter 'lr' is nan: it must be a positive number"),
    ('train_reward', ['--lr', '0'], "hyperparameter 'lr' is 0.0: it must be a positive number"),
    ('train_reward', ['--labels.type', 'best_of_x'],
     "hyperparameter 'labels.type': unknown label type 'best_of_x': expected best_of_<N> (N >= 2), scalar_rating or "
     "scalar_compare"),
    ('train_reward', ['--mpi', '3'], "hyperparameter 'batch_size' is 8: each of the --mpi 3 ranks takes an equal "
                                     "share: choose a multiple of 3 (or another --mpi)"),
    ('train_reward', ['--run.microbatch_size', '2'],
     'run.microbatch_size 2 is smaller than the 4 sequences of one best_of_4 label (its query with each sample), '
     'which the reward model scores in one pass: use at least 4'),
    ('train_policy', ['--ppo.batch_size', '0'], "hyperparameter 'ppo.batch_size' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.nminibatches', '0'], "hyperparameter 'ppo.nminibatches' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.noptepochs', '-2'], "hyperparameter 'ppo.noptepochs' is -2: it must be at least 1"),
    ('train_policy', ['--ppo.total_episodes', '0'], "hyperparameter 'ppo.total_episodes' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.lr', 'inf'], "hyperparameter 'ppo.lr' is inf: it must be a positive number"),
    ('train_policy', ['--task.policy.temperature', '0'],
     "hyperparameter 'task.policy.temperature' is 0.0: it must be a positive number"),
    ('train_policy', ['--task.query_length', '0'], "hyperparameter 'task.query_length' is 0: it must be at least 1"),
    ('train_policy', ['--task.response_length', '-3'], "hyperparameter 'task.response_length' is -3: it must be at least 1"),
    ('train_policy', ['--task.query_length', '6'],  # the test model's n_ctx is 8
     "hyperparameter 'task.query_length' is 6: with task.response_length 3 it needs 9 positions, and the model test "
     "has n_ctx 8"),
    ('train_policy', ['--task.query_dataset', 'nope'],
     # {registered}: the datasets registered when the check runs (the demo registers 'demo' on import).
     "hyperparameter 'task.query_dataset' is 'nope': choose from {registered}, or local:<directory of .txt files>"),
    ('train_policy', ['--task.query_dataset', 'local:/nonexistent/corpus'],
     "hyperparameter 'task.query_dataset' is 'local:/nonexistent/corpus': /nonexistent/corpus is not a directory"),
    ('train_policy', ['--run.save_interval', '0'], "hyperparameter 'run.save_interval' is 0: it must be at least 1"),
    ('train_policy', ['--run.log_interval', '-1'], "hyperparameter 'run.log_interval' is -1: it must be at least 1"),
    ('train_policy', ['--run.keep_checkpoints', '0'], "hyperparameter 'run.keep_checkpoints' is 0: it must be at least 1"),
    ('train_policy', ['--mpi', '3'],
     "hyperparameter 'ppo.batch_size' is 32: each of the --mpi 3 ranks takes an equal share of each of the "
     "ppo.nminibatches 1 minibatches: choose a multiple of 3 (or another --mpi)"),
    ('train_policy', ['--mpi', '8'],
     'Per-rank minibatch size 4 is insufficient for whitening (ppo.batch_size / (ppo.nminibatches * --mpi 8 ranks) '
     'must be >= 8)'),
    ('train_policy', ['--mpi', '-1'], '--mpi -1: the number of ranks must be at least 1'),
    ('train_policy', ['--mpi', '8', '--procs', '3'],
     '--procs 3 must divide --mpi 8 (each process carries the same number of ranks): choose --procs from [1, 2, 4, 8]'),
    ('train_policy', ['--rewards.train_new_model.labels.type', 'pairs'],
     "hyperparameter 'rewards.train_new_model.labels.type': unknown label type 'pairs': expected best_of_<N> (N >= 2), "
     "scalar_rating or scalar_compare"),
]


def snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest()
            for d, _, names in os.walk(root) for f in names}


@pytest.fixture
def save_dir_with_files(tmp_path):
    """A save dir as a run leaves it (the checks must not touch it)."""
    run = tmp_path / 'x'
    (run / 'policy' / 'checkpoints').mkdir(parents=True)
    (run / 'policy' / 'checkpoints' / 'model-3.safetensors').write_bytes(os.urandom(64))
    (run / 'train_policy_hparams.json').write_text('{}')
    return tmp_path


@pytest.mark.parametrize('command, argv, message', CASES, ids=[f'{c}{"".join(a)}' for c, a, _ in CASES])
def test_bad_hparams_are_one_line_at_launch(command, argv, message, save_dir_with_files, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(launch, 'launch', lambda *a, **k: built.append(a))  # nothing may start
    before = snapshot(save_dir_with_files)
    with pytest.raises(SystemExit) as e:
        launch.main(COMMANDS, argv=[command, 'test', 'x', *argv, '--save_dir', str(save_dir_with_files)])
    assert e.value.code == 2
    registered = ', '.join(sorted(datasets._registry))
    assert {'books', 'cnndm', 'test', 'tldr'} <= set(datasets._registry)
    assert capsys.readouterr().err == f'error: x: {message.replace("{registered}", registered)}\n'
    assert not built and snapshot(save_dir_with_files) == before


@pytest.mark.parametrize('argv, message', [
    (['--batch_size', '0'], '--batch_size 0: it must be at least 1'),
    (['--nsamples', '-4'], '--nsamples -4: it must be at least 0 (0: sample forever)'),
    (['--temperature', '0'], '--temperature 0.0: it must be a positive number'),
    (['--temperature', 'nan'], '--temperature nan: it must be a positive number'),
    (['--mpi', '0'], 'sample: --mpi 0: the number of ranks must be at least 1'),
])
def test_bad_sample_options_are_one_line(argv, message, tmp_path, capsys):
    save_dir = tmp_path / 'run'
    (save_dir / 'policy').mkdir(parents=True)
    (save_dir / 'train_policy_hparams.json').write_text('{}')
    with pytest.raises(SystemExit) as e:
        launch.main(top_sample.COMMANDS, argv=['sample', '--save_dir', str(save_dir), *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err == f'error: {message}\n'


@pytest.mark.slow
@pytest.mark.parametrize('argv', [['train_reward', 'test', 'x', '--batch_size', '-8'],
                                  ['train_policy', 'test', 'x', '--mpi', '-1']])
def test_exit_codes_of_a_real_process(argv, tmp_path):
    """Both once trained nothing and exited 0 (`--batch_size -8` even saved its untrained model as done)."""
    proc = subprocess.run([sys.executable, 'launch.py', *argv, '--save_dir', str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith('error: x: ')
    assert not list(tmp_path.iterdir())
