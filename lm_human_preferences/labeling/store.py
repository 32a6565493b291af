"""Ours: a labeling session on disk: its questions, every answer as it is given, and the labels in the
original's JSON format.

    <dir>/session.json     what is asked, written once: the label type, the instruction, the decoded texts'
                           settings, the labelers and their secrets, the share of questions asked twice
    <dir>/questions.jsonl  the questions, appended a batch at a time: each line a question's fields as
                           label_types defines them (token ids, padded), its id, its batch and where its
                           responses came from
    <dir>/answers.jsonl    every event when it happens, fsynced before it is acknowledged: an answer (who,
                           the label, the order the responses were shown in, when it was shown and answered),
                           a skip, an undo, the session's close
    <dir>/labels.json      the answers as the original's label records ({query, sample0..3, best} for best_of_4),
                           in the order they were given: train_reward's labels.source reads it unchanged

answers.jsonl is the truth: labels.json is written from it (atomically) after every event and when the store
opens. A kill -9 loses at most the event being written (a torn last line is dropped when the store opens) and
a batch of questions being appended (no question of it was shown: the batch is made again, the same).

The two logs and their recovery: labeling/session_log.py (`store.log`); who is asked what: its schedule
(labeling/schedule.py, `store.schedule`); its statistics: labeling/session_stats.py.
"""

import hashlib
import hmac
import json
import os
import random
import re
import secrets
import threading
import time

from lm_human_preferences import label_types
from lm_human_preferences.labeling.errors import BadAnswer, LabelingError, NotNow, UnknownQuestion, WrongLabeler
from lm_human_preferences.labeling.schedule import Schedule
from lm_human_preferences.labeling.session_log import SessionLog, question_records, restore_batch
from lm_human_preferences.utils import files

SESSION_FILE = 'session.json'
LABELS_FILE = 'labels.json'
LABELER_NAME = re.compile(r'[A-Za-z0-9_.-]{1,40}')
# The scales a person answers on: scalar_rating's score (1 worst .. 7 best) and scalar_compare's difference
# (sample1's reward minus sample0's, as label_types.ScalarComparison reads it: -3 .. 3).
RATING_SCALE = (1, 7)
COMPARE_SCALE = (-3, 3)


def check_labeler_name(name):
    if not isinstance(name, str) or not LABELER_NAME.fullmatch(name):
        raise BadAnswer(f'labeler name {name!r}: use 1 to 40 letters, digits, "_", "." or "-"')
    return name


def parse_labelers(text):
    """--labelers 'alice,bob' -> {name: a new secret}; None -> None (anyone names themselves)."""
    if text is None:
        return None
    names = [n.strip() for n in str(text).split(',') if n.strip()]
    if not names:
        raise ValueError(f"--labelers {text!r}: give names separated by commas, e.g. --labelers alice,bob")
    for name in names:
        try:
            check_labeler_name(name)
        except LabelingError as e:
            raise ValueError(f'--labelers: {e}') from None
    if len(set(names)) != len(names):
        raise ValueError(f'--labelers {text!r} names someone twice')
    return {name: secrets.token_urlsafe(16) for name in names}


def sample_keys(label_type):
    """The fields of a question of label_type that hold responses, in order (sample0.., or sample)."""
    schemas = label_types.get(label_type).question_schemas(query_length=1, response_length=1)
    return [k for k in schemas if k != 'query']


def label_key(label_type):
    return next(iter(label_types.get(label_type).label_schemas()))


class LabelStore:
    """A labeling session's files (see the module's docstring), safe to use from the server's threads."""

    def __init__(self, directory, *, writable=True):
        """Open the session in directory (made by LabelStore.create); writable False: to read it (while another
        process may serve it), nothing written."""
        self.directory = directory
        path = os.path.join(directory, SESSION_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f'{directory} holds no labeling session ({SESSION_FILE} is missing)')
        with open(path) as f:
            self.session = json.load(f)
        self.label_type = self.session['label_type']
        self.sample_keys = sample_keys(self.label_type)
        self.label_key = label_key(self.label_type)
        self.lock = threading.RLock()  # held while the server's threads read or change the state below
        self.questions = {}  # id -> question record (as in questions.jsonl)
        self.order = []  # question ids in the order they were added
        self.answers = {}  # question id -> [answer events, in order]
        self.done_by = {}  # labeler -> {question id: 'answer' | 'skip'}
        self.history = {}  # labeler -> [their answer and skip events not undone, in order]
        self.events = []  # every answer event not undone, in order: the labels
        self.closed = False
        self.schedule = Schedule(self)  # who is asked what: the leases, the next question of each labeler
        self.log = SessionLog(directory, writable=writable)  # read, after a kill repaired (writable)
        for question in self.log.questions:
            self._add_question(question)
        for event in self.log.events:
            self._apply(event)
        if writable:
            self._write_labels()

    @classmethod
    def create(cls, directory, *, label_type, instruction, texts, labelers=None, overlap=0.05, target=None,
               seed=0, origin=None):
        """A new session in directory (made; it must hold none yet). texts: what the page needs to show the
        questions (query_prefix, query_suffix, the encoding's name). labelers: {name: secret}, or None: anyone
        names themselves (loopback only). target: the labels wanted (None: as many as there are questions).
        origin: what the questions come from (JSON-able, recorded)."""
        label_types.get(label_type)
        if not 0 <= overlap < 1:
            raise ValueError(f'overlap {overlap}: the share of questions asked twice must be at least 0 and under 1')
        os.makedirs(directory, exist_ok=True)
        session = dict(label_type=label_type, instruction=instruction, texts=texts, labelers=labelers,
                       overlap=overlap, target=target, seed=seed, origin=origin, created=time.time())
        files.atomic_write(os.path.join(directory, SESSION_FILE), json.dumps(session, indent=1).encode())
        return cls(directory)

    def close_files(self):
        self.log.close()

    # -------------------------------------------------------------------------------------------------
    # Questions

    def _add_question(self, question):
        self.questions[question['id']] = question
        self.order.append(question['id'])

    @classmethod
    def restore_batch(cls, directory, batch, questions):
        """Write back question batch `batch`, cut short by damage (session_log.DamagedSession.batch), from the same
        questions made again (session_log.restore_batch); returns the store."""
        with open(os.path.join(directory, SESSION_FILE)) as f:
            restore_batch(directory, batch, questions, json.load(f)['overlap'])
        return cls(directory)

    @property
    def batches(self):
        """The number of question batches added (the next one's index)."""
        return 1 + self.questions[self.order[-1]]['batch'] if self.order else 0

    def add_questions(self, questions):
        """Append a batch of questions (dicts holding the label type's question fields, plus anything JSON-able
        to keep with them, e.g. `origin`); returns their ids. The batch is on disk before any is served."""
        with self.lock:
            for question in questions:
                missing = [k for k in ['query'] + self.sample_keys if k not in question]
                if missing:
                    raise ValueError(f'a question lacks {missing} (label type {self.label_type})')
            added = question_records(questions, self.batches, len(self.order), self.session['overlap'])
            self.log.append_questions(added)
            for record in added:
                self._add_question(record)
            return [r['id'] for r in added]

    def shown_order(self, question_id, labeler):
        """The order a labeler sees the question's responses in: a permutation of the sample indices, the same
        every time they are shown it (derived from the session's seed, the question and the labeler)."""
        digest = hashlib.sha256(f'{self.session["seed"]}|{question_id}|{labeler}'.encode()).digest()
        order = list(range(len(self.sample_keys)))
        random.Random(digest).shuffle(order)
        return order

    def set_target(self, target):
        with self.lock:
            self.session['target'] = target

    def check_labeler(self, labeler, key=None):
        """The labeler's name if they may label (named in the session with this secret, or any name in an open
        session); WrongLabeler otherwise."""
        check_labeler_name(labeler)
        secrets = self.session['labelers']
        if secrets is not None:
            # hmac: a comparison in constant time
            if labeler not in secrets or not isinstance(key, str) or not hmac.compare_digest(secrets[labeler], key):
                raise WrongLabeler(f'labeler {labeler!r} is not named in this session or its key is wrong: use '
                                   f'the link printed for you')
        return labeler

    # -------------------------------------------------------------------------------------------------
    # Answers

    def _question_for(self, labeler, question_id):
        if not isinstance(question_id, str):
            raise BadAnswer(f'question {question_id!r}: expected a question id, e.g. "q000000"')
        if question_id not in self.questions:
            raise UnknownQuestion(f'unknown question {question_id!r}')
        if self.closed:
            raise NotNow('this session is closed: it takes no more answers')
        done = self.done_by.get(labeler, {}).get(question_id)
        if done is not None:
            raise NotNow(f'question {question_id} was {"answered" if done == "answer" else "skipped"} by '
                         f'{labeler} already')
        if len(self.answers.get(question_id, [])) >= self.schedule.wanted(question_id):
            raise NotNow(f'question {question_id} has all the answers it wants (another labeler answered it)')
        return self.questions[question_id]

    def label_of(self, choice, order):
        """The label (the original's field and value) of a person's choice on the page, given the order the
        responses were shown in: best_of_N, the position picked (0-based) -> `best`, the sample's index;
        scalar_rating, a score on RATING_SCALE; scalar_compare, a value on COMPARE_SCALE, positive when the
        second shown response is better -> `difference`, sample1's minus sample0's."""
        if isinstance(choice, bool) or not isinstance(choice, (int, float)):
            raise BadAnswer(f'choice {choice!r}: expected a number')
        if self.label_key == 'best':
            if not isinstance(choice, int) or not 0 <= choice < len(order):
                raise BadAnswer(f'choice {choice!r}: pick a response by its position, 0 to {len(order) - 1}')
            return order[choice]
        low, high = RATING_SCALE if self.label_key == 'score' else COMPARE_SCALE
        if not low <= choice <= high:  # NaN is no number from low to high either
            raise BadAnswer(f'choice {choice!r}: expected a number from {low} to {high}')
        if self.label_key == 'difference':
            return float(choice) if order == [0, 1] else -float(choice)
        return float(choice)

    def _log(self, event):
        self.log.append_events([event])
        self._apply(event)
        self._write_labels()

    def answer(self, labeler, question_id, choice, *, client_seconds=None, now=None):
        """Record the labeler's answer to the question shown to them (choice: as label_of reads it; client_seconds:
        how long the page says it took, a number at least 0, or None); returns the event. LabelingError (nothing
        changes) for an unknown question, a second answer, a question not shown to them, a bad choice."""
        now = time.time() if now is None else now
        if client_seconds is not None and (isinstance(client_seconds, bool) or not isinstance(
                client_seconds, (int, float)) or not 0 <= client_seconds < float('inf')):
            raise BadAnswer(f'seconds {client_seconds!r}: expected the seconds the answer took, a number at least 0')
        with self.lock:
            self._question_for(labeler, question_id)
            order = self.shown_order(question_id, labeler)
            label = self.label_of(choice, order)
            shown = self.schedule.shown_at(labeler, question_id)
            event = dict(event='answer', question=question_id, labeler=labeler, label={self.label_key: label},
                         choice=choice, order=order, shown_at=shown, answered_at=now,
                         seconds=round(now - shown, 3), client_seconds=client_seconds)
            self._log(event)
            self.schedule.release(labeler)
            return event

    def answer_many(self, labeler, labels, *, now=None):
        """Record a program's answers at once ({question id: label value (the original's)}), shown in the
        questions' own order; one fsync for all."""
        now = time.time() if now is None else now
        with self.lock:
            order = list(range(len(self.sample_keys)))
            events = []
            for question_id, value in labels.items():
                self._question_for(labeler, question_id)
                events.append(dict(event='answer', question=question_id, labeler=labeler,
                                   label={self.label_key: value}, choice=None, order=order, shown_at=None,
                                   answered_at=now, seconds=None, client_seconds=None))
                self._apply(events[-1])
            self.log.append_events(events)
            self._write_labels()

    def skip(self, labeler, question_id, *, now=None):
        """The labeler passes on the question shown to them: never shown to them again, open to others."""
        now = time.time() if now is None else now
        with self.lock:
            self._question_for(labeler, question_id)
            shown = self.schedule.shown_at(labeler, question_id)
            self._log(dict(event='skip', question=question_id, labeler=labeler, order=self.shown_order(
                question_id, labeler), shown_at=shown, answered_at=now, seconds=round(now - shown, 3)))
            self.schedule.release(labeler)

    def undo(self, labeler, *, now=None):
        """Take back the labeler's last answer or skip (not one already undone): its question is theirs again,
        shown next. Returns the question id."""
        now = time.time() if now is None else now
        with self.lock:
            if self.closed:
                raise NotNow('this session is closed: its answers are final')
            history = self.history.get(labeler, [])
            if not history:
                raise NotNow(f'{labeler} has no answer or skip to undo')
            question_id = history[-1]['question']
            self._log(dict(event='undo', question=question_id, labeler=labeler, at=now))
            self.schedule.give(labeler, question_id, now)
            return question_id

    def close(self):
        """No more answers or undos (the online loop has read the labels)."""
        with self.lock:
            if not self.closed:
                self._log(dict(event='close', at=time.time()))

    def _apply(self, event):
        kind = event['event']
        if kind == 'close':
            self.closed = True
            return
        labeler, question_id = event['labeler'], event['question']
        if kind == 'undo':
            undone = self.history[labeler].pop()
            del self.done_by[labeler][question_id]
            if undone['event'] == 'answer':
                self.answers[question_id].remove(undone)
                if not self.answers[question_id]:
                    del self.answers[question_id]
                self.events.remove(undone)
            return
        self.done_by.setdefault(labeler, {})[question_id] = kind
        self.history.setdefault(labeler, []).append(event)
        if kind == 'answer':
            self.answers.setdefault(question_id, []).append(event)
            self.events.append(event)

    # -------------------------------------------------------------------------------------------------
    # What the answers give

    def label_records(self):
        """The labels as the original's records: the question's fields and the label, in the order given."""
        with self.lock:
            fields = ['query'] + self.sample_keys
            return [dict({k: self.questions[e['question']][k] for k in fields}, **e['label']) for e in self.events]

    def _write_labels(self):
        files.atomic_write(os.path.join(self.directory, LABELS_FILE), json.dumps(self.label_records()).encode())
