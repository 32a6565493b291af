"""Ours: who is asked what in a labeling session, over the questions and answers its store holds (labeling/store.py,
read under the store's lock).

A labeler never gets a question they answered or skipped. A question wants one answer, or two from different
labelers when it is one of the share asked twice (`overlap`, for agreement); a labeler is first offered such a
question that someone else has answered. A question shown to a labeler is theirs (a lease) until they answer, skip
or take LEASE_S seconds, so that two people are not asked the same question at once; a reload shows them the same
question in the same order. A labeler answers or skips only the question shown to them.
"""

import time

from lm_human_preferences.labeling.errors import NotNow

LEASE_S = 600  # how long a question shown to a labeler stays theirs


class Schedule:
    """A session's leases and the question each labeler is shown next (see the module's docstring)."""

    def __init__(self, store):
        self.store = store
        self.leases = {}  # labeler -> (question id, time shown)

    def wanted(self, question_id):
        """The answers a question wants: 2 for the share asked twice, else 1."""
        return 2 if self.store.questions[question_id]['overlap'] else 1

    @property
    def target(self):
        """The labels wanted: the session's target, or (None) every answer its questions want."""
        target = self.store.session['target']
        return sum(self.wanted(q) for q in self.store.order) if target is None else target

    def complete(self):
        """Whether the labels wanted are all given."""
        return len(self.store.events) >= self.target

    def unasked(self, now=None):
        """Questions nobody has answered or is being shown (the queue ahead)."""
        now = time.time() if now is None else now
        store = self.store
        with store.lock:
            leased = {q for q, shown in self.leases.values() if now - shown < LEASE_S}
            return sum(1 for q in store.order if q not in store.answers and q not in leased)

    def _available(self, question_id, labeler, now):
        if question_id in self.store.done_by.get(labeler, {}):
            return False
        answers = self.store.answers.get(question_id, [])
        leased = sum(1 for other, (q, shown) in self.leases.items()
                     if other != labeler and q == question_id and now - shown < LEASE_S)
        return len(answers) + leased < self.wanted(question_id)

    def next_for(self, labeler, now=None):
        """The question to show the labeler next, with the order of its responses: (question, order), or None
        when nothing is left for them (the session complete, closed, or every open question theirs already or
        someone else's)."""
        now = time.time() if now is None else now
        store = self.store
        with store.lock:
            if store.closed or self.complete():
                return None
            lease = self.leases.get(labeler)
            if lease is not None and lease[0] not in store.done_by.get(labeler, {}) and \
                    len(store.answers.get(lease[0], [])) < self.wanted(lease[0]):
                question_id = lease[0]
            else:
                # Second answers first (agreement), then questions nobody answered, in the order added.
                seconds = [q for q in store.answers if self.wanted(q) == 2 and self._available(q, labeler, now)]
                fresh = (q for q in store.order if q not in store.answers and self._available(q, labeler, now))
                question_id = seconds[0] if seconds else next(fresh, None)
                if question_id is None:
                    self.leases.pop(labeler, None)
                    return None
                self.leases[labeler] = (question_id, now)
            return store.questions[question_id], store.shown_order(question_id, labeler)

    def shown_at(self, labeler, question_id):
        """When the question was shown to the labeler, who may answer or skip only the question shown to them
        (a question leased to another, or never shown, is not theirs to answer)."""
        lease = self.leases.get(labeler)
        if lease is None or lease[0] != question_id:
            raise NotNow(f'question {question_id} is not the one shown to {labeler}: answer the question the page '
                         f'shows (GET /api/next)')
        return lease[1]

    def release(self, labeler):
        """The labeler answered or skipped the question shown to them: it is theirs no more."""
        self.leases.pop(labeler, None)

    def give(self, labeler, question_id, now):
        """The question is the labeler's again (their answer to it undone), shown next."""
        self.leases[labeler] = (question_id, now)
