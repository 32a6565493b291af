"""A trainer's run in its save dir (ours: the original's trainers wrote their few files themselves and
could not resume). `train_reward` and `train_policy` use one `Run` the same way:

    with Run(hparams, 'train_policy', may_change=...) as run:  # the save dir locked, stale temporaries removed, hparams
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

The save dir: training/run_folders.py; the stats sinks: training/stats_log.py; progress lines:
training/progress.py.
"""

import contextlib
import json
import os
import signal
import sys
import time
import warnings
from functools import partial
from typing import Callable, Dict, Optional

import torch

from lm_human_preferences.language import checkpoints
from lm_human_preferences.utils import core, cpu, files, finite, hyperparams, ranks, stopping
from lm_human_preferences.training import plots, progress, run_compatibility, state_files, train_state
from lm_human_preferences.training.run_folders import SCOPES
from lm_human_preferences.utils.folder_lock import SaveDirInUseError, locked_save_dir
from lm_human_preferences.training.stats_log import StatsLog, wandb_run

# The metrics an end-of-run summary shows, when logged.
SUMMARY_METRICS = dict(train_reward=('loss', 'eval/loss', 'eval/accuracy'),
                       train_policy=('objective/score', 'objective/kl', 'objective/kl_coef', 'objective/entropy'))


class Run:
    # Training blocks open in this process: one run's may hold another's (the online loop retrains the reward
    # model inside PPO's loop), and a stop is reported once, by the run whose command a rerun resumes.
    _open_training_blocks = 0

    def __init__(self, hparams, kind, *, may_change=()):
        """Open the run `kind` ('train_reward' / 'train_policy') of hparams in hparams.run.save_dir (none:
        nothing is written). Collective over processes: the process carrying rank 0 takes the save dir's
        lock, removes stale temporaries, refuses a save dir holding another run's hparams (those that
        change no result may differ: may_change, the trainer's dotted names) and writes this run's; every
        process raises its error, in one line.
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
                              wandb_init=partial(wandb_run, hparams, kind) if hparams.run.wandb else None)
        self._created = []  # what this run made before it trained anything: removed if it fails then (__exit__)

        def open_save_dir():
            if not self.save_dir:
                return
            try:
                # A rerun must match the hparams of the run in the save dir (refused, it writes nothing).
                # A save dir where nothing was trained yet (a run that stopped at a bad input, say) holds
                # no run: the corrected rerun replaces its hparams.
                existing = self.trained_anything() and run_compatibility.check_resume_compatible(
                    self.save_dir, hparams.to_nested_dict(), f'{kind}_hparams.json', ignore=may_change)
                self._created += [d for d in (self.save_dir, self.model_dir) if not os.path.exists(d)]
                os.makedirs(self.model_dir, exist_ok=True)
                self._lock.enter_context(locked_save_dir(self.save_dir))
                files.remove_stale_temporaries_in_tree(self.save_dir)
                self.stats.read()
                if not existing:
                    hyperparams.save_json(hparams, os.path.join(self.save_dir, f'{kind}_hparams.json'))
                    self._created.append(os.path.join(self.save_dir, f'{kind}_hparams.json'))
            except (OSError, ValueError) as e:  # SaveDirInUseError, IncompatibleRunError, a damaged stats line
                self._lock.close()
                raise (SaveDirInUseError if isinstance(e, SaveDirInUseError) else ValueError)(
                    _one_line(e, self.save_dir)) from None
        core.root_tries(open_save_dir)
        if ranks.is_root():
            self._print_summary()

    def __enter__(self):
        return self

    def trained_anything(self):
        """Whether the run saved a training state or a model checkpoint (its model dir has one)."""
        return bool(state_files.train_state_steps(self.model_dir) or checkpoints.checkpoint_steps(self.model_dir))

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
        flat = h.to_flat_dict()
        keys = [k for k in ('task.query_dataset', 'task.policy.initial_model', 'task.query_length',
                            'task.response_length', 'labels.source', 'labels.num_train', 'batch_size', 'lr',
                            'rewards.trained_model', 'ppo.batch_size', 'ppo.total_episodes', 'ppo.lr',
                            'rewards.kl_coef', 'run.seed', 'run.bf16', 'run.microbatch_size')
                if flat.get(k) is not None]
        where = (f'saving to {self.save_dir} (all hparams: {self.kind}_hparams.json)' if self.save_dir
                 else 'no run.save_dir: nothing is saved')
        layout = (f'{progress.count(ranks.get_world_size(), "rank")} in '
                  f'{progress.count(ranks.num_processes(), "process")}')
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

        def record():
            path = os.path.join(self.save_dir, f'{self.kind}_data.json')
            recorded = {}
            if os.path.exists(path):
                with open(path) as f:
                    recorded = json.load(f)
            trained = self.trained_anything()
            if name in recorded and recorded[name] != fingerprint and trained:
                raise run_compatibility.IncompatibleRunError(
                    f'{self.save_dir} holds a run on other {name}: it recorded {_brief(recorded[name])}, '
                    f'this run has {_brief(fingerprint)}. To resume it, give it its {name} again; to start '
                    f'a new run, give it another NAME (or --save_dir)')
            # the source the run first recorded stays (a resume from a copied dir or another cache
            # path reads the same records); before anything was trained, this run's data replace it
            kept = recorded if trained else {
                k: v for k, v in recorded.items() if k not in (name, f'{name}_source')}
            updated = {name: fingerprint, **({f'{name}_source': source} if source else {}), **kept}
            if updated != recorded:
                if not os.path.exists(path):
                    self._created.append(path)
                files.atomic_write(path, json.dumps(updated, indent=1).encode())
        core.root_tries(record, fails=(run_compatibility.IncompatibleRunError,))

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
            newest = state_files.train_state_steps(self.model_dir)[0]
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
                                      protect=state_files.referenced_checkpoint_steps(self.model_dir))

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
    def training(self, *, step: Callable[[], int], save: Optional[Callable[[], None]] = None, next_steps=()):
        """The trainer's loop runs in this block; step() tells where it is. On success: save() (the final
        save), the learning curves, a summary (with next_steps: the caller's lines of what to run next). A stop
        signal (stopping_on_signals) waits for the loop's next step boundary (save_due), or the block's end, and is
        one line saying where the run stopped and how a rerun resumes; a second Ctrl-C stops at once. On a
        non-finite value or a failed save: nothing more is written. On other errors: the model checkpoint of the
        weights reached (save_model_at_exit)."""
        with stopping.deferred():
            Run._open_training_blocks += 1
            try:
                yield
                if save is not None:
                    save()
            except KeyboardInterrupt as e:  # Stopped, or Ctrl-C's own where no handler is installed
                if not getattr(e, 'reported', False):  # an inner run's stop is its line alone
                    self._report_stop(e, step())
                raise
            except (finite.NonFiniteError, state_files.CheckpointWriteError):
                raise  # nothing more is written: no non-finite values, and a failed save would only fail again
            except BaseException:
                self.save_model_at_exit(step())
                raise
            finally:
                Run._open_training_blocks -= 1
        if self.save_dir and ranks.is_root():
            plots.plot_learning_curves(self.save_dir, kinds=(self.kind[len('train_'):],))
            print(self.summary(step(), next_steps))
        signum = stopping.stop_signal_of_any_process()
        if signum:  # it came after the last step boundary: the run finished first
            e = stopping.Stopped(signum)
            if not Run._open_training_blocks:  # else the enclosing run, which goes on from here, says where it stopped
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
        state = os.path.join(self.model_dir or '', state_files.TRAIN_STATE_SUBDIR, f'state-{self.saved_step}.json')
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

    def summary(self, step, next_steps=()):
        """The end-of-run lines: final metrics, wall time, where everything is and what to run next (next_steps,
        the caller's: its commands know its outputs)."""
        metrics = ', '.join(f'{k} {self.stats.last[k]:.4g}' for k in SUMMARY_METRICS[self.kind] if k in self.stats.last)
        lines = [f'{self.kind} done: {step} steps in {progress.duration(time.time() - self.started)}'
                 + (f'; {metrics}' if metrics else '')]
        if self.save_dir:
            ckpt = checkpoints.latest_checkpoint(self.model_dir)
            lines += [f'  model:        {ckpt}',
                      f'  curves:       {os.path.join(self.save_dir, f"{self.kind}_curves.png")}',
                      f'  stats:        {self.stats.jsonl_path}',
                      f'  tensorboard:  tensorboard --logdir {os.path.join(self.save_dir, "tb")}']
            lines += ['  ' + line for line in next_steps]
        return '\n'.join(lines)


def _brief(fingerprint):
    return ', '.join(f'{k} {v}' for k, v in fingerprint.items())


def _one_line(e, save_dir):
    if isinstance(e, OSError) and e.errno is not None:
        return (f'cannot write the save dir {e.filename or save_dir}: [Errno {e.errno}] {e.strerror}; '
                f'choose another --save_dir')
    return str(e)
