"""run.microbatch_size 'auto' (training/memory.py): the largest pass that the memory model fits in the free memory,
and the trainers running with it."""
import functools
import json

import pytest
import torch

from lm_human_preferences import train_policy
from lm_human_preferences.language import model
from lm_human_preferences.utils import launch, ranks
from lm_human_preferences.training import memory

GPT2 = model.HParams(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)
BOOKS = [memory.Pass('sample', 512, 88, 1), memory.Pass('forward', 512, 88, 24), memory.Pass('train', 512, 88, 24)]


def test_parameter_count_is_the_models():
    for hp in (GPT2, model.HParams(n_vocab=27, n_ctx=64, n_embd=128, n_head=4, n_layer=2)):
        assert memory.parameter_count(hp) == sum(p.numel() for p in model.Model(hp).parameters())


def test_plan_is_the_largest_pass_that_fits():
    gb = 2 ** 30
    plan = memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False, budget=20 * gb)
    k = plan.microbatch_size
    assert plan.binding.kind == 'train' and 100 < k < 512  # the PPO loss binds; it does not fit unsplit
    per_sequence = memory.bytes_per_sequence(plan.binding, GPT2, bf16=False)
    assert plan.fixed + k * per_sequence <= 20 * gb < plan.fixed + (k + 1) * per_sequence
    # bf16 keeps smaller activations: a larger pass in the same memory; enough memory: no split at all
    assert memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=True, budget=20 * gb).microbatch_size > k
    assert memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False, budget=80 * gb).microbatch_size is None
    # less memory than the models need still runs one sequence at a time (and fails where it cannot)
    assert memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False, budget=gb).microbatch_size == 1


def test_the_model_matches_what_benchmarks_memory_measured():
    """The cost per 88-token sequence that benchmarks/memory.py measured on GPT-2 124M in fp32 (MiB, from the
    peaks of 64 and 128 sequences), within the model's 10% of
    caution above it."""
    ppo = memory.bytes_per_sequence(memory.Pass('train', 512, 88, 24), GPT2, bf16=False) / 2 ** 20
    reward = memory.bytes_per_sequence(memory.Pass('train', 128, 88, 0), GPT2, bf16=False) / 2 ** 20
    assert 73.1 <= ppo <= 73.1 * 1.1 and 50.4 <= reward <= 50.4 * 1.1, (ppo, reward)
    # tldr's 575-token sequences (8 and 16 sequences): the same constants hold at 6.5 times the length
    tldr_ppo = memory.bytes_per_sequence(memory.Pass('train', 32, 575, 75), GPT2, bf16=False) / 2 ** 20
    assert 400.6 <= tldr_ppo <= 400.6 * 1.1, tldr_ppo


def test_a_set_size_passes_through_and_auto_is_planned(capsys, monkeypatch):
    run = train_policy.HParams().run
    for setting in (None, 7):
        run.microbatch_size = setting
        assert memory.resolve(run, BOOKS, GPT2, resident=3, trained=1, device=torch.device('cpu'), what='x') == setting
    assert capsys.readouterr().out == ''
    run.microbatch_size, run.bf16 = 'auto', False
    monkeypatch.setattr(memory, 'free_bytes', lambda device: 10 * 2 ** 30)
    k = memory.resolve(run, BOOKS, GPT2, resident=3, trained=1, device=torch.device('cpu'), what='train_policy')
    assert k == memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False,
                            budget=int(10 * 2 ** 30 * memory.USABLE_FRACTION)).microbatch_size
    out = capsys.readouterr().out
    assert f'train_policy: run.microbatch_size auto = {k} sequences a pass (9.0 GB of cpu memory to use' in out


def test_plan_never_splits_below_the_smallest_pass():
    """A best_of_4 label's 4 samples share a pass (the reward model's loss compares them): with too little
    memory auto plans 4, not fewer (it once planned 1, and train_reward divided it into 0 labels a pass)."""
    assert memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False, budget=2 ** 30, smallest=4).microbatch_size == 4


def _resolve_with_free_memory(out_dir, gib_by_process):
    """In each process of a group: plan auto with this process's free memory (gib_by_process[its index])."""
    memory.free_bytes = lambda device: gib_by_process[ranks.process_index()] * 2 ** 30
    run = train_policy.HParams().run
    run.microbatch_size, run.bf16 = 'auto', False
    k = memory.resolve(run, BOOKS, GPT2, resident=3, trained=1, device=torch.device('cpu'), what='x')
    with open(f'{out_dir}/{ranks.process_index()}.json', 'w') as f:
        json.dump(k, f)


@pytest.mark.slow
def test_every_process_plans_the_same_split(tmp_path, monkeypatch):
    """Processes that see different free memory split their passes alike, for the smallest of them (each once
    planned for its own: the runs' rounding then depended on the memory free at launch)."""
    monkeypatch.setenv('LMHP_DIST_BACKEND', 'gloo')
    launch.launch('plan', functools.partial(_resolve_with_free_memory, str(tmp_path), (20, 10)), mpi=2, procs=2)
    planned = [json.loads((tmp_path / f'{i}.json').read_text()) for i in range(2)]
    assert planned[0] == planned[1] == memory.plan(BOOKS, GPT2, resident=3, trained=1, bf16=False,
                                                   budget=int(10 * 2 ** 30 * memory.USABLE_FRACTION)).microbatch_size


@pytest.mark.slow
def test_train_reward_with_auto_and_little_memory_keeps_a_label_in_one_pass(monkeypatch, forward_rows, tmp_path):
    import launch as top_launch
    monkeypatch.setattr(memory, 'free_bytes', lambda device: 1)
    top_launch.launch_train_reward('test', 'auto', save_dir=str(tmp_path), **{'run.microbatch_size': 'auto'})
    assert max(forward_rows) == 4  # a label's 4 samples, one label a pass


@pytest.mark.slow
@pytest.mark.parametrize('bf16', [False, True])
def test_train_policy_with_auto_splits_its_passes_to_the_plan(monkeypatch, capsys, forward_rows, bf16):
    """`train_policy test` with run.microbatch_size auto and little memory: every pass of the run holds at most the
    planned number of sequences, in either precision. (run.bf16 set: unset, it is on under CUDA, whose plan for
    memory sized for fp32 is 2 sequences a pass.)"""
    # the test model's 0.4 MB a sequence in the loss: 3 sequences in 1.3 MB beyond its models and optimizer
    hp = train_policy.HParams()
    hp.override_from_dict({'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
                           'task.response_length': 3, 'rewards.trained_model': 'test', 'ppo.batch_size': 16,
                           'ppo.total_episodes': 32, 'run.seed': 1, 'run.microbatch_size': 'auto', 'run.bf16': bf16})
    hp.validate()
    test_model = model.HParams(n_vocab=27, n_ctx=8, n_embd=7, n_head=1, n_layer=2)
    passes = memory.policy_passes(hp)
    fixed = memory.fixed_bytes(test_model, resident=3, trained=1, bf16=bf16)
    per_sequence = max(memory.bytes_per_sequence(p, test_model, bf16=bf16) for p in passes)
    monkeypatch.setattr(memory, 'free_bytes', lambda device: (fixed + 3.5 * per_sequence) / memory.USABLE_FRACTION)
    train_policy.train(hp)
    assert 'run.microbatch_size auto = 3 sequences a pass' in capsys.readouterr().out
    assert hp.run.microbatch_size == 'auto' and max(forward_rows) == 3  # the hparams keep what was asked
