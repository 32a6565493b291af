"""Ours, the launcher's: the offline experiments by name, each a package that declares its OfflineExperiment (its
experiment.py; offline/ is their engine) and its bindings (bindings.py). launch.py, sample.py and their commands
read this table; no layer below them asks which experiments exist: what one needs of an experiment is passed down
(its question, to the labeling session and the online loop) or declared to it (its query dataset, initial model
and labeler, by name)."""

NAMES = ('demo', 'sentiment_mini')


def experiment(name):
    """The OfflineExperiment `name`, declared when first asked for (it pulls in the trainers and torch), read at call
    time (tests shorten it)."""
    from lm_human_preferences import demo, sentiment_mini
    return dict(demo=demo, sentiment_mini=sentiment_mini)[name].EXPERIMENT


def experiments():
    """Every OfflineExperiment, in the table's order, declared: a command that runs declares them all first, so that
    their models and labelers are known by name (task.policy.initial_model, online.labeler) whatever the run's."""
    return [experiment(name) for name in NAMES]
