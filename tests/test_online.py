"""The paper's online loop (online/loop.py), end to end through the command line: `train_policy --online.retrains 2`
on the test model with a small `local:` query dataset, the demo's rule as the program labeler. A run killed with
SIGKILL while it asks, while it retrains and in PPO between rounds, then rerun, ends bit for bit as the run that
was never interrupted (policy, Adam, KL coefficient, every round's labels and reward model, the stats); with
people on the page, a killed run never asks a question twice. Bad settings are one line at launch."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (NAME, REPO_ROOT, assert_killed, env, finish, kill_when_exists, last_line, launch_cli,
                         policy_args, write_corpus)

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only

ONLINE = ['--online.retrains', '2', '--online.labeler', 'rule', '--online.num_labels', '32',
          '--online.validation_share', '0.25', '--rewards.train_new_model.run.save_interval', '1']
STEPS = 30  # 240 episodes in batches of 8; the rounds at batches 10 and 20

# The asking phase of round 1 held open (after its questions are written, before the program answers), so that
# the kill lands in it.
SLOW_ASKING = """
import runpy, sys, time
from lm_human_preferences.online import loop
answer = loop.OnlineLoop._label_by_program
def slow(self, k, store):
    time.sleep(60)
    return answer(self, k, store)
loop.OnlineLoop._label_by_program = slow
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def run_dir(root):
    return Path(root) / NAME


def assert_same_file(a, b):
    assert Path(a).read_bytes() == Path(b).read_bytes(), (a, b)


def assert_same_tensors(a, b):
    x, y = load_file(str(a)), load_file(str(b))
    assert set(x) == set(y)
    for k in x:
        assert torch.equal(x[k], y[k]), (k, (x[k].double() - y[k].double()).abs().max())


def stats_rows(path):
    """The stats JSONL's rows without the wall-clock ones."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith('elapsed/')}
            for line in Path(path).read_text().splitlines()]


def assert_same_run(whole, resumed):
    a, b = run_dir(whole), run_dir(resumed)
    assert_same_tensors(a / 'policy' / 'checkpoints' / f'model-{STEPS}.safetensors',
                        b / 'policy' / 'checkpoints' / f'model-{STEPS}.safetensors')
    assert_same_tensors(a / 'policy' / 'train_state' / f'state-{STEPS}.safetensors',
                        b / 'policy' / 'train_state' / f'state-{STEPS}.safetensors')  # Adam's moments too
    sidecars = [json.loads((d / 'policy' / 'train_state' / f'state-{STEPS}.json').read_text()) for d in (a, b)]
    assert sidecars[0]['extra']['kl_coef'] == sidecars[1]['extra']['kl_coef'] != 0.15
    assert sidecars[0]['rng'] == sidecars[1]['rng']  # every random stream, the process's torch one included
    for k in (1, 2):
        assert_same_file(a / 'online' / f'round-{k}' / 'labels.json', b / 'online' / f'round-{k}' / 'labels.json')
        assert_same_file(a / 'online' / f'round-{k}' / 'questions.jsonl', b / 'online' / f'round-{k}' / 'questions.jsonl')
        assert_same_file(a / 'online' / f'reward-{k}' / 'labels.json', b / 'online' / f'reward-{k}' / 'labels.json')
        model = sorted((a / 'online' / f'reward-{k}' / 'reward_model' / 'checkpoints').glob('model-*.safetensors'))[-1]
        assert_same_tensors(model, b / 'online' / f'reward-{k}' / 'reward_model' / 'checkpoints' / model.name)
    assert stats_rows(a / 'train_policy_stats.jsonl') == stats_rows(b / 'train_policy_stats.jsonl')


@pytest.fixture(scope='module')
def whole(tmp_path_factory):
    """The uninterrupted run, and the arguments every run of this file takes."""
    root = tmp_path_factory.mktemp('online')
    args = policy_args(write_corpus(root / 'corpus')) + ONLINE
    code, out, err = finish(launch_cli('train_policy', root / 'whole', args, exp='test'))
    assert code == 0, err[-3000:]
    return root / 'whole', args, out


def test_the_rounds_retrain_on_every_label_so_far(whole):
    save_root, args, out = whole
    d = run_dir(save_root)
    initial = json.loads((d / 'train_reward_data.json').read_text())['labels']['records']  # 48 + 2 held out
    for k, step in ((1, 10), (2, 20)):
        assert f'online round {k}/2 at PPO batch {step}: 16 labels of 16 questions of the policy (4 in the validation ' \
               f'form) from the rule labeler' in out
        round_labels = json.loads((d / 'online' / f'round-{k}' / 'labels.json').read_text())
        assert len(round_labels) == 16
        retrained_on = json.loads((d / 'online' / f'reward-{k}' / 'labels.json').read_text())
        assert len(retrained_on) == 48 + 16 * k + 2 == initial + 16 * k  # every label so far, then the held out
        assert retrained_on[48 + 16 * (k - 1):48 + 16 * k] == round_labels
        hparams = json.loads((d / 'online' / f'reward-{k}' / 'train_reward_hparams.json').read_text())
        assert hparams['labels']['num_train'] == 48 + 16 * k and hparams['run']['seed'] == 1 + k  # a fresh head
        assert f'online: PPO scores with the reward model of round {k}' in out
    rows = [json.loads(line) for line in (d / 'train_policy_stats.jsonl').read_text().splitlines()]
    online_rows = [r for r in rows if 'online/round' in r]
    assert [(r['step'], r['online/round'], r['online/labels']) for r in online_rows] == [(10, 1, 64), (20, 2, 80)]
    assert all(0 <= r['online/pi_beats_rho'] <= 1 and r['online/pi_beats_rho_labels'] == 4 for r in online_rows)
    assert [r['step'] for r in rows if 'objective/kl' in r] == list(range(STEPS))


def test_killed_while_asking_resumes_bit_for_bit(whole, tmp_path):
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test', driver=SLOW_ASKING)
    watcher = kill_when_exists(killed, run_dir(tmp_path) / 'online' / 'round-1' / 'questions.jsonl')
    assert_killed(killed, watcher)
    assert not (run_dir(tmp_path) / 'online' / 'round-1' / 'done.json').exists()
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert 'train_policy: resuming from' in out and '(step 10)' in out
    assert_same_run(whole[0], tmp_path)


def test_killed_while_retraining_resumes_bit_for_bit(whole, tmp_path):
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    reward_dir = run_dir(tmp_path) / 'online' / 'reward-2' / 'reward_model'
    watcher = kill_when_exists(killed, reward_dir / 'train_state' / 'state-2.json')
    assert_killed(killed, watcher)
    assert not (reward_dir / 'checkpoints').exists()  # killed before the retraining finished
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert f'train_reward: resuming from {reward_dir}/train_state/state-' in out
    assert_same_run(whole[0], tmp_path)


def test_killed_in_ppo_between_rounds_resumes_bit_for_bit(whole, tmp_path):
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    watcher = kill_when_exists(killed, run_dir(tmp_path) / 'policy' / 'train_state' / 'state-14.json')
    assert_killed(killed, watcher)
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert 'online: PPO scores with the reward model of round 1' in out.split('train_policy: resuming from')[1]
    assert 'online round 1/2 at' not in out  # round 1 is not asked again
    assert_same_run(whole[0], tmp_path)


def test_killed_as_a_round_finishes_resumes_bit_for_bit(whole, tmp_path):
    """Killed once round 1 is written as finished, before PPO saved a state after it: the rerun resumes PPO from its
    state saved at the round's step and must not ask again; as the uninterrupted run, PPO goes on with the random
    streams it had saved there (the retraining reseeded them)."""
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    watcher = kill_when_exists(killed, run_dir(tmp_path) / 'online' / 'round-1' / 'done.json')
    assert_killed(killed, watcher)
    states = run_dir(tmp_path) / 'policy' / 'train_state'
    for path in states.glob('state-*'):  # should the kill have come a step late: the state of the round's step
        if int(path.name.split('.')[0].split('-')[1]) > 10:
            path.unlink()
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert f'resuming from {states}/state-10.json (step 10)' in out and 'online round 1/2 at' not in out
    assert_same_run(whole[0], tmp_path)


def empty_checkpoints_from_step_10(d):
    for path in (d / 'policy' / 'checkpoints').glob('model-*.safetensors'):
        if int(path.name.split('.')[0].split('-')[1]) >= 10:
            path.write_bytes(b'')  # the states of step 10 on refer to these: skipped


def stats_rows_lost_past_step_8(d):
    stats = d / 'train_policy_stats.jsonl'
    stats.write_text(''.join(line for line in stats.read_text().splitlines(keepends=True)
                             if json.loads(line)['step'] <= 8))  # the states past the log give way


@pytest.mark.parametrize('damage', [empty_checkpoints_from_step_10, stats_rows_lost_past_step_8])
def test_resumed_from_a_state_before_a_finished_round_scores_with_its_reward_model(whole, tmp_path, damage):
    """Killed once round 1 is finished, then the newest policy checkpoints found empty, or the stats' rows lost past
    step 8 (recovery paths the README promises): the rerun resumes from a state before the round's step and, at
    that step, must take up round 1's reward model without asking again, as the uninterrupted run."""
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    watcher = kill_when_exists(killed, run_dir(tmp_path) / 'online' / 'round-1' / 'done.json')
    assert_killed(killed, watcher)
    damage(run_dir(tmp_path))
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    resumed_at = int(re.search(r'train_policy: resuming from \S+ \(step (\d+)', out).group(1))
    assert resumed_at < 10 and 'online round 1/2 at' not in out
    assert 'online: PPO scores with the reward model of round 1' in out.split('train_policy: resuming from')[1]
    assert_same_run(whole[0], tmp_path)


def test_a_finished_rounds_empty_reward_model_is_retrained_from_its_states(whole, tmp_path):
    """Killed in PPO after round 1, its reward model's checkpoint then found empty: the rerun retrains it from its
    run's training states (as an interrupted retraining) and goes on bit for bit."""
    _, args, _ = whole
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    assert_killed(killed, kill_when_exists(killed, run_dir(tmp_path) / 'policy' / 'train_state' / 'state-14.json'))
    for path in (run_dir(tmp_path) / 'online' / 'reward-1' / 'reward_model' / 'checkpoints').glob('model-*'):
        path.write_bytes(b'')
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert 'online round 1: its reward model does not load' in out and 'online round 1/2 at' not in out
    assert_same_run(whole[0], tmp_path)


# Round 2 answered, then held before its retraining (a marker file says when), so that the kill lands there.
HELD_BEFORE_RETRAINING_2 = """
import runpy, sys, time
from pathlib import Path
from lm_human_preferences.online import loop
retrain = loop.OnlineLoop._retrain
def held(self, k):
    if k == 2:
        Path(self.dir, 'answered-2').write_text('')
        time.sleep(60)
    return retrain(self, k)
loop.OnlineLoop._retrain = held
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_damaged_round_files_are_rebuilt_and_the_run_goes_on_bit_for_bit(whole, tmp_path):
    """A finished round's labels.json cut in half and an unfinished round's questions.jsonl with a torn last line
    (while its answers are kept): the rerun rebuilds round 1's labels from its answers.jsonl and writes round 2's
    question batch back, made again; never emptied, and the same run as the uninterrupted one."""
    _, args, _ = whole
    online = run_dir(tmp_path) / 'online'
    killed = launch_cli('train_policy', tmp_path, args, exp='test', driver=HELD_BEFORE_RETRAINING_2)
    assert_killed(killed, kill_when_exists(killed, online / 'answered-2'))
    (online / 'answered-2').unlink()
    labels = online / 'round-1' / 'labels.json'
    labels.write_bytes(labels.read_bytes()[:len(labels.read_bytes()) // 2])
    questions = online / 'round-2' / 'questions.jsonl'
    questions.write_bytes(questions.read_bytes()[:-30])
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 0, err[-3000:]
    assert f'online round 2: {questions}: batch 0 was cut short; made again' in out
    assert_same_run(whole[0], tmp_path)


def test_a_finished_rounds_short_answers_are_one_line(whole, tmp_path):
    """Round 1's answers.jsonl missing records (no kill leaves that) before round 2 retrains: one line naming the
    file and what to do, and round 2's retraining labels are not written."""
    _, args, _ = whole
    online = run_dir(tmp_path) / 'online'
    killed = launch_cli('train_policy', tmp_path, args, exp='test', driver=HELD_BEFORE_RETRAINING_2)
    assert_killed(killed, kill_when_exists(killed, online / 'answered-2'))
    answers = online / 'round-1' / 'answers.jsonl'
    answers.write_text(''.join(answers.read_text().splitlines(keepends=True)[1:]))  # its first answer lost
    code, out, err = finish(launch_cli('train_policy', tmp_path, args, exp='test'))
    assert code == 1 and last_line(err) == (f'error: online round 1: {answers} holds 15 labels, the round needs 16: '
                                            f'restore the file from a copy, or move {online / "round-1"} (and the '
                                            f'rounds after it) away to ask its questions again'), err[-2000:]
    assert not (online / 'reward-2' / 'labels.json').exists()


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def api(port, method, path, body=None):
    request = urllib.request.Request(f'http://127.0.0.1:{port}{path}', method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def label_until(port, *, answered, stop, timeout=120):
    """Answer as 'ann' on the page's API (the first response shown) until stop() or the run is gone; the question
    ids answered are added to `answered` (a list: a repeat shows)."""
    start = time.time()
    while not stop() and time.time() - start < timeout:
        try:
            reply = api(port, 'GET', '/api/next?labeler=ann')
        except OSError:  # the run is between its server's lives
            time.sleep(0.2)
            continue
        if reply['state'] != 'question':
            time.sleep(0.2)
            continue
        question = reply['question']['id']
        try:
            api(port, 'POST', '/api/answer', dict(labeler='ann', question=question, choice=0))
            answered.append(question)
        except OSError:
            pass


def test_people_are_never_asked_twice_across_a_kill(tmp_path):
    port = free_port()
    args = policy_args(write_corpus(tmp_path / 'corpus')) + [
        '--online.retrains', '1', '--online.labeler', 'people', '--online.num_labels', '16', '--online.port', str(port)]
    killed = launch_cli('train_policy', tmp_path, args, exp='test')
    answered = []
    # ann answers 5 questions of the round, then the run is killed
    label_until(port, answered=answered, stop=lambda: len(answered) >= 5)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    session = run_dir(tmp_path) / 'online' / 'round-1'
    assert len(json.loads((session / 'labels.json').read_text())) == len(answered) >= 5
    rerun = launch_cli('train_policy', tmp_path, args, exp='test')
    label_until(port, answered=answered, stop=lambda: rerun.poll() is not None)
    code, out, err = finish(rerun)
    assert code == 0, err[-3000:]
    assert len(answered) == len(set(answered)) >= 16  # none asked twice, before or after the kill
    labels = json.loads((session / 'labels.json').read_text())
    assert len(labels) == len(answered)
    assert '[online round 1/1: PPO waits for' in out and f'label at http://127.0.0.1:{port}/' in out
    assert (session / 'done.json').exists()


# The demo shrunk to seconds (its model, held-out labels and eval queries), then launch.py as the command line runs it.
SHRUNK_DEMO = """
import dataclasses, runpy, sys
from lm_human_preferences import demo
exp = demo.EXPERIMENT
demo.EXPERIMENT = dataclasses.replace(exp, held_out_labels=8, eval_queries=8, pretrain=dataclasses.replace(
    exp.pretrain, n_layer=1, n_embd=8, n_head=2, steps=2, batch_size=2))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_people_on_the_demo_are_asked_the_demos_question(tmp_path):
    """The running loop asks people the experiment's question, which the launcher passes down (its hparams name the
    demo's resolved model folder and label file, not the experiment: a lookup from them asked the generic one)."""
    port = free_port()
    args = ['--rewards.train_new_model.labels.num_train', '16', '--rewards.train_new_model.batch_size', '8',
            '--rewards.train_new_model.normalize_samples', '8', '--rewards.train_new_model.rollout_batch_size', '8',
            '--ppo.batch_size', '32', '--ppo.total_episodes', '64', '--run.log_interval', '100',
            '--online.retrains', '1', '--online.labeler', 'people', '--online.num_labels', '8',
            '--online.port', str(port)]
    proc = launch_cli('train_policy', tmp_path, args, exp='demo', driver=SHRUNK_DEMO)
    try:
        deadline, reply = time.time() + 240, None
        while proc.poll() is None and time.time() < deadline:
            try:
                reply = api(port, 'GET', '/api/next?labeler=ann')
            except OSError:  # not serving yet
                reply = None
            if reply is not None and reply['state'] == 'question':
                break
            time.sleep(0.5)
    finally:
        proc.kill()
        out, err = proc.communicate()
    assert reply is not None and reply['state'] == 'question', err[-3000:]
    assert reply['instruction'] == "Which response has the most letters 'e'?"


@pytest.mark.parametrize('extra, says', [
    (['--online.retrains', '2'], "'online.labeler' is None: with online.retrains, name who labels: 'people'"),
    (['--online.retrains', '2', '--online.labeler', 'robot'], "'online.labeler' is 'robot'"),
    (['--online.retrains', '2', '--online.labeler', 'rule', '--online.num_labels', '12'],
     "'online.num_labels' is 12: it must be a multiple of rewards.train_new_model.batch_size 8"),
    (['--online.retrains', '2', '--online.labeler', 'rule', '--online.split', '1,2,3'], "'online.split' is '1,2,3'"),
    (['--online.retrains', '40', '--online.labeler', 'rule'], "fewer than the run's 30 PPO batches"),
    (['--online.retrains', '1', '--online.labeler', 'people', '--online.host', '0.0.0.0'], "'online.labelers' is None"),
    (['--online.retrains', '1', '--online.labeler', 'people', '--online.origin', 'https://labels.example.org'],
     "'online.labelers' is None"),
    (['--online.retrains', '1', '--online.labeler', 'people', '--online.port', '99999'],
     "'online.port' is 99999: it must be a port number from 0 to 65535"),
    (['--online.retrains', '1', '--online.labeler', 'people', '--online.port', 'TAKEN'],
     "'online.port' is TAKEN: cannot serve the labeling page on 127.0.0.1 port TAKEN: Address already in use"),
    (['--online.retrains', '2', '--online.labeler', 'rule', '--online.num_labels', '64', '--online.split', '1e-9,1'],
     "'online.split' is '1e-9,1': its weights give the 64 labels as 6.4e-08, 64: each round needs at least one "
     "minibatch of 8"),
    (['--online.retrains', '2', '--online.labeler', 'rule', '--online.num_labels', '64', '--online.split', '1,1e-9'],
     "'online.split' is '1,1e-9'"),
])
def test_bad_online_settings_are_one_line_at_launch(tmp_path, extra, says):
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = policy_args('test') + [a.replace('TAKEN', port) for a in extra]
        says = says.replace('TAKEN', port)
        proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', NAME, '--save_dir', str(tmp_path),
                               *args], cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and says in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / NAME)  # nothing ran


def test_the_loop_is_found_from_the_command_line():
    proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', '--help'], cwd=REPO_ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for option in ('--online.retrains', '--online.labeler', '--online.num_labels'):
        assert option in proc.stdout, proc.stdout
