"""Ours: the paper's online data collection, which the original code did not ship (it trained the reward model
once, before RL). From the paper: "we train the reward model before the first PPO episode, and then retrain it
19 more times at evenly spaced values. Each time we retrain we reinitialize r to a random linear layer on top of
rho and do a single epoch through the labels collected so far"; validation questions (x ~ D; y0, y1 ~ rho;
y2, y3 ~ pi) were asked at a constant rate, their labels say how often pi beats rho, and they joined the
reward model's training labels.

With `--online.retrains K`, train_policy trains the reward model on the labels at hand (rewards.train_new_model,
as without it), then, as a callback on its training loop (train()), at K evenly spaced PPO steps
(step k * nupdates // (K + 1), k = 1..K):
1. ask: questions of the current policy pi (and a share in the validation form, rho against pi) go to the
   labeler, a program (the offline experiments' labelers) or people on the labeling page (PPO waits for them);
2. retrain: train_reward from a fresh head on rho, one epoch over every label so far (the first training's,
   then each round's), normalized as the original normalizes (normalize_before / normalize_after);
3. PPO goes on against the new reward model, from the state it saved at that step.
Every step is where a rerun resumes: a round's questions and answers are a labeling session (labeling/store.py),
its retraining a train_reward run with its own training states, and PPO continues from its state saved at the
round's step (also when nothing was interrupted: so a resumed run is the same, bit for bit, with a program).

    <save_dir>/online/round-<k>/        round k's labeling session (questions, answers log, labels.json)
    <save_dir>/online/round-<k>/done.json   what the round gave (written last: the round is finished)
    <save_dir>/online/reward-<k>/       round k's train_reward run: labels.json (every label so far, then the
                                        first training's held-out ones), reward_model/, its stats
    <save_dir>/online/labelers.json     the labelers' secrets (people: the same links in every round)
"""

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lm_human_preferences import label_types, train_policy, train_reward
from lm_human_preferences.labeling import programs
from lm_human_preferences.labeling import questions as questions_module
from lm_human_preferences.labeling import session as session_module
from lm_human_preferences.labeling import session_stats
from lm_human_preferences.labeling.online_hparams import PEOPLE, split_weights
from lm_human_preferences.labeling.server import LabelServer
from lm_human_preferences.labeling.session_log import DamagedSession
from lm_human_preferences.labeling.store import LabelStore, parse_labelers
from lm_human_preferences.rewards import TrainedRewardModel
from lm_human_preferences.training import label_files, run_checks
from lm_human_preferences.training.progress import PRINT_EVERY_S
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files, hyperparams, ranks


def train(hparams, *, instructions=questions_module.GENERIC_INSTRUCTION):
    """train_policy.train, with the online loop as its callback when online.retrains is set. instructions: what people
    on the page are asked, by label kind (the experiment's question, which the launcher or the offline engine passes:
    a running loop's hparams name resolved models and label files, not their experiment); a program labeler asks its
    own rule."""
    check_hparams(hparams, ranks.get_world_size())  # at launch already; here for callers of train(), before any work
    callbacks = [OnlineLoop(hparams, instructions=instructions)] if hparams.online.retrains else []
    return train_policy.train(hparams, callbacks=callbacks)

def round_sizes(hparams):
    """The new labels of each round: online.num_labels split by the weights, each a multiple of the reward
    model's batch_size (an epoch is whole minibatches), the last taking what rounding left."""
    online, reward = hparams.online, hparams.rewards.train_new_model
    total = online.num_labels if online.num_labels is not None else online.retrains * reward.labels.num_train
    weights = split_weights(online)
    sizes = [int(total * w / sum(weights) / reward.batch_size) * reward.batch_size for w in weights[:-1]]
    return sizes + [total - sum(sizes)]


def retrain_steps(hparams, nupdates):
    """The PPO steps (batches done) at which the reward model is retrained: evenly spaced, k * nupdates // (K+1)."""
    k = hparams.online.retrains
    return [i * nupdates // (k + 1) for i in range(1, k + 1)]


def check_hparams(hparams, num_ranks, *, prefix=''):
    """Ours, at launch (launch.py's train_policy, for its --mpi) and in train(): train_policy's checks across its parts
    and ranks (run_checks.check_policy), then what the loop needs of train_policy's other hparams (one line each)."""
    run_checks.check_policy(hparams, num_ranks, prefix=prefix)
    online, nupdates = hparams.online, train_policy.nupdates(hparams)
    if not online.retrains:
        return
    reward = hparams.rewards.train_new_model
    if reward is None:
        raise ValueError(f'{prefix}online.retrains {online.retrains} retrains the reward model with '
                         f'{prefix}rewards.train_new_model\'s settings: turn it on (not rewards.trained_model)')
    total = online.num_labels if online.num_labels is not None else online.retrains * reward.labels.num_train
    hyperparams.require(total % reward.batch_size == 0, prefix + 'online.num_labels', total,
                        f'it must be a multiple of {prefix}rewards.train_new_model.batch_size {reward.batch_size} '
                        f'(each retraining is one epoch of whole minibatches)')
    hyperparams.require(total >= online.retrains * reward.batch_size, prefix + 'online.num_labels', total,
                        f'each of the {online.retrains} rounds needs at least one minibatch of '
                        f'{reward.batch_size} labels: give at least {online.retrains * reward.batch_size}')
    weights = split_weights(online)
    shares = [total * w / sum(weights) for w in weights]  # what the weights ask of each round, before rounding
    hyperparams.require(min(shares) >= reward.batch_size, prefix + 'online.split', online.split,
                        f'its weights give the {total} labels as ' + ', '.join(f'{x:.4g}' for x in shares)
                        + f': each round needs at least one minibatch of {reward.batch_size}')
    hyperparams.require(online.retrains < nupdates, prefix + 'online.retrains', online.retrains,
                        f'it must be fewer than the run\'s {nupdates} PPO batches (one retraining between batches)')
    label_type = label_types.get(reward.labels.type)
    if online.labeler == PEOPLE:  # the page's port, free now rather than after the first training
        try:
            LabelServer(host=online.host, port=online.port).stop()
        except OSError as e:
            raise hyperparams.HParamValueError(f"hyperparameter '{prefix}online.port' is {online.port}: {e}") from None
    if online.labeler != PEOPLE and not isinstance(label_type, label_types.PickBest):
        raise ValueError(f"{prefix}online.labeler {online.labeler}: a program labels best_of_N questions, "
                         f"{prefix}rewards.train_new_model.labels.type is {reward.labels.type}")
    if online.validation_share and len(questions_module.label_store.sample_keys(reward.labels.type)) % 2:
        raise ValueError(f'{prefix}online.validation_share {online.validation_share}: validation questions set '
                         f'rho against pi, which needs two responses or more; {reward.labels.type} has one: set it 0')


class OnlineLoop:
    """The rounds of a train_policy run (see the module's docstring): a callback on train_policy's training loop
    (training/callbacks.py), which tells it the run as PPO has resumed (on_train_begin: the PPO trainer, the score
    model, the run, save() of PPO's state at the current step and restore() of the newest saved one), then calls
    on_step_begin before each PPO batch and on_train_end after the last (or a stop)."""

    def __init__(self, hparams, *, instructions):
        self.hparams = hparams
        self.online = hparams.online
        self.reward_hparams = hparams.rewards.train_new_model
        self.nupdates = train_policy.nupdates(hparams)
        self.steps = retrain_steps(hparams, self.nupdates)
        self.sizes = round_sizes(hparams)
        self.dir = os.path.join(hparams.run.save_dir, 'online')
        self.label_type = self.reward_hparams.labels.type
        self.people = self.online.labeler == PEOPLE
        self.labeler = None if self.people else programs.LABELERS[self.online.labeler]
        # What the page asks: a program's own rule in words, else the experiment's question.
        self.instructions = instructions if self.labeler is None else self.labeler.instruction
        self.ppo_trainer = self.score_model = self.run = self.save = self.restore = None  # on_train_begin's
        self.server = None
        self.initial = None  # the first training's labels: (train records, held-out records)
        self.scoring_round = 0  # the round whose reward model PPO scores with (0: the first training's)

    # ---------------------------------------------------------------------------------------------------
    def on_train_begin(self, training):
        """At the start (or a resume) of PPO: the reward model of the last round finished at or before this step,
        and for people the page, up for the whole run."""
        self.ppo_trainer, self.score_model, self.run = training.ppo_trainer, training.score_model, training.run
        self.save, self.restore = training.save, training.restore
        step = self.ppo_trainer.global_step
        finished = [k for k, s in enumerate(self.steps, 1) if s <= step and self._finished(k)]
        if finished:
            self._load_reward_model(finished[-1])
        if self.people and ranks.is_root():
            self.server = LabelServer(host=self.online.host, port=self.online.port, origin=self.online.origin).start()
            self.server.set_session(None, self._waiting_message(step))
            links = self._labeler_secrets()
            print(f'online: labels from people at {self.server.link()}' + (
                ''.join(f'\n  {name}: {self.server.link(name, secret)}' for name, secret in links.items())
                if links else ' (each labeler gives a name)'), flush=True)

    def on_train_end(self, training):
        if self.server is not None:
            self.server.stop()
            self.server = None

    def on_step_begin(self, training):
        """At a round's step: ask, retrain, reload the reward model and PPO's state (unless the round finished
        before a resume); then the round's stats at this step."""
        step = self.ppo_trainer.global_step
        if step not in self.steps:
            return
        k = self.steps.index(step) + 1
        if not self._finished(k):
            self.save()  # PPO's state at this step: where it goes on from, after the round and after a resume
            self._ask(k)
            results = self._retrain(k)
            self._finish_round(k, results)
            self._load_reward_model(k)
            self.restore()  # the retraining drew from the random streams: PPO takes them back as it saved them
        elif self.scoring_round != k:  # resumed from a state before this round, which a run before finished
            self._load_reward_model(k)
        with open(self._done_path(k)) as f:
            stats = json.load(f)['stats']
        self.run.stats.log(stats, step, log_interval=1)

    # ---------------------------------------------------------------------------------------------------
    def _round_dir(self, k):
        return os.path.join(self.dir, f'round-{k}')

    def _done_path(self, k):
        return os.path.join(self._round_dir(k), 'done.json')

    def _finished(self, k):
        return os.path.isfile(self._done_path(k))

    def _reward_dir(self, k):
        return os.path.join(self.dir, f'reward-{k}')

    def _waiting_message(self, step):
        ahead = [s for s in self.steps if s >= step]
        return (f'No questions are open: PPO is training (batch {step} of {self.nupdates}); the next questions come at '
                f'batch {ahead[0]}. This page looks again every few seconds.' if ahead else
                'No questions are open: the run asks no more. Thank you!')

    def _labeler_secrets(self):
        """{name: secret} of online.labelers, made once for the run (people keep their links), or {}."""
        if self.online.labelers is None:
            return {}
        path = os.path.join(self.dir, 'labelers.json')
        if not os.path.isfile(path):
            os.makedirs(self.dir, exist_ok=True)
            files.atomic_write(path, json.dumps(parse_labelers(self.online.labelers)).encode())
        with open(path) as f:
            secrets = json.load(f)
        return {name: secrets[name] for name in parse_labelers(self.online.labelers)}

    # ---------------------------------------------------------------------------------------------------
    # 1. ask
    def _questions(self, k, *, filtered):
        """Round k's question sources: the policy form's and the validation form's (None when its share is 0),
        their questions the round's; and for people, batches of QUESTION_BATCH more, for what they skip."""
        size = self.sizes[k - 1]
        n_validation = int(round(size * self.online.validation_share))
        seed = (self.hparams.run.seed or 0) * 1000 + k
        task = self.hparams.task
        # Queries after those of the first training's labels and the earlier rounds' (the stream repeats).
        first = len(self._initial_labels()[0]) + len(self._initial_labels()[1]) + sum(self.sizes[:k - 1])
        common = dict(task=task, label_type=self.label_type, policy=self.ppo_trainer.policy, seed=seed,
                      filtered=filtered, execution=self.ppo_trainer.execution)
        policy_form = questions_module.QuestionSource(
            size=size - n_validation, first_query=first, origin=dict(form='policy', round=k), **common)
        validation_form = questions_module.QuestionSource(
            size=n_validation, first_query=first + size - n_validation, initial=self.ppo_trainer.ref_policy,
            origin=dict(form='validation', round=k), **dict(common, seed=seed + 500)) if n_validation else None
        extras = questions_module.QuestionSource(
            size=session_module.QUESTION_BATCH, first_query=first + size, origin=dict(form='policy', round=k),
            **dict(common, seed=seed + 700)) if self.people else None
        return policy_form, validation_form, extras

    def _ask(self, k):
        """Round k's labels into its session (made once: a rerun goes on with what it holds)."""
        sources = self._questions(k, filtered=self.people)  # on every process: the query data may be prepared
        if ranks.is_root():
            store = self._session(k, sources)
            validation = sum(1 for q in store.order if 'pi_samples' in store.questions[q])
            print(f'online round {k}/{len(self.steps)} at PPO batch {self.steps[k - 1]}: {store.schedule.target} labels of '
                  f'{len(store.order)} questions of the policy ({validation} in the validation form) from '
                  + ('people' if self.people else f'the {self.online.labeler} labeler'), flush=True)
            if self.people:
                self._wait_for_people(k, store, extras=sources[2])
            else:
                self._label_by_program(k, store)
            store.close()
            store.close_files()
            utils.mpi_bcast(True)
        else:
            while not utils.mpi_bcast(None):  # people: the process carrying rank 0 says when they are done
                pass

    def _session(self, k, sources):
        def open_session():
            return session_module.open_session(
                self._round_dir(k), self.reward_hparams, encoding=self.ppo_trainer.policy.trained_model.encoding.name,
                labelers=self._labeler_secrets() or None, overlap=0.05 if self.people else 0.0,
                target=self.sizes[k - 1], seed=self.hparams.run.seed or 0, origin=dict(round=k, step=self.steps[k - 1]),
                instructions=self.instructions)
        try:
            store = open_session()
        except DamagedSession as e:
            if e.batch is None:
                raise ValueError(f'online round {k}: {e}') from None
            # The round's questions depend only on the policy at its step, the task and the seed: made again, the
            # same, the batch is written back (its answers stay theirs).
            print(f'online round {k}: {e.args[0].split(":")[0]}: batch {e.batch} was cut short; made again',
                  flush=True)
            remade = self._round_questions(k, sources) if e.batch == 0 else sources[2].batch(e.batch - 1)
            LabelStore.restore_batch(self._round_dir(k), e.batch, remade).close_files()
            store = open_session()
        if not store.order:
            store.add_questions(self._round_questions(k, sources))
        return store

    def _round_questions(self, k, sources):
        """Round k's questions (its session's batch 0): the policy form's, then the validation form's (for people
        in a shuffled order, the validation questions spread over the round, not all at its end)."""
        made = []
        for source in sources[:2]:
            if source is not None:
                made += source.batch(0)
        if self.people:
            made = [made[i] for i in np.random.RandomState(k).permutation(len(made))]
        return made

    def _label_by_program(self, k, store):
        """The program's answer to every question of the round (each from the round's seed and the question's
        place alone: a rerun after a kill gives the answers not yet written the same values)."""
        samples = torch.tensor([[store.questions[q][key] for key in store.sample_keys] for q in store.order])
        best = programs.label_best(self.labeler, samples, self.ppo_trainer.policy.encoder,
                                   np.random.RandomState((self.hparams.run.seed or 0) * 1000 + k))
        todo = {q: int(b) for q, b in zip(store.order, best) if q not in store.answers}
        if todo:
            store.answer_many(self.online.labeler, todo)

    def _wait_for_people(self, k, store, *, extras):
        """Serve the round's questions until its labels are given: a progress line at least every PRINT_EVERY_S
        seconds with the page's address (the processes not carrying rank 0 wait in short collectives)."""
        self.server.set_session(store)

        def more_questions(store):  # the session's batch 0 is the round's questions, batch i extras' i - 1
            made = extras.batch(store.batches - 1)
            store.add_questions(made)
            return bool(made)
        self.server.more_questions = more_questions
        printed = 0.0
        try:
            while not store.schedule.complete():
                if time.time() - printed >= PRINT_EVERY_S:
                    p = session_stats.progress(store)
                    print(f'[online round {k}/{len(self.steps)}: PPO waits for {p["target"] - p["done"]} more labels '
                          f'({p["done"]}/{p["target"]} given): label at {self.server.link()}]', flush=True)
                    printed = time.time()
                time.sleep(1)
                utils.mpi_bcast(False)
        finally:
            self.server.set_session(None, self._waiting_message(self.steps[k - 1] + 1))
            self.server.more_questions = None

    # ---------------------------------------------------------------------------------------------------
    # 2. retrain
    def _initial_labels(self):
        """The first training's labels, as the records of its label file (train, held out): kept as they are read
        (checked) until a retraining's train_reward reads them from its labels.json."""
        if self.initial is None:
            reward = self.reward_hparams
            label_type = label_types.get(reward.labels.type)
            schemas = {**label_type.question_schemas(query_length=self.hparams.task.query_length,
                                                     response_length=self.hparams.task.response_length),
                       **label_type.label_schemas()}
            records = label_files.read_labels(
                reward.labels.source, schemas, reward.labels.num_train,
                n_vocab=self.ppo_trainer.policy.trained_model.encoding.n_vocab,
                padding_token=self.ppo_trainer.policy.padding_token)
            self.initial = records[:reward.labels.num_train], records[reward.labels.num_train:]
        return self.initial

    def _retrain(self, k):
        """train_reward on every label so far, from a fresh head on rho, in round k's run dir; its results."""
        hparams = copy.deepcopy(self.reward_hparams)
        hparams.run.save_dir = self._reward_dir(k)
        labels_path = os.path.join(hparams.run.save_dir, 'labels.json')
        train, held_out = self._initial_labels()
        train = list(train)
        for j in range(1, k + 1):
            train += self._round_labels(j)
        merged = json.dumps(train + held_out).encode()
        if ranks.is_root() and not (os.path.isfile(labels_path) and Path(labels_path).read_bytes() == merged):
            os.makedirs(hparams.run.save_dir, exist_ok=True)
            files.atomic_write(labels_path, merged)  # a damaged or short file of an earlier run: written again
        utils.mpi_bcast(None)
        hparams.labels.source = labels_path
        hparams.labels.num_train = len(train)
        if hparams.run.seed is not None:
            hparams.run.seed += k  # a fresh head: another draw than the first training's
        if ranks.is_root():
            print(f'online round {k}/{len(self.steps)}: retraining the reward model from a fresh head on '
                  f'{len(train)} labels (one epoch) in {hparams.run.save_dir}', flush=True)
        return train_reward.train(hparams)

    def _round_labels(self, j):
        """Round j's labels, the first of its size (answers past it, people's, wait unused), rebuilt from its
        session's answers.jsonl, the truth (labels.json is a copy written from it); one line naming the file and
        what to do when it is damaged or short."""
        directory = self._round_dir(j)
        try:
            store = LabelStore(directory, writable=ranks.is_root())  # rank 0's writes labels.json again from it
            store.close_files()
            records = store.label_records()
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f'online round {j}: {e}; restore the file from a copy, or move {directory} (and the '
                             f'rounds after it) away to ask its questions again') from None
        if len(records) < self.sizes[j - 1]:
            raise ValueError(f'online round {j}: {os.path.join(directory, "answers.jsonl")} holds {len(records)} '
                             f'labels, the round needs {self.sizes[j - 1]}: restore the file from a copy, or move '
                             f'{directory} (and the rounds after it) away to ask its questions again')
        return records[:self.sizes[j - 1]]

    def _finish_round(self, k, results):
        """done.json: the round's stats (logged at its step), written last."""
        stats = {'online/round': k, 'online/labels': len(self._initial_labels()[0]) + sum(self.sizes[:k])}
        if ranks.is_root():
            store = LabelStore(self._round_dir(k), writable=False)
            wins = session_stats.policy_wins(store)
            if wins['answers']:
                stats.update({'online/pi_beats_rho': wins['wins'], 'online/pi_beats_rho_labels': wins['answers']})
            agreement = session_stats.agreement(store)
            if agreement['pairs']:
                stats['online/agreement'] = agreement['agree']
            if 'eval' in results:
                stats['online/reward_model_accuracy'] = results['eval'].get('eval/accuracy')
            files.atomic_write(self._done_path(k), json.dumps(dict(stats=stats, step=self.steps[k - 1])).encode())
        utils.mpi_bcast(None)

    # ---------------------------------------------------------------------------------------------------
    # 3. PPO on
    def _read_reward_model(self, k):
        # The model's constructor draws its fresh head from the process's torch stream before the weights are
        # loaded over it: drawn in a fork, so that a resumed run's streams are the uninterrupted run's.
        with torch.random.fork_rng(devices=[]):
            return TrainedRewardModel(os.path.join(self._reward_dir(k), 'reward_model'), self.score_model.encoding)

    def _load_reward_model(self, k):
        """Round k's reward model into PPO's score model; a finished round's that fails to load (a damaged
        checkpoint) is retrained from its run's training states first, as an interrupted retraining is."""
        try:
            new = self._read_reward_model(k)
        except (OSError, ValueError) as e:
            if ranks.is_root():
                print(f'online round {k}: its reward model does not load ({e}); retraining it from its training '
                      f'states in {self._reward_dir(k)}', flush=True)
            self.save()  # PPO's state here: the retraining draws from the random streams, which PPO takes back
            self._retrain(k)
            new = self._read_reward_model(k)
            self.restore()
        self.score_model.load_state_dict(new.state_dict())
        self.scoring_round = k
        if ranks.is_root():
            print(f'online: PPO scores with the reward model of round {k} ({self._reward_dir(k)})', file=sys.stdout,
                  flush=True)
