"""Resuming after a crash, end to end through the command line (`python launch.py ...` subprocesses).

A run killed with SIGKILL (after some training states were written) and rerun with the same command
ends with the same weights, Adam state and KL coefficient as an uninterrupted run, for train_reward
(its label order, normalizations and query position restored) and train_policy (with a reward model
trained first, and its newest training state corrupted before the rerun: the previous one is used,
with a warning), with the same stats logged once per step. The uninterrupted reference runs in this
process (launch.py's main with the same argv) while the killed one runs. The `test` model and a small
`local:` query dataset (whose stream position matters) keep each run a few seconds. Fresh runs into a
save dir of another run are refused: tests/test_bad_inputs.py.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lm_human_preferences.training import train_state

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import launch as top_launch  # noqa: E402  (the top-level launch.py)

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier is -m "not slow")

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


def reward_args(labels, dataset):
    """The sentiment reward experiment (normalized before and after), shrunk onto the test model, a
    local label file and a local query dataset."""
    return ['--labels.source', str(labels), '--labels.num_train', '320', '--batch_size', '8',
            '--rollout_batch_size', '8', '--normalize_samples', '16', '--run.seed', '1',
            '--run.save_interval', '1', '--run.log_interval', '1000', *tiny_task(dataset)]


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


def assert_same_tensors(path_a, path_b, tol=1e-6):
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), rtol=0, atol=tol), (k, (a[k] - b[k]).abs().max())


def assert_close_nested(a, b, tol=1e-6):
    """Equal structure (dicts, lists, None) with numbers equal to within tol."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (a, b)
        for k in a:
            assert_close_nested(a[k], b[k], tol)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_close_nested(x, y, tol)
    elif a is None or isinstance(a, (bool, str)):
        assert a == b
    else:
        assert abs(a - b) <= tol, (a, b)


def assert_same_stats(jsonl_a, jsonl_b, n_steps):
    """One line per step 0..n_steps-1 in each (a resumed run drops the lines it logs again), alike."""
    a, b = ([json.loads(line) for line in Path(p).read_text().splitlines()] for p in (jsonl_a, jsonl_b))
    assert [line['step'] for line in a][:n_steps] == [line['step'] for line in b][:n_steps] == list(range(n_steps))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_close_nested({k: v for k, v in x.items() if not k.startswith('elapsed/')},
                            {k: v for k, v in y.items() if not k.startswith('elapsed/')}, tol=1e-5)


def assert_same_tensorboard(tb_a, tb_b, n_steps):
    """TensorBoard shows every step 0..n_steps-1 once, with the same values: the events the killed run
    wrote for the steps that the resumed run redid are purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = [EventAccumulator(str(d), size_guidance={'scalars': 0}) for d in (tb_a, tb_b)]
    for run in runs:
        run.Reload()
    tags = [t for t in runs[0].Tags()['scalars'] if not t.startswith('elapsed/')]
    assert tags and sorted(tags) == sorted(t for t in runs[1].Tags()['scalars'] if not t.startswith('elapsed/'))
    for tag in tags:
        a, b = ([(e.step, e.value) for e in run.Scalars(tag)] for run in runs)
        assert [step for step, _ in b] == [step for step, _ in a] == list(range(n_steps)), tag
        assert_close_nested([v for _, v in a], [v for _, v in b], tol=1e-5)


def newest_state(model_dir):
    step = train_state.train_state_steps(model_dir)[0]
    return step, Path(model_dir) / 'train_state' / f'state-{step}'


def test_train_reward_resumes_after_sigkill(tmp_path):
    labels = write_labels(tmp_path / 'labels.json', 320)
    args = reward_args(labels, write_corpus(tmp_path / 'corpus'))
    killed = launch_cli('train_reward', tmp_path / 'killed', args)
    reward_dir = tmp_path / 'killed' / NAME / 'reward_model'
    watcher = kill_when_exists(killed, reward_dir / 'train_state' / 'state-3.json')
    run_in_process('train_reward', tmp_path / 'whole', args)  # meanwhile: the uninterrupted run
    assert_killed(killed, watcher)
    killed_at = train_state.train_state_steps(reward_dir)[0]
    assert killed_at < 40  # killed mid-training (40 batches)
    assert not (reward_dir / 'checkpoints').exists()

    code, out, err = finish(launch_cli('train_reward', tmp_path / 'killed', args))
    assert code == 0, err[-3000:]
    assert f'train_reward: resuming from {reward_dir}/train_state/state-' in out

    # Same final reward model (its normalize_after gain/bias too: same query stream and RNG draws),
    # same Adam state and results.
    whole_dir = tmp_path / 'whole' / NAME / 'reward_model'
    assert_same_tensors(whole_dir / 'checkpoints' / 'model-40.safetensors', reward_dir / 'checkpoints' / 'model-40.safetensors')
    (step_a, state_a), (step_b, state_b) = newest_state(whole_dir), newest_state(reward_dir)
    assert step_a == step_b == 40
    assert_same_tensors(state_a.with_suffix('.safetensors'), state_b.with_suffix('.safetensors'))
    extra_a, extra_b = (json.loads(s.with_suffix('.json').read_text())['extra'] for s in (state_a, state_b))
    assert extra_a['done'] and extra_b['done']
    assert set(extra_a['results']) == {'normalize_before', 'normalize_after', 'train'}
    assert_close_nested(extra_a['results'], extra_b['results'])
    assert_same_stats(tmp_path / 'whole' / NAME / 'train_reward_stats.jsonl',
                      tmp_path / 'killed' / NAME / 'train_reward_stats.jsonl', 40)
    assert_same_tensorboard(tmp_path / 'whole' / NAME / 'tb' / 'reward_model',
                            tmp_path / 'killed' / NAME / 'tb' / 'reward_model', 40)


def test_train_policy_resumes_after_sigkill_from_the_last_valid_state(tmp_path):
    args = policy_args(write_corpus(tmp_path / 'corpus'))
    killed = launch_cli('train_policy', tmp_path / 'killed', args)
    policy_dir = tmp_path / 'killed' / NAME / 'policy'
    watcher = kill_when_exists(killed, policy_dir / 'train_state' / 'state-3.json')
    run_in_process('train_policy', tmp_path / 'whole', args)  # meanwhile: the uninterrupted run
    assert_killed(killed, watcher)
    killed_at, newest = newest_state(policy_dir)
    assert killed_at < 30  # 240 episodes / 8 = 30 PPO batches
    # The disk lost the end of the newest state (e.g. the machine died): it must not be loaded.
    tensors = newest.with_suffix('.safetensors')
    with open(tensors, 'r+b') as f:
        f.truncate(os.path.getsize(tensors) - 10)

    code, out, err = finish(launch_cli('train_policy', tmp_path / 'killed', args))
    assert code == 0, err[-3000:]
    assert f'skipping training state {killed_at} in {policy_dir}/train_state' in err
    assert f'train_policy: resuming from {policy_dir}/train_state/state-{killed_at - 1}.json (step {killed_at - 1})' in out
    # The reward model had finished: it is not trained again.
    assert 'train_reward: resuming from' in out and 'already finished' in out

    whole_dir = tmp_path / 'whole' / NAME / 'policy'
    assert_same_tensors(whole_dir / 'checkpoints' / 'model-30.safetensors', policy_dir / 'checkpoints' / 'model-30.safetensors')
    (step_a, state_a), (step_b, state_b) = newest_state(whole_dir), newest_state(policy_dir)
    assert step_a == step_b == 30
    assert_same_tensors(state_a.with_suffix('.safetensors'), state_b.with_suffix('.safetensors'))  # Adam too
    kl_a, kl_b = (json.loads(s.with_suffix('.json').read_text())['extra']['kl_coef'] for s in (state_a, state_b))
    assert kl_a != 0.15 and kl_a == pytest.approx(kl_b, abs=1e-6)  # the adaptive KL controller moved, alike
    assert_same_stats(tmp_path / 'whole' / NAME / 'train_policy_stats.jsonl',
                      tmp_path / 'killed' / NAME / 'train_policy_stats.jsonl', 30)
    assert_same_tensorboard(tmp_path / 'whole' / NAME / 'tb' / 'ppo', tmp_path / 'killed' / NAME / 'tb' / 'ppo', 30)


def test_a_torn_stats_log_ends_as_the_uninterrupted_runs(tmp_path):
    """Killed after a saved state, then the end of the stats log lost (what a full disk or a power cut
    during an append leaves; here the last row and half the one before): the rerun drops the torn line
    with one warning, resumes from the newest kept state that the log covers, redoing the steps whose rows
    were lost, and ends with the uninterrupted run's log and model."""
    args = ['--ppo.total_episodes', '640', '--run.save_interval', '1', '--run.log_interval', '1000']  # 20 steps
    killed = launch_cli('train_policy', tmp_path / 'killed', args, exp='test')
    policy_dir = tmp_path / 'killed' / NAME / 'policy'
    watcher = kill_when_exists(killed, policy_dir / 'train_state' / 'state-10.json')
    run_in_process('train_policy', tmp_path / 'whole', args, exp='test')  # meanwhile: the uninterrupted run
    assert_killed(killed, watcher)
    stats = tmp_path / 'killed' / NAME / 'train_policy_stats.jsonl'
    rows = stats.read_bytes().splitlines(keepends=True)
    newest = train_state.train_state_steps(policy_dir)[0]
    assert len(rows) >= newest >= 10
    stats.write_bytes(b''.join(rows)[:-(len(rows[-1]) + len(rows[-2]) // 2)])
    covered = len(rows) - 2  # the rows of steps 0 .. len(rows) - 3 are whole

    code, out, err = finish(launch_cli('train_policy', tmp_path / 'killed', args, exp='test'))
    assert code == 0, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith('warning:')] == [
        f'warning: {stats}: dropping its last line, which is no complete stats row (an append cut off by a kill or '
        f'a full disk): {rows[-2][:60]!r}']
    assert (f'train_policy: resuming from {policy_dir}/train_state/state-{covered}.json (step {covered}; {stats} ends '
            f'before step {newest}: the steps from {covered} are redone to log them again)') in out
    assert_same_stats(tmp_path / 'whole' / NAME / 'train_policy_stats.jsonl', stats, 20)
    assert_same_tensors(tmp_path / 'whole' / NAME / 'policy' / 'checkpoints' / 'model-20.safetensors',
                        policy_dir / 'checkpoints' / 'model-20.safetensors')
