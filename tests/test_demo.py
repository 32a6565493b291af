"""The offline demo end to end, shortened (lm_human_preferences/demo/ through `launch.py train_policy demo`):
the policy's samples score higher by the rule after PPO, and the reward model beats chance. The mechanism's
unit tests (the labels' ties and format) are in tests/test_offline.py."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import pytest

from lm_human_preferences import demo, label_types, lm_tasks, train_policy
from lm_human_preferences.offline import experiment
from lm_human_preferences.utils import cpu
from lm_human_preferences.offline import report as offline_report
from lm_human_preferences.language import checkpoints, encodings, model
from conftest import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
top_launch = load_script('top_launch', 'launch.py')


def test_rule():
    encoder = encodings.Test.get_encoder()
    responses = torch.tensor([encoder.encode('here.were.three'), encoder.encode('a.big.dog.ran.')[:15] + [27]])
    assert demo.EXPERIMENT.labeler.scores(responses, encoder).tolist() == [6.0, 0.0]  # the padding token decodes to ''


@pytest.fixture
def short_demo(monkeypatch):
    # A narrower model and fewer labels / PPO batches than the defaults, same pipeline (~1 minute).
    exp = demo.EXPERIMENT
    monkeypatch.setattr(demo, 'EXPERIMENT', dataclasses.replace(
        exp, pretrain=dataclasses.replace(exp.pretrain, n_embd=64), held_out_labels=256, eval_queries=128))
    return {'rewards.train_new_model.labels.num_train': '1024',
            'ppo.total_episodes': str(64 * 30),
            'run.log_interval': '100'}


def test_the_initial_model_is_resolved_once_for_all_tasks(tmp_path, monkeypatch, capsys):
    """train_policy's demo resolves its policy's and its reward model's initial model together: one line
    says which model it uses (it once said it twice)."""
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path))
    exp = demo.EXPERIMENT
    exp = dataclasses.replace(exp, pretrain=dataclasses.replace(exp.pretrain, n_embd=16, n_layer=1, steps=2, batch_size=2))
    model = str(tmp_path / 'demo')
    for _ in range(2):  # made, then found in the cache
        policy_task, reward_task = lm_tasks.TaskHParams(), lm_tasks.TaskHParams()
        policy_task.policy.initial_model = reward_task.policy.initial_model = 'demo'
        experiment.resolve_initial_model(exp, policy_task, reward_task)
        experiment.resolve_initial_model(exp, reward_task)  # as prepare_reward_training does next: already resolved
        assert policy_task.policy.initial_model == reward_task.policy.initial_model == model
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('demo: ')]
    assert lines == [f'demo: pretraining the initial model into {model} (1 layers, width 16, 27-token vocabulary, '
                     f'2 steps of 2 x 64 tokens; float32 products with the output embedding)',
                     f'demo: using the pretrained initial model in {model}']


def test_a_model_of_another_encoding_is_one_line_before_any_work(tmp_path, monkeypatch):
    """The demo runs on the original's `test` characters: a GPT-2 BPE model (a Hugging Face GPT-2's encoding)
    as its initial model is one line naming the encodings and where such a model runs, before anything is made
    (no pretraining, no labels); the sentiment miniature says the same the other way round."""
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path / 'models'))
    hp = model.HParams(n_vocab=encodings.Main.n_vocab, n_ctx=96, n_embd=8, n_head=1, n_layer=1)
    checkpoints.save_checkpoint(str(tmp_path / 'bpe'), 0, model.Model(hp), hparams=hp, encoding=encodings.Main)
    hparams = train_policy.HParams()
    hparams.override_from_dict({k: v for k, v, _ in top_launch.get_experiments()['demo'][0] if k is not None})
    hparams.override_from_dict({'task.policy.initial_model': str(tmp_path / 'bpe'), 'run.save_dir': str(tmp_path / 'run')})
    with pytest.raises(ValueError) as e:
        top_launch.launch_commands.run_command(hparams, command='train_policy', exp='demo')
    assert str(e.value) == (f"task.policy.initial_model {tmp_path / 'bpe'} is a model of the 'main' encoding; the demo "
                            f"experiment runs on the 'test' encoding (the original's 26 letters and '.'): a model of "
                            f"GPT-2's BPE (`main`, a Hugging Face GPT-2 included) runs on the sentiment_mini experiment "
                            f"or the paper's tasks")
    assert not (tmp_path / 'models').exists() and not (tmp_path / 'run').exists()


def test_report_line_of_the_reward_model():
    report = dict(rm_heldout_accuracy=0.66, rm_chance_accuracy=0.25, rm_ceiling_accuracy=0.785, rm_train_accuracy=0.712,
                  wall_time_s=1)
    assert ('reward model held-out accuracy: 66.0% (chance 25%, a perfect learner of the rule: 78.5%); on its '
            'training labels: 71.2%') in offline_report.format_report(demo.EXPERIMENT, report).splitlines()


def test_score_report_gain_in_initial_stds():
    before, after = torch.tensor([0., 1., 2., 3.]), torch.tensor([2., 3., 4., 6.])
    report = offline_report.score_report(demo.EXPERIMENT.labeler, before, after)
    unit = np.std([0, 1, 2, 3])  # the initial policy's std, as reported (ddof 0)
    assert report['rule_initial_std'] == pytest.approx(unit)
    assert report['rule_gain_initial_stds'] == pytest.approx((3.75 - 1.5) / unit)
    # The standard error of a difference of two independent means, each from its sample variance (ddof 1).
    se = np.sqrt(np.var([0, 1, 2, 3], ddof=1) / 4 + np.var([2, 3, 4, 6], ddof=1) / 4) / unit
    assert report['rule_gain_initial_stds_se'] == pytest.approx(se)
    lines = offline_report.format_report(demo.EXPERIMENT, dict(report, wall_time_s=1)).splitlines()
    assert f"  gain: +{(3.75 - 1.5) / unit:.2f} standard deviations of the initial policy's scores (standard error {se:.2f})" in lines
    on = 'CPU (1 thread, AVX2 kernels, bf16 not native: ONEDNN_MAX_CPU_ISA=AVX2)'
    lines = offline_report.format_report(demo.EXPERIMENT, dict(report, wall_time_s=1, runs_on=on)).splitlines()
    assert f'wall time: 1s on {on}' in lines


@pytest.mark.slow  # end to end: the full suite only (the fast tier is -m "not slow")
def test_short_demo_learns(tmp_path, short_demo, capsys):
    top_launch.launch_train_policy('demo', 'short', save_dir=str(tmp_path), **short_demo)
    save_dir = tmp_path / 'short'
    out = capsys.readouterr().out
    # progress lines while it makes its labels (1280 labels, 128 queries a batch: 10 batches)
    assert re.search(r'\[demo labels: batch 1/10 done, [\d.]+ s/step, ETA (\d+h)?(\d+m)?\d+s\]', out), out[:3000]
    assert re.search(r'\[demo labels: batch 10/10 done, [\d.]+ s/step, ETA 0s\]', out), out[:3000]
    # which initial model it uses: said once
    assert len(re.findall(r'^demo: (pretraining the|using the pretrained) initial model', out, re.M)) == 1, out[:3000]
    report = json.loads((save_dir / 'demo_report.json').read_text())

    # The labels went through the normal path: the original's JSON format, valid, best = a top scorer.
    records = json.loads((save_dir / 'demo_labels.json').read_text())
    assert len(records) == 1024 + 256
    schemas = label_types.get('best_of_4').question_schemas(query_length=32, response_length=24)
    schemas.update(label_types.get('best_of_4').label_schemas())
    label_types.validate_labels(records, schemas, n_vocab=27, padding_token=27, source='demo labels')
    encoder = encodings.Test.get_encoder()
    for r in records[:50]:
        scores = [demo.rule_score(encoder.decode(r[f'sample{i}'])) for i in range(4)]
        assert scores[r['best']] == max(scores)
    hparams = json.loads((save_dir / 'train_reward_hparams.json').read_text())
    assert hparams['labels']['source'] == str(save_dir / 'demo_labels.json')

    # Learning: the rule's score of the policy's samples rises well beyond the sampling noise, and the
    # reward model, trained on 1024 labels, beats chance (25%) on the 256 held-out ones (by over 3.5
    # standard deviations of a chance-level accuracy on 256 labels, 2.7%).
    n = report['eval_queries']
    stderr = np.hypot(report['rule_initial_std'], report['rule_trained_std']) / np.sqrt(n)
    assert report['rule_trained_mean'] - report['rule_initial_mean'] > max(0.5, 4 * stderr), report
    assert report['rule_gain_initial_stds'] == pytest.approx(
        (report['rule_trained_mean'] - report['rule_initial_mean']) / report['rule_initial_std'])
    assert report['rm_chance_accuracy'] == 0.25 and report['rm_heldout_accuracy'] > 0.35, report
    assert report['rm_heldout_accuracy'] <= report['rm_ceiling_accuracy'] + 0.1  # the ceiling is an expectation, not a bound
    assert 0.25 < report['rm_train_accuracy'] <= 1  # its accuracy on its training labels (eval_train_labels)
    assert report['kl_target'] == 4.0 and report['ppo_batches'] == 30 and report['kl'] > 0
    assert list(report['phase_times_s']) == ['initial model', 'labels', 'train_reward', 'train_policy', 'report samples']
    assert sum(report['phase_times_s'].values()) <= report['wall_time_s']
    if not torch.cuda.is_available():  # what it ran on: the demo's threads, this CPU's kernels and bf16
        threads = int(os.environ.get('LMHP_CPU_THREADS', demo.EXPERIMENT.cpu_threads))
        assert report['runs_on'] == (f"CPU ({threads} thread{'s' if threads != 1 else ''}, "
                                     + cpu.describe('cpu').split(', ', 1)[1])

    # The learning curves were plotted at the end of both trainers, and all of them in the demo's figure.
    for png in ('train_reward_curves.png', 'train_policy_curves.png', 'demo_curves.png'):
        assert (save_dir / png).read_bytes()[:4] == b'\x89PNG'

    # The sample command the end-of-run summary prints works on the demo's save dir (its query dataset
    # is the demo's own): samples of the demo's test queries.
    proc = subprocess.run([sys.executable, 'sample.py', 'sample', '--save_dir', str(save_dir), '--nsamples', '2'],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = proc.stdout.split('=' * 80 + '\n')[1:]
    assert len(blocks) == 4  # batch_size 4 (at least nsamples: whole batches, as the original)
    query, response = blocks[0].splitlines()[:2]
    assert query.startswith('query:    ') and response.startswith('response: ')
    query, response = query[len('query:    '):], response[len('response: '):]
    assert len(query) > 10 and set(query + response) <= set('abcdefghijklmnopqrstuvwxyz.')


@pytest.mark.parametrize('load, threads, env, warned', [
    (1.0, 2, None, True),    # one core's other work beside two threads on two cores
    (0.2, 2, None, False),   # idle cores
    (1.0, 1, None, False),   # one thread splits nothing
    (1.0, 2, '2', False),    # the user chose the threads
    (None, 2, None, False),  # a platform without a load average (Windows): no line, no error
])
def test_busy_cores_are_one_line_naming_the_setting(monkeypatch, capsys, load, threads, env, warned):
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1}, raising=False)
    if load is None:
        monkeypatch.delattr(os, 'getloadavg', raising=False)
    else:
        monkeypatch.setattr(os, 'getloadavg', lambda: (load, load, load))
    if env is None:
        monkeypatch.delenv('LMHP_CPU_THREADS', raising=False)
    else:
        monkeypatch.setenv('LMHP_CPU_THREADS', env)
    exp = dataclasses.replace(demo.EXPERIMENT, cpu_threads=threads)
    saved = torch.get_num_threads()
    with experiment.cpu_threads(exp):
        assert torch.get_num_threads() == int(env or threads)
    assert torch.get_num_threads() == saved
    lines = [line for line in capsys.readouterr().out.splitlines() if 'LMHP_CPU_THREADS=1' in line]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert lines[0].startswith(f'demo: {threads} threads on 2 cores') and 'load average 1.0' in lines[0]


def test_the_report_says_who_labelled():
    """The report names who gave the reward model's labels and, where that was not the program that scores the
    samples (people on the page, a label file, the online loop's rounds), both: the program is not credited with
    people's labels."""
    def origin(**overrides):
        hparams = train_policy.HParams()
        hparams.override_from_dict({k: v for k, v, _ in top_launch.get_experiments()['demo'][0] if k is not None})
        hparams.override_from_dict(overrides)
        return experiment.labels_origin(demo.EXPERIMENT, hparams)
    rule = demo.EXPERIMENT.labeler.description
    assert origin() == rule
    by_people = origin(**{'rewards.train_new_model.labels.source': 'datasets/labels/mine/labels.json'})
    assert by_people == 'the label file datasets/labels/mine/labels.json'
    assert origin(**{'online.retrains': 2, 'online.labeler': 'people'}) == \
        f'{rule}; then people on the labeling page, in 2 rounds of the online loop'
    assert origin(**{'online.retrains': 3}) == f'{rule}; then {rule}, in 3 rounds of the online loop'
    assert origin(**{'rewards.train_new_model': 'off', 'rewards.trained_model': '/m/reward_model'}) == \
        'none: the reward model /m/reward_model was trained elsewhere'
    lines = offline_report.format_report(demo.EXPERIMENT, dict(labels_from=by_people, wall_time_s=1)).splitlines()
    assert f'labels from: {by_people}' in lines and f'samples scored by: {rule}' in lines
    assert not any(line.startswith('labeler:') for line in lines)
    lines = offline_report.format_report(demo.EXPERIMENT, dict(labels_from=rule, wall_time_s=1)).splitlines()
    assert f'labeler: {rule}' in lines
