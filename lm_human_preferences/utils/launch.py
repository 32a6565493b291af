"""Launching trials in a group of worker processes (port of the original utils/launch.py).

The original pickled the trial function with cloudpickle and ran it under `mpiexec -n <mpi>`, one MPI
rank per process, with a `fire` command line. Here the `mpi` ranks are carried by `procs` processes,
mpi / procs each, side by side in its batches (utils/ranks.py): one process can run the paper's 8 ranks.
Ours: the worker processes (utils/workers.py) and the command line (utils/command_line.py).
"""

import os
import sys
from functools import partial

from lm_human_preferences.utils import command_line
from lm_human_preferences.utils.command_line import ConfigError

# `--help` for --procs left unset (workers.default_procs).
PROCS_HELP = 'one per GPU, at most --mpi and a divisor of it; 1 on a CPU; under torchrun, its processes'


def launch(name, f, *, mpi=1, procs=None) -> None:
    """Run f() as `mpi` ranks (the original: `mpiexec -n mpi`) carried by `procs` processes joined in a
    torch.distributed group, mpi / procs ranks each (utils/ranks.py); procs None: workers.default_procs(mpi).

    procs=1 runs f in this process with no group. Under torchrun (WORLD_SIZE set) f runs in this process
    inside torchrun's group, whose processes carry the ranks. If a worker raises, the others are killed
    and WorkerInputError (its one line) or WorkerFailed (its traceback) is raised here; a stop signal
    stops them all, saved, and raises stopping.Stopped.
    """
    # Ours: the workers and torch.distributed imported when a command runs (its --help does without torch).
    import torch.distributed as dist
    from lm_human_preferences.utils import workers
    if procs is None:
        procs = workers.default_procs(mpi)
    workers.reuse_freed_memory()  # in this process (procs=1, torchrun); spawned workers call it themselves
    if 'WORLD_SIZE' in os.environ:
        if procs != int(os.environ['WORLD_SIZE']):
            raise ConfigError(f'{name}: --procs {procs}, but torchrun started {os.environ["WORLD_SIZE"]} processes')
        workers.check_mpi_and_procs(name, mpi, procs)
        workers.check_gpus(name, procs)
        if dist.is_initialized():
            workers.run_ranks(f, mpi)
        else:
            workers.run_in_group(f, mpi)
        return
    workers.check_mpi_and_procs(name, mpi, procs)
    workers.check_gpus(name, procs)
    if procs == 1:
        workers.run_ranks(f, mpi)
        return
    workers.spawn(f, mpi, procs)


def launch_trials(name, fn, trials, hparam_class, extra_hparams=None, dry_run=False, mpi=1, procs=None,
                  save_dir=None, hparams_for_ranks=None, derive=None):
    """Build each trial's hparams (bindings, then the command line's extra hparams), validate (and, ours,
    hparams_for_ranks(hparams, mpi): the sizes the ranks share; derive(hparams): the values the trainer
    sets from the others), and run fn(hparams) as `mpi` ranks in `procs` processes per trial (see
    launch). With dry_run, print the resolved hparams instead (print_dry_run)."""
    from lm_human_preferences.utils import workers  # ours: here, as in launch()
    if procs is None:
        procs = workers.default_procs(mpi)
    workers.check_mpi_and_procs(name, mpi, procs)
    jobs = []
    for trial in trials:
        descriptors = []
        kwargs = {}
        for k, v, s in trial:
            if k is not None:
                if k in kwargs:
                    print(f'WARNING: overriding key {k} from {kwargs[k]} to {v}')
                kwargs[k] = v
            if s.get('descriptor'):
                descriptors.append(str(s['descriptor']))
        job_name = (name + '/' + '-'.join(descriptors)).rstrip('/')
        hparams = hparam_class()
        try:
            hparams.override_from_dict(kwargs)
            stages = [hparams.to_flat_dict()]  # ours: who set each value, for the dry run
            if extra_hparams:
                hparams.override_from_str_dict(extra_hparams)
            stages.append(hparams.to_flat_dict())
            if save_dir:
                # Set before validate() (the original set it after) so --dry_run shows the real save dir.
                hparams.run.save_dir = os.path.join(save_dir, job_name)
            hparams.validate()
            if hparams_for_ranks is not None:
                hparams_for_ranks(hparams, mpi)
            if derive is not None:
                derive(hparams)
        except (ValueError, AttributeError, TypeError, AssertionError) as e:
            # The trainers' validate() methods use asserts and exact_div, as the original.
            raise ConfigError(f'{job_name}: {e or type(e).__name__}') from e
        if dry_run:
            command_line.print_dry_run(job_name, hparams, mpi=mpi, procs=procs, bound=kwargs,
                                       command_line=extra_hparams or {}, stages=stages)
        else:
            workers.check_before_start(job_name, hparams)  # ours: wandb, and the save dir not in use
            jobs.append(partial(launch, job_name, partial(fn, hparams), mpi=mpi, procs=procs))
    if not dry_run:  # last: a command is refused for the same reason whatever the machine's GPUs
        workers.check_gpus(name, procs)
    # The original ran local jobs one at a time too (it asserted there was only one).
    for job in jobs:
        job()


def main(commands_dict, argv=None):
    """`python launch.py COMMAND ARG... [--option value] [--dotted.hparam value]` (the original used fire).

    Each command is a function `(positional..., *, options with defaults, **extra_hparams)`: named options
    go to its parameters, every other `--key value` to **extra_hparams (as strings, parsed by HParams).
    Configuration errors print one `error: ...` line and exit 2; bad inputs met while running (downloads,
    files, values) one line and exit 1; a failing worker exits 1 with its traceback.
    """
    argv = sys.argv[1:] if argv is None else argv
    command_line.usage_or_help(commands_dict, argv)
    from lm_human_preferences.utils import stopping, workers  # ours: past --help, which does without torch
    workers.one_line_warnings()
    workers.joined_group = False  # set if this command runs in a process group (under torchrun)
    try:
        command = commands_dict.get(argv[0])
        if command is None:
            raise ConfigError(f"unknown command '{argv[0]}' (choose from: {', '.join(commands_dict)})")
        positional, kw = command_line.command_arguments(argv[0], command, argv[1:])
        command(*positional, **kw)
        if workers.joined_group:  # under torchrun
            workers.exit_without_finalizing(0)
    except ConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        # The reader of our output went away (`... --dry_run | head`): stop quietly, as Unix tools do. The
        # output goes to /dev/null so that flushing it at exit raises no second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except workers.INPUT_ERRORS + (workers.WorkerInputError,) as e:
        # Bad inputs met while running (an unreachable URL, a missing or mismatched checkpoint, malformed
        # labels, a full disk, a non-finite loss), here or in a worker: one line naming the cause.
        # LMHP_TRACEBACK=1 shows where.
        if os.environ.get('LMHP_TRACEBACK'):
            raise
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        sys.exit(stopping.exit_code(e))  # one line said where it stopped and how to resume (utils/stopping.py)
    except workers.WorkerFailed as e:
        # A bug: the message holds the failing worker's traceback; the launcher's own stack adds nothing.
        print(f'error: a worker failed:\n{e}', file=sys.stderr)
        sys.exit(1)
