"""The policy: a language model with a value head (port of the original policy.py)."""

import torch
from torch import nn

from lm_human_preferences import lm_tasks
from lm_human_preferences.language import bf16, model, sample, vocab_sampling
from lm_human_preferences.utils import categorical, passes


class Policy(nn.Module):
    def __init__(
            self,
            trained_model, *,
            scope=None,
            embed_queries=lambda queries: queries,
            temperature=1.0,
    ):
        super().__init__()
        self.trained_model = trained_model
        self.model_hparams = trained_model.hparams()
        self.encoder = self.trained_model.encoding.get_encoder()
        # The scope named the TF variables (e.g. 'policy/model/wte'); our checkpoints hold one scope's
        # state each, so it is kept only as a name.
        self.scope = scope if scope is not None else 'transformer_policy'
        self.model = model.Model(hparams=self.model_hparams, scalar_heads=['value'])
        self.embed_queries = embed_queries
        self.temperature = temperature
        self.padding_token = self.encoder.padding_token
        # The original loaded the weights on rank 0 only and broadcast them; every rank loads here
        # (the trainers still broadcast with utils.sync_params, which matters for 'test' models).
        self.trained_model.init_model(self)

    @classmethod
    def for_task(cls, trained_model, task, *, scope=None):
        """Ours: the policy of a task (lm_tasks.TaskHParams), with its query formatting and temperature: the
        original wrote this out wherever it made a policy."""
        return cls(trained_model, scope=scope,
                   embed_queries=lm_tasks.query_formatter(task, trained_model.encoding.get_encoder()),
                   temperature=task.policy.temperature)

    def get_encoder(self):
        return self.encoder

    def step_core(self, model_hparams, tokens, past=None, output_positions=slice(None), return_present=True,
                  room=0, check_inputs=True, lm_logits=True):
        lm_output = self.model(tokens, past=past, padding_token=self.padding_token, output_positions=output_positions,
                               return_present=return_present, room=room, check_inputs=check_inputs,
                               lm_logits=lm_logits)
        if not lm_logits:
            # Ours: the final hidden states in place of the logits, for the chunked sampler (respond).
            return {'h': lm_output['h'], 'values': lm_output['value'], 'presents': lm_output.get('present')}
        # need to slice logits since we don't want to generate special tokens
        logits = lm_output['lm_logits'][:, :, :self.model_hparams.n_vocab]
        return {
            'logits': logits,
            'values': lm_output['value'],
            'presents': lm_output.get('present'),
        }

    @torch.no_grad()
    def respond(self, queries, length, generator=None, uniforms=None, execution=None, logprobs=True,
                chunked_vocab=False):
        """Sample `length` response tokens per query: responses [b, length], their logprobs under the
        tempered logits and the values at the positions that predicted them, [b, length] each.

        Ours: uniforms [b, length], each sampled token's draw (language/sample.py's draw_uniforms; default:
        drawn from generator or the global stream). execution (training/execution.py; default: no split, no
        graph): its microbatch_size K samples at most K rows at a time, each microbatch with its own KV cache
        (every row's tokens come from its own draws, so the samples do not depend on K); with its cuda_graph,
        on CUDA each decoding step is replayed as a CUDA graph. logprobs False: responses and values only (the
        same responses, without a log-softmax over the vocabulary a token: sample.sample_sequence).
        chunked_vocab (ours): on a CPU, each token drawn from the final hidden state a chunk of the vocabulary at a
        time, at the CPU's fast fp32 precision (language/vocab_sampling.py: the same distribution, other
        rounding); our own callers ask for it (the offline labels, the questions, the reports), and bf16 mode
        uses it on a CPU. fp32 mode's trainers sample as the original.
        """
        microbatch_size = None if execution is None else execution.microbatch_size
        cuda_graph = execution is not None and execution.cuda_graph
        contexts = self.embed_queries(queries)
        context_length = contexts.shape[1]
        if uniforms is None:
            uniforms = sample.draw_uniforms(len(contexts), length, generator=generator, device=contexts.device)
        # The decoding steps skip the model's input checks (each would wait for the device). The model
        # sees the context and all but the last new token; the last position they take (pads take none)
        # is checked here, once, where the shapes alone cannot rule it out.
        if context_length + length - 1 > self.model_hparams.n_ctx:
            last_position = int((contexts != self.padding_token).sum(dim=1).max()) + length - 2
            if last_position >= self.model_hparams.n_ctx:
                raise ValueError(f'{context_length + length - 1} tokens need positions beyond n_ctx = '
                                 f'{self.model_hparams.n_ctx}')

        chunked = (chunked_vocab or bf16.autocast_dtype(contexts.device.type) is not None) and \
            vocab_sampling.chunked_on(contexts.device)
        vocab = self.model.wte[:self.model_hparams.n_vocab] if chunked else None

        def step(model_hparams, tokens, past=None):
            # Sampling reads only the last position's logits and value (of the whole context first); the
            # context's KV cache keeps room for every token sampled after it.
            return self.step_core(model_hparams, tokens, past=past, output_positions=slice(-1, None),
                                  room=length - 1, check_inputs=past is None, lm_logits=vocab is None)

        results = []
        for piece in passes.microbatches(len(contexts), microbatch_size):
            result = sample.sample_sequence(
                step=step,
                context=contexts[piece],
                length=length,
                model_hparams=self.model_hparams,
                temperature=self.temperature,
                extra_outputs=('values',),
                uniforms=uniforms[piece],
                cuda_graph=cuda_graph,
                logprobs=logprobs,
                vocab=vocab,
            )
            results.append(dict(
                responses=result['tokens'][:, context_length:],
                **({'logprobs': result['logprobs']} if logprobs else {}),
                values=result['values'],
            ))
        return passes.cat_pieces(results)

    def analyze_responses(self, queries, responses):
        """Logprobs and entropies of responses under logits / temperature, and the (unscaled) values,
        at the positions that predict each response token; [b, response_length] each."""
        contexts = self.embed_queries(queries)
        context_length = contexts.shape[1]
        tokens = torch.cat([contexts, responses], dim=1)
        # The positions that predict the response tokens (the original sliced them from all positions).
        # No KV cache either: nothing extends these sequences.
        positions = slice(context_length - 1, -1)
        if bf16.autocast_dtype(tokens.device.type) is not None:
            # Ours, bf16 mode: the same numbers from the hidden states, the logits made and read in one pass.
            lm_output = self.model(tokens, padding_token=self.padding_token, output_positions=positions,
                                   lm_logits=False, return_present=False)
            h = lm_output['h']  # [b, response_length, e]
            logprobs, entropies = bf16.logprobs_and_entropies(
                h.reshape(-1, h.shape[-1]), self.model.wte[:self.model_hparams.n_vocab], responses.reshape(-1),
                self.temperature)
            return dict(logprobs=logprobs.view_as(responses), entropies=entropies.view_as(responses),
                        values=lm_output['value'])
        result = self.step_core(self.model_hparams, tokens, output_positions=positions, return_present=False)
        logits = result['logits']

        logits = logits / self.temperature
        # Ours: the original's logprobs_from_logits and entropy_from_logits in one (fewer passes over the logits)
        logprobs, entropies = categorical.logprobs_and_entropies_from_logits(logits=logits, labels=responses)
        return dict(
            logprobs=logprobs,
            entropies=entropies,
            values=result['values'],
        )
