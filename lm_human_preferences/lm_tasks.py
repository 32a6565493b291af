from dataclasses import dataclass, field
from typing import Optional

import torch

from lm_human_preferences.language import datasets, trained_models
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import hyperparams


@dataclass
class PolicyHParams(hyperparams.HParams):
    temperature: float = 1.0
    initial_model: str = None
    rules = dict(positive=('temperature',))  # ours, as below: what a field allows, one line at launch (hyperparams)

@dataclass
class TaskHParams(hyperparams.HParams):
    # Query params
    query_length: int = None
    query_dataset: str = None
    query_prefix: str = ''
    query_suffix: str = ''
    start_text: Optional[str] = '.'
    end_text: Optional[str] = None

    # Response params
    response_length: int = None

    # Truncate response after the first occurrence of this token at or after index after when sampling.
    truncate_token: Optional[int] = None
    truncate_after: int = 0
    penalty_reward_value: int = -1
    # Ours: off, every response passes the filter below (the truncation kept): what the filter costs PPO, measured
    # (the frontier's ppo_nofilter arm, docs/frontier.md); the original always filters when truncate_token is set.
    filter_responses: bool = True

    policy: PolicyHParams = field(default_factory=PolicyHParams)
    rules = dict(at_least_1=('query_length', 'response_length'), at_least_0=('truncate_after',))

    def validate(self, *, prefix=''):
        """Ours: the values a run cannot use, in one line each, at launch."""
        super().validate(prefix=prefix)
        datasets.check_dataset_name(self.query_dataset, name=prefix + 'query_dataset')
        # A bad name, a missing dir, a config we cannot load: one line.
        n_ctx = hyperparams.require_valid(prefix + 'policy.initial_model', trained_models.known_n_ctx,
                                          self.policy.initial_model)
        tokens = self.query_length + self.response_length
        if n_ctx is not None and tokens > n_ctx:
            # Both lengths take positions: the line names the two, not one of them.
            raise hyperparams.HParamValueError(
                f"hyperparameters '{prefix}query_length' + '{prefix}response_length' are {self.query_length} + "
                f"{self.response_length} = {tokens} positions: the model {self.policy.initial_model} has n_ctx "
                f"{n_ctx}, their sum must be at most {n_ctx}")

#returns a postprocessing function
#it is applied to responses before they are scored
#central example: replace all tokens after truncate_token with padding_token
def postprocess_fn_from_hparams(hparams: TaskHParams, padding_token: int):
    def get_mask(responses, truncate_token, truncate_after):
        # We want to truncate at the first occurrence of truncate_token that appears at or after
        # position truncate_after in the responses
        mask = (responses == truncate_token).long()
        mask = torch.cat([torch.zeros_like(mask)[:, :truncate_after], mask[:, truncate_after:]], dim=1)
        # Occurrences strictly before each position: the first truncate token itself stays.
        return (torch.cumsum(mask, dim=1) - mask).bool()
    if hparams.truncate_token is not None:
        def truncate(responses):
            mask = get_mask(responses, hparams.truncate_token, hparams.truncate_after)
            return torch.where(mask, torch.full_like(responses, padding_token), responses)
        return truncate
    else:
        return lambda responses: responses

#returns a filter function
#responses not passing that function will receive a low (fixed) score
#only query humans on responses that pass that function
#central example: ensure that the sample contains truncate_token
def filter_fn_from_hparams(hparams: TaskHParams):
    def filter(responses):
        if hparams.truncate_token is not None and hparams.filter_responses:
            matches_token = responses[:, hparams.truncate_after:] == hparams.truncate_token
            return matches_token.any(dim=-1)
        else:
            return torch.ones(responses.shape[0], dtype=torch.bool, device=responses.device)
    return filter


def query_formatter(hparams: TaskHParams, encoder):
    """Turns a query into a context to feed to the language model

    NOTE: Both of these are lists of tokens
    """
    # Encoded once here rather than on every call (TF built the constants once, into the graph).
    prefix_tokens = torch.tensor(encoder.encode(hparams.query_prefix), dtype=torch.long)
    suffix_tokens = torch.tensor(encoder.encode(hparams.query_suffix), dtype=torch.long)
    def query_formatter(queries):
        batch_size = queries.shape[0]
        tiled_prefix = utils.expand_tile(prefix_tokens.to(queries), batch_size, axis=0)
        tiled_suffix = utils.expand_tile(suffix_tokens.to(queries), batch_size, axis=0)
        return torch.cat([tiled_prefix, queries, tiled_suffix], 1)
    return query_formatter


def _single_token(encoder, text, name):
    """The original unpacked `token, = encoder.encode(text)`; same check, with a message."""
    tokens = encoder.encode(text)
    if len(tokens) != 1:
        raise ValueError(f'task.{name}={text!r} must encode to exactly one token, got {tokens}')
    return tokens[0]


def make_query_sampler(*, hparams: TaskHParams, encoder, batch_size: int, mode='train', device=None):
    """A function returning dict(tokens=LongTensor [batch_size, query_length]) on utils.get_device(): the
    next batch of the queries of the rank whose section calls it (the original's `comm` is the ranks this
    process carries, utils/ranks.py; the sampler's TF `scope` argument is gone). Made outside the rank
    sections: preparing the dataset is collective over processes. Ours: device, where the tokens go instead
    (the question maker's: its policies', which a caller may have put elsewhere)."""
    if hparams.start_text:
        start_token = _single_token(encoder, hparams.start_text, 'start_text')
    else:
        start_token = None

    if hparams.end_text:
        end_token = _single_token(encoder, hparams.end_text, 'end_text')
    else:
        end_token = None

    data = datasets.get_dataset(hparams.query_dataset).torch_dataset(
        sequence_length=hparams.query_length, mode=mode, encoder=encoder,
        start_token=start_token, end_token=end_token,
    )
    device = device or utils.get_device()

    def sampler():
        context_tokens = data.next_batch(batch_size).to(device)
        return dict(tokens=context_tokens)
    sampler.fingerprint = data.fingerprint  # ours: a run records which queries it used
    return sampler
