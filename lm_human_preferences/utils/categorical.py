"""Ours: the categorical distribution over logits, as the policy samples and scores it: TF's own Multinomial
algorithm for tf.random.categorical (core.sample_from_logits, the original's name, calls it), and the
logprobs and entropies of the same logits in one pass (policy.analyze_responses)."""

import math

import torch


def logprobs_and_entropies_from_logits(*, logits, labels):
    """(logprobs_from_logits, entropy_from_logits) of the same logits [..., n_vocab] from one
    log-softmax: the entropy is -sum(p * log p) of it, computed without autograd (no loss of the original
    differentiates an entropy). With GPT-2's 50,257-token vocabulary every pass over the logits counts: the
    original's two functions made five (softmax, logsumexp, p * logits, their sum, the log-softmax), the
    autograd graph keeping p; this makes three beyond the log-softmax, kept by nothing. Equal to float rounding."""
    log_probs = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        entropies = log_probs.exp().mul_(log_probs).sum(dim=-1).neg_()
    return log_probs.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1), entropies


# The logits per block of sample_from_logits_unchecked's two-level running sum.
SAMPLE_BLOCK = 256


def search_running_sum(cdf, target):
    """The first index [rows, 1] whose running sum cdf [rows, n] exceeds target [rows, 1] (TF's upper bound);
    for a target at or beyond the last running sum, the last index that raised it (of positive weight). (A row
    of NaN sums, without a finite logit, gets an index inside the row: the caller reports it.)"""
    index = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.where(index < cdf.shape[1], index, last).clamp_max_(cdf.shape[1] - 1)


def sample_from_logits_unchecked(logits, generator=None, uniform=None):
    """sample_from_logits without its check, which reads a value on the host: (samples, has_finite), where
    has_finite [rows...] says which rows had a finite logit (the others got an arbitrary sample). A decoding
    loop keeps the device busy and checks once after its last step (language/sample.py). uniform: the
    float64 draw in [0, 1) of each row (ours: a decoding loop draws them beforehand), by default drawn
    here from generator or the global stream."""
    # The running sum in two levels, SAMPLE_BLOCK logits a block: the running sum of the blocks' sums
    # picks the block, the running sum within it the sample. A running sum along 50,257 logits is a sequential
    # pass, and it cost a CPU decoding step as much as its logits' matmul. The blocks' sums are float32, as
    # the exps (~1e-7 relative, where the exps already are); the running sums float64, as TF's. Where the two
    # levels' rounding leaves a target beyond a block's last running sum, the block's last token of positive
    # weight is taken: a token of weight 0 (a non-finite logit, the padding) is never sampled.
    rows, n = math.prod(logits.shape[:-1]), logits.shape[-1]
    blocks = -(-n // SAMPLE_BLOCK)
    # Non-finite logits take no part (TF's kernel skips them): as -inf, their weight exp(-inf - max) is 0, as
    # the padding's to whole blocks. A row without a finite logit has max -inf and NaN weights, so its total
    # is not > 0.
    flat_logits = logits.new_empty((rows, blocks * SAMPLE_BLOCK), dtype=torch.float32)
    flat_logits[:, n:] = -math.inf  # the padding only: the logits' part is written next
    torch.nan_to_num(logits.reshape(rows, n).float(), nan=-math.inf, posinf=-math.inf, neginf=-math.inf,
                     out=flat_logits[:, :n])
    max_logit = flat_logits.amax(dim=-1, keepdim=True)  # [rows, 1]
    weights = flat_logits.sub_(max_logit).exp_().view(rows, blocks, SAMPLE_BLOCK)
    block_cdf = weights.sum(dim=-1).double().cumsum_(dim=-1)  # [rows, blocks], not normalized
    total = block_cdf[:, -1:]
    if uniform is None:
        uniform = torch.rand(total.shape, dtype=torch.float64, device=total.device, generator=generator)
    else:
        uniform = uniform.reshape(total.shape)
    target = uniform * total  # [rows, 1]
    block = search_running_sum(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)  # the blocks before it
    in_block = weights.gather(1, block[:, :, None].expand(rows, 1, SAMPLE_BLOCK))[:, 0]  # [rows, SAMPLE_BLOCK]
    offset = search_running_sum(torch.cumsum(in_block, dim=-1, dtype=torch.float64).add_(before), target)
    samples = (block * SAMPLE_BLOCK + offset).clamp_max_(n - 1).reshape(logits.shape[:-1])  # n - 1: rows of NaN
    return samples, (total[:, 0] > 0).reshape(logits.shape[:-1])


def check_rows_have_finite_logits(has_finite):
    """FloatingPointError naming the rows of sample_from_logits_unchecked's has_finite that had no finite
    logit (TF would have returned the out-of-vocabulary index n for them)."""
    if not bool(has_finite.all()):
        rows = torch.nonzero(~has_finite.reshape(-1)).flatten().tolist()
        raise FloatingPointError(f'sample_from_logits: rows {rows[:10]} have no finite logits')
