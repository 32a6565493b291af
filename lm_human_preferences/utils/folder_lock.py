"""Ours: a folder's lock, so that one process at a time writes a folder: a run's save dir (training/run.py, held by
the process that carries rank 0), a labeling session's (labeling/command.py). The lock is `<folder>/.lock`
(flock, exclusive), holding who holds it; the kernel releases the lock of a process that dies, however it dies.
"""

import contextlib
import fcntl
import json
import os
import socket
import sys


class SaveDirInUseError(OSError):
    """Another process holds the save dir's lock (an OSError: launch.py reports it in one line)."""


_held = {}  # realpath of a lock file -> [open file, holders in this process]


@contextlib.contextmanager
def locked_save_dir(save_dir):
    """Hold <save_dir>/.lock (flock, exclusive) for the block; re-entrant within the process (train_policy
    trains its reward model in the same save dir). A stale lock (its holder died) is taken over by the next
    process. The file goes when the block ends."""
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
            raise SaveDirInUseError(save_dir_in_use(save_dir, lock_holder(path) or 'another process')) \
                from None
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def lock_holder(path):
    """Who holds the flock of the lock file at path: its record (pid, host, command, as the holder wrote it)
    as a phrase, or None when nobody holds it (or there is no such file). The launcher checks a save dir's before
    it starts any worker."""
    try:
        f = open(path)
    except OSError:  # none there, or no such folder: the run says what is wrong with its save dir
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(f.read().strip())
                return f'pid {holder["pid"]} on {holder["host"]}, running `{holder["command"]}`'
            except (ValueError, KeyError, TypeError):
                return 'another process'
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


def save_dir_in_use(save_dir, holder):
    return (f'{save_dir} is in use by another run ({holder}): wait for it to end, or give this run another NAME '
            f'(or --save_dir)')
