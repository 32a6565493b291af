"""sample.py: samples from a train_policy save dir of ours (command line, in a subprocess) and from an
original TF run dir (converted on the fly), and one-line errors for dirs it cannot use."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lm_human_preferences import train_policy

REPO_ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = '=' * 80


@pytest.fixture(scope='module')
def sample_cli():
    # The top-level script, under a name that cannot clash with lm_human_preferences.language.sample.
    spec = importlib.util.spec_from_file_location('sample_cli', REPO_ROOT / 'sample.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread start-up would dominate
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
    """A finished train_policy run of the `test` model, with its save dir."""
    save_dir = tmp_path_factory.mktemp('sample') / 'run'
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'task.query_prefix': 'a', 'rewards.trained_model': 'test',
        'ppo.batch_size': 8, 'ppo.noptepochs': 1, 'ppo.total_episodes': 8, 'run.save_dir': str(save_dir)})
    hparams.validate()
    train_policy.train(hparams)
    return save_dir


def parse_samples(out):
    """[(query, response)] from sample.py's output: each sample is a separator line, `query:    ` and its
    text, `response: ` and its text."""
    lines = out.splitlines()
    samples = [(lines[i + 1], lines[i + 2]) for i, line in enumerate(lines) if line == SEPARATOR]
    assert all(q.startswith('query:    ') and r.startswith('response: ') for q, r in samples), samples
    return [(q[len('query:    '):], r[len('response: '):]) for q, r in samples]


def run_sample(*args):
    return subprocess.run([sys.executable, str(REPO_ROOT / 'sample.py'), 'sample', *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_samples_from_our_save_dir(run_dir):
    proc = run_sample('--save_dir', str(run_dir), '--nsamples', '4', '--batch_size', '2', '--seed', '3',
                      '--temperature', '0.7')
    assert proc.returncode == 0, proc.stderr
    samples = parse_samples(proc.stdout)
    assert len(samples) == 4
    for query, response in samples:
        # The raw query (2 tokens of the test encoding; its padding decodes to ''), without the 'a'
        # prefix the policy sees, and 3 response tokens.
        assert 1 <= len(query) <= 2 and set(query) <= set('abcdefghijklmnopqrstuvwxyz.')
        assert len(response) == 3 and set(response) <= set('abcdefghijklmnopqrstuvwxyz.')


def test_sampling_is_seeded(run_dir, sample_cli, capsys):
    outs = []
    for _ in range(2):
        sample_cli.sample_policy(save_dir=str(run_dir), seed=5, batch_size=4, nsamples=8)
        out = capsys.readouterr().out
        outs.append(parse_samples(out))
    assert len(outs[0]) == 8 and outs[0] == outs[1]
    # One line says what is sampled (no HParams repr, no model hparams dump), then the samples.
    assert out.splitlines()[0] == (f'sample: 8 samples of {run_dir}/policy/checkpoints/model-1.safetensors at '
                                   f'temperature 1, seed 5, on queries from the test split of test')
    assert out.splitlines()[1] == SEPARATOR


def test_the_header_counts_whole_batches(run_dir, sample_cli, capsys):
    sample_cli.sample_policy(save_dir=str(run_dir), temperature=0.7, batch_size=4, nsamples=2)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f'sample: 4 samples (--nsamples 2 in whole batches of --batch_size 4) of '
                                   f'{run_dir}/policy/checkpoints/model-1.safetensors at temperature 0.7, seed '
                                   f'random, on queries from the test split of test')
    assert len(parse_samples(out)) == 4


@pytest.mark.slow
def test_missing_save_dir_is_one_line_error(tmp_path):
    missing = tmp_path / 'nope'
    proc = run_sample('--save_dir', str(missing), '--nsamples', '2')
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f'error: save dir {missing} does not exist']
    assert SEPARATOR not in proc.stdout


def test_other_errors_name_the_path(tmp_path, run_dir, sample_cli, capsys):
    def error(argv):
        with pytest.raises(SystemExit) as e:
            sample_cli.launch.main(sample_cli.COMMANDS, argv=['sample', *argv])
        assert e.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    assert str(tmp_path / 'train_policy_hparams.json') in error(['--save_dir', str(tmp_path)])
    assert 'needs --save_dir' in error([])
    (tmp_path / 'train_policy_hparams.json').write_text('{}')
    assert str(tmp_path / 'policy') in error(['--save_dir', str(tmp_path)])
    assert "invalid float 'hot'" in error(['--save_dir', str(run_dir), '--temperature', 'hot'])
    assert 'hold only the policy' in error(['--save_dir', str(run_dir), '--savescope', 'ref_policy'])
    # The folder that holds runs (launch.py's --save_dir): the error lists them and gives one's --save_dir.
    runs = run_dir.parent
    assert error(['--save_dir', str(runs)]).endswith(f'; it holds the runs run: --save_dir {run_dir}')
    with pytest.raises(SystemExit):
        sample_cli.launch.main(sample_cli.COMMANDS, argv=['best_of_n', '--save_dir', str(runs)])
    assert capsys.readouterr().err.strip().endswith(f'; it holds the runs run: --save_dir {run_dir}')


@pytest.mark.slow
def test_samples_from_an_original_tf_run_dir(tmp_path, sample_cli, capsys, monkeypatch):
    tf = pytest.importorskip('tensorflow', reason='needs tensorflow, the [tf] extra (pip install -e ".[tf]")')
    from conftest import expected_state, write_original_save_dirs
    # The original's train_policy save dir: policy/ (hparams.json, encoding, checkpoints/model.ckpt-7
    # holding policy, ref_policy and the score model) and train_policy_hparams.json with the
    # original's fields only.
    dirs = write_original_save_dirs(tf, str(tmp_path / 'save'), np.random.RandomState(0))
    original_hparams = dict(
        run=dict(seed=1, log_interval=10, save_interval=50, save_dir=str(tmp_path / 'save')),
        task=dict(query_length=2, query_dataset='test', query_prefix='', query_suffix='', start_text='.',
                  end_text=None, response_length=3, truncate_token=None, truncate_after=0,
                  penalty_reward_value=-1, policy=dict(temperature=0.7, initial_model='test')),
        rewards=dict(kl_coef=0.15, adaptive_kl=dict(target=6.0, horizon=10000), trained_model='/x/reward_model',
                     train_new_model=None),
        ppo=dict(total_episodes=8, batch_size=8, nminibatches=1, noptepochs=4, lr=1e-5, vf_coef=0.1, cliprange=0.2,
                 cliprange_value=0.2, gamma=1, lam=0.95, whiten_rewards=True))
    (tmp_path / 'save' / 'train_policy_hparams.json').write_text(json.dumps(original_hparams, indent=2))

    policies = []

    class RecordingPolicy(sample_cli.Policy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            policies.append(self)
    monkeypatch.setattr(sample_cli, 'Policy', RecordingPolicy)

    for scope in ('policy', 'ref_policy'):
        sample_cli.launch.main(sample_cli.COMMANDS, argv=[
            'sample', '--save_dir', str(tmp_path / 'save'), '--nsamples', '2', '--batch_size', '2',
            '--savescope', scope])
        assert len(parse_samples(capsys.readouterr().out)) == 2
        # The scope's weights were loaded (converted from the TF checkpoint).
        state = {k: v.numpy() for k, v in policies[-1].state_dict().items()}
        expected = expected_state(dirs[scope], scope)
        assert sorted(state) == sorted(expected)
        for k, v in expected.items():
            np.testing.assert_array_equal(state[k], v, err_msg=k)


def test_best_of_n_refuses_what_it_cannot_use(tmp_path, run_dir, sample_cli):
    # One line each, before any model is loaded: no run, a bad count, a run that is not an offline experiment's.
    with pytest.raises(sample_cli.launch.ConfigError, match=r'^best_of_n needs --save_dir DIR, a train_policy save '
                                                            r'dir; .*nowhere has no train_policy_hparams.json$'):
        sample_cli.COMMANDS["best_of_n"](save_dir=str(tmp_path / 'nowhere'))
    for n in (0, 2.5):
        with pytest.raises(sample_cli.launch.ConfigError, match=rf'^best_of_n: --n is {n}; it must be a whole number at least 1$'):
            sample_cli.COMMANDS["best_of_n"](save_dir=str(run_dir), n=n)
    with pytest.raises(sample_cli.launch.ConfigError, match=r"^best_of_n is for the offline experiments \(demo, "
                                                            r"sentiment_mini\), .* task.query_dataset 'test'$"):
        sample_cli.COMMANDS["best_of_n"](save_dir=str(run_dir))
