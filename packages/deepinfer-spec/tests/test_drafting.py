"""Procedure D steps 5-6 (Markov drafts, confidences) and the D3 draft sampler."""

import torch
from deepinfer_kernels.ops.sampling import DRAFT_SEED_OFFSET, draw_tokens, processed_logprobs
from deepinfer_spec import Drafts, ProposeBatch, Proposer, markov_drafts


def make_batch(b: int, greedy: bool, stopped=None) -> ProposeBatch:
    return ProposeBatch(
        anchors=torch.arange(b, dtype=torch.int64) * 3 % 11,
        anchor_positions=torch.arange(b, dtype=torch.int64) + 40,
        seeds=torch.arange(b, dtype=torch.int64) * 977 + 5,
        temperature=torch.full((b,), 0.0 if greedy else 0.8),
        top_k=torch.full((b,), 0 if greedy else 6, dtype=torch.int64),
        top_p=torch.full((b,), 1.0 if greedy else 0.9, dtype=torch.float64),
        min_p=torch.zeros(b),
        greedy=torch.full((b,), greedy),
        stopped=torch.zeros(b, dtype=torch.bool) if stopped is None else stopped,
    )


def test_markov_drafts_follow_procedure_d():
    gen = torch.Generator().manual_seed(3)
    b, n, v, d, r = 4, 5, 11, 6, 3
    base = torch.randn(b, n, v, generator=gen)
    hidden = torch.randn(b, n, d, generator=gen)
    w1, w2 = torch.randn(v, r, generator=gen), torch.randn(v, r, generator=gen)
    wc = torch.randn(d + r, generator=gen)
    temps = (1.0, 0.5, 2.0, 1.0, 1e-5)
    stopped = torch.tensor([False, True, False, False])
    for greedy in (True, False):
        batch = make_batch(b, greedy, stopped)
        out = markov_drafts(base, hidden, w1, w2, wc, temps, batch)
        assert isinstance(out, Drafts) and out.tokens.shape == (b, n) and out.logprobs.shape == (b, n, v)
        for i in range(b):
            prev = int(batch.anchors[i])
            for k in range(n):
                logits = base[i, k] + w2 @ w1[prev]
                lp = processed_logprobs(
                    logits[None],
                    batch.temperature[i : i + 1],
                    batch.top_k[i : i + 1],
                    batch.top_p[i : i + 1],
                    batch.min_p[i : i + 1],
                    batch.greedy[i : i + 1],
                )
                assert torch.allclose(out.logprobs[i, k], lp[0], atol=1e-5)
                tok = draw_tokens(
                    lp, batch.seeds[i : i + 1] + DRAFT_SEED_OFFSET, batch.anchor_positions[i : i + 1] + k + 1
                )
                assert int(out.tokens[i, k]) == int(tok[0])
                if greedy:
                    assert int(out.tokens[i, k]) == int(logits.argmax())
                z = torch.dot(torch.cat([hidden[i, k], w1[prev]]), wc) / temps[k]
                c = 0.0 if stopped[i] else float(torch.sigmoid(z.clamp(-60, 60)))
                assert abs(float(out.confidences[i, k]) - c) < 1e-6
                prev = int(out.tokens[i, k])
    assert markov_drafts(base, hidden, w1, w2, None, (1.0,), make_batch(b, True)).confidences is None


def test_proposer_protocol_and_draft_block_adapter():
    class Fixed:
        num_speculative_tokens = 2

        def propose(self, batch: ProposeBatch) -> Drafts:
            b = batch.anchors.shape[0]
            return Drafts(torch.zeros(b, 2, dtype=torch.int64), torch.zeros(b, 2, 3))

    assert isinstance(Fixed(), Proposer)

    class Block:  # the runtime's DraftBlock(tokens, confidences, logprobs)
        tokens = torch.tensor([[1, 2]])
        confidences = torch.tensor([[0.5, 0.25]], dtype=torch.float64)
        logprobs = torch.zeros(1, 2, 4)

    d = Drafts.from_block(Block())
    assert d.confidences.dtype == torch.float32 and d.num_tokens == 2 and d.vocab_size == 4
