"""Ours: the progress lines of a long loop: `done/total done, s/step, ETA`, at least every PRINT_EVERY_S seconds."""

import time


def count(n, noun):
    """'1 rank', '8 ranks', '2 processes'."""
    return f'{n} {noun}' if n == 1 else f'{n} {noun}{"es" if noun.endswith("s") else "s"}'


def duration(seconds):
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
        eta = duration(per_step * (self.total - self._done))
        return f'{self._done}/{self.total} done, {per_step:.3g} s/step, ETA {eta}'

    def due(self):
        """Whether to print a line now: after the first step, after the last, and at least every
        PRINT_EVERY_S seconds between them."""
        now = time.time()
        if self._done in (self.start + 1, self.total) or now - self._printed >= PRINT_EVERY_S:
            self._printed = now
            return True
        return False
