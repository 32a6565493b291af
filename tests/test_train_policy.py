"""train_policy: every case of the original's test_train_policy.py on the `test` model, plus checks of
PPOTrainer's wiring on small stand-ins (stats, KL controller, minibatching, lr schedule, score_fn) and
of what a run writes (checkpoints, hparams, stats jsonl, TensorBoard, wandb offline)."""
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lm_human_preferences import lm_tasks, train_policy
from lm_human_preferences.language import checkpoints, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.training import state_files
from lm_human_preferences.training.run import Run


@pytest.fixture(autouse=True)
def _one_thread():
    # The `test` model is tiny: one thread avoids thread start-up costs that dominate its matmuls.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


STAT_NAMES = sorted([
    'objective/kl', 'objective/kl_coef', 'objective/entropy', 'objective/score', 'objective/score_total',
    'ppo/loss/policy', 'ppo/loss/value', 'ppo/loss/total',
    'ppo/policy/entropy', 'ppo/policy/approxkl', 'ppo/policy/clipfrac',
    'ppo/returns/mean', 'ppo/returns/var',
    'ppo/val/vpred', 'ppo/val/error', 'ppo/val/clipfrac', 'ppo/val/mean', 'ppo/val/var', 'ppo/val/var_explained',
    'elapsed/updates', 'elapsed/steps/serial', 'elapsed/steps/total', 'elapsed/episodes', 'elapsed/fps',
    'elapsed/time',
])


# ---------------------------------------------------------------------------------------------------
# The original's test_train_policy.py

def hparams_for_test():
    hparams = train_policy.HParams()
    hparams.ppo.batch_size = 8
    # The original set `hparams.noptepochs = 1`, a field HParams does not have (a silent no-op on a
    # dataclass); the value it meant is ppo.noptepochs, which keeps the test fast.
    hparams.ppo.noptepochs = 1
    hparams.task.policy.initial_model = 'test'
    hparams.task.query_length = 2
    hparams.task.response_length = 3
    hparams.task.query_dataset = 'test'
    hparams.rewards.trained_model = 'test'
    hparams.ppo.total_episodes = 8
    hparams.run.log_interval = 1

    return hparams


def train_policy_test(override_params):
    hparams = hparams_for_test()
    hparams.override_from_dict(override_params)
    hparams.validate()
    train_policy.train(hparams=hparams)
    return hparams


def test_truncation(capsys):
    train_policy_test({
        'task.truncate_token': 13,
        'task.truncate_after': 2,
    })
    lines = capsys.readouterr().out.splitlines()
    samples = [(lines[i - 1], lines[i]) for i, line in enumerate(lines) if line.startswith('  score = ')]
    assert len(samples) == 3
    for response, score in samples:
        # Token 13 is 'n' in the test encoding; a response without one at index >= 2 fails the filter
        # and scores exactly the penalty.
        if 'n' not in response[2:]:
            assert score == '  score = -1.00'


def test_defaults(capsys):
    train_policy_test({})
    out = capsys.readouterr().out
    # print_samples (3 samples at log_interval 1) and the step time line, as the original.
    assert out.count('  score = ') == 3 and out.count('  kl = ') == 3 and out.count('  total = ') == 3
    assert '[ppo_step 0] step_time=' in out
    for name in STAT_NAMES:
        assert f'| {name} ' in out


def test_affixing():
    train_policy_test({
        'task.query_prefix': 'a',
        'task.query_suffix': 'b'
    })


def test_adaptive_kl():
    train_policy_test({
        'rewards.trained_model': 'test', # not sure why needed
        'rewards.adaptive_kl': 'on',
        'rewards.adaptive_kl.target': 3.0,
        'rewards.adaptive_kl.horizon': 100,
    })


def test_save(tmp_path):
    save_dir = str(tmp_path / 'run')
    hparams = train_policy_test({
        'run.save_dir': save_dir,
        'run.save_interval': 1,
        'ppo.total_episodes': 16,  # two updates: a checkpoint after each
    })
    run = Path(save_dir)
    saved = train_policy.HParams()
    saved.override_from_json_file(str(run / 'train_policy_hparams.json'))
    assert saved.to_nested_dict() == hparams.to_nested_dict() and saved.ppo.total_episodes == 16
    assert json.loads((run / 'policy' / 'encoding').read_text()) == 'test'
    assert json.loads((run / 'policy' / 'hparams.json').read_text())['n_embd'] == 7
    ckpts = sorted(p.name for p in (run / 'policy' / 'checkpoints').iterdir())
    assert ckpts == ['model-1.safetensors', 'model-2.safetensors']
    s1 = checkpoints.load_checkpoint(str(run / 'policy' / 'checkpoints' / 'model-1.safetensors'))
    s2 = checkpoints.load_checkpoint(str(run / 'policy'))
    assert set(s1) == set(s2) and 'model.heads.value.w' in s1
    assert any(not torch.equal(s1[k], s2[k]) for k in s1)  # the second update changed the weights
    # The checkpoint loads into a policy through trained_models, as sample.py does.
    m = trained_models.TrainedModel('sample', savedir=str(run / 'policy'), scope='policy')
    policy = Policy(m, scope='policy')
    assert torch.equal(policy.model.wte.detach(), s2['model.wte'])

    # Stats: one jsonl line per update with every original name; TensorBoard event files.
    lines = [json.loads(l) for l in (run / 'train_policy_stats.jsonl').read_text().splitlines()]
    assert [l['step'] for l in lines] == [0, 1]
    assert sorted(k for k in lines[0] if k != 'step') == STAT_NAMES
    assert lines[1]['elapsed/updates'] == 2 and lines[1]['elapsed/episodes'] == 16
    assert list((run / 'tb' / 'ppo').glob('events.out.tfevents.*'))


REWARD_TRAINING = {
    'rewards.trained_model': None,
    'rewards.train_new_model': 'on',
    'rewards.train_new_model.task.policy.initial_model': 'test',
    'rewards.train_new_model.task.query_length': 2,
    'rewards.train_new_model.task.response_length': 3,
    'rewards.train_new_model.task.query_dataset': 'test',
    'rewards.train_new_model.labels.source': 'test',
    'rewards.train_new_model.labels.num_train': 16,
    'rewards.train_new_model.batch_size': 8,
    'rewards.train_new_model.labels.type': 'best_of_4',
}


def test_reward_training(tmp_path):
    # The original ran this without a save dir and, under pytest only, swapped the new reward model
    # for a random 'test' one. Here the reward model really is trained into <save_dir>/reward_model
    # and the policy trains against it.
    save_dir = tmp_path / 'run'
    hparams = train_policy_test({'run.save_dir': str(save_dir), **REWARD_TRAINING})
    reward_dir = save_dir / 'reward_model'
    assert hparams.rewards.trained_model == str(reward_dir)
    assert checkpoints.latest_checkpoint(str(reward_dir)) is not None
    assert (save_dir / 'train_reward_hparams.json').is_file()
    assert checkpoints.latest_checkpoint(str(save_dir / 'policy')) is not None


@pytest.mark.parametrize('damage', ['state', 'checkpoint'])
def test_a_damaged_reward_phase_is_redone_from_its_fallback_state(tmp_path, damage, capsys):
    """A finished reward phase keeps the state before its last batch too (here its only other one): with its
    final state or model checkpoint damaged, the rerun names it, redoes that batch from the state before,
    to the same reward model, and the policy goes on from its own states to the same end."""
    save_dir = tmp_path / 'run'
    overrides = {'run.save_dir': str(save_dir), 'run.save_interval': 1, 'ppo.total_episodes': 16, **REWARD_TRAINING}
    train_policy_test(overrides)
    reward_dir, policy_dir = save_dir / 'reward_model', save_dir / 'policy'
    assert state_files.train_state_steps(reward_dir) == [2, 1]
    reward_model = checkpoints.load_checkpoint(str(reward_dir / 'checkpoints' / 'model-2.safetensors'))
    policy = checkpoints.load_checkpoint(str(policy_dir / 'checkpoints' / 'model-2.safetensors'))
    for path in [policy_dir / 'train_state' / 'state-2.json', policy_dir / 'train_state' / 'state-2.safetensors',
                 policy_dir / 'checkpoints' / 'model-2.safetensors']:
        path.unlink()  # the policy as killed after its state 1
    damaged = (reward_dir / 'train_state' / 'state-2.safetensors' if damage == 'state'
               else reward_dir / 'checkpoints' / 'model-2.safetensors')
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 1
    damaged.write_bytes(bytes(data))
    capsys.readouterr()

    with pytest.warns(state_files.TrainStateWarning, match=rf'skipping training state 2 in {reward_dir}/train_state: '
                                                             rf'.*{damaged.name}.*(checksum|corrupt)'):
        train_policy_test(overrides)
    out = capsys.readouterr().out
    assert f'train_reward: resuming from {reward_dir}/train_state/state-1.json (step 1)' in out
    assert f'train_policy: resuming from {policy_dir}/train_state/state-1.json (step 1)' in out
    # The same reward model, bit for bit; the policy's steps redone in this process to float rounding
    # (so do those of an intact reward phase; tests/test_resume.py compares whole runs).
    for before, path, tol in [(reward_model, reward_dir, 0), (policy, policy_dir, 1e-5)]:
        after = checkpoints.load_checkpoint(str(path / 'checkpoints' / 'model-2.safetensors'))
        assert set(after) == set(before)
        assert all(torch.allclose(after[k], before[k], rtol=0, atol=tol) for k in before), path


def test_reward_training_needs_the_same_task_and_a_save_dir(tmp_path):
    hparams = hparams_for_test()
    hparams.override_from_dict({**REWARD_TRAINING, 'rewards.train_new_model.task.query_length': 5})
    with pytest.raises(ValueError, match=r"^hyperparameter 'rewards.train_new_model.task.query_length' is 5 but "
                                         r"'task.query_length' is 2: the reward model is trained on the policy's task"):
        train_policy.train(hparams)
    hparams.rewards.train_new_model.task.query_length = 2
    with pytest.raises(ValueError, match='needs run.save_dir'):
        train_policy.train(hparams)


def test_run_bf16_sets_the_reward_phases_precision_too():
    """One precision for the whole run, unless the reward phase's is given: `--run.bf16 false` once left the
    reward phase at its default, bf16 on CUDA (the CUDA run's reward model left the CPU's by 8e-3)."""
    hparams = hparams_for_test()
    hparams.override_from_dict({**REWARD_TRAINING, 'run.bf16': False})
    assert hparams.run.bf16 is False and hparams.rewards.train_new_model.run.bf16 is False
    hparams.override_from_dict({'run.bf16': True, 'rewards.train_new_model.run.bf16': False})
    assert hparams.run.bf16 is True and hparams.rewards.train_new_model.run.bf16 is False


def test_rewards_validate_exactly_one_model():
    hparams = hparams_for_test()
    hparams.override_from_dict({**REWARD_TRAINING, 'rewards.trained_model': 'test'})
    with pytest.raises(ValueError, match='Cannot use trained_model and train new model'):
        hparams.rewards.validate(prefix='rewards.')
    hparams.override_from_dict({'rewards.trained_model': None, 'rewards.train_new_model': 'off'})
    with pytest.raises(ValueError, match='Need either trained_model or to train a new model'):
        hparams.rewards.validate(prefix='rewards.')


def test_validate_minibatch_size_for_whitening():
    hparams = hparams_for_test()
    hparams.ppo.nminibatches = 2  # minibatches of 4 < 8
    with pytest.raises(ValueError, match='insufficient for whitening .*: use --ppo.batch_size 16 or more, fewer '
                                         '--ppo.nminibatches, or --ppo.whiten_rewards false$'):
        hparams.validate()
    hparams.ppo.batch_size = 16  # each suggested fix works
    hparams.validate()
    hparams.ppo.batch_size, hparams.ppo.nminibatches = 8, 1
    hparams.validate()
    hparams.ppo.nminibatches, hparams.ppo.whiten_rewards = 2, False
    hparams.validate()


def test_defaults_match_the_original():
    ppo = train_policy.PpoHParams()
    assert (ppo.total_episodes, ppo.batch_size, ppo.nminibatches, ppo.noptepochs, ppo.lr, ppo.vf_coef,
            ppo.cliprange, ppo.cliprange_value, ppo.gamma, ppo.lam, ppo.whiten_rewards) == \
        (2000000, 64, 1, 4, 5e-6, .1, .2, .2, 1, 0.95, True)
    rewards = train_policy.RewardHParams()
    assert (rewards.kl_coef, rewards.adaptive_kl, rewards.trained_model, rewards.train_new_model) == \
        (0.2, None, None, None)
    kl = train_policy.AdaptiveKLParams()
    assert (kl.target, kl.horizon) == (None, 10000)


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    monkeypatch.setenv('WANDB_SILENT', 'true')
    save_dir = tmp_path / 'run'
    train_policy_test({'run.save_dir': str(save_dir), 'run.wandb': True})
    assert wandb.run is None  # finished
    runs = list(save_dir.glob('wandb/offline-run-*/run-*.wandb'))
    assert runs, list(save_dir.rglob('*'))


# ---------------------------------------------------------------------------------------------------
# PPOTrainer on stand-ins: the numbers it feeds to the math and to the KL controller

class FakeEncoder:
    padding_token = 9

    def decode(self, tokens):
        return ' '.join(map(str, tokens))


class FakePolicy(nn.Module):
    """Logits w at every position; values v * (position + 1). Records the queries it trains on."""
    n_vocab = 5

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(self.n_vocab, generator=g))
        self.v = nn.Parameter(torch.randn((), generator=g))
        self.encoder = FakeEncoder()
        self.trained_on = []

    def analyze_responses(self, queries, responses):
        if torch.is_grad_enabled():
            self.trained_on.append(queries.clone())
        logp = torch.log_softmax(self.w, -1)
        length = responses.shape[1]
        return dict(logprobs=logp[responses], entropies=-(logp.exp() * logp).sum().expand(responses.shape),
                    values=self.v * torch.arange(1, length + 1).float().expand(responses.shape))

    def respond(self, queries, length, uniforms=None, execution=None):
        responses = (queries[:, :1] + torch.arange(length)) % self.n_vocab
        return dict(responses=responses, **{k: v for k, v in self.analyze_responses(queries, responses).items()
                                            if k != 'entropies'})


@pytest.fixture
def on_cpu(monkeypatch):
    """The trainer on the CPU even where CUDA exists: FakePolicy and the numpy recomputations are CPU
    toys (utils.get_device also picks autocast's device)."""
    monkeypatch.setattr(train_policy.utils, 'get_device', lambda: torch.device('cpu'))


def fake_trainer(**overrides):
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.query_length': 2, 'task.response_length': 3, 'ppo.batch_size': 16, 'ppo.nminibatches': 2,
        'ppo.noptepochs': 3, 'ppo.total_episodes': 64, 'ppo.lr': 1e-3, 'run.log_interval': 1,
        'task.query_dataset': 'test', 'task.policy.initial_model': 'test',
        'rewards.trained_model': 'unused', 'rewards.adaptive_kl': 'on', 'rewards.adaptive_kl.target': 0.5,
        'rewards.adaptive_kl.horizon': 100, **overrides})
    hparams.validate()
    batches = []

    def query_sampler():
        # Distinct rows, so each rollout can be recognized by its query.
        base = 2 * 16 * len(batches)
        batches.append(torch.arange(base, base + 32).reshape(16, 2))
        return dict(tokens=batches[-1])

    def score_fn(queries, responses):
        score = responses.float().sum(1) - 3
        return score, responses, dict(score=score)

    trainer = train_policy.PPOTrainer(policy=FakePolicy(0), ref_policy=FakePolicy(1), query_sampler=query_sampler,
                                      score_fn=score_fn, hparams=hparams, run=Run(hparams, 'train_policy'))
    return trainer, batches


def test_trainer_step_stats_and_kl_controller(capsys, on_cpu):
    np.random.seed(0)
    trainer, batches = fake_trainer()
    initial = copy.deepcopy(trainer.policy)
    stats = trainer.step()
    assert sorted(stats) == STAT_NAMES

    # Recompute the rollout's numbers from the initial policy and the reference.
    queries = batches[0]
    rollout = initial.respond(queries, 3)
    ref_logprobs = trainer.ref_policy.analyze_responses(queries, rollout['responses'])['logprobs'].detach()
    kl = (rollout['logprobs'].detach() - ref_logprobs).sum(1)
    score = rollout['responses'].float().sum(1) - 3
    np.testing.assert_allclose(stats['objective/kl'], kl.mean().item(), rtol=1e-5)
    np.testing.assert_allclose(stats['objective/entropy'], -rollout['logprobs'].detach().sum(1).mean().item(), rtol=1e-5)
    np.testing.assert_allclose(stats['objective/score'], score.mean().item(), rtol=1e-6)
    np.testing.assert_allclose(stats['objective/score_total'], (score - 0.2 * kl).mean().item(), rtol=1e-5)
    assert stats['objective/kl_coef'] == pytest.approx(0.2)
    np.testing.assert_allclose(stats['ppo/val/var_explained'], 1 - stats['ppo/val/error'] / stats['ppo/returns/var'],
                               rtol=1e-5)
    assert (stats['elapsed/updates'], stats['elapsed/episodes'], stats['elapsed/steps/serial'],
            stats['elapsed/steps/total']) == (1, 16, 3, 48)

    # The adaptive controller moved once, by the KL of this batch.
    error = np.clip(stats['objective/kl'] / 0.5 - 1, -0.2, 0.2)
    np.testing.assert_allclose(trainer.kl_ctl.value, 0.2 * (1 + error * 16 / 100), rtol=1e-6)
    assert error != 0

    out = capsys.readouterr().out
    assert '[ppo_step 0]' in out and out.count('  kl = ') == 3


def test_trainer_minibatches_cover_the_batch_each_epoch(on_cpu):
    np.random.seed(1)
    trainer, batches = fake_trainer()
    trainer.step()
    seen = trainer.policy.trained_on
    assert len(seen) == 3 * 2 and all(len(q) == 8 for q in seen)  # noptepochs x nminibatches of 16 / 2
    rows = lambda qs: sorted(map(tuple, torch.cat(qs).tolist()))
    for epoch in range(3):
        assert rows(seen[2 * epoch:2 * epoch + 2]) == rows([batches[0]])
    orders = [torch.cat(seen[2 * e:2 * e + 2])[:, 0].tolist() for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3  # a fresh permutation each epoch


def test_trainer_lr_schedule_and_one_adam_step(on_cpu):
    trainer, _ = fake_trainer(**{'ppo.noptepochs': 1, 'ppo.nminibatches': 1})
    trainer.global_step = 3  # of nupdates = 64 / 16 = 4
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.step()
    lr = 1e-3 * (1 - 3 / 4)
    assert trainer.optimizer.param_groups[0]['lr'] == pytest.approx(lr)
    # TF Adam's first step moves each parameter by ~lr * sign(grad) (|grad| >> epsilon).
    for k, v in trainer.policy.named_parameters():
        delta = (v.detach() - before[k]).abs()
        np.testing.assert_allclose(delta.numpy(), lr, rtol=0.05)


def test_make_score_fn_truncates_then_penalizes():
    task = lm_tasks.TaskHParams(truncate_token=4, truncate_after=1, penalty_reward_value=-1)

    class ScoreModel:
        padding_token = 9

        def score_fn(self, queries, responses):
            return 10 * (responses != 9).sum(1).float() + 1

    score_fn = train_policy.make_score_fn(task, score_model=ScoreModel())
    responses = torch.tensor([[4, 4, 1], [1, 4, 2], [1, 2, 3], [4, 1, 2]])
    scores, postprocessed, stats = score_fn(torch.zeros(4, 2, dtype=torch.long), responses)
    # Truncated after the first 4 at index >= 1; the 4 itself stays.
    assert postprocessed.tolist() == [[4, 4, 9], [1, 4, 9], [1, 2, 3], [4, 1, 2]]
    # Scored on the truncated responses; rows without a 4 at index >= 1 get exactly the penalty.
    assert scores.tolist() == [21, 21, -1, -1]
    assert stats['score'] is scores


def test_trainer_loss_wiring_against_numpy(on_cpu):
    from test_ppo_math import np_gae, np_ppo_loss, np_whiten
    trainer, _ = fake_trainer()
    rng = np.random.default_rng(3)
    mb = dict(queries=torch.arange(16).reshape(8, 2), responses=torch.tensor(rng.integers(0, 5, size=(8, 3))),
              values=torch.tensor(rng.normal(size=(8, 3)), dtype=torch.float32),
              logprobs=torch.tensor(rng.normal(-1.6, 0.3, size=(8, 3)), dtype=torch.float32),
              rewards=torch.tensor(rng.normal(0.5, 2, size=(8, 3)), dtype=torch.float32))
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = trainer.loss(mb)

    new = {k: v.detach().numpy().astype(np.float64) for k, v in
           trainer.policy.analyze_responses(mb['queries'], mb['responses']).items()}
    np_mb = {k: v.numpy().astype(np.float64) for k, v in mb.items()}
    # GAE on the minibatch's whitened (mean-kept) rewards and its OLD values; returns from the raw
    # advantages; the loss on whitened advantages, value clipping around the old values.
    adv = np_gae(np_whiten(np_mb['rewards'], shift_mean=False), np_mb['values'], 1.0, 0.95)
    ref = np_ppo_loss(logprob=new['logprobs'], vpred=new['values'], old_logprob=np_mb['logprobs'],
                      old_values=np_mb['values'], advantages=np_whiten(adv), returns=adv + np_mb['values'],
                      cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    np.testing.assert_allclose(stats['loss/total'].item(), ref['total'], rtol=1e-4)
    np.testing.assert_allclose(stats['loss/value'].item(), ref['value'], rtol=1e-4)
    np.testing.assert_allclose(stats['returns/mean'].item(), (adv + np_mb['values']).mean(), rtol=1e-4, atol=1e-6)
    # The loss was back-propagated: every parameter of the policy got a gradient.
    assert all(p.grad is not None for p in trainer.policy.parameters())


@pytest.mark.slow
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason='CUDA only: the same check under CUDA autocast and kernels'))])
@pytest.mark.parametrize('bf16', [False, True])
@pytest.mark.parametrize('nminibatches, microbatch_size', [(1, None), (2, None), (1, 24)],
                         ids=['whole', 'minibatches', 'microbatches'])
def test_first_minibatch_ratio_is_one(tmp_path, monkeypatch, bf16, device, nminibatches, microbatch_size):
    """PPO's ratio new / old probability at the first minibatch of the first epoch (nothing has been updated
    yet). Under bf16 autocast the sampler's cached decoding rounds differently from the loss's full forward, so
    the old logprobs are the loss's forward's:
    - the whole batch in one pass (nminibatches 1, no microbatch split, the paper's experiments on a GPU of 40 GB
      or more): the rollout's forward, kept, is the first minibatch's own: the same tensors, the ratio exactly 1
      on every device;
    - more minibatches, or a microbatch split: the loss recomputes the rows in passes of another shape (half the
      batch; 24 rows, in another order), the same only to bf16 rounding wherever the library picks its kernel by
      shape: cuBLAS on CUDA, oneDNN on a CPU with native bf16 (by its thread count too), and another kernel sums
      in another order, which can move a bf16 activation by an ulp. Measured: exactly 1 on a 2-core AMX CPU (1
      to 14 threads, AMX or held to AVX512-BF16), within 1e-3 on H100 and H200 CUDA, 1.00195 (2^-9) on an H200
      machine's 16-thread CPU. Bound: one bf16 ulp at 1 (2^-7), 25 times inside the clip range 0.2.
    In fp32 the sampler's logprobs are kept, as the original: 1 within fp32 rounding."""
    from lm_human_preferences.language import encodings, model
    # utils.get_device also picks autocast's device
    monkeypatch.setattr(train_policy.utils, 'get_device', lambda: torch.device(device))
    torch.manual_seed(0)
    hp = model.HParams(n_vocab=27, n_ctx=64, n_embd=128, n_head=4, n_layer=2)  # the demo's shape
    checkpoints.save_checkpoint(str(tmp_path / 'm'), 0, model.Model(hp), hparams=hp, encoding=encodings.Test)
    m = trained_models.TrainedModel(str(tmp_path / 'm'))
    policy, ref_policy = Policy(m).to(device), Policy(m).to(device)
    with torch.no_grad():
        policy.model.heads.value.w.normal_()
    trainer, _ = fake_trainer(**{'task.policy.initial_model': str(tmp_path / 'm'),
                                 'task.query_length': 32, 'task.response_length': 24, 'ppo.noptepochs': 1,
                                 'ppo.batch_size': 64, 'ppo.total_episodes': 64, 'ppo.nminibatches': nminibatches,
                                 'run.bf16': bf16, 'run.microbatch_size': microbatch_size})
    trainer.policy, trainer.ref_policy = policy, ref_policy
    trainer.optimizer = train_policy.AdamTF(policy.parameters(), lr=1e-3)
    trainer.sample_queries = lambda: torch.randint(0, 27, (64, 32), device=device)

    sampled, ratios = [], []
    respond, ppo_loss = policy.respond, train_policy.ppo_loss
    monkeypatch.setattr(policy, 'respond', lambda *a, **k: sampled.append(respond(*a, **k)) or sampled[-1])

    def recording_ppo_loss(**kw):
        ratios.append(torch.exp(kw['logprob'] - kw['old_logprob']).detach())
        return ppo_loss(**kw)
    monkeypatch.setattr(train_policy, 'ppo_loss', recording_ppo_loss)
    old_logprobs = []
    train = trainer.train
    monkeypatch.setattr(trainer, 'train', lambda rollouts: old_logprobs.append(rollouts['logprobs']) or train(rollouts))
    trainer.step()
    off = (ratios[0] - 1).abs().max().item()
    sampler_off = (sampled[0]['logprobs'].float() - old_logprobs[0]).abs().max().item()
    if bf16:
        whole = nminibatches == 1 and microbatch_size is None
        assert trainer.execution.microbatch_size == microbatch_size
        if whole:
            assert off == 0  # the same tensors, on every device
        else:
            assert off <= 2 ** -7  # kernels picked by shape (see above)
        if device == 'cpu':
            # With the sampler's logprobs the ratio would be off by bf16 rounding here. (On an H100 the
            # cached steps and the full forward of this model rounded alike: 5e-7.)
            assert sampler_off > 1e-4
    else:
        assert off <= 1e-5 and sampler_off == 0
