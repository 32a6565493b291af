"""Ours: where a trainer's stats go: the stats table and TensorBoard (core.record_stats, as the original), one
JSON line per step, wandb.

One rewind rule for every stats sink: a run resumed at step M logs steps M, M+1, ... again, so the
JSONL lines from step M on are dropped (and a last line cut off by a kill or a full disk, with a warning;
a damaged line before others stops the run as it opens, in one line) and TensorBoard hides its events
from step M on (purge_step); a run that had saved no state yet starts from step 0 and drops all of them.
A state past the end of the JSONL (its last rows lost) gives way to a kept state before them, so that the
log ends as an uninterrupted run's. wandb cannot delete points: a resumed run continues the same wandb
run, which keeps the first value of each step (the redone steps compute the same values: resuming is
exact).
"""

import json
import os
import uuid

from lm_human_preferences.training import plots
from lm_human_preferences.utils import core, files, ranks


TB_SUBDIRS = dict(train_reward='reward_model', train_policy='ppo')


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


def wandb_run(hparams, kind):
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
