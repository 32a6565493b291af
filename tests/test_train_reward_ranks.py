"""train_reward with 2 ranks (utils.launch.launch(..., mpi=2)) against 1 rank on the same global batch and
seed: rank r trains on batch[r::2] and the gradients are averaged, so both end with the same parameters,
held-out results and logged loss (the original's data parallelism changes nothing without normalization).
Whether a process carries both ranks or each has its own is tests/test_ranks.py's subject."""

import json
from functools import partial

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from lm_human_preferences import train_reward
from lm_human_preferences.utils import launch

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
    """Run train_reward.train, recording each minibatch's label indices of every rank, the final params
    and the results."""
    hparams = train_reward.HParams()
    hparams.override_from_nested_dict(hparams_dict)
    record = dict(indices=[])
    cls = train_reward.RewardModelTrainer
    original = dict(save=cls.save, train_batch=cls.train_batch)

    def train_batch(self, indices, lr):
        record['indices'].append([[int(i) for i in rank_indices] for rank_indices in indices])
        return original['train_batch'](self, indices, lr)

    def save(self, **kwargs):  # the final save comes last
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in self.reward_model.state_dict().items()},
                  f'{out_dir}/final.safetensors')
        return original['save'](self, **kwargs)

    cls.save, cls.train_batch = save, train_batch
    try:
        record['results'] = train_reward.train(hparams)
    finally:
        cls.save, cls.train_batch = original['save'], original['train_batch']
    with open(f'{out_dir}/record.json', 'w') as f:
        json.dump(record, f)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_ranks_match_one(tmp_path):
    hparams = _hparams(_labels_file(tmp_path / 'labels.json', 40, seed=0), None)  # 32 to train on, 8 held out
    other = _hparams(_labels_file(tmp_path / 'other.json', 40, seed=1), None)
    runs = {}
    for name, mpi, h in (('one', 1, hparams), ('two', 2, hparams), ('other', 1, other)):
        out = tmp_path / name
        out.mkdir()
        # No save_dir (its TensorBoard writer costs seconds to import): the worker dumps the params.
        launch.launch('ranks', partial(_worker, h, str(out)), mpi=mpi, procs=1)
        runs[name] = (load_file(str(out / 'final.safetensors')), json.loads((out / 'record.json').read_text()))
    (one, r1), (two, r2) = runs['one'], runs['two']
    # One epoch over a permutation of the 32 labels, in global batches of 8.
    assert sorted(sum((batch[0] for batch in r1['indices']), [])) == list(range(32))
    assert [len(batch[0]) for batch in r1['indices']] == [8] * 4
    # The same permutation (drawn by rank 0 from run.seed); rank r takes batch[r::2].
    assert r2['indices'] == [[batch[0][0::2], batch[0][1::2]] for batch in r1['indices']]
    # Four Adam steps at lr 1e-2 on other labels end far apart; on the same labels 1 and 2 ranks end together.
    assert _max_diff(one, runs['other'][0]) > 1e-3
    assert _max_diff(one, two) <= 1e-5
    # ... and the held-out labels are split over the ranks and pooled: the same accuracy and loss.
    assert r2['results']['eval']['eval/accuracy'] == r1['results']['eval']['eval/accuracy']
    assert r2['results']['eval']['eval/loss'] == pytest.approx(r1['results']['eval']['eval/loss'], abs=1e-5)
    # The last minibatch's stats are averaged over the ranks: the 1-rank loss of that batch.
    assert r2['results']['train']['loss'] == pytest.approx(r1['results']['train']['loss'], abs=1e-5)
