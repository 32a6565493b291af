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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (NAME, assert_killed, finish, kill_when_exists, launch_cli, policy_args, run_in_process,
                      tiny_task, write_corpus, write_labels)
from conftest import REPO_ROOT, env  # noqa: F401  (test_online.py imports these from here)
from lm_human_preferences.training import state_files

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier is -m "not slow")


def reward_args(labels, dataset):
    """The sentiment reward experiment (normalized before and after), shrunk onto the test model, a
    local label file and a local query dataset."""
    return ['--labels.source', str(labels), '--labels.num_train', '320', '--batch_size', '8',
            '--rollout_batch_size', '8', '--normalize_samples', '16', '--run.seed', '1',
            '--run.save_interval', '1', '--run.log_interval', '1000', *tiny_task(dataset)]


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
    step = state_files.train_state_steps(model_dir)[0]
    return step, Path(model_dir) / 'train_state' / f'state-{step}'


def test_train_reward_resumes_after_sigkill(tmp_path):
    labels = write_labels(tmp_path / 'labels.json', 320)
    args = reward_args(labels, write_corpus(tmp_path / 'corpus'))
    killed = launch_cli('train_reward', tmp_path / 'killed', args)
    reward_dir = tmp_path / 'killed' / NAME / 'reward_model'
    watcher = kill_when_exists(killed, reward_dir / 'train_state' / 'state-3.json')
    run_in_process('train_reward', tmp_path / 'whole', args)  # meanwhile: the uninterrupted run
    assert_killed(killed, watcher)
    killed_at = state_files.train_state_steps(reward_dir)[0]
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
    newest = state_files.train_state_steps(policy_dir)[0]
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
