"""train_policy in 2 gloo worker processes (utils.launch): the ranks see different queries but stay
identical after every update, the stats are averaged over ranks, and the adaptive KL controller
moves by the all-ranks KL."""
import json
from functools import partial

import numpy as np
import torch

from lm_human_preferences import train_policy
from lm_human_preferences.utils import launch

TARGET, HORIZON, BATCH = 0.02, 50, 16


def _worker(out_dir, hparams):
    """Runs on each rank: train, recording after every PPOTrainer.step the policy's parameters, the
    stats, this rank's own KL and score, and the KL coefficient before and after."""
    from lm_human_preferences.utils import core
    torch.set_num_threads(1)
    records = []
    step, record_step_stats = train_policy.PPOTrainer.step, train_policy.PPOTrainer.record_step_stats

    def recording_record_step_stats(self, **data):
        self.local = dict(kl=(data['logprobs'] - data['ref_logprobs']).sum(1).mean().item(),
                          score=data['scores'].mean().item())
        return record_step_stats(self, **data)

    def recording_step(self):
        kl_before = self.kl_ctl.value
        stats = step(self)
        params = torch.cat([p.detach().flatten() for p in self.policy.parameters()])
        records.append(dict(stats=stats, local=self.local, kl_before=kl_before, kl_after=self.kl_ctl.value,
                            params=params.tolist()))
        return stats

    train_policy.PPOTrainer.step = recording_step
    train_policy.PPOTrainer.record_step_stats = recording_record_step_stats
    train_policy.train(hparams)
    with open(f'{out_dir}/rank{core.get_rank()}.json', 'w') as f:
        json.dump(records, f)


def test_two_ranks_stay_identical_and_average(tmp_path):
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'rewards.trained_model': 'test',
        'rewards.adaptive_kl': 'on', 'rewards.adaptive_kl.target': TARGET, 'rewards.adaptive_kl.horizon': HORIZON,
        'ppo.batch_size': BATCH, 'ppo.noptepochs': 2, 'ppo.total_episodes': 3 * BATCH, 'ppo.lr': 1e-3,
        # No save_dir: the TensorBoard writer would import TensorFlow (seconds) in each worker.
        'run.seed': 1, 'run.log_interval': 1,
    })
    hparams.validate()
    launch.launch('test_ddp', partial(_worker, str(tmp_path), hparams), mpi=2)
    ranks = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in range(2)]
    assert [len(r) for r in ranks] == [3, 3]

    for step, (r0, r1) in enumerate(zip(*ranks)):
        # Identical policies after every update (same averaged gradients, same AdamTF steps) ...
        assert r0['params'] == r1['params'], f'ranks differ after update {step}'
        if step:
            assert r0['params'] != ranks[0][step - 1]['params']
        # ... although each rank trained on its own queries.
        assert r0['local'] != r1['local']
        # Stats are the average over ranks, identical on both.
        assert r0['stats'] == r1['stats']
        stats = r0['stats']
        np.testing.assert_allclose(stats['objective/kl'], (r0['local']['kl'] + r1['local']['kl']) / 2, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(stats['objective/score'], (r0['local']['score'] + r1['local']['score']) / 2,
                                   rtol=1e-5, atol=1e-7)
        assert stats['elapsed/episodes'] == (step + 1) * BATCH
        # The KL controller moved by the averaged KL (the per-rank KLs would give other values).
        for r in (r0, r1):
            error = np.clip(stats['objective/kl'] / TARGET - 1, -0.2, 0.2)
            np.testing.assert_allclose(r['kl_after'], r['kl_before'] * (1 + error * BATCH / HORIZON), rtol=1e-6)
            assert r['kl_after'] != r['kl_before']
        assert r0['kl_after'] == r1['kl_after']
