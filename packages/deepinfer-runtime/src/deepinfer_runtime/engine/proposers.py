"""Draft proposers behind ``deepinfer_spec.Proposer``: what the engine's speculative decoding can draft with.

* ``DSparkProposer``: a DSpark head, V4.1's or V4-Flash-0731's (procedure D): steps 1-4 in the model
  (``dspark_hidden``: block rows [anchor, noise...] over each stage's context rows), steps 5-6 in
  ``deepinfer_spec.markov_drafts`` with each request's own sampler on the draft random stream (``dspark_markov``:
  the Markov factors and the confidence head, if any). After a prefill it drafts D6 placeholders (as DeepInfer).
* ``MTPProposer``: V4-Flash's MTP layer (vLLM's ``"mtp"`` method): the layer runs the backbone streams whose next
  tokens became known, the anchor last, and chains on itself for further drafts (``model.draft_mtp``); each draft
  is sampled with the request's own sampler on the draft random stream, like DSpark's.
* ``NgramProposer``: prompt lookup (vLLM's ``"ngram"`` method) for any model: the tokens that followed the last
  earlier occurrence of the sequence's trailing n-gram. Deterministic drafts: one-hot draft distributions,
  which keeps rejection sampling lossless.
"""

from __future__ import annotations

import torch
from deepinfer_spec import Drafts, ProposeBatch, SpeculativeConfig, markov_drafts
from deepinfer_spec.drafting import sample_draft


class DSparkProposer:
    """``ProposeBatch.context``: the requests' model caches (their DSpark context must end at the anchor)."""

    placeholders_after_prefill = True  # decision D6
    context_kind = "caches"

    def __init__(self, model, config: SpeculativeConfig):
        if getattr(model, "draft_method", None) != "dspark":
            raise ValueError(
                "speculative_config method 'dspark' needs a checkpoint with a DSpark head (V4.1, or V4-Flash-0731 "
                f"with dspark_target_layer_ids); {type(model).__name__} was loaded without one"
            )
        if config.num_speculative_tokens != model.dspark_block_size:
            raise ValueError(
                f"speculative_config.num_speculative_tokens = {config.num_speculative_tokens} must equal the "
                f"checkpoint's dspark_block_size = {model.dspark_block_size} (decisions C16)"
            )
        self.model, self.config = model, config
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, batch: ProposeBatch) -> Drafts:
        base, hidden = self.model.dspark_hidden(batch.anchors, batch.context)
        w1, w2, confidence = self.model.dspark_markov()
        return markov_drafts(base, hidden, w1, w2, confidence, self.config.confidence_temperatures, batch)


class MTPProposer:
    """``ProposeBatch.context``: per request (model cache, token-id accessor ``token_ids(start, stop)``)."""

    placeholders_after_prefill = False  # the layer drafts from the prompt's last streams at once
    context_kind = "caches+tokens"

    def __init__(self, model, config: SpeculativeConfig):
        if getattr(model, "draft_mtp", None) is None:
            raise ValueError(
                f"speculative_config method 'mtp' needs DeepSeek-V4's MTP layer; {type(model).__name__} has none "
                "(V4.1 drafts with 'dspark')"
            )
        if model.draft_method != "mtp":
            raise ValueError("speculative_config method 'mtp': the model was loaded without its MTP layer (mtp=True)")
        self.model, self.config = model, config
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, batch: ProposeBatch) -> Drafts:
        tokens, logprobs = [], []

        def sample(j: int, logits: torch.Tensor) -> torch.Tensor:
            t, lp = sample_draft(logits, batch, batch.anchor_positions + 1 + j)
            tokens.append(t)
            logprobs.append(lp)
            return t

        caches, accessors = zip(*batch.context)
        anchors = batch.anchor_positions.tolist()
        self.model.draft_mtp([c.mtp for c in caches], list(accessors), anchors, self.num_speculative_tokens, sample)
        return Drafts(torch.stack(tokens, 1), torch.stack(logprobs, 1), None)


class NgramProposer:
    """``ProposeBatch.context``: each request's token ids so far (prompt + output, the anchor last)."""

    placeholders_after_prefill = False
    context_kind = "tokens"

    def __init__(self, vocab_size: int, config: SpeculativeConfig):
        self.vocab_size, self.config = vocab_size, config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def lookup(self, tokens: list[int]) -> list[int]:
        """The drafts for one sequence: longest trailing n-gram first, latest earlier match wins."""
        n_spec = self.num_speculative_tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + n_spec]
        return []

    def propose(self, batch: ProposeBatch) -> Drafts:
        b, n = len(batch.context), self.num_speculative_tokens
        dev = batch.anchors.device
        tokens = torch.full((b, n), -1, dtype=torch.int64)
        for i, seq in enumerate(batch.context):
            found = self.lookup(seq)
            tokens[i, : len(found)] = torch.tensor(found, dtype=torch.int64)
        tokens = tokens.to(dev)
        logprobs = torch.full((b, n, self.vocab_size), float("-inf"), device=dev)
        logprobs.scatter_(2, tokens.clamp(min=0).unsqueeze(2), 0.0)  # one-hot (a -1 draft is never read)
        return Drafts(tokens, logprobs, None)


def build_proposer(model, config: SpeculativeConfig):
    """The proposer ``config.method`` names, for this model."""
    if config.method == "dspark":
        return DSparkProposer(model, config)
    if config.method == "ngram":
        return NgramProposer(model.cfg.vocab_size, config)
    if config.method == "mtp":
        return MTPProposer(model, config)
    raise ValueError(
        f"speculative_config method {config.method!r} is not available for {type(model).__name__}: "
        "DeepInfer serves 'dspark' (V4.1 checkpoints with a DSpark head), 'mtp' (V4-Flash's MTP layer) and 'ngram'"
    )
