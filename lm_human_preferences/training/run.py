"""A trainer's run in its save dir (ours: the original's trainers wrote their few files themselves and
could not resume). `train_reward` and `train_policy` use one `Run` the same way:

    with Run(hparams, 'train_policy') as run:  # the save dir locked, stale temporaries removed, hparams
                                               # checked against a run already there, then written
        ... build the models, as the original ...
        state = run.resume(modules=..., optimizer=..., samplers=..., model=...)  # newest valid state or None
        with run.training(step=lambda: step, save=...):  # stop signals, errors, final save, curves, summary
            ... the original's loop, logging through run.stats.log(stats, step) and calling
            run.save(step, extra=...) after each step where run.save_due(step) ...

A stop signal (Ctrl-C, SIGTERM, SIGUSR1: a scheduler's) in launch.py's processes (stopping_on_signals) waits
for the loop's next step boundary: every process saves that step, the process that carries rank 0 says in
one line where it stopped and how to resume, and each exits with 128 + the signal's number. Outside a
training loop, and at a second Ctrl-C, the run stops at once (what it saved before stays).

What a save dir holds for a trainer (<scope> is `reward_model` or `policy`):

    <save_dir>/.lock                         held (flock) by the process that carries rank 0
    <save_dir>/<kind>_hparams.json           the run's hparams (a rerun with other values is refused)
    <save_dir>/<kind>_data.json              which labels and queries it used (a rerun on others: refused)
    <save_dir>/<kind>_stats.jsonl            one JSON line per logged step
    <save_dir>/tb/<scope or ppo>/            TensorBoard events
    <save_dir>/<kind>_curves.png             learning curves, at the end
    <save_dir>/<scope>/checkpoints/          model checkpoints, the last run.keep_checkpoints kept
    <save_dir>/<scope>/train_state/          training states for resuming (training/train_state.py)

One rewind rule for every stats sink: a run resumed at step M logs steps M, M+1, ... again, so the
JSONL lines from step M on are dropped (and a last line cut off by a kill or a full disk, with a warning;
a damaged line before others stops the run as it opens, in one line) and TensorBoard hides its events
from step M on (purge_step); a run that had saved no state yet starts from step 0 and drops all of them.
A state past the end of the JSONL (its last rows lost) gives way to a kept state before them, so that the
log ends as an uninterrupted run's. wandb cannot delete points: a resumed run continues the same wandb
run, which keeps the first value of each step (the redone steps compute the same values: resuming is
exact).
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import time
import uuid
import warnings
from functools import partial
from typing import Callable, Dict, Optional

import torch

from lm_human_preferences.language import checkpoints
from lm_human_preferences.utils import core, cpu, files, finite, hyperparams, ranks, stopping
from lm_human_preferences.training import train_state, plots

SCOPES = dict(train_reward='reward_model', train_policy='policy')
TB_SUBDIRS = dict(train_reward='reward_model', train_policy='ppo')
# Hparams that change what a run logs or keeps, or its memory use or speed, not its results: a rerun may change
# them and still resume.
LOGGING_HPARAMS = ('run.log_interval', 'run.wandb', 'run.wandb_project', 'run.keep_checkpoints',
                   'run.microbatch_size', 'run.cuda_graph', 'online.host', 'online.port')
# The metrics an end-of-run summary shows, when logged.
SUMMARY_METRICS = dict(train_reward=('loss', 'eval/loss', 'eval/accuracy'),
                       train_policy=('objective/score', 'objective/kl', 'objective/kl_coef', 'objective/entropy'))


class SaveDirInUseError(OSError):
    """Another process holds the save dir's lock (an OSError: launch.py reports it in one line)."""


# ---------------------------------------------------------------------------------------------------
# The save dir's lock

_held = {}  # realpath of a lock file -> [open file, holders in this process]


@contextlib.contextmanager
def locked_save_dir(save_dir):
    """Hold <save_dir>/.lock (flock, exclusive) for the block; re-entrant within the process (train_policy
    trains its reward model in the same save dir). The kernel releases the lock of a process that dies,
    however it dies, so a stale lock is taken over by the next run. The file goes when the run ends."""
    path = os.path.realpath(os.path.join(save_dir, '.lock'))
    if path in _held:
        _held[path][1] += 1
    else:
        f = _open_lock(path, save_dir)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), command=' '.join(sys.argv))))
        f.flush()
        _held[path] = [f, 1]
    try:
        yield
    finally:
        _held[path][1] -= 1
        if not _held[path][1]:
            f = _held.pop(path)[0]
            with contextlib.suppress(OSError):
                os.unlink(path)  # while locked: a run that opened it meanwhile finds it gone (_open_lock)
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


def _open_lock(path, save_dir):
    """<save_dir>/.lock opened and locked (exclusive, not waiting); one that its holder removed between our open
    and our lock is opened again."""
    while True:
        f = open(path, 'a+')
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise SaveDirInUseError(files.save_dir_in_use(save_dir, files.lock_holder(path) or 'another process')) \
                from None
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def run_folder_of(path):
    """The run's folder that holds path (path itself or a folder above it: a save dir, holding a trainer's
    <kind>_hparams.json, or a model dir, holding train_state/) and what shows it, or None."""
    path = os.path.realpath(path)
    while True:
        for mark in [f'{kind}_hparams.json' for kind in SCOPES] + [train_state.TRAIN_STATE_SUBDIR]:
            if os.path.exists(os.path.join(path, mark)):
                return path, mark
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)


def _remove_temporaries(save_dir):
    """Temporary files (`*.tmp-<pid>`) that killed writers left anywhere in the save dir: with the lock
    held no writer of ours is at work there."""
    for directory, _, names in os.walk(save_dir):
        if any(files.TMP_RE.fullmatch(n) for n in names):
            files.remove_stale_temporaries(directory)


# ---------------------------------------------------------------------------------------------------
# Stats sinks

class StatsLog:
    """Where a trainer's stats go, on the process that carries rank 0: the stats table on stdout every
    log_interval steps and TensorBoard (core.record_stats, as the original), plus ours: one JSON line per
    step and wandb. Without a save dir only the table is printed."""

    def __init__(self, *, save_dir, kind, log_interval, wandb_init=None):
        self.save_dir = save_dir
        self.kind = kind
        self.log_interval = log_interval
        self.jsonl_path = os.path.join(save_dir, f'{kind}_stats.jsonl') if save_dir else None
        self.tb_dir = os.path.join(save_dir, 'tb', TB_SUBDIRS[kind]) if save_dir else None
        # wandb allows one active run per process: a trainer's starts with its first stats (train_policy's
        # reward phase has finished its own by then).
        self.wandb_init = wandb_init
        self.wandb_run = None
        self.summary_writer = None
        self.purge_step = None
        self.rows = None  # [(line, row)] of the stats file as the run opened (read), on rank 0's process
        self.last = {}  # the last value of each metric logged

    def read(self):
        """Read the stats file, as the run opens (a damaged line stops it before any work: plots.read_rows)."""
        if self.jsonl_path and os.path.exists(self.jsonl_path):
            self.rows = plots.read_rows(self.jsonl_path)

    def next_step(self):
        """The step after the last one logged (0: none); None without a stats file. A training state past it
        would leave the log without the steps between (their rows lost, e.g. cut off by a power cut)."""
        if self.rows is None:
            return None
        return self.rows[-1][1]['step'] + 1 if self.rows else 0

    def log(self, stats, step, *, log_interval=None):
        """Log stats (name -> scalar, already averaged over ranks) at step; returns them as floats."""
        if ranks.is_root() and self.tb_dir and self.summary_writer is None:
            self.summary_writer = core.get_summary_writer(self.save_dir, subdir=TB_SUBDIRS[self.kind],
                                                          purge_step=self.purge_step)
        stats = core.record_stats(stats=stats, summary_writer=self.summary_writer, step=step,
                                  log_interval=self.log_interval if log_interval is None else log_interval)
        if ranks.is_root():
            if self.jsonl_path:
                with open(self.jsonl_path, 'a') as f:
                    f.write(json.dumps({'step': int(step), **stats}) + '\n')
            if self.wandb_init is not None:
                self.wandb_run, self.wandb_init = self.wandb_init(), None
            if self.wandb_run is not None:
                self.wandb_run.log(stats, step=int(step))
        self.last.update(stats)
        return stats

    def rewind(self, step):
        """The run goes on from `step` (None: a finished run, which logs nothing more): forget what the
        interrupted run logged at `step` and after, and a last line cut off (read dropped it)."""
        self.purge_step = step
        if ranks.is_root() and self.rows is not None:
            keep = [line for line, row in self.rows if step is None or row['step'] < step]
            if sum(map(len, keep)) != os.path.getsize(self.jsonl_path):
                files.atomic_write(self.jsonl_path, b''.join(keep))

    def close(self):
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _wandb_run(hparams, kind):
    """A Weights & Biases run for this trainer (ours), on the process that carries rank 0: one per
    trainer and save dir, grouped by the save dir's name (train_policy's reward phase is the group's
    train_reward run); a resumed run continues its wandb run (its id is kept in the save dir)."""
    if not hparams.run.wandb or not ranks.is_root():
        return None
    import wandb  # the `wandb` extra; checked at launch (optional_deps.check_wandb)
    save_dir = hparams.run.save_dir
    name = os.path.basename(os.path.normpath(save_dir)) if save_dir else None
    run_id = None
    if save_dir:
        id_path = os.path.join(save_dir, f'{kind}_wandb_id')
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # wandb's id form: 8 lowercase letters and digits
            files.atomic_write(id_path, run_id.encode())
    return wandb.init(project=hparams.run.wandb_project, config=hparams.to_nested_dict(), dir=save_dir,
                      name=f'{name}/{kind}' if name else None, group=name, job_type=kind, id=run_id,
                      resume='allow' if run_id else None)


# ---------------------------------------------------------------------------------------------------
# Progress lines

def _count(n, noun):
    """'1 rank', '8 ranks', '2 processes'."""
    return f'{n} {noun}' if n == 1 else f'{n} {noun}{"es" if noun.endswith("s") else "s"}'


def _duration(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
    if seconds >= 60:
        return f'{seconds // 60}m{seconds % 60:02d}s'
    return f'{seconds}s'


# A long loop says where it is at least this often.
PRINT_EVERY_S = 30


class Progress:
    """`done/total done, time per step, ETA` of a loop of `total` steps that starts at step `start` (a
    resumed run). Set .done as the loop goes. The time per step is the mean over the steps this process ran
    after its first, which warms up (allocations, caches, a CUDA graph's capture); until there are such
    steps, since `started` (default: now). `done` counts steps (the first step done: 1), unlike the 0-based
    step index of the stats and of `[ppo_step N]`: the word says which."""

    def __init__(self, total, start=0, started=None):
        self.total, self.start, self._done = total, start, start
        self.started = time.time() if started is None else started
        self._warm = None  # (time, done) when the first step was done
        self._printed = self.started

    @property
    def done(self):
        return self._done

    @done.setter
    def done(self, value):
        if self._warm is None and value > self.start:
            self._warm = (time.time(), value)
        self._done = value

    def __call__(self):
        now = time.time()
        if self._warm is not None and self._done > self._warm[1]:
            per_step = (now - self._warm[0]) / (self._done - self._warm[1])
        else:
            per_step = (now - self.started) / max(self._done - self.start, 1)
        eta = _duration(per_step * (self.total - self._done))
        return f'{self._done}/{self.total} done, {per_step:.3g} s/step, ETA {eta}'

    def due(self):
        """Whether to print a line now: after the first step, after the last, and at least every
        PRINT_EVERY_S seconds between them."""
        now = time.time()
        if self._done in (self.start + 1, self.total) or now - self._printed >= PRINT_EVERY_S:
            self._printed = now
            return True
        return False


# ---------------------------------------------------------------------------------------------------
# The run

class Run:
    def __init__(self, hparams, kind):
        """Open the run `kind` ('train_reward' / 'train_policy') of hparams in hparams.run.save_dir (none:
        nothing is written). Collective over processes: the process carrying rank 0 takes the save dir's
        lock, removes stale temporaries, refuses a save dir holding another run's hparams (those that
        change no result may differ: LOGGING_HPARAMS) and writes this run's; every process raises its
        error, in one line.
        """
        self.hparams = hparams
        self.kind = kind
        self.save_dir = hparams.run.save_dir
        self.model_dir = os.path.join(self.save_dir, SCOPES[kind]) if self.save_dir else None
        self.started = time.time()
        self.saved_step = None  # the step of the newest training state
        self.saved_model_step = None  # and of the newest model checkpoint this run wrote
        self.tracked = None  # what save() saves: set by resume()
        self._stopping = 0  # the stop signal every process agreed on at the last step boundary (save_due)
        self._lock = contextlib.ExitStack()
        self.stats = StatsLog(save_dir=self.save_dir, kind=kind, log_interval=hparams.run.log_interval,
                              wandb_init=partial(_wandb_run, hparams, kind) if hparams.run.wandb else None)
        self._created = []  # what this run made before it trained anything: removed if it fails then (__exit__)
        error = None
        if self.save_dir and ranks.is_root():
            try:
                # A rerun must match the hparams of the run in the save dir (refused, it writes nothing).
                # A save dir where nothing was trained yet (a run that stopped at a bad input, say) holds
                # no run: the corrected rerun replaces its hparams.
                existing = self.trained_anything() and train_state.check_resume_compatible(
                    self.save_dir, hparams.to_nested_dict(), f'{kind}_hparams.json', ignore=LOGGING_HPARAMS)
                self._created += [d for d in (self.save_dir, self.model_dir) if not os.path.exists(d)]
                os.makedirs(self.model_dir, exist_ok=True)
                self._lock.enter_context(locked_save_dir(self.save_dir))
                _remove_temporaries(self.save_dir)
                self.stats.read()
                if not existing:
                    hyperparams.save_json(hparams, os.path.join(self.save_dir, f'{kind}_hparams.json'))
                    self._created.append(os.path.join(self.save_dir, f'{kind}_hparams.json'))
            except (OSError, ValueError) as e:  # SaveDirInUseError, IncompatibleRunError, a damaged stats line
                self._lock.close()
                error = (type(e).__name__, _one_line(e, self.save_dir))
        error = core.mpi_bcast(error)
        if error is not None:
            raise (SaveDirInUseError if error[0] == 'SaveDirInUseError' else ValueError)(error[1])
        if ranks.is_root():
            self._print_summary()

    def __enter__(self):
        return self

    def trained_anything(self):
        """Whether the run saved a training state or a model checkpoint (its model dir has one)."""
        return bool(train_state.train_state_steps(self.model_dir) or checkpoints.checkpoint_steps(self.model_dir))

    def __exit__(self, exc_type, exc, tb):
        """Close the stats sinks and release the save dir; a stop signal outside the training loop is one
        line too."""
        if isinstance(exc, stopping.Stopped) and not exc.reported:
            self._report_stop(exc, None)
        self.stats.close()
        if exc is not None and ranks.is_root():
            self._remove_what_it_made()
        self._lock.close()

    def _remove_what_it_made(self):
        """A run that fails (or stops) before it saved a state or a stats line leaves nothing behind: the files and
        folders it made (its hparams and data records, an empty model dir and save dir) go."""
        if not self._created or self.trained_anything() or os.path.exists(self.stats.jsonl_path):
            return
        for path in reversed(self._created):
            with contextlib.suppress(OSError):
                if os.path.isdir(path):
                    if path == self.save_dir:
                        os.remove(os.path.join(path, '.lock'))  # released just after; an empty dir goes first
                    os.rmdir(path)  # only if empty
                else:
                    os.remove(path)

    def _print_summary(self):
        """The hparams that define the run, in a few lines (all of them are in the save dir's JSON)."""
        h = self.hparams
        flat = core.flatten_dict(h.to_nested_dict(), sep='.')
        keys = [k for k in ('task.query_dataset', 'task.policy.initial_model', 'task.query_length',
                            'task.response_length', 'labels.source', 'labels.num_train', 'batch_size', 'lr',
                            'rewards.trained_model', 'ppo.batch_size', 'ppo.total_episodes', 'ppo.lr',
                            'rewards.kl_coef', 'run.seed', 'run.bf16', 'run.microbatch_size')
                if flat.get(k) is not None]
        where = (f'saving to {self.save_dir} (all hparams: {self.kind}_hparams.json)' if self.save_dir
                 else 'no run.save_dir: nothing is saved')
        layout = f'{_count(ranks.get_world_size(), "rank")} in {_count(ranks.num_processes(), "process")}'
        print(f'{self.kind}: {layout} on {cpu.describe(core.get_device())}; {where}')  # the CPU's kind: its timings
        print('  ' + ', '.join(f'{k}={flat[k]}' for k in keys))

    def record_data(self, name, fingerprint, *, source=None):
        """Record in <save_dir>/<kind>_data.json which data the run uses (name: 'labels' or 'queries';
        fingerprint: a JSON-able dict, e.g. the file's sha256 and record count). A rerun whose data differs
        from what the run recorded is refused in one line: resuming on other labels would mix two runs.
        source (e.g. a download's URL and sha256) says where the data came from: recorded as
        `<name>_source` for the reader, not compared (the same records from a mirror resume the run).
        Collective."""
        if not self.save_dir:
            return
        error = None
        if ranks.is_root():
            path = os.path.join(self.save_dir, f'{self.kind}_data.json')
            recorded = {}
            if os.path.exists(path):
                with open(path) as f:
                    recorded = json.load(f)
            trained = self.trained_anything()
            if name in recorded and recorded[name] != fingerprint and trained:
                error = (f'{self.save_dir} holds a run on other {name}: it recorded {_brief(recorded[name])}, '
                         f'this run has {_brief(fingerprint)}. To resume it, give it its {name} again; to start '
                         f'a new run, give it another NAME (or --save_dir)')
            else:
                # the source the run first recorded stays (a resume from a copied dir or another cache
                # path reads the same records); before anything was trained, this run's data replace it
                kept = recorded if trained else {
                    k: v for k, v in recorded.items() if k not in (name, f'{name}_source')}
                updated = {name: fingerprint, **({f'{name}_source': source} if source else {}), **kept}
                if updated != recorded:
                    if not os.path.exists(path):
                        self._created.append(path)
                    files.atomic_write(path, json.dumps(updated, indent=1).encode())
        error = core.mpi_bcast(error)
        if error is not None:
            raise train_state.IncompatibleRunError(error)

    def resume(self, *, modules: Dict[str, torch.nn.Module], optimizer, samplers=None, model=None):
        """Restore the newest valid training state of the save dir, if any (see training/train_state.py),
        and remember what save() saves: modules, optimizer, samplers, and model = (module, model hparams,
        encoding) for the model checkpoint. A state past the end of the stats log (the rows between lost:
        cut off) gives way to a kept one before it, whose steps redone log them again. Returns the
        TrainState or None. Collective. The end-of-run summary times the trainer from here (train_policy's
        reward phase, before it, has its own)."""
        self.started = time.time()
        if self.save_dir and ranks.is_root() and self.tracked is not None:
            self.stats.read()  # as it is now: the online loop resumes a run again after each round
        logged = self.stats.next_step()
        state = train_state.load_latest_train_state(self.model_dir, modules=modules, optimizer=optimizer,
                                                      samplers=samplers, at_most=logged) if self.save_dir else None
        self.tracked = dict(modules=modules, optimizer=optimizer, samplers=samplers or {}, model=model,
                            start=state.step if state else 0)
        self.saved_step = state.step if state else None
        done = bool(state and state.extra.get('done'))
        if self.save_dir:
            self.stats.rewind(None if done else state.step if state else 0)  # a finished run redoes nothing
        if state and ranks.is_root():
            newest = train_state.train_state_steps(self.model_dir)[0]
            note = (f'; {self.stats.jsonl_path} ends before step {newest}: the steps from {state.step} are redone '
                    f'to log them again' if logged is not None and state.step <= logged < newest else '')
            print(f'{self.kind}: resuming from {state.path} (step {state.step}{", already finished" if done else ""}'
                  f'{note})')
            if logged is not None and logged < state.step:
                warnings.warn(f'{self.stats.jsonl_path}: the rows of steps {logged} to {state.step - 1} are lost and '
                              f'no training state before them is kept: the log lacks them', plots.StatsWarning)
        return state

    def save(self, step, *, extra, model=True, done=False):
        """Save the training state after `step` steps (with extra, the trainer's own state, and done: whether
        the run has finished) and, with model, the model checkpoint of that step, which the state refers to
        instead of holding the weights a second time; keep run.keep_checkpoints model checkpoints. Nothing
        non-finite is ever saved. Then, when save_due agreed on a stop signal and the run is not done, raises
        Stopped. Collective; between steps only."""
        if self.save_dir and not (self.saved_step == step and not done
                                  and self.saved_model_step == (step if model else None)):  # not saved already
            self._save(step, extra=extra, model=model, done=done)
        if self._stopping and not done:
            raise stopping.Stopped(self._stopping)

    def save_due(self, step):
        """Whether the trainer saves after `step` steps: every run.save_interval steps, and at once when a stop
        signal reached any process (the save then ends the run). Collective: every process calls it after
        every step."""
        self._stopping = stopping.stop_signal_of_any_process()
        return step % self.hparams.run.save_interval == 0 or bool(self._stopping)

    def _save(self, step, *, extra, model, done):
        modules = self.tracked['modules']
        for name, module in modules.items():
            finite.check_finite(step, **{f'{name} parameters': torch.stack(
                [p.detach().float().abs().max() for p in module.parameters()])})
        module, model_hparams, encoding = self.tracked['model']

        def save_model():
            path = checkpoints.save_checkpoint(self.model_dir, step, module, hparams=model_hparams, encoding=encoding)
            return {name: path for name, m in modules.items() if m is module}
        train_state.save_train_state(
            self.model_dir, step, modules=modules, optimizer=self.tracked['optimizer'],
            samplers=self.tracked['samplers'], extra=dict(extra, done=done), save_model=save_model if model else None)
        self.saved_step = step
        self.saved_model_step = step if model else self.saved_model_step
        if ranks.is_root():
            self._prune_model_checkpoints()

    def _prune_model_checkpoints(self):
        # the newest run.keep_checkpoints (the original's max_to_keep), and those a training state refers to
        checkpoints.prune_checkpoints(self.model_dir, keep=self.hparams.run.keep_checkpoints,
                                      protect=train_state.referenced_checkpoint_steps(self.model_dir))

    def save_model_at_exit(self, step):
        """The original's `finally: saver.save()` after an error: the model checkpoint of the weights
        reached, on the process carrying rank 0 alone (its peers may be gone), if it trained since it
        started or resumed, and they are finite and not saved yet."""
        if (not self.save_dir or not ranks.is_root() or self.tracked is None or step == self.tracked['start']
                or self.saved_model_step == step):
            return
        module, model_hparams, encoding = self.tracked['model']
        if all(bool(torch.isfinite(p).all()) for p in module.parameters()):
            checkpoints.save_checkpoint(self.model_dir, step, module, hparams=model_hparams, encoding=encoding)
            self._prune_model_checkpoints()

    @contextlib.contextmanager
    def training(self, *, step: Callable[[], int], save: Optional[Callable[[], None]] = None):
        """The trainer's loop runs in this block; step() tells where it is. On success: save() (the final
        save), the learning curves, a summary. A stop signal (stopping_on_signals) waits for the loop's next
        step boundary (save_due), or the block's end, and is one line saying where the run stopped and how a
        rerun resumes; a second Ctrl-C stops at once. On a non-finite value or a failed save: nothing more is
        written. On other errors: the model checkpoint of the weights reached (save_model_at_exit)."""
        with stopping.deferred():
            try:
                yield
                if save is not None:
                    save()
            except KeyboardInterrupt as e:  # Stopped, or Ctrl-C's own where no handler is installed
                self._report_stop(e, step())
                raise
            except (finite.NonFiniteError, train_state.CheckpointWriteError):
                raise  # nothing more is written: no non-finite values, and a failed save would only fail again
            except BaseException:
                self.save_model_at_exit(step())
                raise
        if self.save_dir and ranks.is_root():
            plots.plot_learning_curves(self.save_dir, kinds=(self.kind[len('train_'):],))
            print(self.summary(step()))
        signum = stopping.stop_signal_of_any_process()
        if signum:  # it came after the last step boundary: the run finished first
            e = stopping.Stopped(signum)
            self._report_stop(e, step())
            raise e

    def _report_stop(self, e: KeyboardInterrupt, step):
        """The one line of a stop at `step` (None: outside the training loop): where, and how a rerun resumes
        (on the process carrying rank 0)."""
        signum = getattr(e, 'signum', signal.SIGINT)
        e.reported = True
        if not ranks.is_root():
            return
        # after Ctrl-C's ^C, on a line of its own
        stopped = ('\n' if signum == signal.SIGINT else '') + f'{self.kind} stopped by {stopping.signal_name(signum)}'
        state = os.path.join(self.model_dir or '', train_state.TRAIN_STATE_SUBDIR, f'state-{self.saved_step}.json')
        resume = (f'from step {self.saved_step} ({state})' if self.saved_step is not None
                  else 'from the start' if self.tracked is not None else 'where it left off')
        if not self.save_dir:
            line = f'{stopped} (no run.save_dir: nothing is saved)'
        elif step is None:
            line = f'{stopped} outside its training loop; rerunning the same command resumes {resume}'
        elif self.saved_step == step:
            line = f'{stopped} after {step} steps, all saved; rerunning the same command resumes there ({state})'
        else:
            line = f'{stopped} during step {step} (not saved); rerunning the same command resumes {resume}'
        print(line, file=sys.stderr)

    def summary(self, step):
        """The end-of-run lines: final metrics, wall time, where everything is and what to run next."""
        metrics = ', '.join(f'{k} {self.stats.last[k]:.4g}' for k in SUMMARY_METRICS[self.kind] if k in self.stats.last)
        lines = [f'{self.kind} done: {step} steps in {_duration(time.time() - self.started)}'
                 + (f'; {metrics}' if metrics else '')]
        if self.save_dir:
            ckpt = checkpoints.latest_checkpoint(self.model_dir)
            lines += [f'  model:        {ckpt}',
                      f'  curves:       {os.path.join(self.save_dir, f"{self.kind}_curves.png")}',
                      f'  stats:        {self.stats.jsonl_path}',
                      f'  tensorboard:  tensorboard --logdir {os.path.join(self.save_dir, "tb")}']
            if self.kind == 'train_policy':
                lines += [f'  sample:       python sample.py sample --save_dir {self.save_dir} --nsamples 8',
                          f'  export:       python sample.py export --save_dir {self.save_dir} --out HF_DIR']
            else:
                lines += [f'  use it:       python launch.py train_policy EXPERIMENT NAME --rewards.trained_model '
                          f'{self.model_dir} --rewards.train_new_model off',
                          f'  export:       python sample.py export --save_dir {self.save_dir} '
                          f'--savescope reward_model --out HF_DIR']
        return '\n'.join(lines)


def _brief(fingerprint):
    return ', '.join(f'{k} {v}' for k, v in fingerprint.items())


def _one_line(e, save_dir):
    if isinstance(e, OSError) and e.errno is not None:
        return (f'cannot write the save dir {e.filename or save_dir}: [Errno {e.errno}] {e.strerror}; '
                f'choose another --save_dir')
    return str(e)
