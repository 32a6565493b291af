"""The run lifecycle both trainers share (training/run.py): the save dir's lock, stale temporaries, the stats
sinks' rewind rule, pruned checkpoints and training states that refer to them, nothing non-finite saved,
a read-only save dir, the console (progress, summary, Ctrl-C), workers that die with their launcher."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm_human_preferences import train_policy, train_reward
from lm_human_preferences.language import checkpoints
from lm_human_preferences.training import (execution, plots, progress, run, run_compatibility, state_files,
                                          stats_log, train_state)
from lm_human_preferences.utils import cpu, finite, folder_lock, optional_deps, stopping
from conftest import env, write_labels

REPO_ROOT = Path(__file__).resolve().parents[1]


def policy_hparams(save_dir, **overrides):
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'rewards.trained_model': 'test', 'ppo.batch_size': 8,
        'ppo.total_episodes': 48, 'ppo.noptepochs': 1, 'run.seed': 1, 'run.log_interval': 100,
        'run.save_dir': str(save_dir), **overrides})
    hparams.validate()
    return hparams


def jsonl_steps(path):
    return [json.loads(line)['step'] for line in Path(path).read_text().splitlines()]


# ---- the save dir's lock ----

LOCK_HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from lm_human_preferences.utils import folder_lock
with folder_lock.locked_save_dir({save_dir!r}):
    print('locked', flush=True)
    time.sleep(60)
"""


@pytest.mark.slow
def test_a_save_dir_in_use_is_refused_and_a_dead_holder_taken_over(tmp_path):
    save_dir = tmp_path / 'run'
    save_dir.mkdir()
    holder = subprocess.Popen([sys.executable, '-c', LOCK_HOLDER.format(repo=str(REPO_ROOT), save_dir=str(save_dir))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == 'locked\n'
        with pytest.raises(folder_lock.SaveDirInUseError, match=rf'{save_dir} is in use by another run \(pid {holder.pid} '):
            train_policy.train(policy_hparams(save_dir))
        assert not (save_dir / 'train_policy_hparams.json').exists()  # refused before writing anything
    finally:
        holder.kill()  # SIGKILL: no chance to release the lock itself
        holder.wait()
    train_policy.train(policy_hparams(save_dir))  # the kernel released the dead holder's lock
    assert (save_dir / 'policy' / 'checkpoints' / 'model-6.safetensors').exists()
    assert not (save_dir / '.lock').exists()  # a finished run leaves no lock file


def test_lock_is_reentrant_in_one_process(tmp_path):
    # train_policy trains its reward model in the same save dir, in the same process.
    with folder_lock.locked_save_dir(str(tmp_path)), folder_lock.locked_save_dir(str(tmp_path)):
        pass
    with folder_lock.locked_save_dir(str(tmp_path)):  # released: taken again
        assert (tmp_path / '.lock').exists()
    assert not (tmp_path / '.lock').exists()  # removed when released


def test_the_launcher_refuses_a_save_dir_in_use_before_any_worker_starts(tmp_path, monkeypatch):
    """A second command on a live save dir is one line from the launcher, naming the holder, before it starts
    a process (it once came from the workers, seconds later, with a torch warning). The same line on any machine:
    here one GPU for --procs 2 (the GPU count is refused last; it once came first on a GPU machine)."""
    from lm_human_preferences.utils import launch, workers
    monkeypatch.setattr(workers, '_backend', lambda: 'nccl')
    monkeypatch.setattr(workers.torch.cuda, 'device_count', lambda: 1)

    def never(hparams):
        raise AssertionError('a worker started')
    trial = [(k, v, {}) for k, v in {'task.policy.initial_model': 'test', 'task.query_dataset': 'test',
                                     'task.query_length': 2, 'task.response_length': 3, 'rewards.trained_model': 'test',
                                     'ppo.batch_size': 8, 'ppo.total_episodes': 48}.items()]
    (tmp_path / 'live').mkdir()
    with folder_lock.locked_save_dir(str(tmp_path / 'live')):  # held as a running process holds it (another open file)
        with pytest.raises(launch.ConfigError, match=rf"^{tmp_path / 'live'} is in use by another run \(pid "
                                                     rf"{os.getpid()} on .*give this run another NAME"):
            launch.launch_trials('live', never, [trial], train_policy.HParams, mpi=2, procs=2, save_dir=str(tmp_path))
    with pytest.raises(launch.ConfigError, match=r'^live: --procs 2 needs one GPU per process, but only 1 GPUs'):
        launch.launch_trials('live', never, [trial], train_policy.HParams, mpi=2, procs=2, save_dir=str(tmp_path))


def test_a_run_that_fails_before_its_first_state_leaves_nothing(tmp_path, monkeypatch):
    """What a run made before it trained anything (the save dir, its hparams and data records, the lock) goes
    when it fails; a folder that was there stays, and so does a run that saved a state."""
    save_dir = tmp_path / 'runs' / 'new'

    def fail_at_the_first_step(self, *args, **kwargs):
        raise RuntimeError('bad batch')
    monkeypatch.setattr(train_policy.PPOTrainer, 'step', fail_at_the_first_step)
    with pytest.raises(RuntimeError, match='bad batch'):
        train_policy.train(policy_hparams(save_dir))
    assert (tmp_path / 'runs').is_dir() and not save_dir.exists()
    save_dir.mkdir()  # a folder the user made: emptied of what the run made, kept
    with pytest.raises(RuntimeError, match='bad batch'):
        train_policy.train(policy_hparams(save_dir))
    assert save_dir.is_dir() and not any(save_dir.iterdir())
    monkeypatch.undo()
    train_policy.train(policy_hparams(save_dir, **{'ppo.total_episodes': 8}))
    assert sorted(p.name for p in save_dir.iterdir()) == ['policy', 'tb', 'train_policy_curves.png',
                                                          'train_policy_data.json', 'train_policy_hparams.json',
                                                          'train_policy_stats.jsonl']


def test_a_lock_removed_between_open_and_lock_is_opened_again(tmp_path, monkeypatch):
    """A run that opened the lock file just before its holder ended (and removed it) locks a file of its own,
    not the removed one, which a third run could never see."""
    real_flock, removed = folder_lock.fcntl.flock, []

    def flock_after_the_holder_ended(f, op):
        if not removed:  # the holder ends between our open and our lock: its file is gone
            removed.append(os.fstat(f.fileno()).st_ino)
            os.unlink(tmp_path / '.lock')
        return real_flock(f, op)
    monkeypatch.setattr(folder_lock.fcntl, 'flock', flock_after_the_holder_ended)
    with folder_lock.locked_save_dir(str(tmp_path)):
        held = folder_lock._held[os.path.realpath(tmp_path / '.lock')][0]
        assert removed and os.fstat(held.fileno()).st_ino == os.stat(tmp_path / '.lock').st_ino


@pytest.mark.slow
def test_stale_temporaries_are_removed(tmp_path):
    save_dir = tmp_path / 'run'
    (save_dir / 'policy' / 'checkpoints').mkdir(parents=True)
    stale = [save_dir / 'train_policy_stats.jsonl.tmp-123', save_dir / 'policy' / 'checkpoints' / 'model-2.safetensors.tmp-9']
    for path in stale:
        path.write_text('partial')
    train_policy.train(policy_hparams(save_dir))
    assert not any(path.exists() for path in stale)


# ---- stats: one rewind rule ----

def test_a_run_without_a_saved_state_starts_its_stats_again(tmp_path):
    """A run killed before its first saved state left stats behind: the rerun logs from step 0 alone."""
    save_dir = tmp_path / 'run'
    save_dir.mkdir()
    stale = [{'step': s, 'objective/kl': 9.0} for s in range(4)]
    (save_dir / 'train_policy_stats.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in stale))
    train_policy.train(policy_hparams(save_dir))
    assert jsonl_steps(save_dir / 'train_policy_stats.jsonl') == list(range(6))
    assert all(json.loads(line)['objective/kl'] != 9.0
               for line in (save_dir / 'train_policy_stats.jsonl').read_text().splitlines())


def test_stats_log_writes_jsonl_and_tensorboard(tmp_path, capsys):
    log = stats_log.StatsLog(save_dir=str(tmp_path), kind='train_policy', log_interval=2)
    for step in range(3):
        assert log.log({'objective/kl': 0.5 * step, 'ppo/lr': 1e-5}, step)['objective/kl'] == 0.5 * step
    log.close()
    assert capsys.readouterr().out.count('| step') == 2  # the table at steps 0 and 2
    lines = [json.loads(line) for line in (tmp_path / 'train_policy_stats.jsonl').read_text().splitlines()]
    assert lines == [{'step': s, 'objective/kl': 0.5 * s, 'ppo/lr': 1e-5} for s in range(3)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / 'tb' / 'ppo'))
    acc.Reload()
    assert [e.value for e in acc.Scalars('objective/kl')] == [0.0, 0.5, 1.0]
    assert log.last == {'objective/kl': 1.0, 'ppo/lr': 1e-5}


def test_rewind_drops_later_steps_and_a_cut_last_line_with_a_warning(tmp_path):
    path = tmp_path / 'train_policy_stats.jsonl'
    path.write_text(''.join(json.dumps({'step': i, 'loss': i / 2}) + '\n' for i in range(5)) + '{"step": 5, "lo')
    log = stats_log.StatsLog(save_dir=str(tmp_path), kind='train_policy', log_interval=1)
    with pytest.warns(plots.StatsWarning, match=r'train_policy_stats.jsonl: dropping its last line, which is no '
                                                r'complete stats row .*: b\'{"step": 5, "lo\'$'):
        log.read()
    assert log.next_step() == 5
    log.rewind(3)  # resumed at step 3: steps 3, 4 and the cut line go
    assert jsonl_steps(path) == [0, 1, 2]
    # a last line that parses but is no row: dropped the same way; a finished run (rewind(None)) keeps the rows
    path.write_text(path.read_text() + '5\n')
    with pytest.warns(plots.StatsWarning, match=r"no complete stats row .*: b'5\\n'"):
        log.read()
    log.rewind(None)
    assert jsonl_steps(path) == [0, 1, 2]
    # a damaged line with lines after it: one line naming the file, the line and the fix, and nothing changes
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf'^{path} line 2 is not valid JSON \(Invalid control character at: '
                                         r'line 1 .*\), with lines after it \(no append leaves that\): delete that '
                                         r'line and rerun'):
        log.read()
    assert path.read_text() == '{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n'
    # a torn tail is one line whatever bytes it holds (a power cut can leave any: b'\r' too)
    path.write_bytes(b'{"step": 0}\n{"step": 1, "lo\r\x00\x00')
    with pytest.warns(plots.StatsWarning, match='dropping its last line'):
        log.read()
    assert log.next_step() == 1


def test_rows_lost_before_every_kept_state_are_named(tmp_path, capsys):
    """The stats log lost rows that no kept state precedes: the run resumes from its newest state all the
    same, and a warning names the rows the log lacks."""
    save_dir = tmp_path / 'run'
    train_policy.train(policy_hparams(save_dir, **{'run.save_interval': 3}))
    for path in (save_dir / 'policy' / 'train_state').glob('state-6.*'):
        path.unlink()  # as if killed after state 3
    stats = save_dir / 'train_policy_stats.jsonl'
    stats.write_text(''.join(stats.read_text().splitlines(keepends=True)[:1]))  # the rows of steps 1 .. lost
    capsys.readouterr()
    with pytest.warns(plots.StatsWarning, match=rf'^{stats}: the rows of steps 1 to 2 are lost and no training '
                                                r'state before them is kept: the log lacks them$'):
        train_policy.train(policy_hparams(save_dir, **{'run.save_interval': 3}))
    assert f"resuming from {save_dir}/policy/train_state/state-3.json (step 3)\n" in capsys.readouterr().out
    assert jsonl_steps(stats) == [0, 3, 4, 5]


def test_a_damaged_stats_line_stops_a_rerun_before_any_work(tmp_path):
    save_dir = tmp_path / 'run'
    save_dir.mkdir()
    path = save_dir / 'train_policy_stats.jsonl'
    damaged = '{"step": 0, "objective/kl": 1.0}\n{"step": 1, "objective/kl": \n{"step": 2, "objective/kl": 1.0}\n'
    path.write_text(damaged)
    with pytest.raises(ValueError, match=rf'^{path} line 2 is not valid JSON \(.*\), with lines after it'):
        train_policy.train(policy_hparams(save_dir))
    assert path.read_text() == damaged and not (save_dir / 'train_policy_hparams.json').exists()


# ---- checkpoints and training states ----

def test_checkpoints_pruned_and_states_refer_to_them(tmp_path):
    save_dir = tmp_path / 'run'
    train_policy.train(policy_hparams(save_dir, **{'run.save_interval': 1, 'run.keep_checkpoints': 2}))
    policy_dir = save_dir / 'policy'
    assert checkpoints.checkpoint_steps(policy_dir) == [6, 5, 4]  # 2 kept, and state 4's
    assert state_files.train_state_steps(policy_dir) == [6, 5, 4]
    sidecar = json.loads((policy_dir / 'train_state' / 'state-6.json').read_text())
    assert sidecar['module_checkpoints'] == {'policy': 'checkpoints/model-6.safetensors'}
    from safetensors.torch import load_file
    state = load_file(str(policy_dir / 'train_state' / 'state-6.safetensors'))
    assert not [k for k in state if k.startswith('modules.')]  # the weights are not stored twice
    assert [k for k in state if k.startswith('optimizer.')]
    # A state whose model checkpoint is corrupt is skipped for the one before.
    path = policy_dir / 'checkpoints' / 'model-6.safetensors'
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    policy = train_policy.Policy(train_policy.trained_models.TrainedModel('test'))
    optimizer = train_policy.AdamTF(policy.parameters(), lr=1e-3)
    with pytest.warns(state_files.TrainStateWarning, match='refers to a model checkpoint that fails: .*model-6'):
        loaded = train_state.load_latest_train_state(str(policy_dir), modules=dict(policy=policy), optimizer=optimizer,
                                                       samplers=dict(query=train_state.CountingSampler(lambda: None)))
    assert loaded.step == 5


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    """An update that leaves a weight NaN (with a finite loss and gradient before it: today --ppo.lr nan is
    refused at launch, which once saved all-NaN weights) stops the run before it saves them."""
    step = train_policy.AdamTF.step

    def step_then_break(self, *args, **kwargs):
        step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]['params'][0].view(-1)[0] = float('nan')
    monkeypatch.setattr(train_policy.AdamTF, 'step', step_then_break)
    save_dir = tmp_path / 'run'
    with pytest.raises(finite.NonFiniteError, match='non-finite policy parameters at step 1'):
        train_policy.train(policy_hparams(save_dir, **{'run.save_interval': 1}))
    assert checkpoints.checkpoint_steps(save_dir / 'policy') == []
    assert state_files.train_state_steps(save_dir / 'policy') == []


@pytest.mark.slow
def test_save_dir_through_a_file_via_the_command_line(tmp_path):
    """A save dir whose path runs through a file: the command line reports the OSError in one line, before
    any model is built (a read-only save dir: tests/test_bad_inputs.py::test_read_only_save_dir)."""
    blocker = tmp_path / 'file'
    blocker.write_text('not a directory')
    proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'x', '--save_dir', str(blocker)],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f'error: cannot write the save dir {blocker}/x: [Errno 20] Not a directory; choose another --save_dir']


# ---- the console ----

# What a command's first line says it runs on (utils/cpu.describe): a CPU's threads, kernels and bf16 products, or
# the GPU, e.g. 'cuda:0 (NVIDIA H200)'
RUNS_ON = r'(CPU \(\d+ threads?, \w+ kernels, bf16 (native|not native: .+)\)|cuda:\d+ \(.+\))'


def test_the_first_lines_device_reads_a_cpu_or_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H200')
    assert re.fullmatch(RUNS_ON, cpu.describe('cpu')) and re.fullmatch(RUNS_ON, cpu.describe('cuda:0'))


def test_progress_summary_and_one_line_missing_heads(tmp_path, capsys):
    save_dir = tmp_path / 'run'
    train_policy.train(policy_hparams(save_dir))
    out = capsys.readouterr().out
    # [ppo_step N] is the 0-based step, as the stats' step; the count of steps done says 'done'.
    assert '[ppo_step 5] step_time=' in out and '(6/6 done, ' in out and 'ETA 0s)' in out
    # The first line's time per step is that step's (it once measured from the end of the step: ~0 s).
    step_time, per_step = map(float, re.search(r'\[ppo_step 0\] step_time=([\d.]+)s, .*\(1/6 done, ([\d.e-]+) s/step',
                                               out).groups())
    # step_time is printed to 2 decimals (0.02 stands for [0.015, 0.025)): compare with its lowest value
    assert per_step >= 0.9 * (step_time - 0.005), (step_time, per_step)
    assert 'train_policy done: 6 steps in' in out
    assert f'  model:        {save_dir}/policy/checkpoints/model-6.safetensors' in out
    assert f'  sample:       python sample.py sample --save_dir {save_dir} --nsamples 8' in out
    assert f'  tensorboard:  tensorboard --logdir {save_dir}/tb' in out
    assert '\nhparams:\n' not in out and 'model_hparams:' not in out  # a short summary, not the full dumps
    assert re.search(rf'train_policy: 1 rank in 1 process on {RUNS_ON}; saving to', out)


def start_cli(argv, **env_overrides):
    """`python launch.py argv...` with stop signals at their default disposition, as under a terminal,
    whatever this process's are: one started while SIGINT is ignored keeps ignoring it (CPython installs
    its handler only where SIGINT is not ignored)."""
    return subprocess.Popen([sys.executable, 'launch.py', *argv], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(env(), **env_overrides),
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in stopping.STOP_SIGNALS])


def wait_for_rows(path, n, proc, timeout=120):
    """Wait until the stats file at path holds n rows (the run is training)."""
    deadline = time.time() + timeout
    while not (path.exists() and path.read_text().count('\n') >= n):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def stopped_line(kind, name, state_dir, step):
    return (f'{kind} stopped by {name} after {step} steps, all saved; rerunning the same command resumes there '
            f'({state_dir}/state-{step}.json)')


LONG_RUN = ['--ppo.total_episodes', '100000', '--run.save_interval', '1000', '--run.log_interval', '1000']


@pytest.mark.slow
@pytest.mark.parametrize('signum', stopping.STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_saves_where_it_stopped_in_one_line(tmp_path, signum):
    """Ctrl-C, a scheduler's SIGTERM and Slurm's SIGUSR1 notice: the step in progress ends, its state is
    saved (3125 steps, saved every 1000: none without the signal), one line says where, and the exit
    status is 128 + the signal's number (a rerun resumes there: the next test)."""
    argv = ['train_policy', 'test', 'run', '--save_dir', str(tmp_path), *LONG_RUN]
    proc = start_cli(argv)
    stats, state_dir = tmp_path / 'run' / 'train_policy_stats.jsonl', tmp_path / 'run' / 'policy' / 'train_state'
    wait_for_rows(stats, 3, proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]
    step = state_files.train_state_steps(state_dir.parent)[0]
    assert len(stats.read_text().splitlines()) == step >= 3  # the rows of steps 0 .. step - 1
    name = signal.Signals(signum).name if signum != signal.SIGINT else 'Ctrl-C (SIGINT)'
    assert err.strip().splitlines() == [stopped_line('train_policy', name, state_dir, step)]


@pytest.mark.slow
def test_sigterm_to_every_process_of_a_two_process_run(tmp_path):
    """A scheduler signals every process (the launcher passes it on too): the workers agree on the step
    to stop at, save it, the worker carrying rank 0 says where in one line, and every process ends, 143.
    The rerun resumes there; a signal to its launcher alone reaches the workers."""
    argv = ['train_policy', 'test', 'run', '--save_dir', str(tmp_path), '--mpi', '2', '--procs', '2', *LONG_RUN]
    proc = start_cli(argv, LMHP_DIST_BACKEND='gloo')
    stats, state_dir = tmp_path / 'run' / 'train_policy_stats.jsonl', tmp_path / 'run' / 'policy' / 'train_state'
    wait_for_rows(stats, 3, proc)
    children = [int(p) for p in Path(f'/proc/{proc.pid}/task/{proc.pid}/children').read_text().split()]
    workers = [pid for pid in children if b'spawn_main' in Path(f'/proc/{pid}/cmdline').read_bytes()]
    assert len(workers) == 2  # the other child: multiprocessing's resource tracker
    for pid in [proc.pid, *children]:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    step = state_files.train_state_steps(state_dir.parent)[0]
    assert len(stats.read_text().splitlines()) == step >= 3
    assert err.strip().splitlines() == [stopped_line('train_policy', 'SIGTERM', state_dir, step)]
    assert not [pid for pid in workers if os.path.exists(f'/proc/{pid}')]

    proc = start_cli(argv, LMHP_DIST_BACKEND='gloo')
    wait_for_rows(stats, step + 2, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert f'train_policy: resuming from {state_dir}/state-{step}.json (step {step})' in out
    assert err.strip().splitlines() == [
        stopped_line('train_policy', 'SIGUSR1', state_dir, state_files.train_state_steps(state_dir.parent)[0])]


def signal_during_step(monkeypatch, step, *signums):
    """Send this process signums (real signals) while PPO step `step` runs."""
    original = train_policy.PPOTrainer.step

    def stepping(self):
        if self.global_step == step:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return original(self)
    monkeypatch.setattr(train_policy.PPOTrainer, 'step', stepping)


def test_a_stop_waits_for_the_step_and_a_second_ctrl_c_does_not(tmp_path, monkeypatch, capsys):
    sigint_before = signal.getsignal(signal.SIGINT)  # Python's handler; SIG_IGN where the shell started us in the background
    save_dir = tmp_path / 'run'
    state_dir = save_dir / 'policy' / 'train_state'
    signal_during_step(monkeypatch, 2, signal.SIGTERM, signal.SIGTERM)  # the scheduler's, and the launcher's
    with stopping.stopping_on_signals(), pytest.raises(stopping.Stopped) as e:
        train_policy.train(policy_hparams(save_dir))
    assert e.value.signum == signal.SIGTERM and stopping.exit_code(e.value) == 143
    assert state_files.train_state_steps(save_dir / 'policy') == [3]  # step 2 done, then saved
    assert capsys.readouterr().err == stopped_line('train_policy', 'SIGTERM', state_dir, 3) + '\n'

    signal_during_step(monkeypatch, 4, signal.SIGINT, signal.SIGINT)  # Ctrl-C twice: at once
    with stopping.stopping_on_signals(), pytest.raises(stopping.Stopped):
        train_policy.train(policy_hparams(save_dir))
    assert state_files.train_state_steps(save_dir / 'policy') == [3]
    assert capsys.readouterr().err == (f'\ntrain_policy stopped by Ctrl-C (SIGINT) during step 4 (not saved); '
                                       f'rerunning the same command resumes from step 3 ({state_dir}/state-3.json)\n')
    assert signal.getsignal(signal.SIGINT) is sigint_before  # the handlers are given back


def test_a_stop_outside_the_training_loop_is_one_line(tmp_path, monkeypatch, capsys):
    def stop(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(train_policy.PPOTrainer, '__init__', stop)  # while the run builds its trainer
    with stopping.stopping_on_signals(), pytest.raises(stopping.Stopped):
        train_policy.train(policy_hparams(tmp_path / 'run'))
    assert capsys.readouterr().err == ('train_policy stopped by SIGUSR1 outside its training loop; rerunning the '
                                       'same command resumes where it left off\n')


def test_a_stop_after_an_inner_run_finished_is_the_enclosing_runs_line(tmp_path, capsys):
    """The online loop retrains the reward model inside PPO's loop: a stop signal that comes while the retraining
    finishes its last step is one line, the enclosing run's (the retraining is done: it is not where a rerun
    resumes); a stop the inner run reports inside its loop is its line alone."""
    write_labels(tmp_path / 'labels.json', 16)
    for inner_stops_inside in (False, True):
        save = tmp_path / str(inner_stops_inside)
        with run.Run(policy_hparams(save / 'ppo'), 'train_policy') as outer, \
                run.Run(reward_hparams('', tmp_path / 'labels.json'), 'train_reward') as inner:  # no save dir
            with stopping.stopping_on_signals(), pytest.raises(stopping.Stopped) as e:
                with outer.training(step=lambda: 5):
                    with inner.training(step=lambda: 3):
                        os.kill(os.getpid(), signal.SIGTERM)
                        if inner_stops_inside:
                            raise stopping.Stopped(signal.SIGTERM)
        assert e.value.signum == signal.SIGTERM
        err = capsys.readouterr().err.strip().splitlines()
        line = 'train_reward stopped by SIGTERM (no run.save_dir' if inner_stops_inside else \
            'train_policy stopped by SIGTERM during step 5 (not saved)'
        assert len(err) == 1 and err[0].startswith(line), err


WORKER_PIDS = """
import os, sys, time
sys.path.insert(0, {repo!r})
from functools import partial
from lm_human_preferences.utils import launch
def work(out):
    open(os.path.join(out, str(os.getpid())), 'w').close()
    time.sleep(120)
if __name__ == '__main__':
    launch.launch('x', partial(work, {out!r}), mpi=2, procs=2)
"""


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGKILL], ids=['SIGTERM', 'SIGKILL'])
def test_workers_die_with_their_launcher(tmp_path, signum):
    """A `kill` of the launching process ends its workers too: SIGTERM, which it passes on to them, and
    SIGKILL, which it cannot handle (the kernel ends them: PR_SET_PDEATHSIG)."""
    script, out = tmp_path / 'launcher.py', tmp_path / 'pids'
    out.mkdir()
    script.write_text(WORKER_PIDS.format(repo=str(REPO_ROOT), out=str(out)))
    launcher = subprocess.Popen([sys.executable, str(script)], env=dict(env(), LMHP_DIST_BACKEND='gloo'))
    deadline = time.time() + 60
    while len(os.listdir(out)) < 2 and time.time() < deadline:
        time.sleep(0.2)
    workers = [int(p) for p in os.listdir(out)]
    assert len(workers) == 2
    launcher.send_signal(signum)
    launcher.wait(timeout=30)
    deadline = time.time() + 10
    while any(os.path.exists(f'/proc/{pid}') and open(f'/proc/{pid}/stat').read().split()[2] != 'Z'
              for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if os.path.exists(f'/proc/{pid}')
                and open(f'/proc/{pid}/stat').read().split()[2] != 'Z'], 'workers outlived their launcher'


# ---- wandb ----

def test_wandb_problems_are_one_line_at_launch(tmp_path, monkeypatch, capsys):
    pytest.importorskip('wandb')
    monkeypatch.delenv('WANDB_MODE', raising=False)
    monkeypatch.delenv('WANDB_API_KEY', raising=False)
    monkeypatch.setenv('HOME', str(tmp_path))  # no ~/.netrc
    import launch as top_launch
    from lm_human_preferences.utils import launch
    with pytest.raises(SystemExit) as e:
        launch.main(dict(train_reward=top_launch.launch_train_reward),
                    argv=['train_reward', 'test', 'x', '--run.wandb', 'true', '--save_dir', str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == ('error: x: run.wandb is on but no W&B API key is set: run `wandb login`, set '
                                       'WANDB_API_KEY, or set WANDB_MODE=offline to log locally\n')
    monkeypatch.setenv('WANDB_API_KEY', 'x' * 40)
    monkeypatch.setenv('WANDB_BASE_URL', 'http://127.0.0.1:9')  # the discard port: nothing listens
    with pytest.raises(ValueError, match=r'the W&B server http://127.0.0.1:9 cannot be reached'):
        optional_deps.check_wandb('x')
    assert not (tmp_path / 'x').exists()


@pytest.mark.slow
def test_wandb_logs_both_phases_of_train_policy(tmp_path, monkeypatch):
    pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    save_dir = tmp_path / 'run'
    reward = {'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
              'task.response_length': 3, 'labels.type': 'best_of_4', 'labels.source': 'test',
              'labels.num_train': 16, 'batch_size': 8, 'run.seed': 1}
    hparams = policy_hparams(save_dir, **{'rewards.trained_model': None, 'rewards.train_new_model': 'on',
                                          'run.wandb': True,
                                          **{f'rewards.train_new_model.{k}': v for k, v in reward.items()}})
    train_policy.train(hparams)
    ids = {kind: (save_dir / f'{kind}_wandb_id').read_text() for kind in ('train_reward', 'train_policy')}
    assert ids['train_reward'] != ids['train_policy']
    for run_id in ids.values():
        assert list(save_dir.glob(f'wandb/offline-run-*-{run_id}/run-{run_id}.wandb'))


# ---- which data a run used ----

def reward_hparams(save_dir, labels_path):
    hparams = train_reward.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'labels.type': 'best_of_4', 'labels.source': str(labels_path),
        'labels.num_train': 16, 'batch_size': 8, 'rollout_batch_size': 8, 'normalize_before': True,
        'normalize_samples': 8, 'run.seed': 1, 'run.save_dir': str(save_dir)})
    hparams.validate()
    return hparams


def test_a_rerun_on_changed_labels_is_refused(tmp_path):
    labels = write_labels(tmp_path / 'labels.json', 20)
    save_dir = tmp_path / 'run'
    train_reward.train(reward_hparams(save_dir, labels))
    data = json.loads((save_dir / 'train_reward_data.json').read_text())
    assert data['labels']['records'] == 20 and len(data['labels']['sha256']) == 64
    assert data['queries'] == {'dataset': 'test', 'mode': 'train', 'source': 'generator'}
    train_reward.train(reward_hparams(save_dir, labels))  # the same labels: resumes (already finished)
    records = json.loads(labels.read_text())
    records[3]['best'] = (records[3]['best'] + 1) % 4
    labels.write_text(json.dumps(records))
    before = sorted(p.name for p in save_dir.rglob('*'))
    with pytest.raises(run_compatibility.IncompatibleRunError,
                       match=rf'^{save_dir} holds a run on other labels: it recorded sha256 [0-9a-f]+, records 20, '
                             r'this run has sha256 [0-9a-f]+, records 20\. To resume it, give it its labels again'):
        train_reward.train(reward_hparams(save_dir, labels))
    assert sorted(p.name for p in save_dir.rglob('*')) == before


def test_a_run_that_stopped_before_training_does_not_hold_its_save_dir(tmp_path):
    """A fresh run that stopped at a bad input (here its label file) trained nothing: the corrected
    rerun, with other hparams (another label file), takes the save dir instead of being refused as
    another run; once a run has trained, other hparams are refused as before."""
    save_dir = tmp_path / 'run'
    bad = tmp_path / 'bad.json'
    bad.write_text('[{"query": [1, 2], "sample0": ')
    with pytest.raises(ValueError, match='is not valid JSON'):
        train_reward.train(reward_hparams(save_dir, bad))
    assert not save_dir.exists()  # it made the save dir and trained nothing: nothing is left
    save_dir.mkdir()
    (save_dir / 'train_reward_hparams.json').write_text(json.dumps(reward_hparams(save_dir, bad).to_nested_dict()))
    good = write_labels(tmp_path / 'good.json', 20)
    train_reward.train(reward_hparams(save_dir, good))
    assert json.loads((save_dir / 'train_reward_hparams.json').read_text())['labels']['source'] == str(good)
    assert json.loads((save_dir / 'train_reward_data.json').read_text())['labels_source'] == dict(path=str(good))
    with pytest.raises(ValueError, match=rf'^{save_dir} holds another run: its train_reward_hparams.json has '
                                         r'labels.source='):
        train_reward.train(reward_hparams(save_dir, write_labels(tmp_path / 'other.json', 20)))


def test_reward_progress_and_summary(tmp_path, capsys):
    """train_reward's console: progress lines (step/total, time per step, ETA) for the normalization
    sampling and the reward steps, then the end-of-run summary with its final metrics and paths."""
    save_dir = tmp_path / 'run'
    hparams = reward_hparams(save_dir, write_labels(tmp_path / 'labels.json', 20))
    hparams.run.log_interval = 1  # a progress line every reward step (with the stats table)
    train_reward.train(hparams)
    out = capsys.readouterr().out
    # normalize_samples 8 over rollout_batch_size 8: one batch, before and after training
    assert re.search(r'\[normalize sampling 1/1 done, [\d.]+ s/step, ETA 0s\]', out), out
    # 16 labels, batch_size 8: 2 steps
    assert re.search(r'\[reward_step 1/2 done, [\d.]+ s/step, ETA \d+s\]', out), out
    assert re.search(r'\[reward_step 2/2 done, [\d.]+ s/step, ETA 0s\]', out), out
    assert re.search(r'\ntrain_reward done: 2 steps in \d+s; loss [\d.]+', out), out
    assert f'  model:        {save_dir}/reward_model/checkpoints/model-2.safetensors' in out
    assert f'  tensorboard:  tensorboard --logdir {save_dir}/tb' in out
    assert re.search(rf'train_reward: 1 rank in 1 process on {RUNS_ON}; saving to', out)


def test_fresh_heads_are_one_line_once(tmp_path, capsys):
    """A policy started from a model without a value head: one line says it starts fresh, once per kind
    of model and checkpoint (a run builds the policy and the reference from the same one)."""
    from lm_human_preferences.language import model, trained_models
    from lm_human_preferences.policy import Policy
    hp = trained_models.test_hparams()
    checkpoints.save_checkpoint(str(tmp_path / 'lm'), 3, model.Model(hp), hparams=hp, encoding='test')
    for _ in range(2):
        Policy(trained_models.TrainedModel(str(tmp_path / 'lm')))
    path = tmp_path / 'lm' / 'checkpoints' / 'model-3.safetensors'
    assert capsys.readouterr().out == (f'Policy from {path}: value head starts fresh (not in the checkpoint), '
                                       f'as the original intended\n')


def test_progress_times_the_steps_after_the_first_and_speaks_every_30_seconds(monkeypatch):
    """The ETA is taken from the steps after the first (a warm-up: allocations, caches, a CUDA graph's capture),
    and a long loop prints after its first step, its last, and at least every PRINT_EVERY_S seconds."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, 'time', lambda: clock[0])
    loop = progress.Progress(10)
    clock[0] += 60  # the first step: a minute of warm-up
    loop.done = 1
    assert loop.due() and loop() == '1/10 done, 60 s/step, ETA 9m00s'
    for step in range(2, 6):
        clock[0] += 2
        loop.done = step
        assert not loop.due(), step  # 8 s since the last line: nothing to say for 30 s
    assert loop() == '5/10 done, 2 s/step, ETA 10s'  # not (60 + 8) / 5 = 13.6 s a step
    clock[0] += 40
    loop.done = 6
    assert loop.due()
    clock[0] += 1
    loop.done = 10
    assert loop.due()  # the last step


def test_a_rerun_may_change_the_hparams_its_trainer_names_and_no_other(tmp_path):
    """What a rerun may change and still resume is the trainer's to say (train_policy.RERUN_MAY_CHANGE: the
    port's run.* values that change no result, and where the online loop serves its page), not the run
    layer's; any other changed value is refused in one line naming it."""
    assert set(execution.RERUN_MAY_CHANGE) < set(train_policy.RERUN_MAY_CHANGE)
    assert {'online.host', 'online.port'} < set(train_policy.RERUN_MAY_CHANGE)
    save_dir = tmp_path / 'run'
    with run.Run(policy_hparams(save_dir), 'train_policy', may_change=train_policy.RERUN_MAY_CHANGE):
        pass
    (save_dir / 'policy' / 'checkpoints').mkdir(parents=True)
    (save_dir / 'policy' / 'checkpoints' / 'model-1.safetensors').write_bytes(b'')  # it trained: hparams held
    changed = {'run.log_interval': 7, 'run.keep_checkpoints': 3, 'online.port': 8123}
    with run.Run(policy_hparams(save_dir, **changed), 'train_policy', may_change=train_policy.RERUN_MAY_CHANGE):
        pass
    with pytest.raises(ValueError, match='ppo.lr'):
        run.Run(policy_hparams(save_dir, **{'ppo.lr': 1e-3}), 'train_policy', may_change=train_policy.RERUN_MAY_CHANGE)
    with pytest.raises(ValueError, match='online.port'):  # the run layer itself names nothing
        run.Run(policy_hparams(save_dir, **{'online.port': 8124}), 'train_policy')
