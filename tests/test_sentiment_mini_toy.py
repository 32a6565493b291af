"""The sentiment miniature's whole pipeline at a toy size, in the fast tier (seconds): `launch.py train_policy
sentiment_mini` with its task, vocabulary, books, labeler and report, but a model of width 8 pretrained for
2 steps on a page of the books, 8 labels and one PPO batch. It learns nothing; it fails when a phase breaks
or the report loses what the bars are read from. That the full run learns is measured in the README; the
longer end-to-end run with its files and the sample commands is tests/test_sentiment_mini.py (slow tier)."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from lm_human_preferences import sentiment_mini
from lm_human_preferences.offline import pretrain
from conftest import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
top_launch = load_script('top_launch', 'launch.py')

TOY = {'rewards.train_new_model.labels.num_train': '8',
       'rewards.train_new_model.normalize_samples': '8',
       'rewards.train_new_model.rollout_batch_size': '8',
       'ppo.batch_size': '16',
       'ppo.total_episodes': '16',
       'run.log_interval': '100'}


@pytest.fixture
def toy_mini(monkeypatch):
    exp = sentiment_mini.EXPERIMENT
    page = sentiment_mini.pretraining_corpus()[:4000]  # encoding the whole train split takes seconds
    monkeypatch.setattr(sentiment_mini, 'EXPERIMENT', dataclasses.replace(
        exp, corpus=lambda: page, held_out_labels=4, eval_queries=8,
        pretrain=dataclasses.replace(exp.pretrain, n_layer=1, n_embd=8, n_head=2, steps=2, batch_size=2)))
    return sentiment_mini.EXPERIMENT


def test_toy_sentiment_mini_pipeline(tmp_path, toy_mini, capsys):
    top_launch.launch_train_policy('sentiment_mini', 'toy', save_dir=str(tmp_path), **TOY, **{'run.seed': '2'})
    save_dir, out = tmp_path / 'toy', capsys.readouterr().out
    # --run.seed 2 seeds the labels' draws, the reward model (its phase's run.seed) and PPO; the initial model is
    # every seed's (pretrained with the experiment's seed, 1), here the toy's own: not the published one.
    model = Path(pretrain.model_dir(toy_mini))
    assert model.name == 'sentiment_mini'
    assert json.loads((model / 'pretrain.json').read_text())['pretrain']['seed'] == 1
    assert f'sentiment_mini: pretraining the initial model into {model} ' in out and "experiment's published" not in out
    reward_hparams = json.loads((save_dir / 'train_reward_hparams.json').read_text())
    assert reward_hparams['run']['seed'] == 2 and reward_hparams['task']['policy']['initial_model'] == str(model)
    assert json.loads((save_dir / 'train_policy_hparams.json').read_text())['run']['seed'] == 2
    assert len(json.loads((save_dir / 'sentiment_mini_labels.json').read_text())) == 8 + 4

    # Every phase ran and the report holds what the bars are read from.
    report = json.loads((save_dir / 'sentiment_mini_report.json').read_text())
    assert report['seed'] == report['reward_seed'] == 2 and report['ppo_batches'] == 1 and report['eval_queries'] == 8
    for key in ('vader_gain_initial_stds', 'vader_gain_initial_stds_se', 'kl', 'rm_heldout_accuracy',
                'rm_bag_of_words_accuracy', 'rm_ceiling_accuracy'):
        assert isinstance(report[key], float), key
    assert 0 <= report['rm_bag_of_words_accuracy'] <= 1 and 0.25 <= report['rm_ceiling_accuracy'] <= 1
    assert list(report['phase_times_s']) == ['initial model', 'labels', 'train_reward', 'train_policy', 'report samples']
    assert 'seed (run.seed): 2\n' in out
    # The run's last lines: where the report is, and what to run next on it.
    assert out.splitlines()[-4:] == [
        f"sentiment_mini: the report in {save_dir / 'sentiment_mini_report.json'}, all curves in "
        f"{save_dir / 'sentiment_mini_curves.png'}",
        f'  samples:    python sample.py sample --save_dir {save_dir} --nsamples 8',
        f'  export:     python sample.py export --save_dir {save_dir} --out HF_DIR',
        f'  best-of-n:  python sample.py best_of_n --save_dir {save_dir}']
    assert re.search(r'reward model held-out accuracy: [\d.]+% \(chance 25%, a bag-of-words model trained on the same '
                     r'labels: [\d.]+%, a perfect learner of VADER: [\d.]+%\)', out), out[-3000:]
