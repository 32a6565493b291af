"""Ours: the offline experiments, by name: the package that declares each (its OfflineExperiment, its bindings,
its query dataset; offline/ is their engine). launch.py, sample.py and language/trained_models.py read this table;
a package is imported only when it is asked for (it pulls in the trainers, and registers its query dataset)."""

import importlib

PACKAGES = dict(demo='lm_human_preferences.demo', sentiment_mini='lm_human_preferences.sentiment_mini')
# Their labelers (each experiment's Labeler.name), the programs the online loop can ask: --online.labeler NAME.
LABELERS = dict(rule='demo', vader='sentiment_mini')


def package(name):
    """The package of the offline experiment `name` (its train_policy / train_reward entry points, EXPERIMENT)."""
    return importlib.import_module(PACKAGES[name])


def experiment(name):
    """The OfflineExperiment `name` (offline/experiment.py)."""
    return package(name).EXPERIMENT


def labeler(name):
    """The program labeler `name` (LABELERS): its experiment's Labeler (offline/experiment.py)."""
    return experiment(LABELERS[name]).labeler


def experiments():
    """Every OfflineExperiment, in the table's order."""
    return [experiment(name) for name in PACKAGES]
