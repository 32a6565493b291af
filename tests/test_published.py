"""An offline experiment's published initial model and labels (lm_human_preferences/offline/published.py): a run
uses them where it would make the same (how they were made aside), makes its own otherwise, and the files the
sentiment miniature ships are the ones its runs ask for. Fast: tiny models, a few labels."""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from lm_human_preferences import demo, launch_commands, sentiment_mini, train_reward
from lm_human_preferences.offline import experiment, labels, pretrain, published
from lm_human_preferences.utils import files, hyperparams
from lm_human_preferences.utils.command_line import ConfigError
from conftest import load_script
from test_offline import _random_main_model

top_launch = load_script('top_launch', 'launch.py')


def _miniature_reward_hparams(seed):
    hparams = train_reward.HParams()
    hparams.override_from_dict({k: v for k, v, _ in top_launch.get_train_reward_experiments()['sentiment_mini'][0]})
    hparams.run.seed = seed
    return hparams


def test_a_run_copies_the_published_labels_of_its_key_and_makes_other_seeds_own(tmp_path, capsys, monkeypatch):
    """Labels published from a finished run are what a new run of the same key copies, on an empty cache (another
    machine) and whatever made them (the sampler, the batches, the ranks: recorded, not matched); another seed makes
    its own."""
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(tmp_path / 'datasets'))
    initial = _random_main_model(tmp_path / 'initial')
    exp = dataclasses.replace(sentiment_mini.EXPERIMENT, held_out_labels=2, published=str(tmp_path / 'published'))
    with open(Path(initial) / 'pretrain.json', 'w') as f:  # as if the experiment had pretrained it
        json.dump(pretrain._pretrain_key(exp, exp.pretrain), f)

    def prepare(run, seed=1):
        h = _miniature_reward_hparams(seed)
        h.task.policy.initial_model = initial
        h.labels.num_train, h.rollout_batch_size = 6, 8
        save_dir = tmp_path / run
        experiment.prepare_reward_training(exp, h, str(save_dir))
        hyperparams.save_json(h, str(save_dir / 'train_reward_hparams.json'))  # as train_reward writes it
        return save_dir, (save_dir / 'sentiment_mini_labels.json').read_bytes(), capsys.readouterr().out

    first_dir, first, out = prepare('first')
    assert '[sentiment_mini labels: batch' in out and "experiment's published" not in out
    published.publish(exp, [str(first_dir)])
    assert 'published labels-seed1-8.json.gz (seed 1, 8 labels)' in capsys.readouterr().out
    index = json.loads((Path(exp.published) / published.INDEX).read_text())
    assert index['initial_model']['key'] == json.loads((Path(initial) / 'pretrain.json').read_text())
    assert files.sha256_file(str(Path(exp.published) / 'initial_model' / 'checkpoints' / 'model-0.safetensors')) == \
        index['labels'][0]['key']['initial_model']

    shutil.rmtree(tmp_path / 'datasets')  # another machine: nothing cached
    entry = index['labels'][0]
    entry['key'].update(sampler='plain', ranks=4, rollout_batch_size=64, bf16=True)  # made otherwise
    (Path(exp.published) / published.INDEX).write_text(json.dumps(index))
    _, again, out = prepare('again')
    assert again == first
    assert re.search(r"the experiment's published labels, made on .*: rollout_batch_size 64, bf16 True, sampler "
                     r"plain, ranks 4, torch ", out), out
    assert '[sentiment_mini labels: batch' not in out

    _, other_seed, out = prepare('other_seed', seed=2)
    assert other_seed != first and 'kept in' in out and "experiment's published" not in out


def test_a_run_of_fewer_labels_copies_the_first_records_of_a_larger_published_file(tmp_path, capsys, monkeypatch):
    """A run asking for fewer labels than a published file holds copies its first records, which are what making
    them gives (one rank draws in batches of rollout_batch_size from one stream); not from a file made on several
    ranks (each rank's share its own streams), nor fewer records than a batch (drawn in a smaller batch)."""
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(tmp_path / 'datasets'))
    initial = _random_main_model(tmp_path / 'initial')
    exp = dataclasses.replace(sentiment_mini.EXPERIMENT, held_out_labels=2, published=str(tmp_path / 'published'))
    with open(Path(initial) / 'pretrain.json', 'w') as f:
        json.dump(pretrain._pretrain_key(exp, exp.pretrain), f)

    def prepare(run, num_train):
        h = _miniature_reward_hparams(1)
        h.task.policy.initial_model = initial
        h.labels.num_train, h.rollout_batch_size = num_train, 4
        save_dir = tmp_path / run
        experiment.prepare_reward_training(exp, h, str(save_dir))
        hyperparams.save_json(h, str(save_dir / 'train_reward_hparams.json'))
        return save_dir, (save_dir / 'sentiment_mini_labels.json').read_bytes(), capsys.readouterr().out

    made_dir, made, _ = prepare('made', 6)  # 8 labels, made: two batches of 4
    large_dir, _, _ = prepare('large', 14)  # 16 labels
    published.publish(exp, [str(large_dir)])
    shutil.rmtree(tmp_path / 'datasets')  # another machine: nothing cached
    _, prefix, out = prepare('prefix', 6)
    assert prefix == made
    assert re.search(r"the experiment's published labels, made on .*; its first 8 of 16\)", out), out
    _, fewer, out = prepare('fewer', 1)  # 3 labels: below a batch of 4
    assert "experiment's published" not in out and 'kept in' in out
    index = json.loads((Path(exp.published) / published.INDEX).read_text())
    index['labels'][0]['key']['ranks'] = 2
    (Path(exp.published) / published.INDEX).write_text(json.dumps(index))
    shutil.rmtree(tmp_path / 'datasets')
    _, own, out = prepare('several_ranks', 6)
    assert own == made and "experiment's published" not in out and 'kept in' in out


def test_a_run_uses_the_published_initial_model_of_its_pretraining_and_pretrains_another(tmp_path, monkeypatch,
                                                                                        capsys):
    """The published initial model stands for the pretraining it was made by, whatever the products' dtype (another
    CPU's); other pretraining hparams pretrain their own."""
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path / 'saved_models'))
    tiny = dataclasses.replace(demo.EXPERIMENT.pretrain, n_embd=16, n_head=2, n_layer=1, n_ctx=16, steps=2,
                               batch_size=2)
    exp = dataclasses.replace(demo.EXPERIMENT, pretrain=tiny, published=str(tmp_path / 'published'))
    made = pretrain.ensure_pretrained(exp)
    assert made == pretrain.model_dir(exp) and "experiment's published" not in capsys.readouterr().out
    shutil.copytree(made, tmp_path / 'published' / 'initial_model')
    key = json.loads((Path(made) / 'pretrain.json').read_text())
    index = dict(initial_model=dict(kind='initial_model', dir='initial_model', key=dict(key, products_dtype='other'),
                                    made=dict(chip='a CPU of another kind', torch='x')))
    (tmp_path / 'published' / published.INDEX).write_text(json.dumps(index))
    shutil.rmtree(made)
    assert pretrain.ensure_pretrained(exp) == str(tmp_path / 'published' / 'initial_model')
    assert ("demo: the experiment's published initial model, made on a CPU of another kind: products_dtype other, "
            "torch x (every CPU starts from these weights)") in capsys.readouterr().out
    longer = dataclasses.replace(exp, pretrain=dataclasses.replace(tiny, steps=3))
    assert pretrain.ensure_pretrained(longer) == pretrain.model_dir(longer)
    assert 'pretraining the initial model' in capsys.readouterr().out


def test_the_miniatures_published_files_are_what_its_runs_ask_for():
    """The initial model and labels that the sentiment miniature ships are found by its runs (seeds 1-3: the first
    10,240 of each seed's 18,432 records; its frontier's runs take them all): a change of its pretraining or task
    settings fails here until they are published again (published.py says how)."""
    exp = sentiment_mini.EXPERIMENT
    model = published.initial_model(exp, pretrain._pretrain_key(exp, exp.pretrain))
    assert model is not None, 'the published initial model is not the one sentiment_mini pretrains: publish it again'
    for seed in (1, 2, 3):
        h = _miniature_reward_hparams(seed)
        h.task.policy.initial_model = model.path
        num_labels = h.labels.num_train + exp.held_out_labels
        found = published.labels(exp, labels.labels_key(exp, h, num_labels=num_labels, seed=seed))
        assert found is not None, f'no published labels for seed {seed}: publish them again'
        records = json.loads(published.read_labels(found))
        assert len(records) == num_labels and sorted(records[0]) == ['best', 'query'] + [f'sample{i}' for i in range(4)]
    # The published model is the pretraining's whole output: the weights every key names.
    index = json.loads((Path(exp.published) / published.INDEX).read_text())
    assert len(list(Path(model.path, 'checkpoints').glob('*.safetensors'))) == 1
    assert {e['key']['initial_model'] for e in index['labels']} == {published.weights_sha256(model.path)}



def test_publish_refuses_another_experiment_or_a_dir_without_its_labels(tmp_path):
    with pytest.raises(ConfigError, match=r"^publish: 'books' is no offline experiment \(choose from: demo, "
                                          r"sentiment_mini\)$"):
        launch_commands.launch_publish('books', str(tmp_path))
    for present in ([], ['demo_labels.json']):  # neither, or the labels without the run's reward hparams
        for name in present:
            (tmp_path / name).write_text('[]')
        with pytest.raises(ConfigError, match=rf"^publish: {tmp_path}: a save dir of a finished demo run \(with its "
                                              r"demo_labels.json and train_reward_hparams.json\) is needed$"):
            launch_commands.launch_publish('demo', str(tmp_path))
