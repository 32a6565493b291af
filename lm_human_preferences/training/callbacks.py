"""Ours: hooks into a trainer's loop, in the spirit of Hugging Face TRL's TrainerCallback: a caller adds behaviour
(train_policy's: the online loop, online/loop.py) without the trainer knowing it. A callback defines any of
on_train_begin(training), on_step_begin(training) and on_train_end(training); `training` holds what the trainer
shares with them (train_policy: its PPO trainer, score model, run, save() and restore())."""

import contextlib
import types


class Callbacks:
    def __init__(self, callbacks, **training):
        self.callbacks = list(callbacks)
        self.training = types.SimpleNamespace(**training)

    def _call(self, event):
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(self.training)

    @contextlib.contextmanager
    def around_training(self):
        """on_train_begin before the block (the training loop), on_train_end after it, also when it stops."""
        self._call('on_train_begin')
        try:
            yield
        finally:
            self._call('on_train_end')

    def on_step_begin(self):
        self._call('on_step_begin')
