"""Ours: offline experiments, the paper's whole pipeline on a CPU in minutes, nothing downloaded.

An OfflineExperiment names a small GPT-2 to pretrain, a corpus to pretrain it on, and a program that plays the
human labelers. `python launch.py train_policy <its name> NAME` then runs:

1. the initial model (`task.policy.initial_model = <name>`; pretrain.py);
2. the labels (`labels.source = <name>`; labels.py), written to <save_dir>/<name>_labels.json with held-out
   records after the first labels.num_train, made once per initial model, seed and task (a rerun copies them);
3. the normal train_reward (normalization before and after) and train_policy (PPO, adaptive KL);
4. a report (report.py).

`python launch.py train_reward <its name> NAME` runs steps 1-3 for the reward model only and reports its
accuracy. An experiment package (demo/, sentiment_mini/) declares its OfflineExperiment (its model and labeler,
by name: OfflineExperiment.declare) and its bindings and registers its query dataset, so that only the launcher
knows it. Every step is collective under --mpi N: each rank samples its share (in its section, utils/ranks.py)
and the process that carries rank 0 writes the files.
"""

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from lm_human_preferences import label_types
from lm_human_preferences import train_policy as train_policy_module
from lm_human_preferences import train_reward as train_reward_module
from lm_human_preferences.labeling import programs
from lm_human_preferences.language import encodings, model_sources, trained_models
from lm_human_preferences.offline.report import (best_of_n_rows, finish, online_report, policy_report, reward_report,
                                                  reward_model_on_samples, sample_scores, score_report)
from lm_human_preferences.offline import published
from lm_human_preferences.offline.labels import (bag_of_words_accuracy, cache_path, labeler_ceiling, labels_key,
                                                 make_labels)
from lm_human_preferences.offline.pretrain import PretrainHParams, ensure_pretrained
from lm_human_preferences.online import loop as online_loop
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import cpu, files, ranks


@dataclass(frozen=True)
class Labeler:
    """A program in the human labelers' seat: score(text) of each response; the best of N is a highest
    score. `name` prefixes the report's keys ('<name>_initial_mean', ...); `description` is the line the
    report prints; `score_name` names the score in the report and its figure; `title` names the labeler in
    a sentence ('a perfect learner of <title>'); `instruction` what a person on the labeling page is asked, by
    the label's field (best_of_N's `best`, scalar_rating's `score`, scalar_compare's `difference`): its rule in
    words."""
    name: str
    description: str
    score_name: str
    score: Callable[[str], float]
    title: str
    instruction: Dict[str, str]

    def scores(self, responses, encoder):
        """Scores [b] (float64: a score's ties stay exact) of response token ids [b, n], decoded (the
        padding token decodes to '')."""
        return torch.tensor([float(self.score(encoder.decode(r))) for r in responses.tolist()], dtype=torch.float64)


@dataclass(frozen=True)
class OfflineExperiment:
    """name: the initial model (saved_models_dir()/<name>), the labels.source that asks for generated
    labels, and the prefix of the files it writes in the save dir. corpus(): the pretraining text.
    held_out_labels: label records made after labels.num_train, on which train_reward evaluates.
    eval_queries: test queries sampled (once per policy) for the report. cpu_threads: torch's intra-op
    threads while it runs on a CPU. published: the folder of its published initial model and labels, which a run
    uses where it would make the same (published.py); None: every run makes its own."""
    name: str
    encoding: encodings.Encoding
    corpus: Callable[[], str]
    pretrain: PretrainHParams
    labeler: Labeler
    held_out_labels: int = 256
    eval_queries: int = 256
    cpu_threads: int = 1
    encoding_note: str = ''  # what the encoding is, and where a model of another one runs (an error says it)
    published: Optional[str] = None

    def declare(self):
        """Tells the layers below what this experiment serves, by name, as its query dataset registers its own: its
        initial model (language/model_sources.py: the launch-time checks) and its labeler (labeling/programs.py:
        --online.labeler NAME). Returns the experiment."""
        model_sources.OFFLINE_MODELS[self.name] = self.pretrain.n_ctx
        programs.LABELERS[self.labeler.name] = self.labeler
        return self


def check_initial_models(exp: OfflineExperiment, *tasks):
    """One line, before any work, for an initial model of another encoding than the experiment's: its dataset,
    its labels' tokens and its labeler read that one (a model of another would fail far later, or not at all)."""
    for task in tasks:
        name = task.policy.initial_model
        if name == exp.name:
            continue
        encoding = trained_models.TrainedModel(name).encoding
        if encoding.name != exp.encoding.name:
            raise ValueError(f'task.policy.initial_model {name} is a model of the {encoding.name!r} encoding; the '
                             f'{exp.name} experiment runs on the {exp.encoding.name!r} encoding{exp.encoding_note}')


def resolve_initial_model(exp: OfflineExperiment, *tasks):
    """task.policy.initial_model <name> names the experiment's initial model, published or made once
    (ensure_pretrained): the trainers get its directory. All the tasks of a run at once, so that it is checked (and
    reported) once. Collective."""
    named = [task for task in tasks if task.policy.initial_model == exp.name]
    if named:
        model = ensure_pretrained(exp)
        for task in named:
            task.policy.initial_model = model


def prepare_reward_training(exp: OfflineExperiment, hparams: train_reward_module.HParams, save_dir):
    """For labels.source <name>, make the labels (<save_dir>/<name>_labels.json; a resumed run reuses them; a
    new run copies those an earlier one made with the same key: labels.labels_key) and point labels.source at
    them. Collective. Returns the reward model's references on the held-out
    labels (rank 0; {} when the labels are not ours): `ceiling`, the accuracy a perfect learner of the labeler
    would reach, and `bag_of_words`, a bag-of-words model's trained on the same labels."""
    if hparams.labels.source != exp.name:
        return {}
    if not save_dir:
        raise ValueError(f"labels.source '{exp.name}' writes the labels into run.save_dir, which is not set")
    path = os.path.join(save_dir, f'{exp.name}_labels.json')
    num_labels = hparams.labels.num_train + exp.held_out_labels
    started = time.time()
    if utils.mpi_bcast(os.path.isfile(path)):
        made = 'reused: this save dir already had them'
    else:
        seed = hparams.run.seed or 0
        key = labels_key(exp, hparams, num_labels=num_labels, seed=seed)
        found, cached = published.labels(exp, key), cache_path(exp, key)
        if found:
            made = f"the experiment's published labels, {found.made}"
        elif utils.mpi_bcast(os.path.isfile(cached)):
            made = f'copied from {cached}, made by an earlier run of this seed, initial model and task'
        else:
            make_labels(exp, hparams, cached, num_labels=num_labels, seed=seed)
            made = f'made in {time.time() - started:.0f}s, kept in {cached} for a rerun'
        if ranks.is_root():
            os.makedirs(save_dir, exist_ok=True)
            files.atomic_write(path, published.read_labels(found) if found else Path(cached).read_bytes())
        utils.mpi_bcast(None)  # everyone waits until the copy is in place
    hparams.labels.source = path

    def check_and_measure():
        with open(path) as f:
            records = json.load(f)
        if len(records) != num_labels:
            raise ValueError(f'{path} holds {len(records)} label records, this run needs {num_labels} '
                             f'(labels.num_train {hparams.labels.num_train} + {exp.held_out_labels} held out): it '
                             f'belongs to another run; give this run another NAME (or --save_dir)')
        print(f"{exp.name}: {num_labels} labels by {exp.labeler.description} in {path} "
              f"({hparams.labels.num_train} to train on, {exp.held_out_labels} held out; {made})")
        if not exp.held_out_labels:
            return {}
        encoder = trained_models.TrainedModel(hparams.task.policy.initial_model).encoding.get_encoder()
        train, held_out = records[:hparams.labels.num_train], records[hparams.labels.num_train:]
        return dict(ceiling=labeler_ceiling(exp.labeler, held_out, encoder),
                    bag_of_words=bag_of_words_accuracy(train, held_out, padding_token=encoder.padding_token))
    return utils.root_tries(check_and_measure, fails=(ValueError,)) or {}  # every rank stops, not only rank 0


@contextlib.contextmanager
def cpu_threads(exp: OfflineExperiment):
    """exp.cpu_threads intra-op threads while the experiment runs on a CPU (restored after); $LMHP_CPU_THREADS
    instead when set (e.g. 1 on cores shared with other work)."""
    if utils.get_device().type != 'cpu':
        yield
        return
    saved = torch.get_num_threads()
    threads = int(os.environ.get('LMHP_CPU_THREADS', exp.cpu_threads))
    torch.set_num_threads(threads)
    busy = None if 'LMHP_CPU_THREADS' in os.environ else cpu.busy_cores(threads)
    if busy and ranks.process_index() == 0:
        cores, load = busy
        print(f'{exp.name}: {threads} threads on {cores} cores that other work keeps busy (load average {load:.1f}): '
              f'LMHP_CPU_THREADS=1 runs faster there (the demo beside two one-core jobs: 763 s with 2 threads, 236 s '
              f'with 1)')
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# What rerunning the same command does after a stop in a phase (the trainers and the pretraining say it
# themselves: training/run.py, pretrain.py).
RERUN = {'labels': 'makes the labels again (they are written once all are made)',
         'report samples': 'finds the run done and reports it'}


class _Phases:
    """Wall time per phase of a command, in order: `with phases('labels'): ...`; a stop (Ctrl-C, a stop signal)
    in a phase is one line saying where and what a rerun does, unless the phase said it."""

    def __init__(self, name):
        self.name = name
        self.started = time.time()
        self.spans = {}  # name -> (start, end)

    @contextlib.contextmanager
    def __call__(self, phase):
        start = time.time()
        try:
            yield
        except KeyboardInterrupt as e:
            if not getattr(e, 'reported', False) and ranks.is_root():
                print(f'{self.name}: stopped during {phase}; rerunning the same command '
                      f'{RERUN.get(phase, "starts this phase again")}', file=sys.stderr, flush=True)
                e.reported = True
            raise
        finally:
            self.spans[phase] = (start, time.time())

    def split(self, name, first, second, *, at):
        """Divide phase `name` at time `at` (clamped into it; None: at its start) into `first`, `second`."""
        start, end = self.spans.pop(name)
        at = min(max(start if at is None else at, start), end)
        self.spans[first], self.spans[second] = (start, at), (at, end)

    def seconds(self):
        return {name: end - start for name, (start, end) in self.spans.items()}


def train_reward(exp: OfflineExperiment, hparams: train_reward_module.HParams):
    """`launch.py train_reward <name>`: prepare, train_reward.train, report the held-out accuracy."""
    with cpu_threads(exp):
        return _train_reward(exp, hparams)


def train_policy(exp: OfflineExperiment, hparams: train_policy_module.HParams):
    """`launch.py train_policy <name>`: prepare, train_policy.train (reward model first; the online loop's rounds with
    online.retrains), report."""
    with cpu_threads(exp):
        return _train_policy(exp, hparams)


def _check_labeler(exp: OfflineExperiment):
    # Fails now, in one line, when the labeler cannot run (a package not installed), not after pretraining.
    exp.labeler.score('')


def _train_reward(exp, hparams):
    phases = _Phases(exp.name)
    save_dir = hparams.run.save_dir
    _check_labeler(exp)
    check_initial_models(exp, hparams.task)
    with phases('initial model'):
        resolve_initial_model(exp, hparams.task)
    with phases('labels'):
        references = prepare_reward_training(exp, hparams, save_dir)
    with phases('train_reward'):
        train_reward_module.train(hparams)
    num_responses = label_types.get(hparams.labels.type).num_responses
    report = dict(seed=hparams.run.seed, **reward_report(save_dir, references=references, num_responses=num_responses),
                  phase_times_s=phases.seconds(), wall_time_s=time.time() - phases.started, runs_on=_runs_on())
    use_it = (f'use it:     python launch.py train_policy {exp.name} NAME --rewards.trained_model '
              f'{os.path.join(save_dir, "reward_model")} --rewards.train_new_model off')
    return finish(exp, report, save_dir, [use_it])


def _runs_on():
    """What the experiment ran on (utils/cpu.py), for its report: its wall time, and on a CPU its rounding, depend on
    it."""
    return cpu.describe(utils.get_device())


def _last_write(directory):
    """The newest modification time of the files under directory (None when there are none)."""
    times = [os.path.getmtime(os.path.join(root, f)) for root, _, names in os.walk(directory) for f in names]
    return max(times, default=None)


def labels_origin(exp, hparams: train_policy_module.HParams):
    """Who gave the labels the run's reward model learned from, in a few words for its report: the experiment's
    program, a label file (e.g. people's, from the labeling page), a reward model trained elsewhere; and the
    online loop's rounds. The report's score of the samples is the experiment's program whoever labelled."""
    reward_hparams = hparams.rewards.train_new_model
    if reward_hparams is None:
        return f'none: the reward model {hparams.rewards.trained_model} was trained elsewhere'
    source = reward_hparams.labels.source
    origin = exp.labeler.description if source == exp.name else f'the label file {source}'
    online = hparams.online
    if online.retrains:
        who = 'people on the labeling page' if online.labeler == 'people' else \
            exp.labeler.description if online.labeler == exp.labeler.name else f"the program '{online.labeler}'"
        origin += f'; then {who}, in {online.retrains} rounds of the online loop'
    return origin


def _train_policy(exp, hparams):
    phases = _Phases(exp.name)
    save_dir = hparams.run.save_dir
    labels_from = labels_origin(exp, hparams)  # before labels.source is pointed at the labels made
    if not save_dir:
        raise ValueError(f'the {exp.name} experiment needs run.save_dir: the report compares the saved policy '
                         f'with the initial one')
    _check_labeler(exp)
    reward_hparams = hparams.rewards.train_new_model
    check_initial_models(exp, hparams.task, *([reward_hparams.task] if reward_hparams is not None else []))
    references = {}
    with phases('initial model'):
        resolve_initial_model(exp, hparams.task, *([reward_hparams.task] if reward_hparams is not None else []))
    if reward_hparams is not None:
        with phases('labels'):
            references = prepare_reward_training(exp, reward_hparams, save_dir)

    with phases('training'):
        online_loop.train(hparams, instructions=exp.labeler.instruction)  # train_policy.train, with its online loop
    if reward_hparams is not None:
        # train_policy.train trains the reward model first: the reward model's last write ends that phase.
        phases.split('training', 'train_reward', 'train_policy', at=_last_write(os.path.join(save_dir, 'reward_model')))

    seed = hparams.run.seed or 0
    with phases('report samples'):
        before, before_examples = sample_scores(exp, hparams.task.policy.initial_model, hparams.task, seed=seed)
        after, after_examples = sample_scores(exp, os.path.join(save_dir, 'policy'), hparams.task, seed=seed)
        shift = reward_model_on_samples(exp, hparams, save_dir, seed=seed)
    report = dict(labeler=exp.labeler.description, labels_from=labels_from, seed=hparams.run.seed,
                  **score_report(exp.labeler, before, after),
                  **policy_report(save_dir, hparams), **shift, **online_report(save_dir))
    if reward_hparams is not None:
        report['reward_seed'] = reward_hparams.run.seed
        num_responses = label_types.get(reward_hparams.labels.type).num_responses
        report.update(reward_report(save_dir, references=references, num_responses=num_responses))
    report.update(examples=dict(initial=before_examples, trained=after_examples),
                  phase_times_s=phases.seconds(), wall_time_s=time.time() - phases.started, runs_on=_runs_on())
    return finish(exp, report, save_dir, [f'samples:    python sample.py sample --save_dir {save_dir} --nsamples 8',
                                          f'export:     python sample.py export --save_dir {save_dir} --out HF_DIR',
                                          f'best-of-n:  python sample.py best_of_n --save_dir {save_dir}'])


def best_of_n(exp: OfflineExperiment, hparams: train_policy_module.HParams, *, n, queries, seed):
    """`sample.py best_of_n`: report.best_of_n_rows, with the experiment's CPU threads."""
    with cpu_threads(exp):
        return best_of_n_rows(exp, hparams, n=n, queries=queries, seed=seed)
