"""Ours: the processes that carry a launch's ranks (utils/launch.py's launch and launch_trials).

The workers start with torch.multiprocessing.spawn and join a torch.distributed process group (gloo on CPU, NCCL
with one GPU per process); under torchrun we join the group torchrun describes instead. A worker dies with the
launcher, stops cleanly on a stop signal the launcher passes on (utils/stopping.py), and reports its failure for
the launcher, which raises the first one.
"""

import contextlib
import ctypes
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lm_human_preferences.utils import folder_lock, gcs, optional_deps, ranks, stopping
from lm_human_preferences.utils.command_line import ConfigError


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _backend():
    # LMHP_DIST_BACKEND=gloo forces CPU collectives (the tests use it to run 2 workers on a 1-GPU machine).
    return os.environ.get('LMHP_DIST_BACKEND') or ('nccl' if torch.cuda.is_available() else 'gloo')


joined_group = False  # whether this process ran in a process group (see exit_without_finalizing)


def run_in_group(f, mpi):
    """Join the process group described by the env (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK), run f
    as this process's share of the `mpi` ranks."""
    global joined_group
    backend = _backend()
    if backend == 'nccl':
        torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', '0')))
    dist.init_process_group(backend=backend)
    joined_group = True
    run_ranks(f, mpi)
    # Only on success: after a failure a peer may be stuck in a collective, and tearing the group down
    # could block; the parent kills the workers instead. The barrier first, so that no process tears
    # down its connections while a peer still finishes its last collective.
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(f, mpi):
    """f() as this process's share of the `mpi` ranks; a stop signal ends it cleanly (utils/stopping.py)."""
    with ranks.carry(mpi), stopping.stopping_on_signals():
        f()


def exit_without_finalizing(code):
    """End a process that ran in a process group, skipping Python's finalization: a gloo thread that frees a
    collective's work after the main thread returned takes the GIL while Python finalizes, and dies in
    std::terminate (SIGABRT; PORTING.md). Everything of ours is written and closed by then; only the streams
    need flushing."""
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
INPUT_ERRORS = (gcs.DownloadError, OSError, ValueError, FloatingPointError, optional_deps.MissingExtra)
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


def worker_threads(processes):
    """The intra-op threads of each of `processes` workers: OMP_NUM_THREADS where it is set (as torch takes it in
    one process: the same threads in every layout give the products the same rounding), else the cores shared
    out, at least one each."""
    given = os.environ.get('OMP_NUM_THREADS', '')
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // processes)


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
    torch.set_num_threads(worker_threads(world_size))
    reuse_freed_memory()
    try:
        run_in_group(f, mpi)
    except KeyboardInterrupt as e:
        exit_without_finalizing(stopping.exit_code(e))  # one line said where it stopped (utils/stopping.py)
    except BaseException as e:
        # For the launcher, which reports the first error: when one worker fails, its peers fail next in a
        # collective (connection closed), and only the first one says why.
        report = dict(time=time.time(), input=isinstance(e, (ConfigError,) + INPUT_ERRORS),
                      message=str(e) if isinstance(e, (ConfigError,) + INPUT_ERRORS) else traceback.format_exc())
        # Whole or not at all: the launcher kills the other workers as soon as one fails, maybe mid-write, and a
        # half-written report read as JSON was reported as the error (under load: 'Expecting value: line 1 ...').
        path = os.path.join(error_dir, f'error-{local_rank}')
        with open(path + _PARTIAL, 'w') as out:
            json.dump(report, out)
        os.replace(path + _PARTIAL, path)
        exit_without_finalizing(_ERROR_EXIT)
    exit_without_finalizing(0)


def default_procs(mpi):
    """The processes that carry `mpi` ranks by default: under torchrun, its processes; on CUDA, one per
    visible GPU, at most mpi and a divisor of it; on a CPU, one (more processes than cores only add
    contention, and one process runs every rank's math as the original's ranks would)."""
    if 'WORLD_SIZE' in os.environ:
        return int(os.environ['WORLD_SIZE'])
    if not torch.cuda.is_available():
        return 1
    gpus = torch.cuda.device_count()
    return max((p for p in range(1, min(mpi, gpus) + 1) if mpi % p == 0), default=1)  # --mpi < 1: check_mpi_and_procs says so


def check_mpi_and_procs(name, mpi, procs):
    """One-line ConfigErrors for rank and process counts that cannot work on any machine (before anything
    starts); check_gpus says what this machine cannot carry."""
    if mpi < 1:
        raise ConfigError(f'{name}: --mpi {mpi}: the number of ranks must be at least 1')
    if procs < 1:
        raise ConfigError(f'{name}: --procs {procs}: the number of processes must be at least 1')
    if mpi % procs:
        divisors = [p for p in range(1, mpi + 1) if mpi % p == 0]
        raise ConfigError(f'{name}: --procs {procs} must divide --mpi {mpi} (each process carries the same '
                          f'number of ranks): choose --procs from {divisors}')


def check_gpus(name, procs):
    """A one-line ConfigError when this machine has fewer GPUs than `procs` NCCL processes need. Checked after
    everything else a command can refuse, so that a command is refused for the same reason on any machine."""
    if 'WORLD_SIZE' not in os.environ and procs > 1 and _backend() == 'nccl' and procs > torch.cuda.device_count():
        raise ConfigError(f'{name}: --procs {procs} needs one GPU per process, but only '
                          f'{torch.cuda.device_count()} GPUs are visible (fewer processes carry more ranks each)')


def spawn(f, mpi, procs):
    """launch's procs > 1 outside torchrun: f in `procs` spawned workers joined in a process group; the first
    failure or stop of one is raised here (WorkerInputError, WorkerFailed, stopping.Stopped)."""
    # spawn (not fork): each worker starts a fresh interpreter, safe with CUDA and threads.
    with tempfile.TemporaryDirectory(prefix='lmhp-errors-') as error_dir:
        workers = mp.start_processes(_worker, args=(procs, _free_port(), f, mpi, error_dir), nprocs=procs,
                                     join=False, start_method='spawn').processes
        with _passing_stop_signals_to(workers):
            code = _join(workers)
        if code in _STOPPED_EXITS:  # the worker carrying rank 0 said where it stopped
            raise stopping.Stopped(_STOPPED_EXITS[code], reported=True)
        if code:
            reports = error_reports(error_dir)
            if not reports:
                raise WorkerFailed(f'a worker process ended with exit code {code}' if code > 0 else
                                   f'a worker process was killed by {signal.Signals(-code).name}')
            first = min(reports, key=lambda r: r['time'])
            raise (WorkerInputError if first['input'] else WorkerFailed)(first['message'])


_PARTIAL = '.partial'  # a report being written (a worker killed while writing it leaves one)


def error_reports(error_dir):
    """The whole error reports the workers wrote into error_dir (a killed writer's partial one left out)."""
    reports = []
    for name in sorted(os.listdir(error_dir)):
        if not name.endswith(_PARTIAL):
            with open(os.path.join(error_dir, name)) as report:
                reports.append(json.load(report))
    return reports


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


def check_before_start(job_name, hparams):
    """Ours, before any worker starts: a wandb run can log (its package, key and server), and the run's save dir
    is not in use by another process (the run checks it again when it takes it)."""
    if any(v for k, v in hparams.to_flat_dict().items() if k.endswith('run.wandb')):
        try:
            optional_deps.check_wandb(job_name)
        except (ValueError, optional_deps.MissingExtra) as e:
            raise ConfigError(str(e)) from None
    run_dir = hparams.run.save_dir
    holder = folder_lock.lock_holder(os.path.join(run_dir, '.lock')) if run_dir else None
    if holder is not None:
        raise ConfigError(folder_lock.save_dir_in_use(run_dir, holder))
