"""Ours: a run's folders: the save dir's lock, held by the process that carries rank 0, so that two runs never
write one save dir; the run folder a path is in; the temporaries killed writers left.

What a save dir holds for a trainer (<scope> is `reward_model` or `policy`):

    <save_dir>/.lock                         held (flock) by the process that carries rank 0
    <save_dir>/<kind>_hparams.json           the run's hparams (a rerun with other values is refused)
    <save_dir>/<kind>_data.json              which labels and queries it used (a rerun on others: refused)
    <save_dir>/<kind>_stats.jsonl            one JSON line per logged step
    <save_dir>/tb/<scope or ppo>/            TensorBoard events
    <save_dir>/<kind>_curves.png             learning curves, at the end
    <save_dir>/<scope>/checkpoints/          model checkpoints, the last run.keep_checkpoints kept
    <save_dir>/<scope>/train_state/          training states for resuming (training/state_files.py)
"""

import contextlib
import fcntl
import json
import os
import socket
import sys

from lm_human_preferences.training import state_files
from lm_human_preferences.utils import files


# Each trainer's folder in the save dir, its model dir.
SCOPES = dict(train_reward='reward_model', train_policy='policy')


class SaveDirInUseError(OSError):
    """Another process holds the save dir's lock (an OSError: launch.py reports it in one line)."""


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
        for mark in [f'{kind}_hparams.json' for kind in SCOPES] + [state_files.TRAIN_STATE_SUBDIR]:
            if os.path.exists(os.path.join(path, mark)):
                return path, mark
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)


def remove_temporaries(save_dir):
    """Temporary files (`*.tmp-<pid>`) that killed writers left anywhere in the save dir: with the lock
    held no writer of ours is at work there."""
    for directory, _, names in os.walk(save_dir):
        if any(files.TMP_RE.fullmatch(n) for n in names):
            files.remove_stale_temporaries(directory)
