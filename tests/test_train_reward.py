"""Tests for train_reward.py: every case of the original's test_train_reward.py on the `test` model (with
checks of what each run produced), the normalization arithmetic, label files (good, bad, downloaded),
the held-out evaluation, saving, and bf16."""

import hashlib
import json
import math
import os
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from lm_human_preferences import label_types, rewards, train_reward
from lm_human_preferences.language import checkpoints, trained_models
from lm_human_preferences.training import label_files
from lm_human_preferences.training.run import Run
from lm_human_preferences.training.side_by_side import RankGradients
from lm_human_preferences.utils import core, gcs, passes
from lm_human_preferences.language import bf16 as bf16_module
from lm_human_preferences.training.adam import AdamTF

N_VOCAB, PAD = 27, 27  # the `test` encoding: 27 characters, padding token len(vocab)


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """The test model's matmuls are 7 wide: extra intra-op threads only add OpenMP hand-offs, and on a
    busy machine their spin-waits made single tests 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hparams_for_test():
    """The original's hparams_for_test (its `noptepochs`, a field train_reward does not have, dropped)."""
    hparams = train_reward.HParams()
    hparams.rollout_batch_size = 8
    hparams.task.query_length = 2
    hparams.task.response_length = 3
    hparams.task.policy.initial_model = 'test'
    hparams.task.query_dataset = 'test'
    hparams.task.start_text = None
    hparams.run.log_interval = 1

    hparams.labels.source = 'test'
    hparams.labels.num_train = 16
    hparams.labels.type = 'best_of_4'

    hparams.batch_size = 8
    hparams.run.seed = 0  # ours: reproducible tests
    return hparams


def train_reward_test(override_params):
    hparams = hparams_for_test()
    hparams.override_from_dict(override_params)
    hparams.validate()
    return train_reward.train(hparams=hparams)


def synthetic_records(n, *, seed, query_length=2, response_length=3, num_samples=4):
    """best_of_N records in the real files' shape: right-padded queries, responses padded after a cut."""
    rng = np.random.RandomState(seed)
    def tokens(length, *, min_real):
        real = rng.randint(min_real, length + 1)
        return rng.randint(0, N_VOCAB, size=real).tolist() + [PAD] * (length - real)
    return [dict(query=tokens(query_length, min_real=1),
                 **{f'sample{i}': tokens(response_length, min_real=0) for i in range(num_samples)},
                 best=int(rng.randint(num_samples)))
            for _ in range(n)]


def write_labels(path, records):
    path.write_text(json.dumps(records))
    return str(path)


# ---- the original's cases ----

def test_basic():
    results = train_reward_test({})
    # The `test` labels are all zeros: the 4 samples are the same sequence, so every reward model gives
    # them equal rewards and the cross-entropy is log(4) whatever the weights.
    assert set(results['train']) == {'loss', 'error'}
    assert results['train']['loss'] == pytest.approx(math.log(4), abs=1e-6)
    # 50 test records, 16 trained on, 34 held out; ties -> argmax 0 == best 0.
    # The zero labels tie: a 4-way tie scores 1/4, like a random tie-break (argmax alone would give 100%).
    assert results['eval'] == {'eval/loss': pytest.approx(math.log(4), abs=1e-6), 'eval/accuracy': 0.25}
    assert 'normalize_before' not in results and 'normalize_after' not in results


def test_scalar_compare():
    results = train_reward_test({'labels.type': 'scalar_compare'})
    # sample0 == sample1 and difference 0: predicted difference 0, squared error exactly 0.
    assert results['train'] == {'loss': 0.0, 'error': 0.0}
    assert results['eval'] == {'eval/loss': 0.0}  # accuracy is only defined for best_of_N


def test_scalar_rating():
    results = train_reward_test({'labels.type': 'scalar_rating'})
    # The original's stat names for scalar ratings.
    assert set(results['train']) == {'loss', 'error', 'label_mean', 'label_var', 'corr'}
    assert results['train']['label_mean'] == 0 and results['train']['label_var'] == 0
    assert results['train']['loss'] > 0 and results['train']['loss'] == results['train']['error']
    assert set(results['eval']) == {'eval/loss'}


def _assert_normalized(norm, target, *, samples):
    mean, std = norm['after']
    # The debug re-sample has its own sampling noise: its mean is off by ~std/sqrt(samples).
    assert norm['target'] == target
    assert abs(mean - target[0]) < 5 * target[1] / math.sqrt(samples)
    assert abs(std - target[1]) < 0.1 * target[1]
    assert norm['before'][1] > 0


@pytest.mark.slow
def test_normalize_before():
    results = train_reward_test({
        'normalize_before': True,
        'normalize_after': False,
        'normalize_samples': 1024,
        'debug_normalize': 1024,
    })
    _assert_normalized(results['normalize_before'], (0.0, 1.0), samples=1024)  # best_of_N: mean 0, std 1
    assert 'normalize_after' not in results


@pytest.mark.slow
def test_normalize_both():
    results = train_reward_test({
        'normalize_before': True,
        'normalize_after': True,
        'normalize_samples': 1024,
        'debug_normalize': 1024,
    })
    _assert_normalized(results['normalize_before'], (0.0, 1.0), samples=1024)
    _assert_normalized(results['normalize_after'], (0.0, 1.0), samples=1024)


def test_save(tmp_path):
    save_dir = tmp_path / 'save'
    overrides = {
        'run.save_dir': str(save_dir),
        'run.save_interval': 1,
        # ours: with normalize_after the saved gain/bias are the ones it set
        'normalize_after': True,
        'normalize_samples': 64,
    }
    results = train_reward_test(overrides)
    expected = hparams_for_test()
    expected.override_from_dict(overrides)
    assert json.loads((save_dir / 'train_reward_hparams.json').read_text()) == expected.to_nested_dict()
    reward_dir = save_dir / 'reward_model'
    assert json.loads((reward_dir / 'encoding').read_text()) == 'test'
    assert json.loads((reward_dir / 'hparams.json').read_text())['n_embd'] == 7
    # One checkpoint, named by the number of minibatches trained (16 labels / 8).
    assert checkpoints.latest_checkpoint(str(reward_dir)) == str(reward_dir / 'checkpoints' / 'model-2.safetensors')
    state = checkpoints.load_checkpoint(str(reward_dir))
    mean, std = results['normalize_after']['before']
    assert state['reward_norm.gain'].item() == pytest.approx(1 / std, rel=1e-6)
    assert state['reward_norm.bias'].item() == pytest.approx(-mean / std, rel=1e-6, abs=1e-7)
    # The model loads back for scoring (train_policy's path).
    scorer = rewards.TrainedRewardModel(str(reward_dir), trained_models.TrainedModel('test').encoding)
    assert scorer.reward_gain.item() == pytest.approx(1 / std, rel=1e-6)
    # Stats: steps 0 and 1 (log_interval 1), then eval at step 2; TensorBoard under tb/reward_model.
    lines = [json.loads(line) for line in (save_dir / 'train_reward_stats.jsonl').read_text().splitlines()]
    assert [line['step'] for line in lines] == [0, 1, 2]
    assert set(lines[0]) == {'step', 'loss', 'error'} and set(lines[2]) == {'step', 'eval/loss', 'eval/accuracy'}
    assert any((save_dir / 'tb' / 'reward_model').iterdir())


# ---- normalization arithmetic ----

class StubRewardModel(torch.nn.Module):
    """Rewards = gain * (first query token) + bias: known numbers for the statistics."""

    def __init__(self):
        super().__init__()
        self.real = rewards.RewardModelTrainer(trained_models.TrainedModel('test'))
        self.hparams, self.padding_token = self.real.hparams, self.real.padding_token

    def get_rewards(self, queries, responses):
        return self.real.reward_gain * queries[:, 0].float() + self.real.reward_bias

    def reset_reward_scale(self):
        self.real.reset_reward_scale()

    def set_reward_norm(self, **kwargs):
        self.real.set_reward_norm(**kwargs)


def _trainer(reward_model, **overrides):
    hparams = hparams_for_test()
    hparams.override_from_dict(overrides)
    return train_reward.RewardModelTrainer(reward_model=reward_model, policy=None, query_sampler=None,
                                           hparams=hparams, run=Run(hparams, 'train_reward'))


def _batches(*values):
    return [(torch.tensor(v, dtype=torch.float32)[:, None], torch.zeros(len(v), 3, dtype=torch.long)) for v in values]


def test_stats_pools_batches_with_population_std():
    trainer = _trainer(StubRewardModel())
    mean, std = trainer.stats(_batches([1, 2, 3, 4], [5, 6]))  # one rank: its batches
    # 1..6: mean 3.5, population variance 35/12.
    assert mean == pytest.approx(3.5, abs=1e-12)
    assert std == pytest.approx(math.sqrt(35 / 12), abs=1e-12)


def test_stats_moments_do_not_cancel_in_float32():
    """Rewards far from 0 against their spread (mean 1000, std 0.1): E[x^2] - E[x]^2 summed in float32 (the
    original's) loses the variance to rounding, and with it its independence of the order of the sums over
    ranks; summed in float64 it holds to 1e-6 (1e-8 here)."""
    rewards = (1000 + 0.1 * torch.randn(4096, generator=torch.Generator().manual_seed(0))).float()
    trainer = _trainer(StubRewardModel())
    mean, std = trainer.stats(_batches(rewards.tolist()))
    exact = rewards.double()
    assert mean == pytest.approx(exact.mean().item(), rel=1e-12)
    assert std == pytest.approx(exact.std(unbiased=False).item(), rel=1e-6)


@pytest.mark.parametrize('label_type, field, values, expected', [
    ('best_of_4', 'best', [0, 1, 2, 3], (0.0, 1.0)),
    # scalar_rating: the scores, mean 2.5, population std sqrt(1.25)
    ('scalar_rating', 'score', [1.0, 2.0, 3.0, 4.0], (2.5, math.sqrt(1.25))),
    # scalar_compare: difference / 2 = [1, -1, 2, 0]: mean 0.5, variance mean([.25, 2.25, 2.25, .25]) = 1.25
    ('scalar_compare', 'difference', [2.0, -2.0, 4.0, 0.0], (0.5, math.sqrt(1.25))),
])
def test_target_mean_std(label_type, field, values, expected):
    trainer = _trainer(StubRewardModel(), **{'labels.type': label_type, 'labels.num_train': 4, 'batch_size': 4})
    schemas = {**trainer.question_schemas, **trainer.label_type.label_schemas()}
    labels = {k: torch.zeros((4,) + s.shape, dtype=s.dtype) for k, s in schemas.items()}
    labels[field] = torch.tensor(values, dtype=schemas[field].dtype)
    trainer.add_to_buffer(labels)
    mean, std = trainer.target_mean_std()
    assert mean == pytest.approx(expected[0], abs=1e-6) and std == pytest.approx(expected[1], abs=1e-6)


def test_set_reward_norm_arithmetic_and_assertion():
    model = rewards.RewardModelTrainer(trained_models.TrainedModel('test'))
    model.set_reward_norm(old_mean=2.0, old_std=4.0, new_mean=1.0, new_std=2.0)
    # gain = new_std / old_std = 0.5; bias = new_mean - gain * old_mean = 0
    assert (model.reward_gain.item(), model.reward_bias.item()) == (0.5, 0.0)
    with pytest.raises(AssertionError, match='set_reward_norm expects gain = 1 and bias = 0, not 0.5, 0.0'):
        model.set_reward_norm(old_mean=0.0, old_std=1.0, new_mean=0.0, new_std=1.0)


def test_normalize_resets_then_hits_the_target_exactly_on_its_samples():
    stub = StubRewardModel()
    trainer = _trainer(stub, normalize_samples=6, debug_normalize=6)
    samples = _batches([1, 2, 3], [4, 5, 6])
    # A gain/bias left from training must not leak into the statistics: normalize resets them first.
    with torch.no_grad():
        stub.real.reward_gain.fill_(3.0)
        stub.real.reward_bias.fill_(-7.0)
    result = trainer.normalize(lambda n: samples, 0.5, 2.0)  # one rank: its batches of samples
    assert result['before'] == (pytest.approx(3.5), pytest.approx(math.sqrt(35 / 12)))
    assert stub.real.reward_gain.item() == pytest.approx(2.0 / math.sqrt(35 / 12), rel=1e-6)
    assert stub.real.reward_bias.item() == pytest.approx(0.5 - 3.5 * 2.0 / math.sqrt(35 / 12), rel=1e-6)
    # The debug check (same samples here) sees exactly the target.
    assert result['after'] == (pytest.approx(0.5, abs=1e-5), pytest.approx(2.0, abs=1e-5))


@pytest.mark.parametrize('debug_normalize', [0, 6])
def test_normalize_lines(debug_normalize, capsys):
    """The original's three lines, to 4 significant digits (it printed 17); without debug_normalize, the
    'after normalize' line (the original printed none) says it is the target by construction, not measured."""
    trainer = _trainer(StubRewardModel(), normalize_samples=6, debug_normalize=debug_normalize)
    samples = _batches([1, 2, 3], [4, 5, 6])  # mean 3.5, std sqrt(35 / 12) = 1.7078251...
    capsys.readouterr()
    trainer.normalize(lambda n: samples, 0.5, 2.0)  # one rank: its batches of samples
    after = ('after normalize: 0.5 +- 2 (measured on new samples: debug_normalize 6)' if debug_normalize else
             'after normalize: 0.5 +- 2 on those samples, by construction (not measured: debug_normalize N '
             'measures it on N new samples)')
    assert capsys.readouterr().out.splitlines() == ['targets: 0.5 +- 2', 'before normalize: 3.5 +- 1.708', after]


# ---- label files ----

def _run_expecting_error(tmp_path, source, num_train=16):
    save_dir = tmp_path / 'save'
    hparams = hparams_for_test()
    hparams.override_from_dict({'labels.source': source, 'labels.num_train': num_train,
                                'run.save_dir': str(save_dir), 'normalize_before': True, 'normalize_samples': 8})
    hparams.validate()
    with pytest.raises(ValueError) as e:
        train_reward.train(hparams)
    message = str(e.value)
    assert '\n' not in message
    # No training started: nothing logged, no checkpoint.
    assert not (save_dir / 'train_reward_stats.jsonl').exists()
    assert not (save_dir / 'reward_model' / 'checkpoints').exists()
    return message


def test_malformed_json(tmp_path):
    path = tmp_path / 'labels.json'
    path.write_text('[{"query": [1, 2], "best": 0,}]')
    message = _run_expecting_error(tmp_path, str(path))
    # where this Python's parser says (a trailing comma: column 30 under 3.10-3.12, the comma's 29 under 3.13)
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(path.read_text())
    assert str(path) in message and 'not valid JSON' in message
    assert f'line 1 column {parsed.value.colno}' in message


def test_too_few_labels(tmp_path):
    source = write_labels(tmp_path / 'labels.json', synthetic_records(10, seed=0))
    message = _run_expecting_error(tmp_path, source)
    assert source in message and '10 records' in message and 'labels.num_train is 16' in message


def test_record_with_wrong_token_length(tmp_path):
    records = synthetic_records(20, seed=0)
    records[17]['sample2'] = records[17]['sample2'] + [1]  # a held-out record: every record is checked
    source = write_labels(tmp_path / 'labels.json', records)
    message = _run_expecting_error(tmp_path, source)
    assert source in message and 'record 17' in message and "'sample2' has 4 tokens" in message


def test_download_labels_test_source_is_50_zero_records():
    label_type = label_types.get('best_of_4')
    schemas = label_type.question_schemas(query_length=2, response_length=3)
    train, held_out = train_reward.download_labels('test', label_type, schemas, 16, n_vocab=N_VOCAB, padding_token=PAD)
    assert train['query'].shape == (16, 2) and train['sample3'].shape == (16, 3) and train['best'].shape == (16,)
    assert held_out['query'].shape == (34, 2)
    assert all(int(v.abs().sum()) == 0 for v in list(train.values()) + list(held_out.values()))
    assert train['query'].dtype == torch.int32 and train['best'].dtype == torch.int32


def test_read_labels_gives_the_records_as_their_file_holds_them(tmp_path):
    """The online loop keeps the first training's labels as records (label_files.read_labels) and writes them into
    each retraining's labels.json: a file's records as json.load reads them, checked (a bad one is refused), and
    'test''s 50 records of zeros as JSON holds them (lists and ints), which download_labels stacks."""
    label_type = label_types.get('best_of_4')
    schemas = {**label_type.question_schemas(query_length=2, response_length=3), **label_type.label_schemas()}
    records = synthetic_records(20, seed=5)
    source = write_labels(tmp_path / 'labels.json', records)
    assert label_files.read_labels(source, schemas, 16, n_vocab=N_VOCAB, padding_token=PAD) == records
    zeros = label_files.read_labels('test', schemas, 16, n_vocab=N_VOCAB, padding_token=PAD)
    assert json.loads(json.dumps(zeros)) == zeros == [dict(query=[0, 0], sample0=[0, 0, 0], sample1=[0, 0, 0],
                                                           sample2=[0, 0, 0], sample3=[0, 0, 0], best=0)] * 50
    records[3]['best'] = 4
    with pytest.raises(ValueError, match=r"record 3: 'best' is 4, expected an integer in \[0, 4\)"):
        label_files.read_labels(write_labels(tmp_path / 'bad.json', records), schemas, 16, n_vocab=N_VOCAB,
                                padding_token=PAD)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_downloaded_labels_and_held_out_accuracy(tmp_path):
    """Labels over http from a local server; the logged held-out accuracy and loss match a
    recomputation with the saved model."""
    records = synthetic_records(24, seed=1)
    (tmp_path / 'www').mkdir()
    write_labels(tmp_path / 'www' / 'labels.json', records)
    server = ThreadingHTTPServer(('127.0.0.1', 0), partial(_QuietHandler, directory=str(tmp_path / 'www')))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f'http://127.0.0.1:{server.server_address[1]}/labels.json'
        save_dir = tmp_path / 'save'
        # fp32 (bf16 is auto-on with CUDA): the recomputation below is fp32
        results = train_reward_test({'labels.source': url, 'run.save_dir': str(save_dir), 'lr': 1e-2,
                                     'eval_train_labels': True, 'run.bf16': False})
    finally:
        server.shutdown()
        server.server_close()

    scorer = rewards.TrainedRewardModel(str(save_dir / 'reward_model'), trained_models.TrainedModel('test').encoding)
    def evaluate(recs):
        query = torch.tensor([r['query'] for r in recs])
        logits = torch.stack([scorer.score_fn(query, torch.tensor([r[f'sample{i}'] for r in recs]))
                              for i in range(4)], dim=1)
        best = torch.tensor([r['best'] for r in recs])
        is_max = (logits == logits.max(1, keepdim=True).values).float()  # ties share the credit
        return ((is_max[torch.arange(len(best)), best] / is_max.sum(1)).mean().item(),
                torch.nn.functional.cross_entropy(logits, best).item())
    # The save dir says which labels the run used and where their bytes came from.
    data = json.loads((save_dir / 'train_reward_data.json').read_text())
    cached = gcs.cached_path(url)
    assert data['labels_source'] == gcs.download_record(cached)
    assert data['labels_source'] == dict(url=url, requested_url=url, bytes=len(open(cached, 'rb').read()),
                                         sha256=hashlib.sha256(open(cached, 'rb').read()).hexdigest())
    accuracy, loss = evaluate(records[16:])
    assert results['eval']['eval/accuracy'] == pytest.approx(accuracy, abs=1e-6)
    assert results['eval']['eval/loss'] == pytest.approx(loss, abs=1e-5)
    accuracy, loss = evaluate(records[:16])
    assert results['eval_train']['eval_train/accuracy'] == pytest.approx(accuracy, abs=1e-6)
    assert results['eval_train']['eval_train/loss'] == pytest.approx(loss, abs=1e-5)
    # Distinct samples: the loss is no longer the log(4) of ties.
    assert results['train']['loss'] != pytest.approx(math.log(4))


@pytest.fixture
def label_server(tmp_path):
    """A local server of tmp_path/www: (www dir, base URL)."""
    (tmp_path / 'www').mkdir()
    server = ThreadingHTTPServer(('127.0.0.1', 0), partial(_QuietHandler, directory=str(tmp_path / 'www')))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path / 'www', f'http://127.0.0.1:{server.server_address[1]}'
    server.shutdown()
    server.server_close()


def _download_labels(url):
    label_type = label_types.get('best_of_4')
    schemas = label_type.question_schemas(query_length=2, response_length=3)
    return train_reward.download_labels(url, label_type, schemas, 16, n_vocab=N_VOCAB, padding_token=PAD)


def test_a_label_source_that_is_no_file(tmp_path):
    with pytest.raises(ValueError, match=r"^labels.source '': no such file; expected an https URL or a JSON file "
                                         r"of label records$"):
        _download_labels('')
    with pytest.raises(ValueError, match=rf"^labels.source '{tmp_path}': a directory; expected an https URL"):
        _download_labels(str(tmp_path))
    with pytest.raises(ValueError, match=rf"^labels.source '{tmp_path}/nope.json': no such file"):
        _download_labels(str(tmp_path / 'nope.json'))


def test_labels_from_the_mirror_when_the_original_url_fails(label_server, monkeypatch):
    """The original's URL answers 404: the same path on the mirror is downloaded, checked through the
    real label parsing, and cached under the original URL, with a record naming the mirror."""
    www, base = label_server
    monkeypatch.setattr(gcs, 'MIRRORS', {f'{base}/original/labels/': f'{base}/mirror/'})
    records = synthetic_records(20, seed=3)
    (www / 'mirror' / 'sentiment').mkdir(parents=True)
    write_labels(www / 'mirror' / 'sentiment' / 'offline_5k.json', records)
    url = f'{base}/original/labels/sentiment/offline_5k.json'
    train, held_out = _download_labels(url)
    assert train['sample2'].tolist() == [r['sample2'] for r in records[:16]]
    assert held_out['best'].tolist() == [r['best'] for r in records[16:]]
    cached = gcs.cached_path(url)
    assert gcs.download_record(cached)['url'] == f'{base}/mirror/sentiment/offline_5k.json'
    assert gcs.download_record(cached)['requested_url'] == url


def test_downloaded_labels_are_checked_before_the_cache(label_server, monkeypatch):
    """A label file that fails validation (a record of the wrong length) is refused in one line naming
    the URL and the record, and never enters the cache; the mirror's file too."""
    www, base = label_server
    records = synthetic_records(20, seed=4)
    records[7]['sample1'] = records[7]['sample1'][:2]
    write_labels(www / 'labels.json', records)
    url = f'{base}/labels.json'
    with pytest.raises(gcs.DownloadError) as e:
        _download_labels(url)
    assert str(e.value) == (f"could not download {url}: the downloaded file was refused, not cached: {url} "
                            f"record 7: 'sample1' has 2 tokens, expected response_length 3")
    assert not os.path.exists(gcs.cached_path(url))
    write_labels(www / 'labels.json', synthetic_records(10, seed=5))  # too few records: refused too
    with pytest.raises(gcs.DownloadError, match=rf'refused, not cached: label file {url} has 10 records, but '
                                                r'labels\.num_train is 16$'):
        _download_labels(url)
    # the same through the mirror: named as the mirror of the original URL
    monkeypatch.setattr(gcs, 'MIRRORS', {f'{base}/gone/': f'{base}/'})
    gone = f'{base}/gone/labels.json'
    with pytest.raises(gcs.DownloadError, match=rf'^could not download {base}/labels\.json \(the mirror of {gone}\): '
                                                r'the downloaded file was refused, not cached: '):
        _download_labels(gone)
    assert not os.path.exists(gcs.cached_path(gone))
    # both failing: one line naming both URLs
    monkeypatch.setattr(gcs, 'MIRRORS', {f'{base}/gone/': f'{base}/also-gone/'})
    with pytest.raises(gcs.DownloadError) as e:
        _download_labels(gone)
    assert str(e.value) == (f'could not download {gone}: HTTP 404 File not found; its mirror '
                            f'{base}/also-gone/labels.json failed too: HTTP 404 File not found')


def test_lr_decays_linearly_over_one_epoch(monkeypatch):
    """One epoch: num_train / batch_size Adam steps, lr = lr * (1 - start_index / num_train)."""
    lrs = []
    original_step = AdamTF.step
    def step(self, closure=None):
        lrs.append(self.param_groups[0]['lr'])
        return original_step(self, closure)
    monkeypatch.setattr(AdamTF, 'step', step)
    train_reward_test({'labels.num_train': 32, 'lr': 1e-3})
    assert lrs == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])


# ---- bf16 ----

def test_bf16_rewards_close_to_fp32():
    """bf16 keeps 8 significand bits (rounding error <= 2^-9 ~ 0.2% per rounding). A forward pass rounds
    the input of every matmul; in the test model the two layer norms over only 7 channels amplify those
    errors, giving mean |diff| ~0.005 and a worst case ~0.1 over 256 sequences for rewards of size ~1-2.
    Bounds: mean |diff| <= 0.02, max |diff| <= 0.25 and correlation >= 0.999: a wrong dtype path (e.g. a
    head or the gain in bf16, or no autocast at all) breaks one of them; rounding alone does not."""
    torch.manual_seed(0)
    device = core.get_device()  # where passes.autocast acts: CUDA on a GPU machine
    model = rewards.RewardModelTrainer(trained_models.TrainedModel('test')).to(device)
    queries = torch.randint(0, N_VOCAB, (256, 2)).to(device)
    responses = torch.randint(0, N_VOCAB + 1, (256, 3)).to(device)
    with torch.no_grad():
        fp32 = model.get_rewards(queries, responses)
        with passes.autocast(True):
            bf16 = model.get_rewards(queries, responses)
            # autocast did act: the attention keys come from a bf16 matmul (the cache keeps them in attention's
            # dtype: fp32 on a CPU, so they are exactly bf16 values; bf16 on CUDA)
            keys = model.model(torch.cat([queries, responses], 1), padding_token=PAD)['present'].keys[0]
            assert keys.dtype == bf16_module.attention_dtype(device.type)
            assert torch.equal(keys, keys.bfloat16().to(keys.dtype))
        fp32_keys = model.model(queries, padding_token=PAD)['present'].keys[0]
        assert fp32_keys.dtype == torch.float32 and not torch.equal(fp32_keys.bfloat16().float(), fp32_keys)
    assert bf16.dtype == torch.float32  # rewards (head, gain, bias) stay fp32
    diff = (bf16 - fp32).abs()
    assert 0 < diff.mean() <= 0.02 and diff.max() <= 0.25
    assert torch.corrcoef(torch.stack([fp32, bf16]))[0, 1] >= 0.999


def test_bf16_training_run():
    """run.bf16=True trains on CPU too; the loss stays fp32 (ties still give exactly log 4)."""
    results = train_reward_test({'run.bf16': True, 'normalize_before': True, 'normalize_samples': 16})
    assert results['train']['loss'] == pytest.approx(math.log(4), abs=1e-6)
    assert hparams_for_test().run.use_bf16() == torch.cuda.is_available()  # None = auto


def test_one_ranks_gradient_is_the_mean_as_it_is():
    """With one rank (no launcher), RankGradients leaves the gradient of the backward pass in .grad, bit for bit,
    and makes no float64 sums: the mean over one rank is that rank's gradient."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 3))
    (weight.sin() * torch.randn(5, 3)).sum().backward()
    expected = weight.grad.clone()
    gradients = RankGradients([weight])
    gradients.add_rank()
    # (Several ranks' sums take each .grad into float64 sums and clear it.)
    assert gradients.sums is None and torch.equal(weight.grad, expected)
    gradients.mean_into_grads()
    assert torch.equal(weight.grad, expected) and weight.grad.dtype == torch.float32 and gradients.sums is None
