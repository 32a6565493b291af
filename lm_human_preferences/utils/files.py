"""Files we write and read: atomically, and never by unpickling (ours; the original wrote with tf.gfile).

A run is killed, preempted or out of disk at any moment, so every file we save is written whole or not
at all (`atomic_write`: a temporary `<path>.tmp-<pid>`, fsync, rename, fsync of the directory), and the
temporaries of a writer that was killed are recognized by their name (`TMP_RE`) and removed. Nothing we
load is unpickled: tensors come from safetensors, the rest from JSON (`refuse_pickle`).
"""

import hashlib
import os
import re

TMP_RE = re.compile(r'.*\.tmp-\d+')


def fsync_dir(directory):
    """Make renames / creations inside directory durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data):
    """Write data (bytes, or a list of bytes-like chunks written one after another) to path so that path
    holds either its old content or all of data, never a part.

    Written to `<path>.tmp-<pid>` with os.write (short writes continued), fsynced, renamed over path,
    and the directory fsynced. On any error (ENOSPC, EIO, ...) the temporary file is removed and the
    OSError propagates; path is untouched.
    """
    tmp = f'{path}.tmp-{os.getpid()}'
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            for chunk in (data if isinstance(data, list) else [data]):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def sha256_file(path):
    """The sha256 of a file's bytes (hex), read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 24), b''):
            h.update(block)
    return h.hexdigest()


def refuse_pickle(path):
    """Raise ValueError if path starts like a pickle: torch.save writes a zip (PK..) holding one, and raw
    pickles start with the PROTO opcode 0x80. Unpickling can run arbitrary code, so we never do it. A
    safetensors file (an 8-byte header length, then its JSON header '{') is never mistaken for one."""
    with open(path, 'rb') as f:
        magic = f.read(9)
    if magic[8:9] != b'{' and (magic.startswith(b'PK\x03\x04') or magic[:1] == b'\x80'):
        raise ValueError(f'refusing to load {path}: it is a pickle / torch.save file (unpickling can run '
                         f'arbitrary code); we load only safetensors and JSON')


def remove_stale_temporaries(directory):
    """Remove the temporary files (`*.tmp-<pid>`) that a killed writer left in directory; returns their names."""
    removed = []
    for name in os.listdir(directory):
        if TMP_RE.fullmatch(name):
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed


def remove_stale_temporaries_in_tree(root):
    """remove_stale_temporaries in root and every folder below it (a run's save dir, its lock held: no writer
    of ours is at work there)."""
    for directory, _, names in os.walk(root):
        if any(TMP_RE.fullmatch(n) for n in names):
            remove_stale_temporaries(directory)
