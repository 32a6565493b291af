"""Ranks independent of processes, and microbatches that change no result (utils/ranks.py).

`--mpi 4` means the original's 4 MPI ranks whichever number of processes carries them: `train_reward test`,
`train_policy test` and the demo's model for a few PPO batches end with the same weights, Adam state and
logged stats under `--procs 1`, `2` and `4` (gloo workers on the CPU), and a run resumes under another
`--procs`. `--run.microbatch_size K` splits every model pass into pieces of at most K sequences: the same
results (sampled tokens included) up to fp32 rounding. Each comparison first checks that the runs moved
far beyond the tolerance and that a different rank count does change them, so that it can fail.

A process carries its ranks side by side, as row blocks of one batch, so `--procs 1` runs one pass over
4 ranks' rows where `--procs 4` runs four passes of one rank's: fp32 matmuls of other shapes round
differently, and the results agree up to that rounding, not bit for bit. Two kinds of quantity amplify it
and are compared their own way:
- the directions in which the loss is exactly flat (GAUGE: a shift of every reward, the reward model's
  output biases; an attention key bias, which shifts every score of a query alike). Their true gradient is 0,
  so Adam (ε = 1e-5 under sqrt(v)) moves them by its rounding noise, about lr * 3e-4 a step; the original
  drifts there too. They change no output: compared within GAUGE_TOL, and the outputs are compared.
- Adam's moments: gradients are sums over the batch's rows that partly cancel, which a batch of another
  shape sums in another order: compared within MOMENTS_TOL relative, as the microbatches' are (below).
The labels are random tokens: the original's `test` labels (all samples zeros) give every reward-model
weight a true gradient of 0, which would make the whole reward model a gauge direction.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lm_human_preferences.language import checkpoints, encodings, model
from lm_human_preferences.training import state_files

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import launch as top_launch  # noqa: E402  (the top-level launch.py)

pytestmark = pytest.mark.slow

TOL = 1e-6
# On CUDA, cuBLAS picks a GEMM kernel by the matrices' shapes, and --procs 1's one pass over 4 ranks' rows has
# other shapes than --procs 2's or 4's passes: the PPO runs agree to that rounding, measured on an H100 at
# 1.1e-5 (weights) and 3.4e-4 (stats, relative). The reward model, which passes over each rank's rows alone
# (training/side_by_side.py), is exact there too.
CUDA = torch.cuda.is_available()
WEIGHTS_TOL, STATS_TOL = (3e-5, 1e-3) if CUDA else (TOL, TOL)
N_VOCAB, PAD = 27, 27  # the `test` encoding
NOT_COMPARED = ('elapsed/time', 'elapsed/fps')  # wall clock


@pytest.fixture(autouse=True)
def _workers(monkeypatch):
    # CPU collectives even on a GPU machine, one intra-op thread per process (as the workers use), so that
    # the in-process run computes its matmuls as the workers do.
    monkeypatch.setenv('LMHP_DIST_BACKEND', 'gloo')
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def labels_file(path, n, *, seed=0, query_length=2, response_length=3):
    """best_of_4 records of random tokens: every label has its own gradient, so it matters which rank
    trains on which."""
    rng = np.random.RandomState(seed)

    def tokens(length, min_real):
        real = rng.randint(min_real, length + 1)
        return rng.randint(0, N_VOCAB, size=real).tolist() + [PAD] * (length - real)
    records = [dict(query=tokens(query_length, 1), **{f'sample{i}': tokens(response_length, 0) for i in range(4)},
                    best=int(rng.randint(4))) for _ in range(n)]
    path.write_text(json.dumps(records))
    return str(path)


def run(command, exp, save_root, name, *, mpi=4, procs=1, **overrides):
    # fp32: the equivalences are exact up to fp32 rounding (bf16 autocast, the default on CUDA, is not)
    overrides.setdefault('run.bf16', False)
    launch_fn = dict(train_reward=top_launch.launch_train_reward, train_policy=top_launch.launch_train_policy)[command]
    launch_fn(exp, name, mpi=mpi, procs=procs, save_dir=str(save_root), **{k: str(v) for k, v in overrides.items()})
    return save_root / name


def newest(directory, prefix):
    steps = [int(f[len(prefix) + 1:-len('.safetensors')]) for f in os.listdir(directory)
             if f.startswith(prefix + '-') and f.endswith('.safetensors')]
    return load_file(str(directory / f'{prefix}-{max(steps)}.safetensors'))


def outcome(run_dir, scope):
    """What a run of `scope` (reward_model or policy) ends with: its model, its Adam state, its stats."""
    adam = {k: v for k, v in newest(run_dir / scope / 'train_state', 'state').items() if k.startswith('optimizer.')}
    stats_file = dict(reward_model='train_reward_stats.jsonl', policy='train_policy_stats.jsonl')[scope]
    stats = [{k: v for k, v in json.loads(line).items() if k not in NOT_COMPARED}
             for line in (run_dir / stats_file).read_text().splitlines()]
    return dict(model=newest(run_dir / scope / 'checkpoints', 'model'), adam=adam, stats=stats)


GAUGE_TOL = 1e-5
MOMENTS_TOL = 1e-5  # as the microbatches' (below): sums over rows in another order


def max_diff(a, b, parts=('model', 'adam', 'stats'), *, relative=False, gauge=False):
    """Largest difference between two outcomes (their models, Adam states and stats): absolute, or
    relative to the first outcome's value plus 1 (so that values near 0 are compared absolutely). Weights: the non-gauge ones, or with gauge=True the
    gauge ones (the reward model's output biases and every attention key bias) only."""
    def diff(x, y):
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        d = (x - y).abs()
        if relative:
            d = d / (x.abs() + 1)
        return d.max().item() if d.numel() else 0.0
    diffs = []
    for part in parts:
        if part == 'stats':
            assert [sorted(s) for s in a['stats']] == [sorted(s) for s in b['stats']]
            diffs += [diff(x[k], y[k]) for x, y in zip(a['stats'], b['stats']) for k in x]
        elif part == 'adam':
            assert a[part].keys() == b[part].keys()
            diffs += [diff(a[part][k], b[part][k]) for k in a[part]]
        else:
            assert a[part].keys() == b[part].keys()
            reward_model = 'reward_norm.gain' in a[part]
            for k in a[part]:
                x, y = a[part][k], b[part][k]
                flat = k in ('reward_norm.bias', 'model.heads.reward.b', 'model.ln_f.b') and reward_model
                if k.endswith('attn.c_attn.b'):  # [q, k, v] biases: the keys' part is flat
                    e = x.shape[0] // 3
                    if gauge:
                        diffs.append(diff(x[e:2 * e], y[e:2 * e]))
                    else:
                        diffs += [diff(x[:e], y[:e]), diff(x[2 * e:], y[2 * e:])]
                elif flat == gauge:
                    diffs.append(diff(x, y))
    return max(diffs)


def assert_same(a, b, *, exact=False):
    """Two outcomes agree: non-gauge weights within WEIGHTS_TOL absolutely, stats within STATS_TOL relatively,
    Adam's moments within MOMENTS_TOL relatively, the gauge directions within GAUGE_TOL; exact: all within TOL
    (a run whose passes have the same shapes whatever the layout)."""
    diffs = dict(weights=max_diff(a, b, ['model']), gauge=max_diff(a, b, ['model'], gauge=True),
                 stats=max_diff(a, b, ['stats'], relative=True), adam=max_diff(a, b, ['adam'], relative=True))
    if exact:
        assert max(diffs.values()) <= TOL, diffs
    assert diffs['weights'] <= WEIGHTS_TOL and diffs['stats'] <= STATS_TOL, diffs
    assert diffs['gauge'] <= GAUGE_TOL and diffs['adam'] <= MOMENTS_TOL, diffs


def model_change(a, b):
    return max((a['model'][k] - b['model'][k]).abs().max().item() for k in a['model'])


# ---------------------------------------------------------------------------------------------------
# The result does not depend on --procs

def test_train_reward_same_for_any_number_of_processes(tmp_path):
    labels = labels_file(tmp_path / 'labels.json', 40)  # 32 to train on, 8 held out
    # Normalization before and after: each rank samples its own queries with its own streams.
    # lr 1e-3 (the paper's is 5e-5): the gauge directions' drift (about lr * 3e-4 a step) stays under GAUGE_TOL.
    args = dict(**{'labels.source': labels, 'labels.num_train': 32, 'lr': 1e-3, 'normalize_samples': 32,
                   'debug_normalize': 32, 'run.save_interval': 2})
    runs = {procs: outcome(run('train_reward', 'test', tmp_path, f'procs{procs}', procs=procs, **args), 'reward_model')
            for procs in (1, 2, 4)}
    # The rank count matters: with 2 ranks each normalizes on other samples.
    two_ranks = outcome(run('train_reward', 'test', tmp_path, 'mpi2', mpi=2, **args), 'reward_model')
    assert model_change(runs[1], two_ranks) > 1e-4
    assert_same(runs[1], runs[2])
    assert_same(runs[1], runs[4])
    assert len(runs[1]['stats']) == 4 + 1  # 4 minibatches, then the held-out evaluation


def test_train_policy_same_for_any_number_of_processes_and_resumes_under_another(tmp_path):
    # 3 PPO batches of 32; the chained reward model on random labels (see the module docstring)
    args = {'ppo.lr': 1e-3, 'ppo.total_episodes': 96, 'run.save_interval': 1,
            'rewards.train_new_model.labels.source': labels_file(tmp_path / 'labels.json', 40),
            'rewards.train_new_model.labels.num_train': 32}
    runs = {procs: run('train_policy', 'test', tmp_path, f'procs{procs}', procs=procs, **args) for procs in (1, 2, 4)}
    policy = {procs: outcome(d, 'policy') for procs, d in runs.items()}
    assert [s['elapsed/updates'] for s in policy[1]['stats']] == [1, 2, 3]
    two_ranks = outcome(run('train_policy', 'test', tmp_path, 'mpi2', mpi=2, **{**args, 'ppo.batch_size': 16,
                                                                                  'ppo.total_episodes': 48}), 'policy')
    assert model_change(policy[1], two_ranks) > 1e-4
    for procs in (2, 4):
        assert_same(policy[1], policy[procs])
        assert_same(outcome(runs[1], 'reward_model'), outcome(runs[procs], 'reward_model'), exact=True)

    # A run whose states were written by 4 processes goes on in 1: keep its state after PPO batch 1 only.
    resumed = tmp_path / 'resumed'
    shutil.copytree(runs[4], resumed)
    for step in (2, 3):
        for path in [resumed / 'policy' / 'train_state' / f'state-{step}.{ext}' for ext in ('json', 'safetensors')] + \
                [resumed / 'policy' / 'checkpoints' / f'model-{step}.safetensors']:
            path.unlink()
    assert state_files.train_state_steps(resumed / 'policy') == [1]
    run('train_policy', 'test', tmp_path, 'resumed', procs=1, **args)
    assert_same(policy[1], outcome(resumed, 'policy'))


def bits_differ(a, b):
    """The reward-model tensors (weights, Adam state) whose bits differ between two outcomes."""
    return [f'{part}.{k}' for part in ('model', 'adam') for k in a[part] if not torch.equal(a[part][k], b[part][k])]


def test_train_policy_test_exact_for_any_number_of_processes(tmp_path):
    """The `test` experiment as it is (the original's `test` labels: every sample zeros, so the reward model's
    loss is flat and Adam steps on the rounding of its gradient, about lr * 1e-2 a step) under --procs 1, 2 and
    4, one rank a process included: the reward model (its normalization included) bit for bit, the policy's
    weights, Adam's moments and stats within 1e-6. Before each rank's gradient had a pass of its own the reward
    models differed by 4e-6; before each rank's normalization samples were scored in passes of their own,
    reward_norm differed by 3e-8 (procs 2 here, procs 4 under AVX2), and so every later step by Adam's rounding."""
    args = {'ppo.batch_size': 32, 'ppo.total_episodes': 96}
    runs = {procs: run('train_policy', 'test', tmp_path, f'procs{procs}', procs=procs, **args) for procs in (1, 2, 4)}
    one = outcome(runs[1], 'reward_model')
    for procs in (2, 4):
        other = outcome(runs[procs], 'reward_model')
        assert bits_differ(one, other) == [], procs
        assert_same(one, other, exact=True)
        assert_same(outcome(runs[1], 'policy'), outcome(runs[procs], 'policy'), exact=True)
    # What the reward model's steps on rounding amount to: with 20 times its learning rate it ends 10 TOL away (with
    # twice it, 4.8 TOL on a Zen 4 and more on a Sapphire Rapids: the rounding that drives it is the CPU's).
    faster = run('train_policy', 'test', tmp_path, 'faster', **args, **{'rewards.train_new_model.lr': 1e-3})
    assert model_change(one, outcome(faster, "reward_model")) > 10 * TOL


def test_train_policy_test_exact_with_one_rank_a_process_of_8(tmp_path):
    """--mpi 8 as one process and as 8, one rank each (the paper's rank count; each rank normalizes on one sample
    a batch, scored alone where one process carries one rank): the reward model bit for bit, the policy within
    1e-6. Before each rank's normalization samples were scored in passes of their own, reward_norm.bias differed
    by 1.2e-5 and the reward model's weights by 2e-6 (native bf16 CPU)."""
    args = {'ppo.batch_size': 64, 'ppo.total_episodes': 192}
    runs = {procs: run('train_policy', 'test', tmp_path, f'procs{procs}', mpi=8, procs=procs, **args) for procs in (1, 8)}
    one, eight = outcome(runs[1], 'reward_model'), outcome(runs[8], 'reward_model')
    assert bits_differ(one, eight) == []
    assert_same(one, eight, exact=True)
    assert_same(outcome(runs[1], 'policy'), outcome(runs[8], 'policy'), exact=True)


def demo_shaped_model(directory):
    """A random model of the demo's shape (2 layers, width 128) on its character encoding, as a checkpoint."""
    torch.manual_seed(0)
    hparams = model.HParams(n_vocab=encodings.Test.n_vocab, n_ctx=64, n_embd=128, n_head=4, n_layer=2)
    checkpoints.save_checkpoint(str(directory), 0, model.Model(hparams), hparams=hparams, encoding=encodings.Test)
    return str(directory)


def test_demo_model_same_for_any_number_of_processes(tmp_path):
    """`launch.py train_policy demo` (its report included) on the demo's model shape and task, 3 PPO batches
    of 64 with 4 ranks (nminibatches 2, so each rank still whitens over 8); the reward model is the same
    model with a random reward head (rewards.allow_untrained_head)."""
    initial = demo_shaped_model(tmp_path / 'initial')
    args = {'task.policy.initial_model': initial, 'rewards.train_new_model': 'off', 'rewards.trained_model': initial,
            'rewards.allow_untrained_head': True,
            'ppo.nminibatches': 2, 'ppo.total_episodes': 192, 'run.log_interval': 100}
    runs = {procs: run('train_policy', 'demo', tmp_path, f'procs{procs}', procs=procs, **args) for procs in (1, 4)}
    one, four = outcome(runs[1], 'policy'), outcome(runs[4], 'policy')
    start = checkpoints.load_checkpoint(initial)
    assert max((one['model'][k] - start[k]).abs().max().item() for k in start) > 3e-4  # 3 batches, 2 epochs each
    assert_same(one, four)
    reports = [json.loads((runs[p] / 'demo_report.json').read_text()) for p in (1, 4)]
    rule_scores = [{k: v for k, v in report.items() if k.startswith('rule_')} for report in reports]
    assert len(rule_scores[0]) == 6 and rule_scores[0] == rule_scores[1]  # the same samples of the trained policy
    assert reports[0]['examples'] == reports[1]['examples']


# ---------------------------------------------------------------------------------------------------
# Microbatches change no result
#
# Split passes round differently (other matmul shapes, the loss summed in pieces), so the runs agree up
# to fp32 rounding: the weights within 1e-6 after the `test` experiments (learning rates as they are),
# the Adam moments and stats within 1e-5 relative. The sampled tokens are identical: tests/test_model.py.

def test_train_reward_microbatches(tmp_path, forward_rows):
    labels = labels_file(tmp_path / 'labels.json', 40)
    args = dict(**{'labels.source': labels, 'labels.num_train': 32, 'batch_size': 16, 'rollout_batch_size': 16,
                   'run.save_interval': 2})
    whole = outcome(run('train_reward', 'test', tmp_path, 'whole', mpi=2, **args), 'reward_model')
    # without a split: 16 sequences a pass (both ranks' 8 labels' sample i side by side, each rank's as the
    # original scores them; their 8 normalization samples each)
    assert max(forward_rows) == 16
    other_labels = outcome(run('train_reward', 'test', tmp_path, 'other', mpi=2, **{
        **args, 'labels.source': labels_file(tmp_path / 'other.json', 40, seed=1)}), 'reward_model')
    assert max_diff(whole, other_labels, ['model']) > 1e-5  # what a real difference looks like
    # 16 labels a minibatch, 8 per rank: 4 sequences (1 label) or 8 (2 labels) through the model at a time,
    # a microbatch spanning both ranks where it falls so.
    for k in (4, 8):
        forward_rows.clear()
        split = outcome(run('train_reward', 'test', tmp_path, f'k{k}', mpi=2, **{**args, 'run.microbatch_size': k}),
                        'reward_model')
        # no pass held more than K sequences: normalization sampling, scoring, the loss, the evaluation
        assert forward_rows and max(forward_rows) <= k, (k, sorted(set(forward_rows)))
        assert max_diff(whole, split, ['model']) <= TOL, k
        assert max_diff(whole, split, ['adam', 'stats'], relative=True) <= 1e-5, k


def test_train_policy_microbatches(tmp_path, forward_rows):
    # Against the random `test` reward model: a trained one would differ by its own rounding (tested above),
    # which its normalization amplifies.
    args = {'ppo.total_episodes': 96, 'ppo.nminibatches': 2, 'rewards.train_new_model': 'off',
            'rewards.trained_model': 'test'}
    whole = outcome(run('train_policy', 'test', tmp_path, 'whole', mpi=2, **args), 'policy')
    assert max(forward_rows) == 32  # without a split: both ranks' 16 episodes sampled in one pass
    # 16 episodes per rank a batch, 8 a minibatch: pieces of 3 (the last one 1 or 2) in sampling, scoring, the loss.
    forward_rows.clear()
    split = outcome(run('train_policy', 'test', tmp_path, 'split', mpi=2, **{**args, 'run.microbatch_size': 3}), 'policy')
    assert forward_rows and max(forward_rows) == 3, sorted(set(forward_rows))  # no pass held more than K
    assert max_diff(whole, split, ['model']) <= TOL
    assert max_diff(whole, split, ['adam', 'stats'], relative=True) <= 1e-5
    # The policy moved far beyond the tolerance (Adam's first steps move each weight by about ppo.lr; a
    # learning rate of 1e-12 keeps it where it started: lr 0 is refused at launch).
    still = outcome(run('train_policy', 'test', tmp_path, 'still', mpi=2, **{**args, 'ppo.lr': 1e-12}), 'policy')
    assert max_diff(whole, still, ['model']) > 1e-5
