"""train_policy with 2 ranks carried by one process (utils.launch.launch(..., mpi=2)), side by side as the two
halves of every batch: each rank samples its own queries with its own random streams, the stats are
averaged over the ranks, and the adaptive KL controller moves by the all-ranks KL. Whether one process or
two carry the ranks: tests/test_ranks.py."""
from functools import partial

import numpy as np
import torch

from lm_human_preferences import train_policy
from lm_human_preferences.utils import launch

TARGET, HORIZON, BATCH = 0.02, 50, 32


def _train(hparams, records):
    """train_policy.train, recording after every PPOTrainer.step the stats, each rank's own KL and score (its
    half of the rows), and the KL coefficient before and after."""
    step, record_step_stats = train_policy.PPOTrainer.step, train_policy.PPOTrainer.record_step_stats

    def recording_record_step_stats(self, *, data, **kwargs):
        halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
        self.local = [dict(kl=(data['logprobs'][h] - data['ref_logprobs'][h]).sum(1).mean().item(),
                           score=data['scores'][h].mean().item()) for h in halves]
        return record_step_stats(self, data=data, **kwargs)

    def recording_step(self):
        kl_before = self.kl_ctl.value
        stats = step(self)
        records.append(dict(stats=stats, local=self.local, kl_before=kl_before, kl_after=self.kl_ctl.value))
        return stats

    train_policy.PPOTrainer.step = recording_step
    train_policy.PPOTrainer.record_step_stats = recording_record_step_stats
    try:
        train_policy.train(hparams)
    finally:
        train_policy.PPOTrainer.step, train_policy.PPOTrainer.record_step_stats = step, record_step_stats


def test_two_ranks_sample_apart_and_average(monkeypatch):
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'rewards.trained_model': 'test',
        'rewards.adaptive_kl': 'on', 'rewards.adaptive_kl.target': TARGET, 'rewards.adaptive_kl.horizon': HORIZON,
        'ppo.batch_size': BATCH, 'ppo.noptepochs': 2, 'ppo.total_episodes': 3 * BATCH, 'ppo.lr': 1e-3,
        # No save_dir: the TensorBoard writer would import TensorFlow (seconds).
        'run.seed': 1, 'run.log_interval': 1,
    })
    hparams.validate()
    queries = []
    rollout = train_policy.PPOTrainer.rollout

    def recording_rollout(self, kl_coef):
        rollouts, data = rollout(self, kl_coef)
        queries.append(rollouts['queries'].clone())
        return rollouts, data
    monkeypatch.setattr(train_policy.PPOTrainer, 'rollout', recording_rollout)
    records = []
    launch.launch('ranks', partial(_train, hparams, records), mpi=2, procs=1)
    assert len(records) == 3 and len(queries) == 3  # one rollout a step, for both ranks

    for step, r in enumerate(records):
        # Each rank trained on its own queries (its shard of the `test` stream, from its own `random`).
        assert queries[step].shape[0] == BATCH
        assert not torch.equal(queries[step][:BATCH // 2], queries[step][BATCH // 2:])
        assert r['local'][0] != r['local'][1]
        # The stats are the average over the ranks.
        stats = r['stats']
        np.testing.assert_allclose(stats['objective/kl'], np.mean([x['kl'] for x in r['local']]), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(stats['objective/score'], np.mean([x['score'] for x in r['local']]),
                                   rtol=1e-5, atol=1e-7)
        assert stats['elapsed/episodes'] == (step + 1) * BATCH
        # The KL controller moved by the averaged KL (the per-rank KLs would give other values).
        error = np.clip(stats['objective/kl'] / TARGET - 1, -0.2, 0.2)
        np.testing.assert_allclose(r['kl_after'], r['kl_before'] * (1 + error * BATCH / HORIZON), rtol=1e-6)
        assert r['kl_after'] != r['kl_before']
