"""Sampling from an autoregressive sequence model (port of the original language/sample.py)."""

import torch

from lm_human_preferences.language import vocab_sampling
from lm_human_preferences.utils import categorical
from lm_human_preferences.utils import core as utils


def draw_uniforms(batch_size, length, *, generator=None, device=None):
    """The uniform draws of sampling `length` tokens for each of batch_size rows, [b, length] float64.

    Ours: drawn before the decoding loop, so that the loop draws nothing (a CUDA graph can replay it, and
    the ranks a process carries side by side each draw theirs from their own stream). Column i holds the
    batch that the original's step i drew, in the same order: on a CPU the same numbers as drawing one
    batch per step from the same stream."""
    return torch.rand(length, batch_size, dtype=torch.float64, device=device, generator=generator).t()


def queries_and_draws(queries, length):
    """(queries, their draw_uniforms for `length` tokens, drawn from the global stream): what a rank samples
    from, made in its section (ranks.concat_ranks)."""
    # Drawn from the CPU's stream whatever the device: CUDA's generator is another stream, and with it a run
    # on a GPU would sample other tokens than the same run on a CPU (one copy of b x length per rollout).
    return queries, draw_uniforms(len(queries), length).to(queries.device)


@torch.no_grad()
def sample_sequence(*, step, model_hparams, length, context, temperature=1, top_k=0, top_p=1.0,
                    extra_outputs=(), generator=None, uniforms=None, cuda_graph=False, logprobs=True, vocab=None):
    """Sampling from an autoregressive sequence model.

    Inputs:
        step: A function which takes model hparams, a tokens tensor and past, and returns a dictionary
            with 'logits' [b, s, n_vocab], 'presents' (passed back as past), and any extra outputs [b, s];
            called on the context, then on each new token [b, 1]. (The original also passed past_tokens to
            mask their pads; our KV cache keeps which of its positions are pads: language/model.py.)
        context: Includes start tokens, [b, c].
        length: number of tokens to sample (always exactly this many: the original's `cond` is unused).
        extra_outputs: keys of step's outputs to collect, e.g. ('values',) (the original also took dtypes).
        uniforms: ours, [b, length] float64, each sampled token's draw (draw_uniforms); by default drawn
            from `generator` (a torch.Generator, or the global stream) before the loop.
        logprobs: ours; False: no 'logprobs' (a log-softmax over the vocabulary every step, 15 % of a small
            model's sampling step on a CPU) where only the tokens are used; the same tokens.
        vocab: ours, the output embedding w [n_vocab, e] or None: step returns 'h' (the final hidden states
            [b, s, e]) in place of 'logits', and each token is drawn from h @ w.T by
            vocab_sampling.sample_from_hidden (the logits never written whole: the same distribution, other
            rounding; no top_k / top_p).
        cuda_graph: ours, on CUDA: one decoding step captured as a CUDA graph and replayed for each later
            token (the original's tf.while_loop was a graph too); step must then extend `past` in place and
            return tensors of the same shapes each call (Policy.respond's step does).
    Returns: a dict with 'tokens' [b, c + length] (context then samples), 'presents', 'logprobs' [b, length]
        and one [b, length] entry per extra output (entry i: at the position that predicted token i).
    """
    if length < 1:
        raise ValueError(f'sample_sequence: length must be >= 1, got {length}')
    if uniforms is None:
        uniforms = draw_uniforms(len(context), length, generator=generator, device=context.device)

    beta = 1 / max(temperature, 1e-10)
    if vocab is not None and (top_k != 0 or top_p != 1.0):
        raise ValueError('sample_sequence: vocab (the chunked sampler) takes no top_k / top_p')

    # First step: the whole context, whose last position samples the first token; then the loop's variables.
    context_output = step(model_hparams, context)
    want_logprobs = logprobs
    responses, logprobs, extras, has_finite = _first_token(context_output, uniforms, beta, length, extra_outputs,
                                                           want_logprobs, vocab)
    prev = responses[:, :1].clone()  # [b, 1]
    past = context_output['presents']
    index = torch.ones(1, dtype=torch.long, device=context.device)

    def body():
        nonlocal past
        next_outputs = step(model_hparams, prev, past=past)
        if vocab is not None:
            next_sample, next_has_finite, next_logprob = _sample_from_hidden(
                next_outputs['h'][:, 0], vocab, uniforms.index_select(1, index), beta, want_logprobs)  # [b, 1]
        else:
            logits = next_outputs['logits'].float() * beta  # [b, 1, n_vocab]
            if top_k != 0:
                logits = utils.take_top_k_logits(logits, top_k)
            if top_p != 1.0:
                logits = utils.take_top_p_logits(logits, top_p)
            next_sample, next_has_finite = categorical.sample_from_logits_unchecked(
                logits, uniform=uniforms.index_select(1, index))  # [b, 1]
            if want_logprobs:
                next_logprob = utils.logprobs_from_logits(logits=logits, labels=next_sample)  # [b, 1]
        has_finite.logical_and_(next_has_finite[:, 0])
        if want_logprobs:
            logprobs.index_copy_(1, index, next_logprob)
        past = next_outputs['presents']
        prev.copy_(next_sample)
        responses.index_copy_(1, index, next_sample)
        for k in extra_outputs:
            extras[k].index_copy_(1, index, next_outputs[k])
        index.add_(1)

    # Then one token per step, from the cache.
    run_steps = _replay_as_cuda_graph if cuda_graph and context.device.type == 'cuda' else _run_eagerly
    run_steps(body, length - 1)

    categorical.check_rows_have_finite_logits(has_finite)
    return dict(tokens=torch.cat([context, responses], dim=1), presents=past, **extras,
                **(dict(logprobs=logprobs) if want_logprobs else {}))


def _sample_from_hidden(h, vocab, uniform, beta, want_logprobs):
    """sample_sequence's draw of one token a row [b, 1] from the final hidden states h [b, e] (its `vocab`):
    (samples, has_finite, logprobs or None), each [b, 1]."""
    samples, has_finite, logprobs = vocab_sampling.sample_from_hidden(h, vocab, uniform, beta=beta,
                                                                      logprobs=want_logprobs)
    return samples[:, None], has_finite[:, None], None if logprobs is None else logprobs[:, None]


def _first_token(context_output, uniforms, beta, length, extra_outputs, want_logprobs=True, vocab=None):
    """The first sampled token from the context's last logits, and the loop's variables (the original's
    while_loop variables) with it in column 0: responses and logprobs [b, length], one [b, length] per extra
    output, and has_finite [b]. They have fixed shapes and are written in place (the original concatenated onto
    them every step)."""
    # As the original, top_k / top_p are not applied to the first sampled token.
    # Ours: nothing in the loop reads a value on the host, so the device never waits for it; whether
    # every row had a finite logit at every step is checked once, after the loop.
    if vocab is not None:
        first, has_finite, first_logprobs = _sample_from_hidden(context_output['h'][:, -1], vocab, uniforms[:, 0],
                                                                beta, want_logprobs)
        first, has_finite = first[:, 0], has_finite[:, 0]
    else:
        logits = beta * context_output['logits'][:, -1].float()  # [b, n_vocab]
        first, has_finite = categorical.sample_from_logits_unchecked(logits, uniform=uniforms[:, 0])  # [b]
        if want_logprobs:
            first_logprobs = utils.logprobs_from_logits(logits=logits, labels=first)
    responses = first.new_empty(len(first), length)
    responses[:, 0] = first
    logprobs = None
    if want_logprobs:
        logprobs = uniforms.new_empty(len(first), length, dtype=torch.float32)
        logprobs[:, 0] = first_logprobs.reshape(-1)
    extras = {}
    for k in extra_outputs:
        extras[k] = context_output[k].new_empty(len(first), length)
        extras[k][:, 0] = context_output[k][:, -1]
    return responses, logprobs, extras, has_finite


def _run_eagerly(body, steps):
    for _ in range(steps):
        body()


# Steps run eagerly before the capture, on a side stream: CUDA graphs need the libraries' lazy setup (cuBLAS
# workspaces, autocast's weight casts) done before they record.
_CUDA_GRAPH_WARMUP_STEPS = 2


def _replay_as_cuda_graph(body, steps):
    """Run body() `steps` times: a few eagerly, then once captured as a CUDA graph (recording, not running
    it) and replayed for each remaining step."""
    warmup = min(_CUDA_GRAPH_WARMUP_STEPS, steps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(side)
    if steps == warmup:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(steps - warmup):
        graph.replay()
