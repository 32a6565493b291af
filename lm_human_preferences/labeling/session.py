"""Ours: the one way a labeling session is made, by the `label` command (command.py) and the online loop
(online/loop.py) alike: the question the page asks (the caller's: its experiment's, which the launcher or the
offline engine passes down), the texts' settings, the label key, and how many questions are made at a time for
people."""

import os

from lm_human_preferences.labeling.store import LabelStore, SESSION_FILE, label_key

QUESTION_BATCH = 16  # questions made at a time for people: a person's next minutes


def recorded(directory):
    """Whether directory holds a session already."""
    return os.path.isfile(os.path.join(directory, SESSION_FILE))


def open_session(directory, hparams, *, encoding, labelers, overlap, target, seed, origin, instructions):
    """The session in directory: opened when it holds one, else made for a train_reward hparams (its texts'
    settings); encoding: the name of the tokens' encoding; labelers {name: secret} or None; instructions: what the
    page asks, by label kind (labeling/questions.py's tables, or a program labeler's rule in words)."""
    if recorded(directory):
        return LabelStore(directory)
    task = hparams.task
    return LabelStore.create(
        directory, label_type=hparams.labels.type, instruction=instructions[label_key(hparams.labels.type)],
        texts=dict(encoding=encoding, query_prefix=task.query_prefix, query_suffix=task.query_suffix),
        labelers=labelers, overlap=overlap, target=target, seed=seed, origin=origin)
