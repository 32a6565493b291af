"""Tests for utils/launch.py and the top-level launch.py: experiments, command line, worker groups.

The 2-process tests also cover the multi-process side of utils/distributed.py's collectives and
utils/gcs.py's rank-0-downloads rule.
"""
import atexit
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lm_human_preferences.utils import core, distributed, gcs, hyperparams, launch, ranks, workers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import launch as top_launch  # noqa: E402  (the top-level launch.py)


# ---- a small stand-in for the trainers' HParams ----

@dataclass
class RunHParams(hyperparams.HParams):
    seed: Optional[int] = None
    save_dir: Optional[str] = None


@dataclass
class KL(hyperparams.HParams):
    target: float = None


@dataclass
class ToyHParams(hyperparams.HParams):
    run: RunHParams = field(default_factory=RunHParams)
    lr: float = None
    batch_size: int = 8
    adaptive_kl: Optional[KL] = None

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        core.exact_div(64, self.batch_size)


def _record(out_path, hparams):
    with open(out_path, 'a') as f:
        f.write(json.dumps(hparams.to_nested_dict()) + '\n')


def test_launch_trials_in_process(tmp_path, capsys):
    from lm_human_preferences.utils.combos import bind, combos, options_vardesc
    trials = combos(bind('lr', 1e-3), bind('adaptive_kl', 'on'), bind('adaptive_kl.target', 6.0),
                    options_vardesc('batch_size', [4, 16]))
    out = tmp_path / 'calls.jsonl'
    launch.launch_trials('exp', partial(_record, str(out)), trials, ToyHParams,
                         extra_hparams={'lr': '5e-4', 'run.seed': '3'}, save_dir=str(tmp_path / 'save'))
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c['batch_size'] for c in calls] == [4, 16]
    assert all(c['lr'] == 5e-4 and c['run']['seed'] == 3 and c['adaptive_kl'] == {'target': 6.0} for c in calls)
    # <save_dir>/<job_name>, the job name joining the descriptors, as the original.
    assert [c['run']['save_dir'] for c in calls] == [str(tmp_path / 'save' / 'exp' / 'batch_size4'),
                                                     str(tmp_path / 'save' / 'exp' / 'batch_size16')]

    launch.launch_trials('exp', partial(_record, str(tmp_path / 'none.jsonl')), trials, ToyHParams, dry_run=True)
    assert not (tmp_path / 'none.jsonl').exists()
    printed = capsys.readouterr().out
    assert 'exp/batch_size16: 1 rank (--mpi 1) in 1 process (--procs 1)' in printed
    assert '\n  lr: 0.001  # experiment\n' in printed and '\n  batch_size: 16  # experiment\n' in printed


def test_launch_trials_config_errors():
    from lm_human_preferences.utils.combos import bind, combos
    run = partial(launch.launch_trials, 'e', lambda hp: None, hparam_class=ToyHParams)
    with pytest.raises(launch.ConfigError, match="'lrr'.*closest valid keys: lr"):
        run(combos(bind('lr', 1.0)), extra_hparams={'lrr': '1'})
    with pytest.raises(launch.ConfigError, match="'batch_size'.*'big'"):
        run(combos(bind('lr', 1.0)), extra_hparams={'batch_size': 'big'})
    with pytest.raises(launch.ConfigError, match="missing mandatory value for hyperparameter 'lr'"):
        run(combos(bind('batch_size', 4)))
    with pytest.raises(launch.ConfigError, match='Inexact division'):  # a subclass validate() failing
        run(combos(bind('lr', 1.0), bind('batch_size', 5)))


def _command(exp, name, dry_run=False, mpi=None, save_dir='/unused', **extra_hparams):
    """A stand-in for launch.py's commands, on ToyHParams."""
    from lm_human_preferences.utils.combos import bind, combos
    trials = {'toy': combos(bind('lr', 1.0))}
    if exp not in trials:
        raise launch.ConfigError(f"Couldn't find experiment '{exp}'")
    launch.launch_trials(name, lambda hp: print('RAN', hp.lr, hp.batch_size, hp.run.save_dir), trials[exp],
                         ToyHParams, extra_hparams=extra_hparams, dry_run=dry_run, mpi=mpi or 1, save_dir=save_dir)


def _main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main({'cmd': _command}, argv=argv)
        sys.exit(0)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_main_parses_options_and_hparams(capsys):
    code, out, err = _main(['cmd', 'toy', 'n', '--batch_size', '16', '--lr=0.5', '--save_dir', '/s'], capsys)
    assert code == 0 and 'RAN 0.5 16 /s/n' in out, err
    code, out, err = _main(['cmd', 'toy', 'n', '--dry_run', '--run.seed', '4'], capsys)
    assert code == 0 and 'RAN' not in out and '\n  run.seed: 4  # command line\n' in out
    code, out, err = _main(['cmd', 'toy', 'n', '--dry_run=false', '--mpi', '1'], capsys)
    assert code == 0 and 'RAN' in out


@pytest.mark.parametrize('argv, message', [
    (['cmd', 'toy', 'n', '--lrr', '1'], "error: n: unknown hyperparameter 'lrr'"),
    (['cmd', 'toy', 'n', '--batch_size', 'x'], "error: n: bad value for hyperparameter 'batch_size': 'x'"),
    (['cmd', 'nope', 'n'], "error: Couldn't find experiment 'nope'"),
    (['bogus', 'toy', 'n'], "error: unknown command 'bogus' (choose from: cmd, fail)"),
    (['cmd', 'toy'], 'error: cmd takes 2 arguments (EXP NAME), got 1: toy'),
    (['cmd', 'toy', 'n', '--lr'], 'error: option --lr needs a value'),
    (['cmd', 'toy', 'n', '--mpi', 'two'], "error: option --mpi: invalid int 'two'"),
    (['cmd', 'toy', 'n', '--lr', '1', '--lr', '2'], 'error: option --lr given twice'),
    (['fail', 'e', 'n', '--lr', '1'], 'error: fail has no option --lr'),
])
def test_main_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main({'cmd': _command, 'fail': _failing_command}, argv=argv)
    code, err = e.value.code, capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count('\n') == 1, err
    assert 'Traceback' not in err


def _main_exit(commands, argv, capsys):
    """(exit code, stdout, stderr) of launch.main on argv (None: it returned)."""
    try:
        launch.main(commands, argv=argv)
        code = None
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_on_every_command_and_sub_command(capsys, monkeypatch):
    """--help (and -h) on both scripts and each of their commands: usage, what it does, its options,
    and for the trainers their experiments and most used hparams; nothing runs, nothing on stderr."""
    import sample as top_sample
    trainers = dict(train_policy=top_launch.launch_train_policy, train_reward=top_launch.launch_train_reward)
    for commands, program in ((trainers, 'launch.py'), (top_sample.COMMANDS, 'sample.py')):
        monkeypatch.setattr(sys, 'argv', [program])  # the usage names the script that runs
        for argv in (['--help'], ['-h'], []):
            code, out, err = _main_exit(commands, argv, capsys)
            assert code in ((None, 0) if argv else (2,)) and not err, (argv, code, err)  # no command: exit 2
            for name in commands:
                assert f'usage: {program} {name} ' in out
        for name in commands:
            for flag in ('--help', '-h'):
                code, out, err = _main_exit(commands, [name, flag], capsys)
                assert code in (None, 0) and not err, (name, err)
                assert out.startswith(f'usage: {program} {name} ') and '\noptions:\n' in out, out
                assert commands[name].__doc__.split()[0] in out  # its description
        if program == 'launch.py':
            code, out, _ = _main_exit(commands, ['train_policy', 'sentiment', 'x', '--help'], capsys)
            for exp in ('sentiment', 'descriptiveness', 'cnndm', 'tldr', 'test', 'demo', 'sentiment_mini'):
                assert f'\n  {exp} ' in out
            assert '--mpi 8: books queries (64+24 tokens), model 124M' in out
            assert 'most used hparams' in out and '--run.microbatch_size' in out and '--ppo.lr' in out


def test_the_command_line_describes_itself_without_torch():
    """`launch.py --help` and each command's --help import no torch (it is imported when a command runs): not the
    launcher's bindings (demo/, sentiment_mini/ keep their experiments for when they are asked for), not the
    commands' descriptions. Imported, torch alone took seconds of a 2-core CPU's start-up."""
    script = textwrap.dedent("""
        import runpy, sys
        for argv in (['--help'], ['train_policy', '--help'], ['train_reward', '--help'], ['label', '--help']):
            sys.argv = ['launch.py', *argv]
            try:
                runpy.run_path('launch.py', run_name='__main__')
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        print('modules:', ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))))
    """)
    proc = subprocess.run([sys.executable, '-c', script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and 'usage: launch.py train_policy EXP NAME' in proc.stdout, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == 'modules: ', proc.stdout.splitlines()[-1][:300]


def test_help_says_what_an_unset_option_means(capsys, monkeypatch):
    """An option whose default is None says what happens when it is left out, or that it is required
    (in the usage line too: no brackets); none says '(set by the command)'."""
    import sample as top_sample
    trainers = dict(train_policy=top_launch.launch_train_policy, train_reward=top_launch.launch_train_reward)
    for commands, program in ((trainers, 'launch.py'), (top_sample.COMMANDS, 'sample.py')):
        monkeypatch.setattr(sys, 'argv', [program])
        for name, command in commands.items():
            unset = [p.name for p in inspect.signature(command).parameters.values() if p.default is None]
            assert sorted(command.option_help) == sorted(unset), name  # each one described, no other
    out = {name: _main_exit(commands, [name, '--help'], capsys)[1] for commands in (trainers, top_sample.COMMANDS)
           for name in commands}
    assert not any('set by the command' in text for text in out.values())
    assert out['sample'].startswith('usage: sample.py sample --save_dir SAVE_DIR [--savescope SAVESCOPE] ')
    assert '\n  --save_dir (required)\n' in out['sample'] and '\n  --seed (random)\n' in out['sample']
    assert out['export'].startswith('usage: sample.py export --save_dir SAVE_DIR --out OUT [--savescope SAVESCOPE]')
    assert "\n  --mpi (the experiment's: 1 for test, demo, sentiment_mini, 8 for the paper's)\n" in out['train_policy']
    assert '\n  --procs (one per GPU, at most --mpi and a divisor of it; 1 on a CPU;' in out['train_reward']
    # A switch reads as one, not as an option taking False.
    assert '\n  --dry_run (a switch: on when given)\n' in out['train_policy'] and 'False' not in out['train_policy']


# ---- the real experiments ----

def _bindings(trials):
    assert len(trials) == 1
    return {k: v for k, v, _ in trials[0] if k is not None}


def test_experiments():
    reward = top_launch.get_train_reward_experiments()
    policy = top_launch.get_experiments()
    paper = {'sentiment', 'descriptiveness', 'cnndm', 'tldr'}
    assert paper <= set(reward) and set(reward) == set(policy)
    for exp in paper:
        r, p = _bindings(reward[exp]), _bindings(policy[exp])
        assert r['labels.type'] == 'best_of_4' and r['run.seed'] == 1
        assert r['labels.source'].startswith('https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/')
        # The policy experiment trains its reward model with the reward experiment of the same name.
        assert p['rewards.train_new_model'] == 'on'
        assert {k[len('rewards.train_new_model.'):]: v for k, v in p.items()
                if k.startswith('rewards.train_new_model.')} == r
        assert not any(k == 'rewards.whiten' for k in p)
    assert _bindings(policy['cnndm'])['ppo.whiten_rewards'] is False  # the fixed 'rewards.whiten'
    assert _bindings(policy['tldr'])['ppo.whiten_rewards'] is False
    assert 'ppo.whiten_rewards' not in _bindings(policy['sentiment'])
    s = _bindings(policy['sentiment'])
    assert (s['rewards.adaptive_kl'], s['rewards.adaptive_kl.target'], s['ppo.lr']) == ('on', 6.0, 1e-5)
    assert _bindings(reward['cnndm'])['labels.num_train'] == 46_000


def _run_launch_py(*args):
    return subprocess.Popen([sys.executable, 'launch.py', *args], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_unknown_experiment_via_command_line():
    p = _run_launch_py('train_reward', 'nosuch', 'x', '--dry_run')
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert err.startswith("error: Couldn't find experiment 'nosuch' for train_reward (choose from: sentiment, "
                          "descriptiveness, cnndm, tldr") and err.count('\n') == 1


def test_output_piped_into_a_reader_that_stops_early_is_no_error(tmp_path):
    """`--dry_run | head -3`: the pipe closes after 3 lines; no `error: [Errno 32] Broken pipe` follows."""
    p = subprocess.Popen([sys.executable, 'launch.py', 'train_policy', 'test', 'x', '--dry_run', '--save_dir',
                          str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # as `head` does once it has its lines, here before the command has written any
    err = p.stderr.read()
    p.wait(timeout=60)
    assert 'error' not in err and 'Traceback' not in err, err


@pytest.mark.slow
@pytest.mark.parametrize('command', ['train_reward', 'train_policy'])
def test_dry_run_every_experiment(command, tmp_path):
    procs = {exp: _run_launch_py(command, exp, 'x', '--dry_run', '--save_dir', str(tmp_path))
             for exp in ('sentiment', 'descriptiveness', 'cnndm', 'tldr')}
    for exp, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f'{command} {exp}:\n{err}'
        assert '\nsave dirs, and what the trainer derives from them:\n' in out
        assert f'\n  run.save_dir: {tmp_path / "x"}\n' in out
        assert f"\n  run.save_dir: '{tmp_path / 'x'}'  # --save_dir/NAME\n" in out
        if command == 'train_policy':  # the reward model is trained first, into the same save dir
            assert f"\n  rewards.trained_model: '{tmp_path / 'x' / 'reward_model'}'  # derived\n" in out
            assert f"\n  rewards.train_new_model.run.save_dir: '{tmp_path / 'x'}'  # derived\n" in out
        assert max(map(len, out.splitlines())) < 200  # one binding per line (the bindings once made one of 1,494)
    bad = _run_launch_py(command, 'sentiment', 'x', '--dry_run', '--run.sede', '1')
    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2
    assert err.startswith("error: x: unknown hyperparameter 'run.sede'") and err.count('\n') == 1, err


@pytest.mark.parametrize('command', ['train_reward', 'train_policy'])
def test_paper_experiments_run_as_the_originals_8_ranks(command, monkeypatch):
    """The paper's experiments default to the original's 8 ranks (mpi=8), carried on a CPU by one process
    (on GPUs: one per GPU); ours, test, demo and sentiment_mini, are sized for one rank. --mpi and --procs
    override."""
    calls = {}
    monkeypatch.setattr(launch, 'launch_trials', lambda name, **kw: calls.__setitem__(name, (kw['mpi'], kw['procs'])))
    fn = dict(train_reward=top_launch.launch_train_reward, train_policy=top_launch.launch_train_policy)[command]
    for exp in ('sentiment', 'descriptiveness', 'cnndm', 'tldr', 'test', 'demo', 'sentiment_mini'):
        fn(exp, exp)
    fn('sentiment', 'custom', mpi=4, procs=2)
    assert calls == dict(sentiment=(8, None), descriptiveness=(8, None), cnndm=(8, None), tldr=(8, None),
                         test=(1, None), demo=(1, None), sentiment_mini=(1, None), custom=(4, 2))
    assert workers.default_procs(8) == (max(p for p in (1, 2, 4, 8) if p <= torch.cuda.device_count())
                                       if torch.cuda.is_available() else 1)


@pytest.mark.parametrize('gpus', [0, 1])
def test_rank_and_process_counts_are_checked_at_launch(capsys, gpus):
    # gpus 1: as on a one-GPU machine (default_procs looks at the GPUs before the counts are checked)
    cuda = (mock.patch('torch.cuda.is_available', return_value=bool(gpus)),
            mock.patch('torch.cuda.device_count', return_value=gpus))
    with cuda[0], cuda[1]:
        _check_counts_at_launch(capsys)


def _check_counts_at_launch(capsys):
    for argv, message in [
            (['--mpi', '8', '--procs', '3'], 'x: --procs 3 must divide --mpi 8 (each process carries the same number '
                                             'of ranks): choose --procs from [1, 2, 4, 8]'),
            (['--mpi', '0'], 'x: --mpi 0: the number of ranks must be at least 1'),
            (['--procs', '0'], 'x: --procs 0: the number of processes must be at least 1')]:
        with pytest.raises(SystemExit) as e:
            launch.main(dict(train_policy=top_launch.launch_train_policy), argv=['train_policy', 'test', 'x', *argv])
        assert e.value.code == 2
        assert capsys.readouterr().err == f'error: {message}\n'


# ---- worker groups ----

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append(self.path)
        if self.path == '/missing':
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header('Content-Length', '5')
        self.end_headers()
        self.wfile.write(b'hello')

    def log_message(self, *args):
        pass


def _collectives_worker(out_dir, base_url):
    process = ranks.process_index()
    assert dist.is_initialized() and dist.get_backend() == 'gloo' and dist.get_world_size() == 2
    assert ranks.get_world_size() == 4 and list(ranks.local_ranks()) == [2 * process, 2 * process + 1]
    assert os.environ['LOCAL_RANK'] == str(process)
    mine = list(ranks.local_ranks())
    res = {}
    res['sum'] = core.mpi_allreduce_sum([torch.tensor([r + 1.0, 10.0]) for r in mine]).tolist()
    res['mean'] = core.mpi_allreduce_mean([torch.tensor([r + 1.0]) for r in mine]).tolist()
    res['np_mean'] = core.mpi_allreduce_mean([np.array([2.0 * r]) for r in mine]).tolist()
    res['float_sum'] = core.mpi_allreduce_sum([0.5 + r for r in mine])
    res['bcast_obj'] = core.mpi_bcast({'from': process})
    res['bcast_tensor'] = core.mpi_bcast(torch.full((2,), float(process))).tolist()
    res['is_root'] = ranks.is_root()
    res['ranks_in_sections'] = ranks.for_each_rank(lambda: (ranks.get_rank(), ranks.is_root()))
    res['all_gathered'] = distributed.all_gather_ranks([f'r{r}' for r in mine])
    with pytest.raises(TypeError, match="the list of the values of this process's 2 ranks"):
        core.mpi_allreduce_sum(torch.zeros(1))
    with pytest.raises(RuntimeError, match='collective over processes'):
        ranks.for_each_rank(lambda: core.mpi_bcast(1))

    torch.manual_seed(100 + process)  # different initial weights in each process
    model = torch.nn.Linear(3, 2)
    model.register_buffer('gain', torch.tensor(float(process + 7)))
    core.sync_params(model)
    res['params'] = [t.tolist() for t in model.state_dict().values()]
    # Each process's gradient is the mean of its ranks' (rank r: r everywhere, as one backward of the mean of
    # their losses gives); bias.grad stays None (skipped).
    model.weight.grad = torch.full_like(model.weight, sum(mine) / len(mine))
    core.mpi_allreduce_mean_grads(model.parameters())
    res['grad'] = model.weight.grad.flatten().tolist()
    res['bias_grad'] = model.bias.grad
    core.set_mpi_seed(1)
    res['seeded'] = ranks.for_each_rank(lambda: torch.rand(1).item())
    res['process_stream'] = torch.rand(1).item()
    # gcs: rank 0 downloads, the others use its file; an error reaches every rank.
    res['path'] = gcs.download_file_cached(base_url + '/data.txt', cache_dir=os.path.join(out_dir, 'cache'))
    try:
        gcs.download_file_cached(base_url + '/missing', cache_dir=os.path.join(out_dir, 'cache'), backoff_s=0.01)
    except RuntimeError as e:
        res['error'] = str(e)
    with open(os.path.join(out_dir, f'process{process}.json'), 'w') as f:
        json.dump(res, f)
    # A worker ends without Python's finalization (workers.exit_without_finalizing): this never runs.
    atexit.register(lambda: open(os.path.join(out_dir, f'finalized{process}'), 'w').close())


@pytest.mark.slow
def test_four_ranks_in_two_gloo_workers(tmp_path, gloo):
    httpd = ThreadingHTTPServer(('127.0.0.1', 0), _Handler)
    httpd.requests = []
    threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.02), daemon=True).start()
    base_url = f'http://127.0.0.1:{httpd.server_address[1]}'
    try:
        launch.launch('collectives', partial(_collectives_worker, str(tmp_path), base_url), mpi=4, procs=2)
    finally:
        httpd.shutdown()
        httpd.server_close()
    p0, p1 = (json.loads((tmp_path / f'process{p}.json').read_text()) for p in range(2))
    for p in (p0, p1):
        # Reductions over the 4 ranks (values r + 1, 2r, 0.5 + r of ranks 0..3), whatever process carries them.
        assert p['sum'] == [10.0, 40.0] and p['mean'] == [2.5] and p['np_mean'] == [3.0] and p['float_sum'] == 8.0
        assert p['bcast_obj'] == {'from': 0} and p['bcast_tensor'] == [0.0, 0.0]
        assert p['grad'] == [1.5] * 6 and p['bias_grad'] is None  # (0 + 1 + 2 + 3) / 4
        assert p['all_gathered'] == ['r0', 'r1', 'r2', 'r3']
        assert p['error'] == f'could not download {base_url}/missing: HTTP 404 Not Found'
        assert open(p['path']).read() == 'hello'
    assert p0['is_root'] and not p1['is_root']
    assert p0['ranks_in_sections'] == [[0, True], [1, False]] and p1['ranks_in_sections'] == [[2, False], [3, False]]
    assert p0['params'] == p1['params'] and p1['params'][-1] == 7.0  # buffers synced too
    seeded = p0['seeded'] + p1['seeded']
    assert len(set(seeded)) == 4  # seed + 100003 * rank: every rank its own stream
    assert p0['process_stream'] == p1['process_stream']  # the processes' own streams: seed, in every one
    assert httpd.requests == ['/data.txt', '/missing']  # only process 0 downloaded
    assert not list(tmp_path.glob('finalized*'))


def _failing_worker(error):
    if ranks.process_index() == 1:
        raise error('boom from process 1')
    core.mpi_allreduce_sum([torch.zeros(1)])  # process 0 would wait here forever for process 1
    time.sleep(60)


def _failing_command(exp, name):
    launch.launch(name, partial(_failing_worker, dict(bug=RuntimeError, input=ValueError)[exp]), mpi=2, procs=2)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['bug', 'input'])
def test_raising_worker_ends_launch(capsys, gloo, kind):
    """A worker that raises ends the launch in seconds: a bug with its traceback, a bad input (a
    ValueError, OSError, ...) in one line, as in a single process."""
    start = time.time()
    with pytest.raises(SystemExit) as e:
        launch.main({'cmd': _failing_command}, argv=['cmd', kind, 'n'])
    elapsed = time.time() - start
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert elapsed < 45, elapsed  # the waiting worker sleeps 60 s: it was killed, not waited for (H100 machine, 12 test workers: 17 s)
    if kind == 'bug':
        assert 'Traceback' in err and 'RuntimeError: boom from process 1' in err and '_failing_worker' in err
    else:
        assert err == 'error: boom from process 1\n'


def test_a_report_a_killed_worker_was_writing_is_left_out(tmp_path):
    """The launcher kills the other workers when one fails, maybe while one writes its own report: the first
    failure's report is read, the partial one left out (it once failed to parse and was reported as the error)."""
    (tmp_path / 'error-1').write_text(json.dumps(dict(time=1.0, input=True, message='boom from process 1')))
    (tmp_path / 'error-0.partial').write_text('{"time": 2.0, "inp')  # killed mid-write
    assert workers.error_reports(str(tmp_path)) == [dict(time=1.0, input=True, message='boom from process 1')]


def _group_check(out_path):
    with open(out_path, 'w') as f:
        json.dump([dist.is_initialized(), dist.get_world_size(), ranks.get_world_size(), list(ranks.local_ranks())], f)


@pytest.mark.slow
def test_torchrun_env_joins_existing_group(tmp_path, monkeypatch):
    # As under torchrun: the env describes the group (here one process); launch joins it in this process,
    # whose processes then carry the `mpi` ranks.
    monkeypatch.setenv('WORLD_SIZE', '1')
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', str(workers._free_port()))
    out = tmp_path / 'group.json'
    launch.launch('t', partial(_group_check, str(out)), mpi=4)
    assert json.loads(out.read_text()) == [True, 1, 4, [0, 1, 2, 3]]
    assert not dist.is_initialized()
    with pytest.raises(launch.ConfigError, match='--procs 2, but torchrun started 1 processes'):
        launch.launch('t', partial(_group_check, str(out)), mpi=4, procs=2)


_RSS_AFTER_FREE = '''
import re, torch
from lm_human_preferences.utils import workers
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
applied = workers.reuse_freed_memory()
before = rss_mb()
x = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
del x
print(applied, rss_mb() - before)
'''


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc tuning is Linux-only')
@pytest.mark.parametrize('user_setting', [False, True])
def test_reuse_freed_memory(user_setting):
    """Freed large tensors stay in the process for reuse (no fresh page faults on the next step), unless
    the user tuned glibc themselves, which is then left alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('MALLOC_')}
    if user_setting:
        env['MALLOC_TRIM_THRESHOLD_'] = '0'
    out = subprocess.run([sys.executable, '-c', _RSS_AFTER_FREE], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout.split()
    applied, kept_mb = out[0] == 'True', float(out[1])
    assert applied == (not user_setting)
    if applied:
        assert kept_mb > 60, f'only {kept_mb:.0f} MiB of a freed 64 MiB tensor stayed mapped'
    else:
        assert kept_mb < 4, f'{kept_mb:.0f} MiB stayed mapped with glibc defaults'


def test_workers_keep_a_given_omp_num_threads(monkeypatch):
    """The same threads in every layout give the same kernels' rounding (tests/test_ranks.py): a given
    OMP_NUM_THREADS is every worker's, as it is one process's; unset (or not a positive number), the cores are
    shared out."""
    monkeypatch.setenv('OMP_NUM_THREADS', '3')
    assert workers.worker_threads(4) == 3
    cores = os.cpu_count() or 1
    for value in ('', '0', 'x'):
        monkeypatch.setenv('OMP_NUM_THREADS', value)
        assert workers.worker_threads(2) == max(1, cores // 2)
    monkeypatch.delenv('OMP_NUM_THREADS')
    assert workers.worker_threads(cores * 2) == 1
