"""Ours: stopping on a signal. Ctrl-C, a scheduler's SIGTERM and Slurm's notice ahead of a time limit end a run
cleanly: in a training loop (training/run.py's Run.training) at its next step boundary, saved, with one line saying
where it stopped and how to resume; elsewhere at once, with one line. Every process launch.py runs handles them
(utils/launch.py); the process exits with 128 + the signal's number, as a shell reports a process a signal ended."""

import contextlib
import signal
import threading

from lm_human_preferences.utils import distributed

# Ctrl-C, a scheduler's SIGTERM (Slurm, Kubernetes, torchrun's shutdown) and the notice Slurm sends ahead of
# a time limit (sbatch --signal=USR1@SECONDS).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum):
    return 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else signal.Signals(signum).name


class Stopped(KeyboardInterrupt):
    """A stop signal ended the run (a KeyboardInterrupt, as Ctrl-C's: what catches one catches both); the
    process exits with 128 + signum. reported: whether a line said where it stopped."""

    def __init__(self, signum, *, reported=False):
        super().__init__(signal_name(signum))
        self.signum = signum
        self.reported = reported


def exit_code(e: KeyboardInterrupt):
    """A stopped process's exit status, as a shell gives one a signal ended: 128 + the signal's number."""
    return 128 + getattr(e, 'signum', signal.SIGINT)


_stop = dict(requested=None, deferring=False)  # the signal received, and whether a training loop waits for it


def _on_stop_signal(signum, frame):
    """In a training loop (Run.training) the first stop signal waits for its next step boundary, where the run
    saves and stops; elsewhere, and at a second Ctrl-C, Stopped is raised at once. A scheduler's signal that
    comes again (it signals every process, and the launcher passes it on) changes nothing."""
    if _stop['requested'] is None and _stop['deferring']:
        _stop['requested'] = signum
    elif _stop['requested'] is None or signum == signal.SIGINT:
        raise Stopped(signum)


def stop_signal_of_any_process():
    """The stop signal any process received (the highest number), 0 for none. Collective."""
    return -distributed.processes_min(-(_stop['requested'] or 0))


@contextlib.contextmanager
def stopping_on_signals():
    """Run the block (a process of launch.py's) with STOP_SIGNALS handled as _on_stop_signal says. Signal
    handlers are the main thread's: in another the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop.update(requested=None, deferring=False)


@contextlib.contextmanager
def deferred():
    """A stop signal received in the block waits for the training loop to ask (training/run.py's save_due)."""
    deferring = _stop['deferring']
    _stop['deferring'] = True
    try:
        yield
    finally:
        _stop['deferring'] = deferring
