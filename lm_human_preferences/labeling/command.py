"""Ours: `python launch.py label EXPERIMENT NAME`: people label questions of the experiment's task in a browser.

The questions come from the task's initial model (or --policy SAVE_DIR: a train_policy run's policy; or
--validation SAVE_DIR: the paper's validation form, two responses from the initial model and two from the run's
policy), made a batch at a time as they are needed; the labels go to <save_dir>/NAME/labels.json in the
original's format (store.py), which train_reward reads with --labels.source. Rerunning the same command goes on
with the same session: what was answered stays answered.
"""

import json
import os
import sys
import time

from lm_human_preferences.labeling import questions as questions_module
from lm_human_preferences.labeling import session as session_module
from lm_human_preferences.labeling import session_stats
from lm_human_preferences.labeling.server import LabelServer, check_origin, is_loopback
from lm_human_preferences.labeling.store import SESSION_FILE, parse_labelers
from lm_human_preferences.language import trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import folder_lock, gcs, stopping


def default_save_dir():
    """Where label sessions go unless --save_dir says: <datasets dir>/labels (kept: people's work is data)."""
    return os.path.join(gcs.datasets_dir(), 'labels')


def _policy(model, task):
    policy = Policy.for_task(model, task).to(utils.get_device())
    policy.requires_grad_(False)
    return policy


def _run_hparams(save_dir, task):
    """Check that save_dir is a train_policy run of the task's queries (one line if not)."""
    hparams_path = os.path.join(save_dir, 'train_policy_hparams.json')
    if not os.path.isfile(hparams_path):
        raise ValueError(f'{save_dir} is no train_policy save dir ({hparams_path} is missing)')
    with open(hparams_path) as f:
        run_task = json.load(f)['task']
    for k in ('query_dataset', 'query_length', 'response_length', 'query_prefix', 'query_suffix'):
        if run_task.get(k) != getattr(task, k):
            raise ValueError(f"{save_dir}'s run had task.{k} {run_task.get(k)!r}, this session {getattr(task, k)!r}: "
                             f"its policy answers another task's queries")


def _run_policy(save_dir, task):
    """The policy of a train_policy save dir (checked by _run_hparams), for task."""
    return _policy(trained_models.TrainedModel(name='policy', savedir=os.path.join(save_dir, 'policy')), task)


def label_session(hparams, *, instructions, policy=None, validation=None, num=100, labelers=None,
                  host='127.0.0.1', port=0, overlap=0.05, origin=None, question_batch=session_module.QUESTION_BATCH,
                  prepare_task=None):
    """Serve the session in hparams.run.save_dir (a train_reward experiment's hparams: its task, labels.type and
    run.seed) until num labels are given; returns the store. instructions: what the page asks, by label kind;
    prepare_task(task): what makes the task's initial model first (an offline experiment's pretraining):
    both the experiment's, which the launcher passes; origin: the page's public address behind a reverse proxy.
    Every bad argument is one line before anything is made; the page is up before the first questions are made."""
    task, label_type, seed = hparams.task, hparams.labels.type, hparams.run.seed or 0
    directory = hparams.run.save_dir
    existing = None
    if session_module.recorded(directory):
        with open(os.path.join(directory, SESSION_FILE)) as f:
            existing = json.load(f)
    _check_arguments(directory, existing, policy=policy, validation=validation, num=num, labelers=labelers,
                     host=host, overlap=overlap, origin=origin)
    run_dir = policy or validation
    if run_dir is not None:
        _run_hparams(run_dir, task)
    server = LabelServer(host=host, port=port, origin=origin)  # a port in use: one line, nothing made
    try:
        if prepare_task is not None:
            prepare_task(task)
        initial_model = trained_models.TrainedModel(task.policy.initial_model)
        made_from = dict(form='validation' if validation else 'policy', initial_model=initial_model.checkpoint(),
                         run=os.path.abspath(run_dir) if run_dir else None)
        if existing is not None:
            _check_same_session(existing, directory, label_type=label_type, origin=made_from)
        os.makedirs(directory, exist_ok=True)
        with folder_lock.locked_save_dir(directory):
            store = session_module.open_session(
                directory, hparams, encoding=initial_model.encoding.name, labelers=parse_labelers(labelers),
                overlap=overlap, target=num, seed=seed, origin=made_from, instructions=instructions)
            store.set_target(num)
            return _serve(store, server, task=task, label_type=label_type, seed=seed, initial_model=initial_model,
                          run_dir=run_dir, validation=validation is not None, question_batch=question_batch)
    finally:
        server.stop()


def _check_arguments(directory, existing, *, policy, validation, num, labelers, host, overlap, origin):
    if policy is not None and validation is not None:
        raise ValueError('--policy and --validation both name a run: give one (--validation asks about the '
                         'initial model and that run\'s policy side by side)')
    if num < 1:
        raise ValueError(f'--num {num}: the labels wanted must be at least 1')
    if not 0 <= overlap < 1:
        raise ValueError(f'--overlap {overlap}: the share of questions asked twice must be at least 0 and under 1')
    check_origin(origin)
    given = parse_labelers(labelers)
    if existing is not None:
        recorded = existing['labelers']
        if labelers is not None and recorded is None:
            raise ValueError(f'{directory} is an open session (anyone names themselves): --labelers can only be given '
                             f'when a session starts')
        if given is not None and set(given) != set(recorded):
            raise ValueError(f'--labelers {labelers}: {directory} was started with --labelers '
                             f'{",".join(recorded)} (their links stay the same): give those, or another NAME for '
                             f'a new session')
        if overlap != existing['overlap']:
            raise ValueError(f'--overlap {overlap}: {directory} was started with --overlap {existing["overlap"]}: '
                             f'give that, or another NAME for a new session')
    named = existing['labelers'] if existing is not None else given
    if (not is_loopback(host) or origin is not None) and named is None:
        raise ValueError(f'--host {host}' + (f' --origin {origin}' if origin else '') + ' opens the page beyond this '
                         'machine: name the labelers with --labelers a,b,... so that each gets a link with a secret '
                         'of their own')


def _check_same_session(recorded, directory, *, label_type, origin):
    if recorded['label_type'] != label_type or recorded['origin'] != origin:
        raise ValueError(f'{directory} holds another session ({recorded["label_type"]} questions, '
                         f'{recorded["origin"]}): give this one another NAME (or --save_dir)')


def _serve(store, server, *, task, label_type, seed, initial_model, run_dir, validation, question_batch):
    """The page first (it says no question is open while the models load and the first batch is made), then
    questions a batch at a time as they are needed, until the labels wanted are given."""
    server.set_session(store)
    _announce(store, server, task, run_dir, validation)
    server.start()
    try:
        rho = _policy(initial_model, task)
        if run_dir is None:
            policy, initial = rho, None
        else:
            policy = _run_policy(run_dir, task)
            initial = rho if validation else None
        source = questions_module.QuestionSource(task=task, label_type=label_type, policy=policy, initial=initial,
                                                 size=question_batch, seed=seed, origin=store.session['origin'])

        def more_questions(store):
            made = source.batch(store.batches)
            store.add_questions(made)
            return bool(made)
        server.more_questions = more_questions
        _wait(store, server, question_batch)
    except KeyboardInterrupt as e:
        done = session_stats.progress(store)['done']
        print(f'\nlabel stopped by {stopping.signal_name(getattr(e, "signum", 2))}: {done} labels '
              f'are saved in {store.directory}; rerunning the same command goes on from there', file=sys.stderr)
        e.reported = True
        raise
    finally:
        server.stop()
        store.close_files()
    _finish(store)
    return store


def _announce(store, server, task, run_dir, validation):
    origin = ('the initial model' if run_dir is None else
              f'the initial model and the policy of {run_dir} (two each)' if validation else f'the policy of {run_dir}')
    print(f'label: {store.schedule.target} {store.label_type} labels of {task.query_dataset} queries, responses of '
          f'{origin}, saved in {store.directory} as they are given')
    print(f'  asks: {store.session["instruction"]}')
    if store.session['labelers'] is None:
        print(f'  open {server.link()} in a browser (each labeler gives a name; ?labeler=NAME in the link)')
    else:
        for name, key in store.session['labelers'].items():
            print(f'  {name}: {" or ".join(server.links(name, key))}')
    print('  Ctrl-C stops; rerunning the same command goes on where it stopped', flush=True)


def _status(store):
    p = session_stats.progress(store)
    per = ', '.join(f'{k} {v["answers"]}' for k, v in session_stats.per_labeler(store).items())
    agreement = session_stats.agreement(store)
    agree = (f'; agreement {agreement["agree"]:.0%} on {agreement["pairs"]} questions asked twice'
             + (f' (chance {agreement["chance"]:.0%})' if agreement['chance'] else '') if agreement['pairs'] else '')
    return f'{p["done"]}/{p["target"]} labels' + (f' ({per})' if per else '') + agree


def _wait(store, server, question_batch, poll_s=0.5):
    """Until the labels wanted are given: a line each time the count changes (at most every 5 s), the next batch
    of questions made ahead when fewer than half a batch are open."""
    last, printed = None, 0.0
    while not store.schedule.complete():
        if store.schedule.unasked() < question_batch // 2:
            with server.making:
                server.more_questions(store)
        done = session_stats.progress(store)['done']
        if done != last and time.time() - printed >= 5:
            print(f'[label: {_status(store)}]', flush=True)
            last, printed = done, time.time()
        time.sleep(poll_s)
    time.sleep(1.0)  # the last answer's page asks for its next question: it learns the session is done


def _finish(store):
    n = session_stats.progress(store)['done']
    directory = store.directory
    print(f'label done: {_status(store)}')
    print(f'  labels:  {os.path.join(directory, "labels.json")} (the original\'s format)')
    print(f'  log:     {os.path.join(directory, "answers.jsonl")} (who, when, how long, the order shown, skips)')
    print(f'  for TRL: python launch.py export_labels {directory} --out HF_DIR')
    return n
