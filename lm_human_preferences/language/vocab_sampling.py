"""Ours: a categorical sample of the logits h @ w.T * beta without writing them, for sampling on a CPU.

With GPT-2's 50,257-token vocabulary and a small model, a CPU decoding step is the n_vocab projection and the
passes over its [rows, n_vocab] logits: the product writes them (103 MB for 512 rows, far past the caches), the
sampler reads them back three times, and a fresh tensor of that size is page-faulted in at every step. Here the
vocabulary goes a chunk at a time (CHUNK tokens: the chunk's logits stay in cache): each chunk's product, its
maximum and its blocks' sums of exp(logit - chunk max); then the blocks' sums rescaled to the row's maximum, and
the sample found as categorical.sample_from_logits_unchecked finds it (TF's running sum, searched for uniform * total,
in two levels): the block by the running sum of the blocks' sums, the token by the running sum within the
block, whose BLOCK logits are made again for its row alone.

The same distribution as sample_from_logits_unchecked with the same uniform draws, not the same tokens bit for
bit: the exps are taken against each chunk's maximum and rescaled (~1e-7 relative), so a draw within that of a
boundary between two tokens can fall on the other. The products run at the CPU's fast fp32 precision (fp32
logits; products_precision). The trainers' fp32 mode (the original's numbers) never comes here: Policy.respond
uses it on a CPU for our own tokens-only sampling (the offline labels, the labeling page's questions, the
reports' samples) and in bf16 mode.
"""

import math

import torch

from lm_human_preferences.language import bf16
from lm_human_preferences.utils import categorical

# Tokens a chunk: with 128 rows its fp32 logits are 1 MB (a core's L2 holds them).
CHUNK = 2048
# Tokens a block of the two-level search (a divisor of CHUNK): the recomputed logits of each row's block are
# BLOCK x n_embd weights gathered per row.
BLOCK = 64


def chunked_on(device):
    """Whether sampling on this device draws from the hidden states by sample_from_hidden: on a CPU. A GPU
    keeps the plain sampler, whose numbers are the ones measured there."""
    return torch.device(device).type == 'cpu'


def products_precision():
    """The float32 matmul precision of the chunked sampler's products on a CPU: 'medium' where the CPU
    multiplies bf16 natively (bf16.fast_fp32_matmuls: fp32 logits from bf16-rounded inputs where oneDNN takes
    the product, as on AMX; elsewhere torch 2.13 gives fp32 products the fp32 kernel), else 'highest'."""
    return 'medium' if bf16.native_bf16_cpu() else 'highest'


@torch.no_grad()
def sample_from_hidden(h, w, uniform, *, beta=1.0, logprobs=False):
    """One categorical sample per row of the logits h [rows, e] @ w [n_vocab, e].T * beta, drawn by uniform
    [rows] (float64 in [0, 1)); the logits are never written whole (module docstring). Returns (samples [rows]
    int64, has_finite [rows] as sample_from_logits_unchecked's, logprobs [rows] of the samples under the scaled
    logits or None). Non-finite logits take no part, as in sample_from_logits_unchecked.

    The products at the CPU's fast fp32 precision (products_precision), fp32 logits: a CPU's bf16 product has
    no fp32 output in torch, and bf16 logits would be rounded to steps of 0.5 at GPT-2's logits of ~100."""
    h = h.float().contiguous()
    # Autocast off: bf16 mode samples here too, and its bf16 products would round the logits.
    with torch.autocast(h.device.type, enabled=False), bf16.fast_fp32_matmuls(h.device.type):
        return _sample(h, w, uniform, beta, logprobs)


def _sample(h, w, uniform, beta, logprobs):
    rows, n = h.shape[0], w.shape[0]
    chunks = -(-n // CHUNK)
    blocks_a_chunk = CHUNK // BLOCK
    block_sums = h.new_zeros((rows, chunks, blocks_a_chunk), dtype=torch.float32)
    chunk_max = h.new_empty((rows, chunks), dtype=torch.float32)
    for c in range(chunks):
        start = c * CHUNK
        width = min(CHUNK, n - start)
        logits = torch.mm(h, w[start:start + width].t()).mul_(beta)  # [rows, width]
        torch.nan_to_num_(logits, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
        top = logits.amax(dim=1, keepdim=True)  # [rows, 1]
        chunk_max[:, c] = top[:, 0]
        # A chunk of no finite logit in a row: its weights exp(-inf - 0) are 0, not NaN.
        weights = logits.sub_(top.nan_to_num(neginf=0.0)).exp_()
        full = width // BLOCK * BLOCK
        block_sums[:, c, :full // BLOCK] = weights[:, :full].view(rows, -1, BLOCK).sum(dim=-1)
        if full < width:
            block_sums[:, c, full // BLOCK] = weights[:, full:].sum(dim=-1)
    # Rescaled to the row's maximum: exp(logit - max) as the plain sampler's weights. A row of no finite logit
    # has max -inf and NaN scales, so its total is not > 0.
    row_max = chunk_max.amax(dim=1, keepdim=True)  # [rows, 1]
    block_sums.mul_((chunk_max - row_max).exp_()[:, :, None])
    block_cdf = block_sums.view(rows, -1).double().cumsum_(dim=1)  # [rows, blocks], not normalized
    total = block_cdf[:, -1:]
    target = uniform.reshape(rows, 1) * total
    block = categorical.search_running_sum(block_cdf, target)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    # The chosen block's logits again, for its row alone: [rows, BLOCK, e] @ [rows, e, 1].
    tokens = block * BLOCK + torch.arange(BLOCK, device=h.device)  # [rows, BLOCK]
    in_vocab = tokens < n
    block_w = w[tokens.clamp_max(n - 1)]  # [rows, BLOCK, e]
    block_logits = torch.bmm(block_w, h[:, :, None])[:, :, 0].mul_(beta)
    torch.nan_to_num_(block_logits, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    block_logits.masked_fill_(~in_vocab, -math.inf)
    in_block = (block_logits - row_max).exp_()
    offset = categorical.search_running_sum(torch.cumsum(in_block, dim=1, dtype=torch.float64).add_(before), target)
    samples = (block * BLOCK + offset).clamp_max_(n - 1)[:, 0]
    sample_logprobs = None
    if logprobs:
        # log softmax at the sample: logit - max - log(sum of exp(logit - max))
        sample_logprobs = block_logits.gather(1, offset)[:, 0] - row_max[:, 0] - total[:, 0].float().log()
    return samples, total[:, 0] > 0, sample_logprobs
