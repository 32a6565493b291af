"""Ours: a labeling session's two logs (labeling/store.py keeps the session's state; its docstring, the files) and
their recovery after a kill.

    <dir>/questions.jsonl  the questions, appended a batch at a time: each line a question's fields, its id, its
                           batch (and the batch's size) and whether it is one of the share asked twice
    <dir>/answers.jsonl    every event when it happens: an answer, a skip, an undo, the session's close

A line counts once it is fsynced (an event before it is acknowledged, a batch of questions before any of it is
served). So a kill -9 leaves at most a torn last line (dropped as the logs open, and cut from the file) and a
batch of questions cut short (none of it was shown: dropped, and made again, the same, by whoever adds it). Any
other state is damage no kill leaves: DamagedSession, one line naming the file and what to do.
"""

import json
import os

from lm_human_preferences.utils import files

QUESTIONS_FILE = 'questions.jsonl'
ANSWERS_FILE = 'answers.jsonl'


class DamagedSession(ValueError):
    """A session's file in a state no kill leaves (one line naming it). batch: the question batch cut short while
    answers.jsonl holds answers to it (made again, the same, it is written back by restore_batch), else None."""

    def __init__(self, message, batch=None):
        super().__init__(message)
        self.batch = batch


def overlap_question(index, share):
    """Whether question number `index` (0-based) is one of the share asked twice: exactly that share of every
    run of questions, spread evenly (floor((i + 1) * share) > floor(i * share))."""
    return int((index + 1) * share) > int(index * share)


def question_records(questions, batch, start, overlap):
    """The records of a batch of questions as questions.jsonl holds them (ids from start on; overlap: the
    session's share of questions asked twice)."""
    return [dict(question, id=f'q{start + j:06d}', batch=batch, batch_size=len(questions),
                 overlap=overlap_question(start + j, overlap)) for j, question in enumerate(questions)]


class SessionLog:
    """The logs of the session in directory, read as they open (writable: repaired, then open to append):
    .questions, the question records of its whole batches, and .events, every event, each in order."""

    def __init__(self, directory, *, writable=True):
        self.directory = directory
        questions_path, answers_path = (os.path.join(directory, name) for name in (QUESTIONS_FILE, ANSWERS_FILE))
        questions, questions_torn = _read_lines(questions_path)
        events, answers_torn = _read_lines(answers_path)
        asked = {e['question'] for e in events if 'question' in e}
        questions, rewritten = _drop_partial_batch(questions_path, directory, questions, asked, writable)
        unknown = sorted(asked - {q['id'] for q in questions})
        if unknown:
            raise DamagedSession(f'{answers_path} answers {len(unknown)} questions that {questions_path} lacks '
                                 f'({unknown[0]} first): a file is damaged; restore it from a copy, or move '
                                 f'{directory} away to start the session again')
        if writable and questions_torn is not None and not rewritten:
            _cut(questions_path, questions_torn)
        if writable and answers_torn is not None:
            _cut(answers_path, answers_torn)
        self.questions, self.events = questions, events
        self._questions_file = self._answers_file = None
        if writable:
            self._questions_file = open(questions_path, 'ab')
            self._answers_file = open(answers_path, 'ab')

    def append_questions(self, records):
        """A batch of question records, on disk (fsynced) when this returns."""
        _append(self._questions_file, records)

    def append_events(self, events):
        """Events, on disk (fsynced once for all) when this returns."""
        _append(self._answers_file, events)

    def close(self):
        for f in (self._questions_file, self._answers_file):
            if f is not None:
                f.close()


def restore_batch(directory, batch, questions, overlap):
    """Write back question batch `batch`, cut short by damage (DamagedSession.batch), from the same questions made
    again (overlap: the session's share asked twice); refused (DamagedSession) unless its intact lines are theirs."""
    path = os.path.join(directory, QUESTIONS_FILE)
    intact, _ = _read_lines(path)
    kept = [q for q in intact if q['batch'] < batch]
    remade = question_records(questions, batch, len(kept), overlap)
    if intact[len(kept):] != remade[:len(intact) - len(kept)]:
        raise DamagedSession(f'{path}: batch {batch} made again differs from its intact lines: restore the file '
                             f'from a copy, or move {directory} away to start the session again')
    files.atomic_write(path, b''.join(_line(q) for q in kept + remade))


def _line(record):
    return (json.dumps(record, allow_nan=False) + '\n').encode()  # strict JSON: no NaN a strict reader refuses


def _append(f, records):
    for record in records:
        f.write(_line(record))
    f.flush()
    os.fsync(f.fileno())


def _read_lines(path):
    """The JSON lines of path, and the length of its intact part when its last line was cut off by a kill (no
    newline, or not JSON: dropped), else None. A damaged line before others: DamagedSession."""
    if not os.path.exists(path):
        return [], None
    with open(path, 'rb') as f:
        lines = f.readlines()
    records, good_bytes = [], 0
    for i, line in enumerate(lines):
        try:
            record = json.loads(line) if line.endswith(b'\n') else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict):
            if i == len(lines) - 1:
                return records, good_bytes
            raise DamagedSession(f'{path} line {i + 1} is no JSON record, with lines after it: the file is damaged '
                                 f'(no write of ours leaves that)')
        records.append(record)
        good_bytes += len(line)
    return records, None


def _cut(path, good_bytes):
    """Cut a torn last line from path, so that the next append starts a line of its own."""
    with open(path, 'r+b') as f:
        f.truncate(good_bytes)


def _drop_partial_batch(path, directory, questions, answered, writable):
    """A batch cut off by a kill (fewer lines than its size): dropped from the questions and, writable, from the
    file at path (a batch is served only once it is all on disk: none of it was shown). Returns the questions left
    and whether the file was written. answered: the question ids answers.jsonl holds; an answer to the batch means
    the file was damaged later: DamagedSession, the file as it is."""
    if not questions:
        if answered:
            raise DamagedSession(f'{path} holds no question while answers.jsonl holds answers: the file was '
                                 f'damaged; restore it from a copy, or move {directory} away to start the '
                                 f'session again', batch=0)
        return questions, False
    last = questions[-1]
    batch = [q['id'] for q in questions if q['batch'] == last['batch']]
    if len(batch) == last['batch_size']:
        return questions, False
    if answered & set(batch) or any(_index(i) > _index(last['id']) for i in answered):
        raise DamagedSession(f'{path}: its last batch of questions (batch {last["batch"]}) is cut short '
                             f'({len(batch)} of {last["batch_size"]} lines) while answers.jsonl holds answers to '
                             f'it: the file was damaged after it was written; restore it from a copy, or move '
                             f'{directory} away to start the session again', batch=last['batch'])
    kept = questions[:-len(batch)]
    if writable:
        files.atomic_write(path, b''.join(_line(q) for q in kept))
    return kept, writable


def _index(question_id):
    return int(question_id[1:]) if isinstance(question_id, str) and question_id[1:].isdigit() else -1
