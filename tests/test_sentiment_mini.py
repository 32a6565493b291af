"""The sentiment miniature end to end, shortened (`launch.py train_policy sentiment_mini`, through
lm_human_preferences/sentiment_mini/): the real GPT-2 BPE, the books task's query pipeline on the shipped
books, a pretrained initial model, VADER's labels in the original's format read back by train_reward,
both trainers and the report. Sizes are cut to about a minute, too small to learn: that the full run
learns is measured in docs/sentiment_mini.md. Unit tests of its parts: tests/test_offline.py."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lm_human_preferences import label_types, sentiment_mini, train_policy
from lm_human_preferences.offline import experiment, pretrain
from lm_human_preferences.language import checkpoints, encodings
from lm_human_preferences.sentiment_mini import vader
from conftest import load_script

pytestmark = pytest.mark.slow  # an end-to-end run: the full suite only (the fast tier is -m "not slow")

REPO_ROOT = Path(__file__).resolve().parents[1]
top_launch = load_script('top_launch', 'launch.py')
sample_cli = load_script('sample_cli', 'sample.py')

REPORT_KEYS = {'vader_initial_mean', 'vader_initial_std', 'vader_trained_mean', 'vader_trained_std', 'kl', 'kl_target',
               'rm_heldout_accuracy', 'rm_ceiling_accuracy', 'rm_bag_of_words_accuracy', 'seed', 'reward_seed',
               'wall_time_s'}


@pytest.fixture
def short_mini(monkeypatch):
    # A much smaller model, fewer labels, samples and PPO batches than the experiment's; the same task,
    # vocabulary, books and pipeline.
    exp = sentiment_mini.EXPERIMENT
    monkeypatch.setattr(sentiment_mini, 'EXPERIMENT', dataclasses.replace(
        exp, pretrain=dataclasses.replace(exp.pretrain, n_layer=1, n_embd=32, steps=20, batch_size=4),
        held_out_labels=32, eval_queries=32))
    return {'rewards.train_new_model.labels.num_train': '64',
            'rewards.train_new_model.normalize_samples': '64',
            'rewards.train_new_model.rollout_batch_size': '32',
            'ppo.batch_size': '32',
            'ppo.total_episodes': '64',
            'run.log_interval': '100'}


def test_short_sentiment_mini(tmp_path, short_mini, capsys):
    top_launch.launch_train_policy('sentiment_mini', 'short', save_dir=str(tmp_path), **short_mini)
    save_dir = tmp_path / 'short'
    out = capsys.readouterr().out
    # The initial model was pretrained on the real vocabulary, with progress lines, and cached.
    assert 'sentiment_mini: pretraining the initial model into ' in out and '50,257-token vocabulary' in out
    assert re.search(r'\[sentiment_mini pretraining: step 20/20 done, [\d.]+ s/step, ETA 0s, loss [\d.]+\]', out), out[:3000]
    initial = Path(pretrain.model_dir(sentiment_mini.EXPERIMENT))
    assert checkpoints.read_encoding(str(initial)) is encodings.Main
    assert re.search(r'\[sentiment_mini labels: batch 3/3 done, [\d.]+ s/step, ETA 0s\]', out), out[:3000]

    # VADER's labels: the original's JSON format, valid, `best` a most positive sample; read back by
    # train_reward from the save dir, the last 32 held out.
    records = json.loads((save_dir / 'sentiment_mini_labels.json').read_text())
    assert len(records) == 64 + 32
    label_type = label_types.get('best_of_4')
    schemas = {**label_type.question_schemas(query_length=8, response_length=16), **label_type.label_schemas()}
    label_types.validate_labels(records, schemas, n_vocab=50257, padding_token=50259, source='sentiment_mini labels')
    encoder = encodings.Main.get_encoder()
    for r in records:
        scores = [vader.compound_score(encoder.decode(r[f'sample{i}'])) for i in range(4)]
        assert scores[r['best']] == max(scores)
    hparams = json.loads((save_dir / 'train_reward_hparams.json').read_text())
    assert hparams['labels']['source'] == str(save_dir / 'sentiment_mini_labels.json')
    assert hparams['task']['query_dataset'] == 'sentiment_mini' and hparams['task']['query_length'] == 8
    assert 'eval on 32 labels: eval/loss' in out

    # Both trainers ran (normalization before and after, 2 PPO batches), and the report has its keys.
    report = json.loads((save_dir / 'sentiment_mini_report.json').read_text())
    assert REPORT_KEYS <= set(report), REPORT_KEYS - set(report)
    assert report['kl_target'] == 6.0 and report['ppo_batches'] == 2 and report['eval_queries'] == 32
    assert report['rm_chance_accuracy'] == 0.25 and 0.25 <= report['rm_ceiling_accuracy'] <= 1
    for when in ('initial', 'trained'):
        assert -1 <= report[f'vader_{when}_mean'] <= 1 and len(report['examples'][when]) == 5
    assert list(report['phase_times_s']) == ['initial model', 'labels', 'train_reward', 'train_policy', 'report samples']
    assert 'SENTIMENT_MINI REPORT' in out and 'VADER compound score of 32 samples on test queries: ' in out
    # The gain in the unit of the bar, the initial policy's standard deviation, with its standard error.
    gain, gain_se = report['vader_gain_initial_stds'], report['vader_gain_initial_stds_se']
    assert gain == pytest.approx((report['vader_trained_mean'] - report['vader_initial_mean']) / report['vader_initial_std'])
    assert f"  gain: {gain:+.2f} standard deviations of the initial policy's scores (standard error {gain_se:.2f})" in out
    for png in ('train_reward_curves.png', 'train_policy_curves.png', 'sentiment_mini_curves.png'):
        assert (save_dir / png).read_bytes()[:4] == b'\x89PNG'

    # The sample command works on the save dir (sample.py knows the miniature's dataset): text of the test
    # split's queries.
    proc = subprocess.run([sys.executable, 'sample.py', 'sample', '--save_dir', str(save_dir), '--nsamples', '2'],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = proc.stdout.split('=' * 80 + '\n')[1:]
    assert len(blocks) == 4
    for block in blocks:  # a query's text, then the response's
        query, response = block.splitlines()[:2]
        assert query.startswith('query:    ') and query[10:].strip() and response.startswith('response: ')

    # best_of_n on the run: the labeler's score of the best of k initial-policy samples, picked by the run's
    # reward model and by VADER itself (never below the reward model's pick; the same sample when k = 1).
    hparams = train_policy.HParams()
    hparams.override_from_json_file(str(save_dir / 'train_policy_hparams.json'))
    rows, scores = experiment.best_of_n(sentiment_mini.EXPERIMENT, hparams, n=4, queries=8, seed=0)
    assert scores.shape == (8, 4) and [row['k'] for row in rows] == [1, 2, 4]
    assert rows[0]['reward_model_pick'] == rows[0]['ppo_score_pick'] == rows[0]['labeler_pick'] == pytest.approx(
        float(scores[:, 0].mean()))
    for row in rows:
        assert max(row['reward_model_pick'], row['ppo_score_pick']) <= row['labeler_pick'] + 1e-12
        assert row['labeler_pick'] == pytest.approx(float(scores[:, :row['k']].max(dim=1).values.mean()))
        assert row['kl_bound'] == pytest.approx(np.log(row['k']) - (row['k'] - 1) / row['k'])
    assert rows[1]['labeler_pick'] <= rows[2]['labeler_pick']
    sample_cli.COMMANDS["best_of_n"](save_dir=str(save_dir), n=4, queries=8)
    out = capsys.readouterr().out
    assert 'VADER compound score of the best of k samples of the initial policy, on 8 test queries; ' in out
    assert re.search(r'^   4      0\.64 +-?[\d.]+ \([+-][\d.]+\) +-?[\d.]+ \([+-][\d.]+\) +-?[\d.]+ \([+-][\d.]+\)$', out, re.M) and f"the run's PPO policy: {report['vader_gain_initial_stds']:+.2f}" in out, out

    # A second run uses the cached initial model.
    top_launch.launch_train_reward('sentiment_mini', 'again', save_dir=str(tmp_path),
                                   **{'labels.num_train': '64', 'normalize_samples': '64', 'rollout_batch_size': '32'})
    out = capsys.readouterr().out
    assert f'sentiment_mini: using the pretrained initial model in {initial}' in out
    assert 'reward model held-out accuracy: ' in out
