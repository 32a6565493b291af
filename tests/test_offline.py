"""The offline experiments' engine (lm_human_preferences/offline/) and the sentiment miniature's
parts (lm_human_preferences/sentiment_mini/): the labelers, their ties, the label file they write (read back
through train_reward's normal path), the pretraining loss, and the miniature's task and dataset. Fast: no
end-to-end run (those are tests/test_demo.py and tests/test_sentiment_mini.py, in the slow tier)."""
import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lm_human_preferences import demo, label_types, sentiment_mini, train_reward
from lm_human_preferences.sentiment_mini import bindings as sentiment_mini_bindings
from lm_human_preferences.labeling import programs
from lm_human_preferences.offline import experiment, labels, pretrain
from lm_human_preferences.language import checkpoints, datasets, encodings, model, model_sources, trained_models
from lm_human_preferences.utils import cpu, gcs
from lm_human_preferences.sentiment_mini import vader
from conftest import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
top_launch = load_script('top_launch', 'launch.py')


def test_an_offline_experiments_model_name_is_known_at_launch(tmp_path, monkeypatch):
    """`demo` and `sentiment_mini` name the models their experiments make (their context length checked at
    launch), not hub models; elsewhere, before it is made, the name is one line saying which command makes it."""
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path))  # not the session's cache: the demo test made one
    assert demo.EXPERIMENT and sentiment_mini.EXPERIMENT  # declared (as the launcher declares them before its checks)
    assert model_sources.model_source('demo') == model_sources.model_source('sentiment_mini') == 'offline'
    assert trained_models.known_n_ctx('sentiment_mini') == sentiment_mini.EXPERIMENT.pretrain.n_ctx == 96
    with pytest.raises(FileNotFoundError, match=r"^model 'demo' is the demo experiment's initial model, which is not "
                                                r"made yet: python launch.py train_policy demo NAME makes it in "):
        trained_models.TrainedModel('demo')


def test_pick_best_breaks_ties_at_random():
    rng = np.random.RandomState(0)
    picks = [programs.pick_best(np.array([[1, 3, 3, 0]]), rng)[0] for _ in range(200)]
    assert set(picks) == {1, 2} and 60 < picks.count(1) < 140  # ties at random, never a lower score


def test_demo_rule():
    encoder = encodings.Test.get_encoder()
    responses = torch.tensor([encoder.encode('here.were.three'), encoder.encode('a.big.dog.ran.')[:15] + [27]])
    assert demo.EXPERIMENT.labeler.scores(responses, encoder).tolist() == [6.0, 0.0]  # the padding token decodes to ''


def test_vader_labeler_prefers_the_most_positive_response():
    labeler = sentiment_mini.EXPERIMENT.labeler
    encoder = encodings.Main.get_encoder()
    texts = [' She was very happy, and he loved her dearly.', ' It was a dreadful, miserable evening.',
             ' The carriage stood at the door.', ' She was happy.']
    pad = encoder.padding_token
    responses = torch.tensor([(encoder.encode(t) + [pad] * 16)[:16] for t in texts])
    scores = labeler.scores(responses, encoder).numpy()
    assert scores[0] > scores[3] > 0 and scores[1] < 0 and scores[2] == 0  # VADER's compound, in [-1, 1]
    assert scores.tolist() == [vader.compound_score(t) for t in texts]  # the padding decodes to ''
    assert programs.pick_best(scores[None], np.random.RandomState(0)).tolist() == [0]
    # Neutral responses tie (compound 0): the best is any of them, at random.
    neutral = np.array([[labeler.score(' The carriage stood at the door.'), labeler.score(' He read the letter.'),
                         labeler.score(' It was a dreadful evening.'), labeler.score(' They walked to the town.')]])
    assert neutral[0, [0, 1, 3]].tolist() == [0, 0, 0] and neutral[0, 2] < 0
    rng = np.random.RandomState(0)
    assert {programs.pick_best(neutral, rng)[0] for _ in range(100)} == {0, 1, 3}


def test_labeler_ceiling_counts_ties():
    encoder = encodings.Main.get_encoder()
    labeler = sentiment_mini.EXPERIMENT.labeler
    happy, neutral = encoder.encode(' She was happy.'), encoder.encode(' The door.')
    records = [dict(query=[0], best=0, sample0=happy, sample1=neutral, sample2=neutral, sample3=neutral),
               dict(query=[0], best=1, sample0=neutral, sample1=neutral, sample2=neutral, sample3=neutral)]
    assert labels.labeler_ceiling(labeler, records, encoder) == pytest.approx((1 + 1 / 4) / 2)


def test_bag_of_words_accuracy_learns_a_token_and_not_noise():
    """The reward model's bag-of-words baseline: where one token makes a response the best, it is learned from
    the training records and found in held-out ones (accuracy 1); where `best` is drawn at random, held-out
    accuracy is chance (1/4); an all-tied held-out record counts 1/4 (ties as train_reward counts them)."""
    rng = np.random.RandomState(0)
    pad, good = 9, 7

    def records(n, informative):
        out = []
        for _ in range(n):
            samples = rng.randint(0, 7, size=(4, 5))  # tokens 0..6, never the good one
            samples[:, -1] = pad
            best = rng.randint(4)
            if informative:
                samples[best, rng.randint(4)] = good
            out.append(dict(query=[0], best=int(best), **{f'sample{i}': samples[i].tolist() for i in range(4)}))
        return out
    assert labels.bag_of_words_accuracy(records(200, True), records(100, True), padding_token=pad) == 1
    noise = labels.bag_of_words_accuracy(records(200, False), records(2000, False), padding_token=pad)
    assert abs(noise - 0.25) < 0.05
    tied = [dict(query=[0], best=2, **{f'sample{i}': [1, 2, pad] for i in range(4)})]
    assert labels.bag_of_words_accuracy(records(50, True), tied, padding_token=pad) == 0.25


def test_missing_vader_is_one_line(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_vader(name, *args, **kwargs):
        if name.startswith('vaderSentiment'):
            raise ImportError(f'No module named {name!r}')
        return real_import(name, *args, **kwargs)
    vader._analyzer.cache_clear()
    monkeypatch.setattr(builtins, '__import__', no_vader)
    try:
        with pytest.raises(ImportError, match=r"^the sentiment miniature's labeler is VADER, which is not installed: "
                                              r"pip install vaderSentiment \(it is in requirements.txt\)$"):
            vader.compound_score('good')
    finally:
        vader._analyzer.cache_clear()


def _random_main_model(directory, seed=0):
    """A tiny random GPT-2 on the real 50,257-token BPE, saved as an initial model."""
    torch.manual_seed(seed)
    hp = model.HParams(n_vocab=encodings.Main.n_vocab, n_ctx=96, n_embd=8, n_head=2, n_layer=1)
    checkpoints.save_checkpoint(str(directory), 0, model.Model(hp), hparams=hp, encoding=encodings.Main)
    return str(directory)


def test_vader_labels_in_the_original_format_read_back_by_train_reward(tmp_path):
    """The sentiment miniature's labels for the books task's queries (a tiny random model answers): the
    original's best_of_4 records, `best` a most positive sample by VADER, read back (and validated) by
    train_reward.download_labels with the held-out records after labels.num_train."""
    hparams = train_reward.HParams()
    hparams.override_from_dict({k: v for k, v, _ in top_launch.get_train_reward_experiments()['sentiment_mini'][0]})
    hparams.task.policy.initial_model = _random_main_model(tmp_path / 'initial')
    hparams.labels.num_train, hparams.rollout_batch_size = 6, 8  # one batch of 8 queries
    exp = dataclasses.replace(sentiment_mini.EXPERIMENT, held_out_labels=2)
    references = experiment.prepare_reward_training(exp, hparams, str(tmp_path))
    path = tmp_path / 'sentiment_mini_labels.json'
    assert hparams.labels.source == str(path)
    records = json.loads(path.read_text())
    assert len(records) == 8 and all(sorted(r) == ['best', 'query', 'sample0', 'sample1', 'sample2', 'sample3']
                                      for r in records)
    encoder = encodings.Main.get_encoder()
    query_length, response_length = hparams.task.query_length, hparams.task.response_length
    for r in records:
        assert len(r['query']) == query_length and all(len(r[f'sample{i}']) == response_length for i in range(4))
        scores = [vader.compound_score(encoder.decode(r[f'sample{i}'])) for i in range(4)]
        assert scores[r['best']] == max(scores)
        # The books pipeline: cut back to the last '.' of the window, whole when it has none.
        real = [t for t in r['query'] if t != encoder.padding_token]
        assert encoder.decode(real).endswith('.') or len(real) == query_length
    assert sorted(references) == ['bag_of_words', 'ceiling']
    assert 0.25 <= references['ceiling'] <= 1 and 0 <= references['bag_of_words'] <= 1

    label_type = label_types.get('best_of_4')
    train, held_out = train_reward.download_labels(
        str(path), label_type, label_type.question_schemas(query_length=query_length, response_length=response_length),
        6, n_vocab=encodings.Main.n_vocab, padding_token=encoder.padding_token)
    assert train['sample0'].shape == (6, response_length) and held_out['query'].shape == (2, query_length)
    assert held_out['best'].tolist() == [r['best'] for r in records[6:]]
    # A rerun in the same save dir reuses them; one needing another number of labels is refused.
    hparams.labels.source = 'sentiment_mini'
    hparams.labels.num_train = 20
    with pytest.raises(ValueError, match=rf'{path} holds 8 label records, this run needs 22 .*give this run another '
                                         r'NAME \(or --save_dir\)'):
        experiment.prepare_reward_training(exp, hparams, str(tmp_path))


def test_labels_are_made_once_per_seed_and_copied_by_a_rerun(tmp_path, capsys, monkeypatch):
    """The labels are kept in the datasets cache under a key of what they depend on: a new run of the same
    settings copies them (the same bytes, nothing sampled), another seed or initial model makes its own."""
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(tmp_path / 'datasets'))  # no other test's labels
    hparams = train_reward.HParams()
    hparams.override_from_dict({k: v for k, v, _ in top_launch.get_train_reward_experiments()['sentiment_mini'][0]})
    initial = _random_main_model(tmp_path / 'initial')
    exp = dataclasses.replace(sentiment_mini.EXPERIMENT, held_out_labels=2)

    def prepare(run, seed=1, model=initial):
        h = copy.deepcopy(hparams)
        h.task.policy.initial_model, h.run.seed = model, seed
        h.labels.num_train, h.rollout_batch_size = 6, 8
        save_dir = tmp_path / run
        experiment.prepare_reward_training(exp, h, str(save_dir))
        return (save_dir / 'sentiment_mini_labels.json').read_bytes(), capsys.readouterr().out

    first, out = prepare('first')
    cached = re.search(r'kept in (\S+) for a rerun\)', out).group(1)
    assert Path(cached).parent == Path(gcs.datasets_dir()) / 'sentiment_mini_labels'
    assert Path(cached).read_bytes() == first and '[sentiment_mini labels: batch' in out
    again, out = prepare('again')
    assert again == first and f'copied from {cached}, made by an earlier run' in out
    assert '[sentiment_mini labels: batch' not in out
    other_seed, out = prepare('other_seed', seed=2)
    assert other_seed != first and 'kept in' in out
    other_model, out = prepare('other_model', model=_random_main_model(tmp_path / 'other', seed=1))
    assert other_model != first and 'kept in' in out


def test_pretraining_loss_is_cross_entropy():
    """The chunked cross-entropy of the pretraining: F.cross_entropy's value and gradients."""
    torch.manual_seed(0)
    n = pretrain._LinearCrossEntropy.CHUNK * 2 + 5  # three chunks, the last short
    h = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (n,))
    ours = pretrain._LinearCrossEntropy.apply(h, w, targets, torch.float64)
    grads = torch.autograd.grad(3 * ours, [h, w])
    theirs = F.cross_entropy(F.linear(h, w), targets)
    expected = torch.autograd.grad(3 * theirs, [h, w])
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, atol=1e-12)


def test_pretraining_loss_with_bf16_products():
    """bf16 products (a pretraining that asks for them, on a CPU that has them): mixed precision, close to the
    fp32 loss and gradients, and the loss and gradients kept in fp32."""
    torch.manual_seed(0)
    n = pretrain._LinearCrossEntropy.CHUNK + 7
    h = torch.randn(n, 64, requires_grad=True)
    w = (0.1 * torch.randn(5000, 64)).requires_grad_()
    targets = torch.randint(0, 5000, (n,))
    ours = pretrain._LinearCrossEntropy.apply(h, w, targets, torch.bfloat16)
    grads = torch.autograd.grad(ours, [h, w])
    theirs = F.cross_entropy(F.linear(h, w), targets)
    expected = torch.autograd.grad(theirs, [h, w])
    assert ours.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-3)
    for a, b in zip(grads, expected):
        assert (a - b).abs().max() <= 0.02 * b.abs().max()
        assert not torch.equal(a, b)  # the products were bf16


def test_pretraining_products_dtype(monkeypatch):
    """bf16 products only when asked for and where the CPU multiplies bf16 natively (emulated bf16 is
    slower than fp32); the miniature asks (its output layer is most of its FLOPs), the demo (27 tokens) does not."""
    asked = dataclasses.replace(demo.EXPERIMENT.pretrain, bf16_products=True)
    for native in (False, True):
        # Whether this CPU is native (the chip, and the libraries' limits: tests/test_cpu.py) is not this test's:
        # it passes on an AVX2 CPU and under the AVX2 stand-in as on one with native bf16.
        monkeypatch.setattr(cpu, 'native_bf16', lambda: native)
        assert pretrain.pretraining_products_dtype(demo.EXPERIMENT.pretrain) == torch.float32
        assert pretrain.pretraining_products_dtype(sentiment_mini.EXPERIMENT.pretrain) == \
            (torch.bfloat16 if native else torch.float32)
        assert pretrain.pretraining_products_dtype(asked) == (torch.bfloat16 if native else torch.float32)
        # The cached model's key says which, so that a model made one way is not taken for the other.
        key = pretrain._pretrain_key(demo.EXPERIMENT, asked)
        assert key['products_dtype'] == ('bfloat16' if native else 'float32')


def test_sentiment_mini_task_is_the_books_task_but_dataset_and_model():
    books = dict((k, v) for k, v, _ in top_launch.books_task[0])
    mini = dict((k, v) for k, v, _ in sentiment_mini_bindings.task(top_launch.books_task)[0])
    assert {k for k in books.keys() | mini.keys() if books.get(k) != mini.get(k)} == {
        'query_dataset', 'policy.initial_model', 'query_length', 'response_length', 'truncate_after',
        'penalty_reward_value'}
    assert mini['query_dataset'] == mini['policy.initial_model'] == 'sentiment_mini'
    assert (mini['query_length'], mini['response_length'], mini['truncate_token'], mini['truncate_after'],
            mini["penalty_reward_value"], mini["policy.temperature"]) == (8, 16, 13, 8, 0, 0.7)
    with pytest.raises(AssertionError, match=r"not bound in the experiment: \['nope'\]"):
        sentiment_mini_bindings._rebind(top_launch.books_task, {'nope': 1})


def test_sentiment_mini_queries_are_book_passages():
    """The `sentiment_mini` dataset: the shipped books through the books task's query pipeline (64 GPT-2
    tokens after a '.', cut back to the last '.', padded with 50259)."""
    encoder = encodings.Main.get_encoder()
    data = datasets.get_dataset('sentiment_mini')
    train = data.torch_dataset(64, mode='train', encoder=encoder, start_token=13, end_token=13)
    test = data.torch_dataset(64, mode='test', encoder=encoder, start_token=13, end_token=13)
    assert len(train.shards[0].order) > 700 and len(test.shards[0].order) > 35  # every 20th passage is test
    for row in test.next_batch(16).tolist():
        real = [t for t in row if t != 50259]
        assert real[-1] == 13 and row[len(real):] == [50259] * (64 - len(real)) and len(real) > 20
    # The pretraining corpus is the train split: no test passage in it.
    corpus = sentiment_mini.pretraining_corpus()
    from lm_human_preferences.datasets.local import local_texts
    assert all(p not in corpus for p in local_texts(sentiment_mini.BOOKS_DIR, 'test')[:5])
    assert 'It is a truth universally acknowledged' in corpus


def test_phases_split():
    phases = experiment._Phases('demo')
    phases.spans = {'labels': (0.0, 1.0), 'training': (1.0, 11.0)}
    phases.split('training', 'train_reward', 'train_policy', at=4.0)
    assert phases.seconds() == {'labels': 1.0, 'train_reward': 3.0, 'train_policy': 7.0}
    phases.split('train_policy', 'a', 'b', at=None)  # nothing written: all of it in the second
    assert phases.seconds()['a'] == 0 and phases.seconds()['b'] == 7.0


def test_a_stopped_pretraining_resumes_to_the_same_model(tmp_path, monkeypatch, capsys):
    """The pretraining saves its state (model, Adam, the windows' generator, the step) at least every
    SAVE_EVERY_S seconds and when a stop ends it, says so in one line, and a rerun resumes there to the very
    model an uninterrupted pretraining makes; the saved state goes once the model is made."""
    exp = dataclasses.replace(demo.EXPERIMENT, pretrain=dataclasses.replace(
        demo.EXPERIMENT.pretrain, n_embd=16, n_head=2, n_layer=1, n_ctx=16, steps=6, batch_size=2))
    key = pretrain._pretrain_key(exp, exp.pretrain)
    whole = pretrain.pretrain(exp, str(tmp_path / 'whole'), key)

    step = pretrain._pretraining_step
    def stopped_at_4(*args):
        if args[-1] == 4:
            raise KeyboardInterrupt
        return step(*args)
    monkeypatch.setattr(pretrain, 'SAVE_EVERY_S', 0)  # and saved after every step before it
    monkeypatch.setattr(pretrain, '_pretraining_step', stopped_at_4)
    out = str(tmp_path / 'resumed')
    with pytest.raises(KeyboardInterrupt):
        pretrain.pretrain(exp, out, key)
    assert 'demo: pretraining stopped at step 4/6, saved; rerunning the same command resumes there' in \
        capsys.readouterr().err
    assert not os.path.exists(out) and os.path.isdir(out + '.partial')
    monkeypatch.setattr(pretrain, '_pretraining_step', step)
    pretrain.pretrain(exp, out, key)
    assert 'resuming the pretraining at step 4/6' in capsys.readouterr().out
    a, b = checkpoints.load_checkpoint(whole), checkpoints.load_checkpoint(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not os.path.exists(out + '.partial')
    # A state made for other hparams (another key) is not resumed from.
    monkeypatch.setattr(pretrain, '_pretraining_step', stopped_at_4)
    with pytest.raises(KeyboardInterrupt):
        pretrain.pretrain(exp, str(tmp_path / 'other'), key)
    monkeypatch.setattr(pretrain, '_pretraining_step', step)
    pretrain.pretrain(exp, str(tmp_path / 'other'), dict(key, corpus_sha1='another'))
    assert 'resuming' not in capsys.readouterr().out


def test_a_stop_in_a_phase_says_what_a_rerun_does(capsys):
    """A stop in a phase that does not say it itself (the labels, the report's samples) is one line naming the
    phase and what rerunning the same command does; one that was said (the trainers', the pretraining's) is
    not said twice."""
    phases = experiment._Phases('demo')
    with pytest.raises(KeyboardInterrupt):
        with phases('labels'):
            raise KeyboardInterrupt
    assert capsys.readouterr().err == ('demo: stopped during labels; rerunning the same command makes the labels '
                                       'again (they are written once all are made)\n')
    said = KeyboardInterrupt()
    said.reported = True
    with pytest.raises(KeyboardInterrupt):
        with phases('train_policy'):
            raise said
    assert capsys.readouterr().err == '' and set(phases.seconds()) == {'labels', 'train_policy'}


def test_each_experiment_declares_its_model_and_labeler_by_name():
    """The launcher's table (offline_experiments.NAMES) declares every experiment; each tells the layers below its
    initial model (its context length: language/model_sources.py) and its labeler (--online.labeler NAME:
    labeling/programs.py), which ask no registry of experiments."""
    from lm_human_preferences import offline_experiments
    from lm_human_preferences.labeling import programs
    declared = offline_experiments.experiments()
    assert [exp.name for exp in declared] == list(offline_experiments.NAMES) == ['demo', 'sentiment_mini']
    for exp in declared:
        assert model_sources.OFFLINE_MODELS[exp.name] == exp.pretrain.n_ctx
        assert programs.LABELERS[exp.labeler.name] is exp.labeler
    assert sorted(programs.LABELERS) == ['rule', 'vader']
