"""Bad inputs and failures, end to end through the command line: each run exits with code 1 and the
cause on the last line of stderr, and the checkpoints already in the save dir stay as they were.

Most cases rerun a finished run's command in a copy of its save dir after something it reads broke (a
label file, the reward model dir, its training states): resuming checks its inputs again. Four cases
run as `python launch.py ...` subprocesses (one under a driver that fills the disk), concurrently with
the others, which run launch.py's main in this process (same code from the argv on, minus the
interpreter start; see SUBPROCESS_CASES). Covered elsewhere, not repeated here: unknown experiment /
hparam / option (tests/test_launch.py::test_main_errors_are_one_line, ::test_unknown_experiment_via_command_line),
a crashing DDP worker ending the launch in seconds (tests/test_launch.py::test_raising_worker_ends_launch),
every label-record error (tests/test_label_types.py), TF checkpoints of the wrong kind or with
mismatched shapes (tests/test_converter.py::test_conversion_errors*, ::test_checkpoint_errors).
"""
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import traceback
import warnings

import pytest
import torch

from lm_human_preferences import rewards
from lm_human_preferences.language import checkpoints, trained_models
from lm_human_preferences.training import state_files, train_state
from lm_human_preferences.training.adam import AdamTF
from conftest import NAME, TEST_TASK, finish, last_line, launch_cli, run_in_process, write_labels

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier is -m "not slow")

REWARD_ARGS = ['--labels.num_train', '16', '--batch_size', '8', '--normalize_before', 'false',
               '--normalize_after', 'false', '--run.save_interval', '1', '--run.seed', '1', *TEST_TASK]
POLICY_ARGS = ['--rewards.train_new_model', 'off', '--ppo.batch_size', '8', '--ppo.total_episodes', '16',
               '--ppo.noptepochs', '1', '--run.save_interval', '1', '--run.seed', '1', *TEST_TASK]

# Makes every os.write into a file named state-2.* fail as on a full disk (our atomic writes use os.write).
FULL_DISK_DRIVER = """
import errno, os, runpy, sys
real_write = os.write
def write(fd, data):
    if 'state-2.' in os.path.basename(os.readlink(f'/proc/self/fd/{fd}')):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)
os.write = write
sys.argv = sys.argv[1:]
runpy.run_path('launch.py', run_name='__main__')
"""


class Boom:
    """Unpickling this creates the file `marker`: proof that a loader ran code from the file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


def closed_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def reward_labels_path(root):
    # Inside the save dir: a copied dir then runs the same command (paths in it compare relative to it).
    return root / NAME / 'labels.json'


def reward_args(root, *extra):
    return ['--labels.source', reward_labels_path(root), *REWARD_ARGS, *extra]


def policy_args(root, *extra):
    return ['--rewards.trained_model', root / NAME / 'rm', *POLICY_ARGS, *extra]


def break_labels(records):
    def setup(root):
        reward_labels_path(root).write_text(records if isinstance(records, str) else json.dumps(records))
    return setup


CASES = ['malformed_label_json', 'wrong_token_length', 'token_id_out_of_range', 'too_few_labels',
         'label_file_nested_deeply', 'huge_token_id', 'policy_dir_as_reward_model', 'garbage_tf_checkpoint',
         'other_hparams_in_save_dir', 'missing_reward_model_dir', 'hparams_json_disagrees_with_weights',
         'pickle_reward_model', 'all_train_states_corrupt', 'unreachable_url', 'offline', 'non_finite_loss',
         'full_disk_during_save']


def cases(tmp):
    """name -> (finished run whose save dir is copied: 'reward' / 'policy' / None (a fresh dir), setup(root)
    breaking something, command, args(root), the expected cause: a part of the last stderr line, with
    {root} standing for the case's save root)."""
    records = json.loads(write_labels(tmp / 'good_labels.json', 16).read_text())
    wrong_length = [dict(r) for r in records]
    wrong_length[5]['sample2'] = [1, 2]
    out_of_range = [dict(r) for r in records]
    out_of_range[3]['query'] = [99, 1]
    marker = tmp / 'unpickled'

    def remove_reward_model(root):
        shutil.rmtree(root / NAME / 'rm')

    def reward_model_hparams_disagree(root):
        path = root / NAME / 'rm' / 'hparams.json'
        path.write_text(json.dumps(dict(json.loads(path.read_text()), n_embd=8)))

    def pickle_reward_model(root):
        path = root / NAME / 'rm' / 'checkpoints' / 'model-0.safetensors'
        torch.save({'model.wte': torch.zeros(1), 'payload': Boom(str(marker))}, str(path))

    def corrupt_train_states(root):
        state_dir = root / NAME / 'reward_model' / 'train_state'
        for path in state_dir.glob('*.safetensors'):
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(bytes(data))

    def fresh_labels(root):
        (root / NAME).mkdir(parents=True)
        reward_labels_path(root).write_text(json.dumps(records))

    huge_token = [dict(r) for r in records]
    huge_token[3]['query'] = [10 ** 30, 1]

    def policy_as_reward_model(root):
        shutil.rmtree(root / NAME / 'rm')
        shutil.copytree(root / NAME / 'policy', root / NAME / 'rm')

    def garbage_tf_checkpoint(root):
        rm = root / NAME / 'rm'
        shutil.rmtree(rm / 'checkpoints')
        (rm / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt-0"\n')
        (rm / 'model.ckpt-0.index').write_bytes(bytes(range(256)) * 3)
        (rm / 'model.ckpt-0.data-00000-of-00001').write_bytes(b'\x00' * 100)

    url = f'http://127.0.0.1:{closed_port()}/labels.json'
    return {
        'malformed_label_json': ('reward', break_labels('[{"query": [1, 2], "sample0": '), 'train_reward', reward_args,
                                 'error: label file {root}/run/labels.json is not valid JSON: Expecting value'),
        'wrong_token_length': ('reward', break_labels(wrong_length), 'train_reward', reward_args,
                               "labels.json record 5: 'sample2' has 2 tokens, expected response_length 3"),
        'token_id_out_of_range': ('reward', break_labels(out_of_range), 'train_reward', reward_args,
                                  "labels.json record 3: 'query' token 0 is 99, outside the vocabulary [0, 27)"),
        'too_few_labels': ('reward', break_labels(records[:10]), 'train_reward', reward_args,
                           'labels.json has 10 records, but labels.num_train is 16'),
        'label_file_nested_deeply': ('reward', break_labels('[' * 100_000 + ']' * 100_000), 'train_reward', reward_args,
                                     'error: label file {root}/run/labels.json is nested too deeply to be label '
                                     'records (expected a JSON array of objects)'),
        'huge_token_id': ('reward', break_labels(huge_token), 'train_reward', reward_args,
                          "labels.json record 3: 'query' token 0 is 1000000000000000000000000000000, outside the "
                          "vocabulary [0, 27)"),
        'policy_dir_as_reward_model': ('policy', policy_as_reward_model, 'train_policy', policy_args,
                                       'error: {root}/run/rm is not a trained reward model: its checkpoint has no reward '
                                       "head (a policy's value head is not one)"),
        'garbage_tf_checkpoint': ('policy', garbage_tf_checkpoint, 'train_policy', policy_args,
                                  'error: {root}/run/rm/model.ckpt-0 is not a readable TensorFlow checkpoint ('
                                  if importlib.util.find_spec('tensorflow') else  # without TF: that it is needed
                                  'error: converting the TensorFlow checkpoint {root}/run/rm/model.ckpt-0 needs '
                                  'tensorflow, which is not installed'),
        'other_hparams_in_save_dir': ('reward', None, 'train_reward', lambda root: reward_args(root, '--lr', '0.001'),
                                      'holds another run: its train_reward_hparams.json has lr=5e-05, this run has '
                                      'lr=0.001. To resume that run, rerun its command with the same hyperparameters; '
                                      'to start a new run, give it another NAME (or --save_dir)'),
        'missing_reward_model_dir': ('policy', remove_reward_model, 'train_policy', policy_args,
                                     'error: model directory {root}/run/rm does not exist'),
        'hparams_json_disagrees_with_weights': ('policy', reward_model_hparams_disagree, 'train_policy', policy_args,
                                                "error: variable 'model.wpe' has shape [8, 7] in {root}/run/rm/checkpoints/model-0.safetensors, "
                                                "but the model (built from its hparams.json) expects [8, 8]"),
        'pickle_reward_model': ('policy', pickle_reward_model, 'train_policy', policy_args,
                                'refusing to load {root}/run/rm/checkpoints/model-0.safetensors: it is a pickle'),
        'all_train_states_corrupt': ('reward', corrupt_train_states, 'train_reward', reward_args,
                                     'error: no valid training state in {root}/run/reward_model/train_state: every '
                                     'one (steps [2, 1]) is corrupt; move the directory away to start afresh'),
        'unreachable_url': (None, fresh_labels, 'train_reward',
                            lambda root: ['--labels.source', url, *REWARD_ARGS],
                            f'could not download {url}: connection failed'),
        # No internet: the host does not resolve (.invalid never does). Not retried; the demo suggested.
        'offline': (None, fresh_labels, 'train_reward',
                    lambda root: ['--labels.source', 'https://lmhp-test.invalid/labels.json', *REWARD_ARGS],
                    'error: could not download https://lmhp-test.invalid/labels.json: the host lmhp-test.invalid '
                    'cannot be resolved (no internet?); the offline demo runs without it: python launch.py '
                    'train_policy demo NAME'),
        'non_finite_loss': (None, fresh_labels, 'train_reward', lambda root: reward_args(root, '--lr', '1e30'),
                            'error: non-finite loss at step 1: nan'),
        'full_disk_during_save': (None, None, 'train_policy',
                                  lambda root: ['--rewards.trained_model', 'test', *POLICY_ARGS],
                                  'error: could not save the training state to '
                                  '{root}/run/policy/train_state/state-2.safetensors: [Errno 28] No space left on '
                                  'device (earlier states in {root}/run/policy/train_state are kept)'),
    }


# Run as `python launch.py ...` subprocesses (exit code and stderr of a real process); the others run
# launch.py's main in this process (the same code from the argv on, without an interpreter start each).
SUBPROCESS_CASES = {'malformed_label_json', 'other_hparams_in_save_dir', 'non_finite_loss', 'full_disk_during_save'}
# The save dir's lock file records who holds it (training/run.py): every launch rewrites it.
REWRITTEN = {f'{NAME}/.lock'}


def main_in_process(command, root, args):
    """(exit code, stdout, stderr) of launch.py's main run here."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        # Warnings to (this run's) stderr, as a process prints them, rather than to pytest's summary.
        warnings.simplefilter('always')
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            run_in_process(command, root, args)
        except SystemExit as e:
            code = e.code
        except Exception:  # what an uncaught error does to a real process: a traceback, exit code 1
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    """The two finished runs (in this process), then every case. Returns name -> dict(root, before
    (snapshot of the files the case did not break), present (the files before the run), code, out, err,
    expected, base, argv)."""
    tmp = tmp_path_factory.mktemp('bad_inputs')
    finished = {'reward': tmp / 'reward_done', 'policy': tmp / 'policy_done'}
    (finished['reward'] / NAME).mkdir(parents=True)
    write_labels(reward_labels_path(finished['reward']), 16)
    with contextlib.redirect_stdout(io.StringIO()):
        run_in_process('train_reward', finished['reward'], reward_args(finished['reward']))
        rm = rewards.RewardModelTrainer(trained_models.TrainedModel('test'))
        checkpoints.save_checkpoint(str(finished['policy'] / NAME / 'rm'), 0, rm, hparams=rm.hparams,
                                       encoding='test')
        run_in_process('train_policy', finished['policy'], policy_args(finished['policy']))

    all_cases = cases(tmp)
    assert list(all_cases) == CASES
    runs = {}
    for name, (base, setup, command, args, expected) in all_cases.items():
        root = tmp / name
        if base is not None:
            shutil.copytree(finished[base], root)
        before = snapshot(root) if root.exists() else {}
        if setup is not None:
            setup(root)
        present = snapshot(root) if root.exists() else {}
        before = {k: v for k, v in before.items() if present.get(k) == v}  # what setup left alone
        runs[name] = dict(root=root, before=before, present=set(present), expected=expected.format(root=root),
                          base=base, argv=(command, root, args(root)))
    # The subprocesses first: they run while this process runs the other cases.
    procs = {}
    for name in sorted(SUBPROCESS_CASES):
        driver = FULL_DISK_DRIVER if name == 'full_disk_during_save' else None
        procs[name] = launch_cli(*runs[name]['argv'], driver=driver)
    for name, run in runs.items():
        if name not in SUBPROCESS_CASES:
            run['code'], run['out'], run['err'] = main_in_process(*run['argv'])
    for name, proc in procs.items():
        runs[name]['code'], runs[name]['out'], runs[name]['err'] = finish(proc, timeout=300)
    for run in runs.values():
        run['marker'] = tmp / 'unpickled'
    return runs


@pytest.mark.parametrize('name', CASES)
def test_fails_with_one_line_and_keeps_checkpoints(results, name):
    r = results[name]
    assert r['code'] == 1, r['err'][-3000:]
    line = last_line(r['err'])
    assert r['expected'] in line, r['err'][-3000:]
    after = snapshot(r['root'])
    for path, digest in r['before'].items():
        assert path in REWRITTEN or after.get(path) == digest, f'{path} changed'
    # Nothing new among the checkpoints and training states; a refused run writes nothing at all.
    new = set(after) - r['present']
    if r['base'] is not None:
        assert not [p for p in new if 'checkpoints' in p or 'train_state' in p], new
    if name == 'other_hparams_in_save_dir':
        assert after == r['before'] and not new
    if name == 'pickle_reward_model':
        assert not r['marker'].exists()  # never unpickled
    if name == 'all_train_states_corrupt':
        assert 'warning: skipping training state 2 in ' in r['err']
        assert 'state-1.safetensors: checksum mismatch (the file is corrupt)' in r['err']


def test_non_finite_loss_keeps_the_last_good_state(results):
    r = results['non_finite_loss']
    model_dir = r['root'] / NAME / 'reward_model'
    assert state_files.train_state_steps(model_dir) == [1]  # after batch 0; batch 1 was never applied
    assert sorted(os.listdir(model_dir / 'train_state')) == ['state-1.json', 'state-1.safetensors']
    rm = rewards.RewardModelTrainer(trained_models.TrainedModel('test'))
    state = train_state.load_latest_train_state(str(model_dir), modules=dict(reward_model=rm),
                                                  optimizer=AdamTF(rm.parameters(), lr=1))
    assert state.step == 1 and all(torch.isfinite(p).all() for p in rm.parameters())


def test_full_disk_keeps_earlier_states(results):
    policy_dir = results['full_disk_during_save']['root'] / NAME / 'policy'
    # State 1 whole, no trace of state 2 (no temporary file).
    assert sorted(os.listdir(policy_dir / 'train_state')) == ['state-1.json', 'state-1.safetensors']
    assert state_files.choose_train_state(str(policy_dir))[0] == 1  # its checksums verify


@contextlib.contextmanager
def read_only(root):
    """`root` and everything under it read-only: by its mode, or, for root (whom modes do not stop), made
    immutable with chattr +i where the filesystem supports it."""
    paths = [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files] + [str(root)]
    modes = {p: os.stat(p).st_mode for p in paths}
    for p in paths:
        os.chmod(p, modes[p] & ~0o222)
    immutable = False
    try:
        if os.access(root, os.W_OK):
            immutable = subprocess.run(['chattr', '-R', '+i', str(root)], capture_output=True).returncode == 0
            if not immutable:
                pytest.skip('cannot make a directory read-only here (running as root, and chattr +i failed)')
        yield
    finally:
        if immutable:
            subprocess.run(['chattr', '-R', '-i', str(root)], check=True)
        for p in paths:
            os.chmod(p, modes[p])


@pytest.mark.parametrize('which', ['finished_run', 'new_run'])
def test_read_only_save_dir(results, tmp_path, which):
    """A save dir that cannot be written: refused in one line (no TensorBoard writer-thread traceback after
    it), and the run already in it left as it was."""
    root = tmp_path / 'save'
    if which == 'finished_run':
        shutil.copytree(results['malformed_label_json']['root'].parent / 'reward_done', root)
        args = reward_args(root)
        lock = root / NAME / '.lock'
    else:
        root.mkdir()
        write_labels(tmp_path / 'labels.json', 16)
        args = ['--labels.source', tmp_path / 'labels.json', *REWARD_ARGS]
        lock = root / NAME
    before = snapshot(root)
    with read_only(root):
        code, out, err = finish(launch_cli('train_reward', root, args))
    assert code == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f'error: cannot write the save dir {lock}: [Errno '), err
    assert lines[0].endswith('; choose another --save_dir'), err
    assert 'Traceback' not in err and snapshot(root) == before
