"""Launching trials in a group of worker processes (port of the original utils/launch.py).

The original pickled the trial function with cloudpickle and ran it under `mpiexec -n <mpi>`, one MPI
rank per process, with a `fire` command line. Here the `mpi` ranks are carried by `procs` processes,
mpi / procs each, side by side in its batches (utils/ranks.py): one process can run the paper's 8 ranks. We
start the workers with torch.multiprocessing.spawn and join them in a torch.distributed process group
(gloo on CPU, NCCL with one GPU per process); under torchrun we join the group torchrun describes
instead, whose processes carry the ranks. The command line is parsed by `main` below (no `fire`).
"""

import contextlib
import ctypes
import inspect
import json
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lm_human_preferences.utils import core, extras, files, gcs, ranks, stopping


class ConfigError(Exception):
    """A bad command line, experiment name or hyperparameter: reported as one line, without a traceback."""


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _backend():
    # LMHP_DIST_BACKEND=gloo forces CPU collectives (the tests use it to run 2 workers on a 1-GPU machine).
    return os.environ.get('LMHP_DIST_BACKEND') or ('nccl' if torch.cuda.is_available() else 'gloo')


_joined_group = False  # whether this process ran in a process group (see exit_without_finalizing)


def _run_in_group(f, mpi):
    """Join the process group described by the env (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK), run f
    as this process's share of the `mpi` ranks."""
    global _joined_group
    backend = _backend()
    if backend == 'nccl':
        torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', '0')))
    dist.init_process_group(backend=backend)
    _joined_group = True
    _run_ranks(f, mpi)
    # Only on success: after a failure a peer may be stuck in a collective, and tearing the group down
    # could block; the parent kills the workers instead. The barrier first, so that no process tears
    # down its connections while a peer still finishes its last collective.
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(f, mpi):
    """f() as this process's share of the `mpi` ranks; a stop signal ends it cleanly (utils/stopping.py)."""
    with ranks.carry(mpi), stopping.stopping_on_signals():
        f()


def exit_without_finalizing(code):
    """End a process that ran in a process group, skipping Python's finalization.

    A collective's work object is freed by the gloo thread that ran it when that thread lets go of it,
    which can be after the main thread has returned from the collective and gone on to exit, and
    destroy_process_group does not join those threads. Freeing the work's tensors takes the GIL; a
    thread taking the GIL while Python finalizes is ended with pthread_exit, whose forced unwind through
    gloo's noexcept destructor calls std::terminate: SIGABRT, "terminate called without an active
    exception" (2 runs in 100 of tests/test_checkpointing.py's two-process test; a core dump showed
    ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> decref_pyobject -> take_gil -> pthread_exit).
    Everything of ours is written and closed by then; only the streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reuse_freed_memory():
    """Make glibc keep freed memory in the process for reuse, as CUDA's caching allocator does.

    By default glibc hands every large block (above 128 KiB to 32 MiB) out with a fresh mmap and unmaps
    it when freed, so each large CPU tensor (logits [16, 24, 50257] are 77 MB) is page-faulted and
    zeroed by the kernel anew on every step: a third of the time of a GPT-2 124M forward on 2 cores
    (benchmarks/ppo_throughput.py). Nothing changes but speed (and RSS staying at its peak). Returns
    whether it applied: not off glibc, nor over MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ a
    user set.
    """
    if not sys.platform.startswith('linux') or any(
            k in os.environ for k in ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')):
        return False
    try:
        mallopt = ctypes.CDLL('libc.so.6').mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # mallopt takes a C int: 1 GiB blocks still get their own mmap; up to 2 GiB free stays mapped.
    return bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


# Errors of bad inputs (a file, a value, a download, a missing extra), reported in one line by main. A
# worker that fails writes a report (the line, or a bug's traceback) for the launcher, which reports the
# first one.
INPUT_ERRORS = (gcs.DownloadError, OSError, ValueError, FloatingPointError, extras.MissingExtra)
_ERROR_EXIT = 3  # a worker's exit code after it wrote its error report
_STOPPED_EXITS = {stopping.exit_code(stopping.Stopped(signum)): signum for signum in stopping.STOP_SIGNALS}


class WorkerInputError(RuntimeError):
    """A worker stopped on a bad input; the message is its one line."""


class WorkerFailed(RuntimeError):
    """A worker raised (a bug); the message is its traceback."""


def _die_with_parent():
    """Linux: the kernel kills this worker when the launching process dies, whatever signal killed it (a
    plain `kill` of the launcher would otherwise leave the workers training)."""
    if sys.platform.startswith('linux'):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL('libc.so.6').prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)


def one_line_warnings():
    """Warnings (a skipped corrupt checkpoint, a dropped stats line) as one `warning: ...` line each."""
    warnings.formatwarning = lambda message, category, *args, **kwargs: f'warning: {message}\n'


def _worker(local_rank, world_size, port, f, mpi, error_dir):
    _die_with_parent()
    # A process group of its own: a terminal's Ctrl-C reaches the launcher alone, which passes each stop
    # signal on once (a second Ctrl-C would stop the worker at once).
    os.setpgrp()
    one_line_warnings()
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    # Share the cores between the workers (as torchrun does with OMP_NUM_THREADS): N workers each running
    # torch's default of one thread per core spin-wait against each other, many times slower on a CPU.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    reuse_freed_memory()
    try:
        _run_in_group(f, mpi)
    except KeyboardInterrupt as e:
        exit_without_finalizing(stopping.exit_code(e))  # one line said where it stopped (utils/stopping.py)
    except BaseException as e:
        # For the launcher, which reports the first error: when one worker fails, its peers fail next in a
        # collective (connection closed), and only the first one says why.
        report = dict(time=time.time(), input=isinstance(e, (ConfigError,) + INPUT_ERRORS),
                      message=str(e) if isinstance(e, (ConfigError,) + INPUT_ERRORS) else traceback.format_exc())
        with open(os.path.join(error_dir, f'error-{local_rank}'), 'w') as out:
            json.dump(report, out)
        exit_without_finalizing(_ERROR_EXIT)
    exit_without_finalizing(0)


# `--help` for --procs left unset (default_procs).
PROCS_HELP = 'one per GPU, at most --mpi and a divisor of it; 1 on a CPU; under torchrun, its processes'


def default_procs(mpi):
    """The processes that carry `mpi` ranks by default: under torchrun, its processes; on CUDA, one per
    visible GPU, at most mpi and a divisor of it; on a CPU, one (more processes than cores only add
    contention, and one process runs every rank's math as the original's ranks would)."""
    if 'WORLD_SIZE' in os.environ:
        return int(os.environ['WORLD_SIZE'])
    if not torch.cuda.is_available():
        return 1
    gpus = torch.cuda.device_count()
    return max((p for p in range(1, min(mpi, gpus) + 1) if mpi % p == 0), default=1)  # --mpi < 1: check_ranks says so


def check_ranks(name, mpi, procs):
    """One-line ConfigErrors for rank and process counts that cannot work (before anything starts)."""
    if mpi < 1:
        raise ConfigError(f'{name}: --mpi {mpi}: the number of ranks must be at least 1')
    if procs < 1:
        raise ConfigError(f'{name}: --procs {procs}: the number of processes must be at least 1')
    if mpi % procs:
        divisors = [p for p in range(1, mpi + 1) if mpi % p == 0]
        raise ConfigError(f'{name}: --procs {procs} must divide --mpi {mpi} (each process carries the same '
                          f'number of ranks): choose --procs from {divisors}')
    if 'WORLD_SIZE' not in os.environ and procs > 1 and _backend() == 'nccl' and procs > torch.cuda.device_count():
        raise ConfigError(f'{name}: --procs {procs} needs one GPU per process, but only '
                          f'{torch.cuda.device_count()} GPUs are visible (fewer processes carry more ranks each)')


def launch(name, f, *, mpi=1, procs=None) -> None:
    """Run f() as `mpi` ranks (the original: `mpiexec -n mpi`) carried by `procs` processes joined in a
    torch.distributed group, mpi / procs ranks each (utils/ranks.py); procs None: default_procs(mpi).

    procs=1 runs f in this process with no group. Under torchrun (WORLD_SIZE set) f runs in this process
    inside torchrun's group, whose processes carry the ranks. If a worker raises, the others are killed
    and WorkerInputError (its one line) or WorkerFailed (its traceback) is raised here; a stop signal
    stops them all, saved, and raises stopping.Stopped.
    """
    if procs is None:
        procs = default_procs(mpi)
    reuse_freed_memory()  # in this process (procs=1, torchrun); spawned workers call it themselves
    if 'WORLD_SIZE' in os.environ:
        if procs != int(os.environ['WORLD_SIZE']):
            raise ConfigError(f'{name}: --procs {procs}, but torchrun started {os.environ["WORLD_SIZE"]} processes')
        check_ranks(name, mpi, procs)
        if dist.is_initialized():
            _run_ranks(f, mpi)
        else:
            _run_in_group(f, mpi)
        return
    check_ranks(name, mpi, procs)
    if procs == 1:
        _run_ranks(f, mpi)
        return
    # spawn (not fork): each worker starts a fresh interpreter, safe with CUDA and threads.
    with tempfile.TemporaryDirectory(prefix='lmhp-errors-') as error_dir:
        workers = mp.start_processes(_worker, args=(procs, _free_port(), f, mpi, error_dir), nprocs=procs,
                                     join=False, start_method='spawn').processes
        with _passing_stop_signals_to(workers):
            code = _join(workers)
        if code in _STOPPED_EXITS:  # the worker carrying rank 0 said where it stopped
            raise stopping.Stopped(_STOPPED_EXITS[code], reported=True)
        if code:
            reports = []
            for name in os.listdir(error_dir):
                with open(os.path.join(error_dir, name)) as report:
                    reports.append(json.load(report))
            if not reports:
                raise WorkerFailed(f'a worker process ended with exit code {code}' if code > 0 else
                                   f'a worker process was killed by {signal.Signals(-code).name}')
            first = min(reports, key=lambda r: r['time'])
            raise (WorkerInputError if first['input'] else WorkerFailed)(first['message'])


_STOP_GRACE_S = 60  # how long workers may take to stop after the first stopped on a signal


def _join(processes):
    """Wait for the worker processes; the exit code of the first that failed, 0 if none did. The others are
    then killed at once (those waiting for it in a collective would wait forever), or when it stopped on a
    signal, after _STOP_GRACE_S: they save and stop by themselves (utils/stopping.py)."""
    running, first, deadline = list(processes), 0, None
    while running:
        multiprocessing.connection.wait([p.sentinel for p in running],
                                        timeout=None if deadline is None else max(0.0, deadline - time.time()))
        for p in [p for p in running if p.exitcode is not None]:
            running.remove(p)
            if p.exitcode and not first:
                first = p.exitcode
                deadline = time.time() + (_STOP_GRACE_S if first in _STOPPED_EXITS else 0)
        if deadline is not None and time.time() >= deadline:
            for p in running:
                p.kill()
    return first


@contextlib.contextmanager
def _passing_stop_signals_to(processes):
    """In the block, the launcher passes each stop signal it gets on to the workers (in process groups of
    their own) and goes on waiting for them: they save and stop (utils/stopping.py)."""
    def pass_on(signum, frame):
        for p in processes:
            if p.exitcode is None:
                os.kill(p.pid, signum)
    previous = {signum: signal.signal(signum, pass_on) for signum in stopping.STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def launch_trials(name, fn, trials, hparam_class, extra_hparams=None, dry_run=False, mpi=1, procs=None,
                  save_dir=None, hparams_for_ranks=None, derive=None):
    """Build each trial's hparams (bindings, then the command line's extra hparams), validate (and, ours,
    hparams_for_ranks(hparams, mpi): the sizes the ranks share; derive(hparams): the values the trainer
    sets from the others), and run fn(hparams) as `mpi` ranks in `procs` processes per trial (see
    launch). With dry_run, print the resolved hparams instead (print_dry_run)."""
    if procs is None:
        procs = default_procs(mpi)
    check_ranks(name, mpi, procs)
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
            stages = [_flat(hparams)]  # ours: who set each value, for the dry run
            if extra_hparams:
                hparams.override_from_str_dict(extra_hparams)
            stages.append(_flat(hparams))
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
            print_dry_run(job_name, hparams, mpi=mpi, procs=procs, bound=kwargs, command_line=extra_hparams or {},
                          stages=stages)
        else:
            if any(v for k, v in _flat(hparams).items() if k.endswith('run.wandb')):
                try:
                    extras.check_wandb(job_name)  # ours: a missing key or an unreachable server, before any work
                except (ValueError, extras.MissingExtra) as e:
                    raise ConfigError(str(e)) from None
            run_dir = hparams.run.save_dir
            holder = files.lock_holder(os.path.join(run_dir, '.lock')) if run_dir else None
            if holder is not None:  # ours: before any worker starts (the run checks it again when it takes it)
                raise ConfigError(files.save_dir_in_use(run_dir, holder))
            jobs.append(partial(launch, job_name, partial(fn, hparams), mpi=mpi, procs=procs))
    # The original ran local jobs one at a time too (it asserted there was only one).
    for job in jobs:
        job()


def _flat(hparams):
    return core.flatten_dict(hparams.to_nested_dict(), sep='.')


def print_dry_run(job_name, hparams, *, mpi, procs, bound, command_line, stages):
    """Ours (the original printed the bindings' dict on one line, then the nested hparams): the ranks and
    processes, the save dirs the run will use, then every hparam as `key: value` (repr), one per line, with
    who set it: the experiment, the command line (directly, or through an hparam that sets others too),
    the launcher (run.save_dir: --save_dir/NAME) or the trainer (derived from other hparams). stages: the
    flat hparams after the experiment's bindings and after the command line's."""
    after_bindings, after_command_line = stages
    final = _flat(hparams)

    def origin(k):
        if k in command_line or after_command_line.get(k) != after_bindings.get(k):
            return 'command line'
        if final[k] != after_command_line.get(k):
            return '--save_dir/NAME' if k == 'run.save_dir' else 'derived'
        return 'experiment' if k in bound else None
    origins = {k: origin(k) for k in final}
    ranks_text = f'{mpi} rank{"s" if mpi != 1 else ""}'
    procs_text = f'{procs} process{"es" if procs != 1 else ""}'
    print(f'{job_name}: {ranks_text} (--mpi {mpi}) in {procs_text} (--procs {procs}); --dry_run: nothing runs')
    print('save dirs, and what the trainer derives from them:')
    for k in sorted(final):
        if k.endswith('save_dir') or origins[k] == 'derived':
            print(f'  {k}: {final[k]}')
    print('hparams (# who set it: the experiment, the command line, or derived from others; no mark: the default):')
    for k in sorted(final):
        print(f'  {k}: {final[k]!r}' + (f'  # {origins[k]}' if origins[k] else ''))


def _parse_command_line(argv, params):
    """argv (after the command) -> (positional args, options). `--key value` and `--key=value`; an option
    that is a bool parameter of the command may be given alone as a flag (`--dry_run`)."""
    positional, options = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith('--'):
            positional.append(arg)
            i += 1
            continue
        key, eq, value = arg[2:].partition('=')
        if not key:
            raise ConfigError(f"malformed option '{arg}'")
        if key in options:
            raise ConfigError(f"option --{key} given twice")
        param = params.get(key)
        is_flag = param is not None and isinstance(param.default, bool)
        if not eq:
            if is_flag and (i + 1 == len(argv) or argv[i + 1].startswith('--')):
                value = 'true'
            elif i + 1 == len(argv):
                raise ConfigError(f'option --{key} needs a value')
            else:
                i += 1
                value = argv[i]
        options[key] = value
        i += 1
    return positional, options


def _convert_option(key, value, param):
    """Command options (not hparams) take the type of their default (bool / int / float); None defaults
    take int for `mpi` and `procs`, str otherwise."""
    default = param.default
    if isinstance(default, bool):
        if value.lower() in ('t', 'true', '1', 'yes'):
            return True
        if value.lower() in ('f', 'false', '0', 'no'):
            return False
        raise ConfigError(f"option --{key}: invalid bool '{value}'")
    if isinstance(default, int) or (default is None and key in ('mpi', 'procs')):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"option --{key}: invalid int '{value}'") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"option --{key}: invalid float '{value}'") from None
    return value


# A command's options whose default is None say in `--help` what that means (ours: the help printed
# "(set by the command)"): the command's `option_help` dict maps each to a text, or to REQUIRED.
REQUIRED = 'required'


def _option_help(command):
    return getattr(command, 'option_help', {})


def _usage(name, command):
    words = [name]
    for p in inspect.signature(command).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            words.append('[--dotted.hparam VALUE ...]')
        elif p.default is inspect.Parameter.empty:
            words.append(p.name.upper())
        elif _option_help(command).get(p.name) == REQUIRED:
            words.append(f'--{p.name} {p.name.upper()}')
        else:
            words.append(f'[--{p.name} {p.name.upper()}]' if not isinstance(p.default, bool) else f'[--{p.name}]')
    return ' '.join(words)


def main(commands_dict, argv=None):
    """`python launch.py COMMAND ARG... [--option value] [--dotted.hparam value]` (the original used fire).

    Each command is a function `(positional..., *, options with defaults, **extra_hparams)`: named options
    go to its parameters, every other `--key value` to **extra_hparams (as strings, parsed by HParams).
    Configuration errors print one `error: ...` line and exit 2; bad inputs met while running (downloads,
    files, values) one line and exit 1; a failing worker exits 1 with its traceback.
    """
    argv = sys.argv[1:] if argv is None else argv
    program = os.path.basename(sys.argv[0])
    usage = '\n'.join(f'usage: {program} {_usage(name, command)}' for name, command in commands_dict.items())
    if not argv or argv[0] in ('-h', '--help'):
        print(usage + f'\n\n`{program} COMMAND --help` tells more of each command.')
        sys.exit(0 if argv else 2)
    if argv[0] in commands_dict and any(a in ('-h', '--help') for a in argv[1:]):
        print(command_help(program, argv[0], commands_dict[argv[0]]))
        sys.exit(0)
    one_line_warnings()
    global _joined_group
    _joined_group = False  # set if this command runs in a process group (under torchrun)
    try:
        command = commands_dict.get(argv[0])
        if command is None:
            raise ConfigError(f"unknown command '{argv[0]}' (choose from: {', '.join(commands_dict)})")
        positional, kw = _command_arguments(argv[0], command, argv[1:])
        command(*positional, **kw)
        if _joined_group:  # under torchrun
            exit_without_finalizing(0)
    except ConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        # The reader of our output went away (`... --dry_run | head`): stop quietly, as Unix tools do. The
        # output goes to /dev/null so that flushing it at exit raises no second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except INPUT_ERRORS + (WorkerInputError,) as e:
        # Bad inputs met while running (an unreachable URL, a missing or mismatched checkpoint, malformed
        # labels, a full disk, a non-finite loss), here or in a worker: one line naming the cause.
        # LMHP_TRACEBACK=1 shows where.
        if os.environ.get('LMHP_TRACEBACK'):
            raise
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        sys.exit(stopping.exit_code(e))  # one line said where it stopped and how to resume (utils/stopping.py)
    except WorkerFailed as e:
        # A bug: the message holds the failing worker's traceback; the launcher's own stack adds nothing.
        print(f'error: a worker failed:\n{e}', file=sys.stderr)
        sys.exit(1)


def _command_arguments(name, command, args):
    """(positional arguments, keyword arguments) of a command line's args for command (see main)."""
    params = inspect.signature(command).parameters
    positional, options = _parse_command_line(args, params)
    kw = {}
    names = [p.name for p in params.values() if p.default is inspect.Parameter.empty
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != len(names):
        raise ConfigError(f"{name} takes {len(names)} arguments ({' '.join(names).upper()}), "
                          f"got {len(positional)}: {' '.join(positional)}")
    takes_hparams = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key, value in options.items():
        param = params.get(key)
        if param is not None and param.kind is not param.VAR_KEYWORD:
            kw[key] = _convert_option(key, value, param)
        elif takes_hparams:
            kw[key] = value  # a dotted hparam override: goes to **extra_hparams
        else:
            raise ConfigError(f'{name} has no option --{key}')
    return positional, kw


def _option_default(command, param):
    if param.default is False:  # a switch: --dry_run alone is true
        return '(a switch: on when given)'
    return f'({_option_help(command)[param.name]})' if param.default is None else repr(param.default)


def command_help(program, name, command):
    """`COMMAND --help`: the command's description (its docstring), usage, options with their defaults (or
    for those left unset, their option_help: what happens then, or REQUIRED), and, where the command lists
    them, its experiments and most used hparams."""
    lines = [f'usage: {program} {_usage(name, command)}', '', inspect.cleandoc(command.__doc__ or '')]
    options = [p for p in inspect.signature(command).parameters.values()
               if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
    if options:
        lines += ['', 'options:'] + [f'  --{p.name} ' + _option_default(command, p) for p in options]
    extra = getattr(command, 'help_sections', None)
    if extra is not None:
        lines += ['', extra()]
    return '\n'.join(lines).rstrip()
