"""Ours: the one way a labeling session is made, by the `label` command (command.py) and the online loop
(online/loop.py) alike: the question the page asks (one lookup, from the run's hparams), the texts' settings, the
label key, and how many questions are made at a time for people."""

import os
import re

from lm_human_preferences import offline_experiments
from lm_human_preferences.labeling import questions as questions_module
from lm_human_preferences.labeling.store import LabelStore, SESSION_FILE, label_key

QUESTION_BATCH = 16  # questions made at a time for people: a person's next minutes
# A paper experiment's labels (launch.py's labels.source): https://.../lm-human-preferences/labels/<experiment>/...
PAPER_LABELS = re.compile(r'/labels/([a-z_]+)/')


def experiment_of(hparams):
    """The experiment whose question fits a train_reward hparams (its task and labels): an offline experiment's
    name (its initial model or its labels.source), a paper experiment's (the folder of its labels.source, or its
    query dataset), or None."""
    task, source = hparams.task, str(hparams.labels.source or '')
    for name in (task.policy.initial_model, source):
        if name in offline_experiments.PACKAGES:
            return name
    found = PAPER_LABELS.search(source)
    if found and found.group(1) in questions_module.INSTRUCTIONS:
        return found.group(1)
    return task.query_dataset if task.query_dataset in questions_module.INSTRUCTIONS else None


def instruction(hparams, labeler=None):
    """What the page asks for a train_reward hparams' task and label type (labeler: a program in the labelers'
    seat, whose rule in words is what it was asked): the paper's instructions by experiment, an offline
    experiment's labeler's rule, else the generic question."""
    key = label_key(hparams.labels.type)
    if labeler is None:
        name = experiment_of(hparams)
        if name in offline_experiments.PACKAGES:
            labeler = offline_experiments.experiment(name).labeler
    if labeler is not None:
        return labeler.instruction[key]
    table = questions_module.INSTRUCTIONS.get(experiment_of(hparams), questions_module.GENERIC_INSTRUCTION)
    return table[key]


def recorded(directory):
    """Whether directory holds a session already."""
    return os.path.isfile(os.path.join(directory, SESSION_FILE))


def open_session(directory, hparams, *, encoding, labelers, overlap, target, seed, origin, labeler=None):
    """The session in directory: opened when it holds one, else made for a train_reward hparams (the question
    asked, its texts' settings); encoding: the name of the tokens' encoding; labelers {name: secret} or None;
    labeler: a program in the labelers' seat (its rule is what is asked)."""
    if recorded(directory):
        return LabelStore(directory)
    task = hparams.task
    return LabelStore.create(
        directory, label_type=hparams.labels.type, instruction=instruction(hparams, labeler),
        texts=dict(encoding=encoding, query_prefix=task.query_prefix, query_suffix=task.query_suffix),
        labelers=labelers, overlap=overlap, target=target, seed=seed, origin=origin)
