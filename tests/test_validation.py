"""Bad hyperparameters and options, checked at launch: each ends with exit code 2 and one line naming the
hparam (or option) and what is allowed, before any worker starts or any model is built, and a save dir
already there is left as it was. (Bad files and runs that fail later: tests/test_bad_inputs.py.)"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_human_preferences.language import datasets
from lm_human_preferences.training import run_checks
from lm_human_preferences.utils import launch
from conftest import env

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import launch as top_launch  # noqa: E402  (the top-level launch.py)
import sample as top_sample  # noqa: E402  (the top-level sample.py)

COMMANDS = dict(train_reward=top_launch.launch_train_reward, train_policy=top_launch.launch_train_policy)

# The test experiment has no adaptive KL controller: these turn it on with a target that works.
ADAPTIVE_KL = ['--rewards.adaptive_kl', 'on', '--rewards.adaptive_kl.target', '6']

CASES = [
    # command, extra argv, the error line after 'error: x: '
    ('train_reward', ['--batch_size', '-8'], "hyperparameter 'batch_size' is -8: it must be at least 1"),
    ('train_reward', ['--rollout_batch_size', '0'], "hyperparameter 'rollout_batch_size' is 0: it must be at least 1"),
    ('train_reward', ['--labels.num_train', '0'], "hyperparameter 'labels.num_train' is 0: it must be at least 1"),
    ('train_reward', ['--labels.num_train', '12'],
     "hyperparameter 'labels.num_train' is 12: it must be a multiple of batch_size 8 (one epoch of whole minibatches)"),
    ('train_reward', ['--normalize_samples', '-1'], "hyperparameter 'normalize_samples' is -1: it must be at least 0"),
    ('train_reward', ['--lr', 'nan'], "hyperparameter 'lr' is nan: it must be a positive number"),
    ('train_reward', ['--lr', '0'], "hyperparameter 'lr' is 0.0: it must be a positive number"),
    ('train_reward', ['--labels.type', 'best_of_x'],
     "hyperparameter 'labels.type': unknown label type 'best_of_x': expected best_of_<N> (N >= 2), scalar_rating or "
     "scalar_compare"),
    ('train_reward', ['--mpi', '3'], "hyperparameter 'batch_size' is 8: each of the --mpi 3 ranks takes an equal "
                                     "share: choose a multiple of 3 (or another --mpi)"),
    ('train_reward', ['--run.microbatch_size', '2'],
     'run.microbatch_size 2 is smaller than the 4 sequences of one best_of_4 label (its query with each sample), '
     'which the reward model scores in one pass: use at least 4'),
    # numpy's seeds are 0 .. 2**32 - 1 and rank r's is seed + 100003 * r (numpy's own message named no option)
    ('train_policy', ['--run.seed', '-1'], "hyperparameter 'run.seed' is -1: it must be from 0 to 4294967295: rank r "
                                           "seeds numpy (0 to 2**32 - 1) with seed + 100003 * r; unset: fresh entropy"),
    ('train_policy', ['--run.seed', '4294967295', '--mpi', '4'],
     "hyperparameter 'run.seed' is 4294967295: it must be from 0 to 4294667286 with --mpi 4: rank r seeds numpy (0 "
     "to 2**32 - 1) with seed + 100003 * r; unset: fresh entropy"),
    ('train_reward', ['--run.seed', '4294967295', '--mpi', '2'],
     "hyperparameter 'run.seed' is 4294967295: it must be from 0 to 4294867292 with --mpi 2: rank r seeds numpy (0 "
     "to 2**32 - 1) with seed + 100003 * r; unset: fresh entropy"),
    ('train_policy', ['--ppo.batch_size', '0'], "hyperparameter 'ppo.batch_size' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.nminibatches', '0'], "hyperparameter 'ppo.nminibatches' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.noptepochs', '-2'], "hyperparameter 'ppo.noptepochs' is -2: it must be at least 1"),
    ('train_policy', ['--ppo.total_episodes', '0'], "hyperparameter 'ppo.total_episodes' is 0: it must be at least 1"),
    ('train_policy', ['--ppo.lr', 'inf'], "hyperparameter 'ppo.lr' is inf: it must be a positive number"),
    ('train_policy', ['--task.policy.temperature', '0'],
     "hyperparameter 'task.policy.temperature' is 0.0: it must be a positive number"),
    ('train_policy', ['--task.query_length', '0'], "hyperparameter 'task.query_length' is 0: it must be at least 1"),
    ('train_policy', ['--task.response_length', '-3'], "hyperparameter 'task.response_length' is -3: it must be at least 1"),
    ('train_policy', ['--task.query_length', '6'],  # the test model's n_ctx is 8
     "hyperparameters 'task.query_length' + 'task.response_length' are 6 + 3 = 9 positions: the model test has "
     "n_ctx 8, their sum must be at most 8"),
    ('train_policy', ['--task.response_length', '100000'],  # once named only task.query_length
     "hyperparameters 'task.query_length' + 'task.response_length' are 2 + 100000 = 100002 positions: the model "
     "test has n_ctx 8, their sum must be at most 8"),
    ('train_policy', ['--rewards.train_new_model.task.response_length', '7'],
     "hyperparameters 'rewards.train_new_model.task.query_length' + 'rewards.train_new_model.task.response_length' "
     "are 2 + 7 = 9 positions: the model test has n_ctx 8, their sum must be at most 8"),
    # The PPO and KL floats (once unchecked: -1 ran, nan and inf failed after the reward model had trained).
    ('train_policy', ['--rewards.kl_coef', '-1'],
     "hyperparameter 'rewards.kl_coef' is -1.0: it must be a number at least 0 (0: no KL penalty)"),
    ('train_policy', ['--rewards.kl_coef', 'nan'],
     "hyperparameter 'rewards.kl_coef' is nan: it must be a number at least 0 (0: no KL penalty)"),
    ('train_policy', ['--rewards.kl_coef', 'inf'],
     "hyperparameter 'rewards.kl_coef' is inf: it must be a number at least 0 (0: no KL penalty)"),
    ('train_policy', [*ADAPTIVE_KL, '--rewards.kl_coef', '0'],
     "hyperparameter 'rewards.kl_coef' is 0.0: it must be a positive number with rewards.adaptive_kl on (the "
     "controller only multiplies it: 0 stays 0)"),
    ('train_policy', ['--rewards.adaptive_kl', 'on', '--rewards.adaptive_kl.target', '0'],
     "hyperparameter 'rewards.adaptive_kl.target' is 0.0: it must be a positive number (the KL the controller aims "
     "at)"),
    ('train_policy', ['--rewards.adaptive_kl', 'on', '--rewards.adaptive_kl.target', 'nan'],
     "hyperparameter 'rewards.adaptive_kl.target' is nan: it must be a positive number (the KL the controller aims "
     "at)"),
    ('train_policy', [*ADAPTIVE_KL, '--rewards.adaptive_kl.horizon', '0'],
     "hyperparameter 'rewards.adaptive_kl.horizon' is 0: it must be at least 1"),
    ('train_policy', [*ADAPTIVE_KL, '--rewards.adaptive_kl.horizon', '6'],  # 1 - 0.2 * 32 / 6 < 0
     "hyperparameter 'rewards.adaptive_kl.horizon' is 6: it must be more than ppo.batch_size 32 / 5 (each batch "
     "the controller multiplies rewards.kl_coef by down to 1 - 0.2 * batch_size / horizon, which must stay "
     "positive)"),
    ('train_policy', ['--ppo.cliprange', '-1'], "hyperparameter 'ppo.cliprange' is -1.0: it must be a positive number"),
    ('train_policy', ['--ppo.cliprange', '0'], "hyperparameter 'ppo.cliprange' is 0.0: it must be a positive number"),
    ('train_policy', ['--ppo.cliprange_value', 'inf'],
     "hyperparameter 'ppo.cliprange_value' is inf: it must be a positive number"),
    ('train_policy', ['--ppo.vf_coef', '-0.1'], "hyperparameter 'ppo.vf_coef' is -0.1: it must be a number at least 0"),
    ('train_policy', ['--ppo.vf_coef', 'nan'], "hyperparameter 'ppo.vf_coef' is nan: it must be a number at least 0"),
    ('train_policy', ['--ppo.gamma', 'nan'], "hyperparameter 'ppo.gamma' is nan: it must be a number from 0 to 1"),
    ('train_policy', ['--ppo.gamma', '1.01'], "hyperparameter 'ppo.gamma' is 1.01: it must be a number from 0 to 1"),
    ('train_policy', ['--ppo.lam', '2'], "hyperparameter 'ppo.lam' is 2.0: it must be a number from 0 to 1"),
    ('train_policy', ['--ppo.lam', '-0.5'], "hyperparameter 'ppo.lam' is -0.5: it must be a number from 0 to 1"),
    ('train_policy', ['--task.query_dataset', 'nope'],
     # {registered}: the datasets registered when the check runs (the demo registers 'demo' on import).
     "hyperparameter 'task.query_dataset' is 'nope': choose from {registered}, or local:<directory of .txt files>"),
    ('train_policy', ['--task.query_dataset', 'local:/nonexistent/corpus'],
     "hyperparameter 'task.query_dataset' is 'local:/nonexistent/corpus': /nonexistent/corpus is not a directory"),
    ('train_policy', ['--run.save_interval', '0'], "hyperparameter 'run.save_interval' is 0: it must be at least 1"),
    ('train_policy', ['--run.log_interval', '-1'], "hyperparameter 'run.log_interval' is -1: it must be at least 1"),
    ('train_policy', ['--run.keep_checkpoints', '0'], "hyperparameter 'run.keep_checkpoints' is 0: it must be at least 1"),
    ('train_policy', ['--mpi', '3'],
     "hyperparameter 'ppo.batch_size' is 32: each of the --mpi 3 ranks takes an equal share of each of the "
     "ppo.nminibatches 1 minibatches: choose a multiple of 3 (or another --mpi)"),
    ('train_policy', ['--mpi', '8'],
     'Per-rank minibatch size 4 is insufficient for whitening (ppo.batch_size / (ppo.nminibatches * --mpi 8 ranks) '
     'must be >= 8): use --ppo.batch_size 64 or more, --mpi 4, or --ppo.whiten_rewards false'),
    ('train_policy', ['--mpi', '-1'], '--mpi -1: the number of ranks must be at least 1'),
    ('train_policy', ['--mpi', '8', '--procs', '3'],
     '--procs 3 must divide --mpi 8 (each process carries the same number of ranks): choose --procs from [1, 2, 4, 8]'),
    ('train_policy', ['--rewards.train_new_model.labels.type', 'pairs'],
     "hyperparameter 'rewards.train_new_model.labels.type': unknown label type 'pairs': expected best_of_<N> (N >= 2), "
     "scalar_rating or scalar_compare"),
    # A starting model that is none of the kinds accepted: one line before any download, listing them.
    ('train_policy', ['--task.policy.initial_model', 'gpt 2'],
     "hyperparameter 'task.policy.initial_model': model 'gpt 2' is none of: 124M, 355M, 774M, 1558M (OpenAI's "
     "GPT-2, downloaded), test, a model dir (ours, or an original TF one, or its https URL), a Hugging Face GPT-2 "
     "folder or hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2 or owner/name, e.g. "
     "openai-community/gpt2)"),
    # A name without an owner that is no GPT-2 on the hub: a typo, one line at launch (it once passed --dry_run
    # and failed after the launch as a hub download).
    ('train_policy', ['--task.policy.initial_model', '125M'],
     "hyperparameter 'task.policy.initial_model': model '125M' is none of: 124M, 355M, 774M, 1558M (OpenAI's "
     "GPT-2, downloaded), test, a model dir (ours, or an original TF one, or its https URL), a Hugging Face GPT-2 "
     "folder or hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2 or owner/name, e.g. "
     "openai-community/gpt2)"),
    ('train_policy', ['--task.policy.initial_model', '/no/such/model'],
     "hyperparameter 'task.policy.initial_model': model directory /no/such/model does not exist"),
    # The reward model trained first must learn on the policy's task: a real mismatch is one line (it once ran
    # the launch, then stopped with two 300-character reprs).
    ('train_policy', ['--rewards.train_new_model.task.policy.temperature', '0.5'],
     "hyperparameter 'rewards.train_new_model.task.policy.temperature' is 0.5 but 'task.policy.temperature' is 1.0: "
     "the reward model is trained on the policy's task, they must be equal (--task.policy.temperature alone sets both)"),
    ('train_policy', ['--task.query_length', '4', '--rewards.train_new_model.task.query_length', '3',
                      '--rewards.train_new_model.task.start_text', 'a'],
     "hyperparameter 'rewards.train_new_model.task.query_length' is 3 but 'task.query_length' is 4: the reward "
     "model is trained on the policy's task, they must be equal (--task.query_length alone sets both) "
     "(also differing: start_text)"),
]


def snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest()
            for d, _, names in os.walk(root) for f in names}


@pytest.fixture
def save_dir_with_files(tmp_path):
    """A save dir as a run leaves it (the checks must not touch it)."""
    run = tmp_path / 'x'
    (run / 'policy' / 'checkpoints').mkdir(parents=True)
    (run / 'policy' / 'checkpoints' / 'model-3.safetensors').write_bytes(os.urandom(64))
    (run / 'train_policy_hparams.json').write_text('{}')
    return tmp_path


@pytest.mark.parametrize('command, argv, message', CASES, ids=[f'{c}{"".join(a)}' for c, a, _ in CASES])
def test_bad_hparams_are_one_line_at_launch(command, argv, message, save_dir_with_files, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(launch, 'launch', lambda *a, **k: built.append(a))  # nothing may start
    before = snapshot(save_dir_with_files)
    with pytest.raises(SystemExit) as e:
        launch.main(COMMANDS, argv=[command, 'test', 'x', *argv, '--save_dir', str(save_dir_with_files)])
    assert e.value.code == 2
    registered = ', '.join(sorted(datasets._registry))
    assert {'books', 'cnndm', 'test', 'tldr'} <= set(datasets._registry)
    assert capsys.readouterr().err == f'error: x: {message.replace("{registered}", registered)}\n'
    assert not built and snapshot(save_dir_with_files) == before


@pytest.mark.parametrize('argv', [
    # The ends of each allowed range still run.
    ['--rewards.kl_coef', '0', '--ppo.vf_coef', '0', '--ppo.gamma', '0', '--ppo.lam', '1'],
    ['--ppo.gamma', '1', '--ppo.lam', '0', '--ppo.cliprange', '1e-3', '--ppo.cliprange_value', '100'],
    [*ADAPTIVE_KL, '--rewards.kl_coef', '1e-3', '--rewards.adaptive_kl.horizon', '7'],  # 7 > 32 / 5
    ['--task.query_length', '5'],  # 5 + 3 = 8 = n_ctx
    # Each fix the whitening error for --mpi 8 suggests (above) runs.
    ['--mpi', '8', '--ppo.batch_size', '64'], ['--mpi', '4'], ['--mpi', '8', '--ppo.whiten_rewards', 'false'],
    ['--run.seed', '0'], ['--run.seed', '4294667286', '--mpi', '4'],  # the seeds of the last rank: 2**32 - 1
])
def test_hparams_at_the_edges_are_accepted(argv, tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(launch, 'launch', lambda *a, **k: built.append(a))
    launch.main(COMMANDS, argv=['train_policy', 'test', 'x', *argv, '--save_dir', str(tmp_path)])
    assert capsys.readouterr().err == '' and len(built) == 1


@pytest.fixture
def test_model_dir(tmp_path):
    """One of our model dirs: the test model's shape with n_ctx 16 (the test model's is 8)."""
    from lm_human_preferences.language import checkpoints, encodings, model, trained_models
    hparams = trained_models.test_hparams()
    hparams.n_ctx = 16
    checkpoints.save_checkpoint(str(tmp_path / 'model'), 0, model.Model(hparams), hparams=hparams,
                                encoding=encodings.Test)
    return tmp_path / 'model'


@pytest.mark.parametrize('argv, field, value', [
    (['--task.policy.temperature', '0.7'], 'policy.temperature', 0.7),
    (['--task.query_length', '3'], 'query_length', 3),
    (['--task.policy.initial_model', 'MODEL_DIR', '--task.query_length', '12'], 'policy.initial_model', 'MODEL_DIR'),
])
def test_task_overrides_apply_to_both_phases(argv, field, value, test_model_dir, tmp_path, capsys, monkeypatch):
    """`--task.X` on train_policy sets the task of the reward model trained first too, as the experiments bind
    it for both (all three once failed in train: 'rewards.train_new_model.task must equal task: ...')."""
    built = []
    monkeypatch.setattr(launch, 'launch', lambda name, f, **k: built.append(f.args[0]))
    argv = [str(test_model_dir) if a == 'MODEL_DIR' else a for a in argv]
    value = str(test_model_dir) if value == 'MODEL_DIR' else value
    launch.main(COMMANDS, argv=['train_policy', 'test', 'x', *argv, '--save_dir', str(tmp_path)])
    assert capsys.readouterr().err == ''
    hparams, = built
    policy_task, reward_task = hparams.task.to_nested_dict(), hparams.rewards.train_new_model.task.to_nested_dict()
    assert policy_task == reward_task
    *groups, leaf = field.split('.')
    for g in groups:
        policy_task = policy_task[g]
    assert policy_task[leaf] == value
    run_checks.check_reward_task(hparams)  # what train() checks first

    # Not with the reward model trained elsewhere: then there is no second task to set.
    built.clear()
    launch.main(COMMANDS, argv=['train_policy', 'test', 'y', *argv, '--rewards.train_new_model', 'off',
                                '--rewards.trained_model', 'test', '--save_dir', str(tmp_path)])
    assert built[0].rewards.train_new_model is None and capsys.readouterr().err == ''


def test_dry_run_shows_both_phases_save_dirs_ranks_and_one_binding_per_line(tmp_path, capsys):
    launch.main(COMMANDS, argv=['train_policy', 'test', 'x', '--task.policy.temperature', '0.7', '--dry_run',
                                '--save_dir', str(tmp_path), '--mpi', '2', '--ppo.batch_size', '64'])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == 'x: 2 ranks (--mpi 2) in 1 process (--procs 1); --dry_run: nothing runs'
    assert lines[1:5] == ['save dirs, and what the trainer derives from them:',
                          f'  rewards.train_new_model.run.save_dir: {tmp_path / "x"}',
                          f'  rewards.trained_model: {tmp_path / "x" / "reward_model"}',
                          f'  run.save_dir: {tmp_path / "x"}']
    for line in ["  task.policy.temperature: 0.7  # command line",
                 "  rewards.train_new_model.task.policy.temperature: 0.7  # command line",
                 "  ppo.batch_size: 64  # command line", "  ppo.noptepochs: 1  # experiment",
                 "  task.query_dataset: 'test'  # experiment", "  ppo.lr: 5e-06", "  rewards.adaptive_kl: None"]:
        assert line in lines
    # one binding per line (the bindings' dict was one line of 1,494); the save dirs are as long as tmp_path
    assert max(len(line.replace(str(tmp_path), '<tmp>')) for line in lines) < 120
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_task_override_runs_through_both_phases(tmp_path):
    """The issue's first command: exit 0, and both phases saved the overridden task."""
    import json
    proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'qd', '--task.policy.temperature', '0.7',
                           '--save_dir', str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, env=env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    saved = {kind: json.loads((tmp_path / 'qd' / f'{kind}_hparams.json').read_text())
             for kind in ('train_policy', 'train_reward')}
    assert saved['train_policy']['task']['policy']['temperature'] == 0.7
    assert saved['train_reward']['task'] == saved['train_policy']['task']


@pytest.mark.parametrize('command', sorted(COMMANDS))
@pytest.mark.parametrize('name', ['', '.', '..', '../../etc', 'a/b', '/abs', 'x/', 'a\0b'])
def test_run_names_that_are_not_one_directory_are_refused(command, name, save_dir_with_files, capsys, monkeypatch):
    """NAME is a directory under --save_dir: '' once wrote into the save dir itself, '../../etc' outside it
    (both ran with --dry_run and exit 0)."""
    built = []
    monkeypatch.setattr(launch, 'launch', lambda *a, **k: built.append(a))
    before = snapshot(save_dir_with_files)
    with pytest.raises(SystemExit) as e:
        launch.main(COMMANDS, argv=[command, 'test', name, '--dry_run', '--save_dir', str(save_dir_with_files)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"error: run name {name!r}: it must be a plain directory name (no '/', not '.' or '..', "
                   f"not empty)\n")
    assert len(err.splitlines()) == 1
    assert not built and snapshot(save_dir_with_files) == before


@pytest.mark.parametrize('argv, message', [
    (['--batch_size', '0'], '--batch_size 0: it must be at least 1'),
    (['--nsamples', '-4'], '--nsamples -4: it must be at least 0 (0: sample forever)'),
    (['--temperature', '0'], '--temperature 0.0: it must be a positive number'),
    (['--temperature', 'nan'], '--temperature nan: it must be a positive number'),
    (['--mpi', '0'], 'sample: --mpi 0: the number of ranks must be at least 1'),
])
def test_bad_sample_options_are_one_line(argv, message, tmp_path, capsys):
    save_dir = tmp_path / 'run'
    (save_dir / 'policy').mkdir(parents=True)
    (save_dir / 'train_policy_hparams.json').write_text('{}')
    with pytest.raises(SystemExit) as e:
        launch.main(top_sample.COMMANDS, argv=['sample', '--save_dir', str(save_dir), *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err == f'error: {message}\n'


@pytest.mark.slow
@pytest.mark.parametrize('argv, start', [
    (['train_reward', 'test', 'x', '--batch_size', '-8'], 'error: x: '),
    (['train_policy', 'test', 'x', '--mpi', '-1'], 'error: x: '),
    (['train_policy', 'test', 'x', '--ppo.cliprange', '-1'], "error: x: hyperparameter 'ppo.cliprange' is -1.0"),
    (['train_reward', 'test', '../../etc', '--dry_run'], "error: run name '../../etc': "),
])
def test_exit_codes_of_a_real_process(argv, start, tmp_path):
    """All once exited 0: the first two trained nothing (`--batch_size -8` even saved its untrained model as
    done), the third trained with a negative clip range, the last wrote outside --save_dir."""
    proc = subprocess.run([sys.executable, 'launch.py', *argv, '--save_dir', str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(start)
    assert not list(tmp_path.iterdir())


def test_train_policy_alone_refuses_the_online_loops_rounds():
    """online.retrains is the online loop's to run (a callback on train_policy's loop, added by online/loop.train):
    train_policy.train without it refuses before any work, rather than train without the rounds."""
    from lm_human_preferences import train_policy
    hparams = train_policy.HParams()
    hparams.online.retrains = 2
    with pytest.raises(ValueError, match=r'^online.retrains 2: the online loop runs them as its callback '
                                         r'\(online/loop.train, which launch.py runs\), not train_policy.train alone$'):
        train_policy.train(hparams)
