"""train_reward in a 2-process gloo group (utils.launch.launch(..., mpi=2)): the same parameters as one
process on the same global batch and seed, and identical reward gain/bias on every rank after each
normalization."""

import json
from functools import partial

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from lm_human_preferences import train_reward
from lm_human_preferences.utils import core, launch

N_VOCAB, PAD = 27, 27  # the `test` encoding


def _labels_file(path, n, *, seed):
    """best_of_4 records of random tokens (queries right-padded), so every label has its own gradient."""
    rng = np.random.RandomState(seed)
    def tokens(length, min_real):
        real = rng.randint(min_real, length + 1)
        return rng.randint(0, N_VOCAB, size=real).tolist() + [PAD] * (length - real)
    records = [dict(query=tokens(2, 1), **{f'sample{i}': tokens(3, 0) for i in range(4)}, best=int(rng.randint(4)))
               for _ in range(n)]
    path.write_text(json.dumps(records))
    return str(path)


def _hparams(source, save_dir, **overrides):
    hparams = train_reward.HParams()
    hparams.override_from_dict({
        'task.query_length': 2, 'task.response_length': 3, 'task.policy.initial_model': 'test',
        'task.query_dataset': 'test', 'task.start_text': None,
        'labels.source': source, 'labels.num_train': 32, 'labels.type': 'best_of_4',
        'batch_size': 8, 'rollout_batch_size': 8, 'lr': 1e-2, 'run.seed': 3, 'run.log_interval': 1,
        # fp32 (bf16 is auto-on with CUDA): 1- and 2-process runs round bf16 differently
        'run.bf16': False, 'run.save_dir': save_dir, **overrides,
    })
    hparams.validate()
    return hparams.to_nested_dict()


def _worker(hparams_dict, out_dir):
    """Run train_reward.train, recording on each rank: the params when training starts (after the sync),
    the gain/bias after each normalization, each minibatch's label indices, the final params and the
    results."""
    rank = core.get_rank()
    hparams = train_reward.HParams()
    hparams.override_from_nested_dict(hparams_dict)
    record = dict(gain_bias=[], indices=[])
    cls = train_reward.RewardModelTrainer
    original = dict(add_to_buffer=cls.add_to_buffer, normalize=cls.normalize, save=cls.save,
                    train_batch=cls.train_batch)

    def state(trainer):
        return {k: v.detach().cpu().clone().contiguous() for k, v in trainer.reward_model.state_dict().items()}

    def add_to_buffer(self, labels):
        save_file(state(self), f'{out_dir}/initial{rank}.safetensors')
        return original['add_to_buffer'](self, labels)

    def normalize(self, *args, **kwargs):
        result = original['normalize'](self, *args, **kwargs)
        record['gain_bias'].append([self.reward_model.reward_gain.item(), self.reward_model.reward_bias.item()])
        return result

    def train_batch(self, indices, lr):
        record['indices'].append([int(i) for i in indices])
        return original['train_batch'](self, indices, lr)

    def save(self):
        save_file(state(self), f'{out_dir}/final{rank}.safetensors')
        return original['save'](self)

    for name, f in dict(add_to_buffer=add_to_buffer, normalize=normalize, save=save, train_batch=train_batch).items():
        setattr(cls, name, f)
    try:
        record['results'] = train_reward.train(hparams)
    finally:
        for name, f in original.items():
            setattr(cls, name, f)
    with open(f'{out_dir}/rank{rank}.json', 'w') as f:
        json.dump(record, f)


def _load(out_dir, what, rank):
    return load_file(str(out_dir / f'{what}{rank}.safetensors'))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _run_jobs(jobs):
    for hparams_dict, out_dir in jobs:
        _worker(hparams_dict, out_dir)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """One 2-process launch (process start-up dominates) running two trainings: normalization off
    (also run in this process, to compare) and normalization before + after."""
    root = tmp_path_factory.mktemp('ddp')
    # Normalization off: with it, each rank samples its own queries and the runs could not match.
    plain = _hparams(_labels_file(root / 'labels.json', 40, seed=0), None)  # 32 to train on, 8 held out
    norm = _hparams(_labels_file(root / 'labels_norm.json', 32, seed=1), None, normalize_before=True,
                    normalize_after=True, normalize_samples=32, debug_normalize=32)
    dirs = {name: root / name for name in ('plain1', 'plain2', 'norm2')}
    for d in dirs.values():
        d.mkdir()
    # No save_dir in these runs (its TensorBoard writer costs seconds to import): the workers dump params.
    launch.launch('ddp', partial(_worker, plain, str(dirs['plain1'])), mpi=1)
    with pytest.MonkeyPatch.context() as mp:
        # CPU collectives even on a GPU machine (NCCL would need one GPU per worker).
        mp.setenv('LMHP_DIST_BACKEND', 'gloo')
        # One intra-op thread per worker (what torchrun sets): two workers whose OpenMP threads spin-wait
        # on the same cores ran the tiny model ~50x slower here.
        mp.setenv('OMP_NUM_THREADS', '1')
        launch.launch('ddp', partial(_run_jobs, [(plain, str(dirs['plain2'])), (norm, str(dirs['norm2']))]), mpi=2)
    return dirs


def test_two_processes_match_one(runs):
    one = _load(runs['plain1'], 'final', 0)
    # Rank 1 started from rank 0's weights (it initialised the test model from another seed).
    assert _max_diff(_load(runs['plain2'], 'initial', 0), _load(runs['plain2'], 'initial', 1)) == 0
    assert _max_diff(_load(runs['plain1'], 'initial', 0), _load(runs['plain2'], 'initial', 0)) == 0
    # Four Adam steps at lr 1e-2 moved the weights far beyond the tolerance ...
    assert _max_diff(one, _load(runs['plain1'], 'initial', 0)) > 1e-3
    for rank in (0, 1):
        # ... and both ranks of the 2-process run end where the 1-process run ends.
        assert _max_diff(one, _load(runs['plain2'], 'final', rank)) <= 1e-5

    one_process = json.loads((runs['plain1'] / 'rank0.json').read_text())
    r1 = one_process['results']
    # One epoch over a permutation of the 32 labels, in global batches of 8.
    assert sorted(sum(one_process['indices'], [])) == list(range(32))
    assert [len(batch) for batch in one_process['indices']] == [8] * 4
    for rank in (0, 1):
        record = json.loads((runs['plain2'] / f'rank{rank}.json').read_text())
        # The same permutation (drawn on rank 0 from run.seed, broadcast); rank r takes batch[r::2].
        assert record['indices'] == [batch[rank::2] for batch in one_process['indices']]
        r2 = record['results']
        # The held-out labels are split over the ranks and pooled: the same accuracy and loss.
        assert r2['eval']['eval/accuracy'] == r1['eval']['eval/accuracy']
        assert r2['eval']['eval/loss'] == pytest.approx(r1['eval']['eval/loss'], abs=1e-5)
        # The last minibatch's stats are averaged over the ranks: the 1-process loss of that batch.
        assert r2['train']['loss'] == pytest.approx(r1['train']['loss'], abs=1e-5)


def test_ranks_agree_on_normalization(runs):
    r0, r1 = (json.loads((runs['norm2'] / f'rank{rank}.json').read_text()) for rank in (0, 1))
    assert len(r0['gain_bias']) == 2  # before and after training
    assert r0['gain_bias'] == r1['gain_bias']  # bitwise: both ranks used the pooled statistics
    assert all(gain != 1 for gain, _ in r0['gain_bias'])
    for key in ('normalize_before', 'normalize_after'):
        assert r0['results'][key]['before'] == r1['results'][key]['before']
        assert r0['results'][key]['after'] == r1['results'][key]['after']
    assert _max_diff(_load(runs['norm2'], 'final', 0), _load(runs['norm2'], 'final', 1)) == 0
