"""A proposer that drafts a known continuation: for acceptance-statistics tests and the speculative-decoding
ceiling benchmark ("the draft forced to the target's greedy token"). Not a real drafter."""

from __future__ import annotations

import torch
from deepinfer_spec import Drafts, ProposeBatch


class ScriptedProposer:
    """Drafts ``script[prompt][i]`` for output position i (the target's greedy tokens from a plain run), or a
    token that is surely wrong (``wrong=True``: the scripted token + 1 mod V). One-hot draft distributions.

    Args:
        scripts: prompt token ids (tuple) -> the full output token list to draft from.
        num_speculative_tokens: N.
        vocab_size: V.
    """

    placeholders_after_prefill = False
    context_kind = "tokens"

    def __init__(self, scripts: dict[tuple, list[int]], num_speculative_tokens: int, vocab_size: int, wrong=False):
        self.scripts, self.num_speculative_tokens, self.vocab_size, self.wrong = (
            scripts,
            num_speculative_tokens,
            vocab_size,
            wrong,
        )

    def _continuation(self, seq: list[int]) -> list[int]:
        for prompt, out in self.scripts.items():
            if tuple(seq[: len(prompt)]) == prompt and seq[len(prompt) :] == out[: len(seq) - len(prompt)]:
                nxt = out[len(seq) - len(prompt) :][: self.num_speculative_tokens]
                return [(t + 1) % self.vocab_size for t in nxt] if self.wrong else nxt
        return []

    def propose(self, batch: ProposeBatch) -> Drafts:
        b, n = len(batch.context), self.num_speculative_tokens
        tokens = torch.full((b, n), -1, dtype=torch.int64)
        for i, seq in enumerate(batch.context):
            found = self._continuation(seq)
            tokens[i, : len(found)] = torch.tensor(found, dtype=torch.int64)
        tokens = tokens.to(batch.anchors.device)
        logprobs = torch.full((b, n, self.vocab_size), float("-inf"), device=tokens.device)
        logprobs.scatter_(2, tokens.clamp(min=0).unsqueeze(2), 0.0)
        return Drafts(tokens, logprobs, None)
