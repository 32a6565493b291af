"""Sampling from an autoregressive sequence model (port of the original language/sample.py)."""

import torch

from lm_human_preferences.utils import core as utils


@torch.no_grad()
def sample_sequence(*, step, model_hparams, length, context, temperature=1, top_k=0, top_p=1.0,
                    extra_outputs=(), generator=None):
    """
    Sampling from an autoregressive sequence model.

    Inputs:
        step: A function which takes model hparams, a tokens tensor, past and past_tokens, and
            returns a dictionary with 'logits' [b, s, n_vocab], 'presents' (passed back as past), and
            any extra outputs [b, s]. It is called once on the context, then once per new token without
            reading values on the host (Policy.respond skips the model's input checks there).
        context: Includes start tokens, [b, c].
        length: number of tokens to sample (always exactly this many: the original's `cond` is unused).
        extra_outputs: keys of step's outputs to collect, e.g. ('values',). (The original took a map
            from key to dtype; the dtype comes from the tensors here.)
        generator: optional torch.Generator for reproducible sampling.
    Returns:
        A dict with 'tokens' [b, c + length] (context then samples), 'presents', 'logprobs'
        [b, length] and one [b, length] entry per extra output: entry i is the output at the position
        that predicted sampled token i.
    """
    if length < 1:
        raise ValueError(f'sample_sequence: length must be >= 1, got {length}')
    batch_size, context_length = context.shape

    beta = 1 / max(temperature, 1e-10)

    # First step: the whole context.
    context_output = step(model_hparams, context)
    logits = context_output['logits'][:, -1].float()  # [b, n_vocab]

    # As the original, top_k / top_p are not applied to the first sampled token.
    first_output_logits = beta * logits
    # Ours: nothing in the loop reads a value on the host, so the device never waits for it; whether
    # every row had a finite logit at every step is checked once, after the loop.
    first_outputs, has_finite = utils.sample_from_logits_unchecked(first_output_logits, generator=generator)  # [b]
    first_logprobs = utils.logprobs_from_logits(logits=first_output_logits, labels=first_outputs)  # [b]

    # Preallocated outputs (the original concatenated onto them every step).
    tokens = torch.empty(batch_size, context_length + length, dtype=context.dtype, device=context.device)
    tokens[:, :context_length] = context
    tokens[:, context_length] = first_outputs
    logprobs = torch.empty(batch_size, length, dtype=torch.float32, device=context.device)
    logprobs[:, 0] = first_logprobs
    extras = {}
    for k in extra_outputs:
        extras[k] = context_output[k].new_empty(batch_size, length)
        extras[k][:, 0] = context_output[k][:, -1]

    # Then one token per step, from the cache.
    past = context_output['presents']
    for i in range(1, length):
        n = context_length + i  # tokens so far
        next_outputs = step(model_hparams, tokens[:, n - 1:n], past=past, past_tokens=tokens[:, :n - 1])
        logits = next_outputs['logits'].float() * beta  # [b, 1, n_vocab]
        if top_k != 0:
            logits = utils.take_top_k_logits(logits, top_k)
        if top_p != 1.0:
            logits = utils.take_top_p_logits(logits, top_p)
        next_sample, next_has_finite = utils.sample_from_logits_unchecked(logits, generator=generator)  # [b, 1]
        has_finite &= next_has_finite[:, 0]
        next_logprob = utils.logprobs_from_logits(logits=logits, labels=next_sample)  # [b, 1]
        past = next_outputs['presents']
        tokens[:, n] = next_sample[:, 0]
        logprobs[:, i] = next_logprob[:, 0]
        for k in extra_outputs:
            extras[k][:, i] = next_outputs[k][:, 0]

    utils.check_rows_have_finite_logits(has_finite)
    return dict(tokens=tokens, presents=past, logprobs=logprobs, **extras)
