"""Ours: the questions a labeler answers: queries of the task's dataset, each with a policy's responses (as many
as the label type compares), postprocessed (truncated) as the original's label files hold them. Questions for
people hold only responses that pass the task's truncation filter: the original "only query[s] humans on
responses that pass that function" (lm_tasks.filter_fn_from_hparams); a failing response is drawn again.

Two forms: `policy`, every response from one policy; `validation`, the paper's validation questions: half the
responses from the initial policy rho, half from the trained policy pi, in shuffled places (`pi_samples` records
which are pi's), whose labels say how often pi beats rho.

A batch of questions depends only on the policies, the task, the seed and the batch's index (its queries are
the index's share of the query stream, its draws a generator of its own): made again after a kill, it is the
same, and it takes nothing from the random streams of a run it is made in.
"""

import hashlib

import numpy as np
import torch

from lm_human_preferences import lm_tasks
from lm_human_preferences.labeling import store as label_store
from lm_human_preferences.utils import ranks

# Draws of a response that fails the filter before its query is dropped (at a pass rate of 20 %, 0.8 ** 32:
# one query in 1,300).
MAX_DRAWS = 32

# What a person is asked, by experiment and by the label's field (best_of_N's `best`, scalar_rating's `score`,
# scalar_compare's `difference`): the paper's instructions in short. The offline experiments' labelers say their
# rule in words themselves (offline/experiment.py's Labeler.instruction).
def _asks(quality, what='continuation'):
    return dict(best=f'Which {what} is the most {quality}?', score=f'How {quality} is this {what}?',
                difference=f'Which {what} is more {quality}?')


INSTRUCTIONS = dict(
    sentiment=_asks('positive and happy'),
    descriptiveness=_asks('vividly descriptive'),
    cnndm=dict(best='Which is the best summary of the article?', score='How good a summary of the article is this?',
               difference='Which is the better summary of the article?'),
    tldr=dict(best='Which is the best summary of the post?', score='How good a summary of the post is this?',
              difference='Which is the better summary of the post?'),
)
GENERIC_INSTRUCTION = dict(best='Which response is the best?', score='How good is this response?',
                           difference='Which response is better?')


def sample_responses(policy, queries, count, *, length, generator, postprocess, passes=None, execution=None):
    """count postprocessed responses of policy to each of queries [b, query_length]: [b, count, length], and
    which queries have them all passing [b] (passes: the task's filter; None: every response counts). Responses
    are drawn `count` times for the whole batch, then, with passes, again for those failing, up to MAX_DRAWS
    times in all."""
    def draw(rows):
        return postprocess(policy.respond(rows, length, generator=generator, execution=execution,
                                          logprobs=False, chunked_vocab=True)['responses'])  # the tokens only
    samples = torch.stack([draw(queries) for _ in range(count)], dim=1)  # [b, count, length]
    if passes is None:
        return samples, torch.ones(len(queries), dtype=torch.bool, device=queries.device)

    def failing():
        return ~passes(samples.reshape(-1, length)).view(len(queries), count)  # [b, count]
    for _ in range(MAX_DRAWS - 1):
        rows, slots = failing().nonzero(as_tuple=True)
        if not len(rows):
            break
        samples[rows, slots] = draw(queries[rows])
    return samples, ~failing().any(dim=1)


def batch_generator(device, seed, *keys):
    """A torch generator on device (the policies') for the batch named by keys (e.g. a round and a batch index)."""
    digest = hashlib.sha256('|'.join(map(str, (seed,) + keys)).encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], 'little') >> 1)


class QuestionSource:
    """Batches of `size` questions of one label type for a task: from `policy` (form `policy`), or with `initial`
    too (form `validation`: half of each question's responses from initial, half from policy). Policies: frozen
    policy.Policy modules of the task. Batch i takes the queries at positions first_query + i * size, ... of the
    task's query stream of split `mode` (rank 0's share, under --mpi N). filtered: only responses passing the task's
    filter (people); False: as the offline experiments' labels, every postprocessed response (a program rates
    any). Made on every process (the query data may be prepared, a collective); batches on rank 0's, on the
    policies' device (the command's, whatever device the query stream returns its tokens on)."""

    def __init__(self, *, task, label_type, policy, initial=None, size=16, first_query=0, seed=0, filtered=True,
                 execution=None, origin=None, mode='train'):
        self.task = task
        self.keys = label_store.sample_keys(label_type)
        if initial is not None and len(self.keys) % 2:
            raise ValueError(f'validation questions take as many responses from each policy: label type '
                             f'{label_type} compares {len(self.keys)}')
        self.policy, self.initial = policy, initial
        self.device = policy.model.wte.device
        if initial is not None and initial.model.wte.device != self.device:
            raise ValueError(f'validation questions sample both policies on one device: the policy is on '
                             f'{self.device}, the initial policy on {initial.model.wte.device}')
        self.encoder = policy.encoder
        self.postprocess = lm_tasks.postprocess_fn_from_hparams(task, self.encoder.padding_token)
        self.passes = lm_tasks.filter_fn_from_hparams(task) if filtered else None
        self.size, self.first_query, self.seed = size, first_query, seed
        self.execution = execution
        self.origin = origin
        # The stream has no way to seek: queries are read one at a time and dropped up to the one wanted.
        self.sampler = lm_tasks.make_query_sampler(hparams=task, encoder=self.encoder, batch_size=1, mode=mode,
                                                   device=self.device)
        self.read = 0  # queries read from the stream
        self.dropped = 0  # queries dropped: a response kept failing the filter

    def _queries(self, index):
        """Batch index's queries [size, query_length] (batches are made in order: the stream only goes on)."""
        start = self.first_query + index * self.size
        if start < self.read:
            raise ValueError(f'question batch {index} was made already: batches are made in order')
        with ranks.rank_section(ranks.local_ranks()[0]):  # the process carrying rank 0: its share of the stream
            while self.read < start:
                self.sampler()
                self.read += 1
            self.read += self.size
            return torch.cat([self.sampler()['tokens'] for _ in range(self.size)])

    @torch.no_grad()
    def batch(self, index):
        """Question batch number `index` (made in order): dicts of the label type's question fields (token ids
        as lists), `origin`, and `pi_samples` in the validation form; fewer than size when queries were dropped."""
        queries = self._queries(index)
        draw = dict(length=self.task.response_length, generator=batch_generator(self.device, self.seed, index),
                    postprocess=self.postprocess, passes=self.passes, execution=self.execution)
        if self.initial is None:
            samples, ok = sample_responses(self.policy, queries, len(self.keys), **draw)
            pi_places = None
        else:
            half = len(self.keys) // 2
            rho, rho_ok = sample_responses(self.initial, queries, half, **draw)
            pi, pi_ok = sample_responses(self.policy, queries, half, **draw)
            # Shuffled places: a question's sample index says nothing of where it came from.
            rng = np.random.RandomState([self.seed % 2 ** 32, index])
            pi_places = [sorted(rng.permutation(len(self.keys))[:half].tolist()) for _ in range(len(queries))]
            samples = torch.empty_like(torch.cat([rho, pi], dim=1))
            for i, places in enumerate(pi_places):
                samples[i, places] = pi[i]
                samples[i, [j for j in range(len(self.keys)) if j not in places]] = rho[i]
            ok = rho_ok & pi_ok
        questions = []
        for i in range(len(queries)):
            if not ok[i]:
                self.dropped += 1
                continue
            question = dict(query=queries[i].tolist(), **{k: samples[i, j].tolist() for j, k in enumerate(self.keys)},
                            origin=self.origin)
            if pi_places is not None:
                question['pi_samples'] = pi_places[i]
            questions.append(question)
        return questions

