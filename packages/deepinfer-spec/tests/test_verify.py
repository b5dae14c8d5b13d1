"""Verification (procedure V and block verification): statistical losslessness, greedy exactness,
constructed acceptance cases, row invariance and layouts.

The statistical tests simulate a toy first-order Markov "model" pair (target Q[x] and draft P[x] are
the next-token distributions after token x, V = 8, with zero-probability entries), draft with the
draft random stream, verify, and compare the empirical distribution of the first emitted token and
of the first two emitted tokens with the target's exact distribution. The bound is
Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= lam) <= 2^k exp(-n lam^2 / 2) over k cells, so
lam = sqrt(2 (k ln 2 + ln(1/delta)) / n) fails a correct sampler with probability < delta = 1e-7 (a
correct sampler here is also only exact up to the e^(-5e-5) residual factor, whose L1 effect is
below 2e-4 per token and is added as slack). Negative checks run the same statistic on deliberately
wrong samplers and must exceed the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from deepinfer_kernels.ops.sampling import DRAFT_SEED_OFFSET, draw_tokens, processed_logprobs
from deepinfer_spec import (
    Drafts,
    SpecStats,
    VerifyResult,
    block_step_seeds,
    block_verify,
    placeholder_drafts,
    rejection_verify,
)

VERIFIERS = {"rejection": rejection_verify, "block": block_verify}
V, N = 8, 4
DRAWS = 400_000
DELTA = 1e-7
SLACK = 1e-3  # >= the L1 effect of the e^(-5e-5) residual factor over two tokens


def random_tables(v: int, gen: torch.Generator, zero_frac: float = 0.25) -> torch.Tensor:
    """fp32 [V, V] log next-token distributions with some zero-probability (-inf) entries."""
    probs = (-torch.rand(v, v, generator=gen, dtype=torch.float64).log()) ** 2  # skewed, positive
    drop = torch.rand(v, v, generator=gen) < zero_frac
    drop[torch.arange(v), torch.randint(0, v, (v,), generator=gen)] = False  # keep one entry per row
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return probs.log().float()


def sequence_seeds(n: int, salt: int) -> torch.Tensor:
    """int64 [n] distinct seeds (an odd-multiplier walk, wrapping in int64)."""
    return torch.arange(n, dtype=torch.int64) * 0x9E3779B1 + salt


def draft_block(log_p: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, seeds: torch.Tensor, n: int):
    """Sample n drafts per sequence from the draft table on the draft stream (decision D3)."""
    prev, toks, lps = anchors, [], []
    for k in range(n):
        lp = log_p[prev]
        prev = draw_tokens(lp, seeds + DRAFT_SEED_OFFSET, positions + k + 1)
        toks.append(prev)
        lps.append(lp)
    return Drafts(torch.stack(toks, 1), torch.stack(lps, 1))


def spec_step(
    verify: Callable[..., VerifyResult],
    log_q: torch.Tensor,
    log_p: torch.Tensor,
    anchors: torch.Tensor,
    positions: torch.Tensor,
    seeds: torch.Tensor,
    num_verified: torch.Tensor,
    n: int,
    drafts: Drafts | None = None,
    verify_log_q: torch.Tensor | None = None,
) -> tuple[VerifyResult, Drafts]:
    """One draft + verify step; ``verify_log_q`` replaces the target given to the verifier (negative checks)."""
    if drafts is None:
        # Block mode gives the proposer per-step seeds (see block_verify's module docstring).
        dseeds = block_step_seeds(seeds, positions) if verify is block_verify else seeds
        drafts = draft_block(log_p, anchors, positions, dseeds, n)
    ctx = torch.cat([anchors.unsqueeze(1), drafts.tokens.clamp(min=0)], 1)
    table = log_q if verify_log_q is None else verify_log_q
    return verify(table[ctx], drafts, num_verified, seeds, positions), drafts


def l1_bound(cells: int, n: int) -> float:
    return math.sqrt(2.0 * (cells * math.log(2.0) + math.log(1.0 / DELTA)) / n) + SLACK


def first_two_tokens(verify, log_q, log_p, anchor: int, n: int, draws: int, salt: int, num_verified=None, **kw):
    """(first token [draws], second token [draws]) of a simulated decode from ``anchor`` at position 100."""
    anchors = torch.full((draws,), anchor, dtype=torch.int64)
    pos = torch.full((draws,), 100, dtype=torch.int64)
    seeds = sequence_seeds(draws, salt)
    m = torch.full((draws,), n, dtype=torch.int64) if num_verified is None else num_verified
    res1, _ = spec_step(verify, log_q, log_p, anchors, pos, seeds, m, n, **kw)
    first = res1.tokens[:, 0]
    # The second token: from this step when it emitted two, else from the next step (anchor = first).
    second = res1.tokens[:, 1].clone()
    one = (res1.num_emitted == 1).nonzero().squeeze(1)  # rows are independent: run only these
    res2, _ = spec_step(verify, log_q, log_p, first[one], pos[one] + 1, seeds[one], m[one], n, **kw)
    second[one] = res2.tokens[:, 0]
    return first, second, res1


def l1_distance(samples: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    return float((counts / samples.numel() - expected.reshape(-1)).abs().sum())


def target_pair_distribution(log_q: torch.Tensor, anchor: int) -> torch.Tensor:
    q = log_q.double().exp()
    return q[anchor].unsqueeze(1) * q  # [V, V]: Q[anchor](t1) Q[t1](t2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests run many small elementwise ops; one intra-op thread is faster on a shared 2-core
    machine (and the results do not depend on it: every op is row-invariant)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tables():
    gen = torch.Generator().manual_seed(1234)
    return random_tables(V, gen), random_tables(V, gen)


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_emitted_distribution_equals_target(method, tables):
    log_q, log_p = tables
    anchor = 3
    # Per-request verify lengths 0..N exercise the padding path (procedure S can give any prefix).
    m = torch.arange(DRAWS, dtype=torch.int64) % (N + 1)
    first, second, res = first_two_tokens(VERIFIERS[method], log_q, log_p, anchor, N, DRAWS, salt=11, num_verified=m)
    q_first = log_q[anchor].double().exp()
    assert l1_distance(first, q_first) < l1_bound(V, DRAWS)
    assert l1_distance(first * V + second, target_pair_distribution(log_q, anchor)) < l1_bound(V * V, DRAWS)
    # The test exercised every path: accepted drafts, rejections (residuals) and bonus tokens.
    assert bool((res.num_accepted > 0).any()) and bool(res.resampled.any()) and bool((~res.resampled).any())


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_statistic_detects_wrong_samplers(method, tables):
    """The same statistic on deliberately wrong samplers must exceed the bound (the test can fail)."""
    log_q, log_p = tables
    anchor, draws = 3, 20_000
    verify = VERIFIERS[method]
    # 1. Verifying against the draft distribution substituted for the target's.
    first, second, _ = first_two_tokens(verify, log_q, log_p, anchor, N, draws, salt=21, verify_log_q=log_p)
    assert l1_distance(first * V + second, target_pair_distribution(log_q, anchor)) > l1_bound(V * V, draws)
    # 2. Drafts sampled from P but reported with the target's distribution (verification is then blind).
    anchors = torch.full((draws,), anchor, dtype=torch.int64)
    pos = torch.full((draws,), 100, dtype=torch.int64)
    seeds = sequence_seeds(draws, 31)
    real = draft_block(log_p, anchors, pos, seeds, N)
    ctx = torch.cat([anchors.unsqueeze(1), real.tokens], 1)
    lying = Drafts(real.tokens, log_q[ctx[:, :N]])
    res, _ = spec_step(verify, log_q, log_p, anchors, pos, seeds, torch.full((draws,), N), N, drafts=lying)
    assert l1_distance(res.tokens[:, 0], log_q[anchor].double().exp()) > l1_bound(V, draws)


def test_block_accepts_at_least_as_many_as_token_level(tables):
    log_q, log_p = tables
    draws = DRAWS // 4
    anchors = torch.full((draws,), 5, dtype=torch.int64)
    pos = torch.full((draws,), 7, dtype=torch.int64)
    seeds = sequence_seeds(draws, 41)
    m = torch.full((draws,), N, dtype=torch.int64)
    drafts = draft_block(log_p, anchors, pos, seeds, N)
    tok, _ = spec_step(rejection_verify, log_q, log_p, anchors, pos, seeds, m, N, drafts=drafts)
    blk, _ = spec_step(block_verify, log_q, log_p, anchors, pos, seeds, m, N, drafts=drafts)
    # Hoeffding on each mean (values in [0, N]) with failure probability 1e-7 each.
    tol = 2 * N * math.sqrt(math.log(2 / DELTA) / (2 * draws))
    assert blk.num_accepted.double().mean() >= tok.num_accepted.double().mean() - tol


def greedy_table(v: int, seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logits [V, V], target greedy logprobs, draft greedy logprobs) for a Markov toy."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(v, v, generator=gen) * 3
    draft_logits = logits + noise * torch.randn(v, v, generator=gen)

    def greedy(x):
        zeros = torch.zeros(v)
        return processed_logprobs(
            x,
            zeros,
            torch.zeros(v, dtype=torch.int64),
            torch.ones(v, dtype=torch.float64),
            zeros,
            torch.ones(v, dtype=torch.bool),
        )

    return logits, greedy(logits), greedy(draft_logits)


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_greedy_is_the_target_argmax_chain(method):
    v, n, steps, batch = 64, 5, 12, 32
    logits, log_q, log_p = greedy_table(v, 7, noise=0.7)
    anchors = torch.arange(batch, dtype=torch.int64) % v
    pos = torch.full((batch,), 50, dtype=torch.int64)
    seeds = sequence_seeds(batch, 5)
    emitted = [[] for _ in range(batch)]
    accepted = []
    for _ in range(steps):
        res, _ = spec_step(VERIFIERS[method], log_q, log_p, anchors, pos, seeds, torch.full((batch,), n), n)
        for b in range(batch):
            emitted[b].extend(res.tokens[b, : int(res.num_emitted[b])].tolist())
        anchors = res.tokens.gather(1, res.num_accepted.unsqueeze(1)).squeeze(1)
        pos = pos + res.num_emitted
        accepted.append(res.num_accepted)
    for b in range(batch):
        prev, chain = b % v, []
        for _ in emitted[b]:
            prev = int(logits[prev].argmax())
            chain.append(prev)
        assert emitted[b] == chain
    acc = torch.cat(accepted)
    assert bool((acc == 0).any()) and bool((acc == n).any()) and bool(((acc > 0) & (acc < n)).any())


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_always_and_never_accepted_drafts_and_their_stats(method, tables):
    log_q, _ = tables
    batch = 512
    anchors = torch.arange(batch, dtype=torch.int64) % V
    pos = torch.arange(batch, dtype=torch.int64) + 10
    seeds = sequence_seeds(batch, 3)
    m = torch.full((batch,), N, dtype=torch.int64)
    # A draft equal to the target: every draft accepted, the bonus emitted.
    res, drafts = spec_step(VERIFIERS[method], log_q, log_q, anchors, pos, seeds, m, N)
    assert torch.equal(res.num_accepted, m) and not bool(res.resampled.any())
    assert torch.equal(res.tokens[:, :N], drafts.tokens)
    stats = SpecStats()
    stats.record_batch(list(range(batch)), m, res.num_verified, res.num_accepted)
    d = stats.as_dict()
    assert d["spec_mean_accepted_length"] == N + 1 and d["spec_acceptance_rate"] == 1.0
    assert d["spec_position_acceptance_rates"] == [1.0] * N
    assert d["spec_draft_tokens_verified"] == d["spec_draft_tokens_accepted"] == batch * N
    assert stats.request_metrics(0)["spec_tokens_emitted"] == N + 1
    # A draft that always proposes a token the target gives probability 0: nothing accepted.
    q = log_q.exp()
    impossible = q.argmin(-1)  # probability 0 (each row has zero entries) ...
    assert bool((q[torch.arange(V), impossible] == 0).all())
    never = torch.full((V, V), float("-inf"))
    never[torch.arange(V), impossible] = 0.0  # ... proposed with certainty
    res, _ = spec_step(VERIFIERS[method], log_q, never, anchors, pos, seeds, m, N)
    assert bool((res.num_accepted == 0).all()) and bool(res.resampled.all())
    assert bool((res.tokens[:, 1:] == -1).all())
    assert bool((q[anchors, res.tokens[:, 0]] > 0).all())
    stats = SpecStats()
    stats.record_batch(list(range(batch)), m, res.num_verified, res.num_accepted)
    d = stats.as_dict()
    assert d["spec_mean_accepted_length"] == 1.0 and d["spec_acceptance_rate"] == 0.0
    assert d["spec_position_acceptance_rates"] == [0.0] * N
    assert d["spec_draft_tokens_accepted"] == 0 and d["spec_tokens_emitted"] == batch


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_row_invariant_layouts_and_reproducible(method, tables):
    log_q, log_p = tables
    batch = 24
    anchors = torch.arange(batch, dtype=torch.int64) % V
    pos = torch.arange(batch, dtype=torch.int64) * 3 + 5
    seeds = sequence_seeds(batch, 77)
    m = torch.arange(batch, dtype=torch.int64) % (N + 1)
    verify = VERIFIERS[method]
    drafts = draft_block(log_p, anchors, pos, seeds, N)
    ctx = torch.cat([anchors.unsqueeze(1), drafts.tokens], 1)
    padded = log_q[ctx]
    full = verify(padded, drafts, m, seeds, pos)
    again = verify(padded.clone(), drafts, m, seeds, pos)
    flat = torch.cat([padded[b, : int(m[b]) + 1] for b in range(batch)])
    from_flat = verify(flat, drafts, m, seeds, pos)
    for other in (again, from_flat):
        for name in ("num_accepted", "tokens", "logprobs", "resampled"):
            assert torch.equal(getattr(full, name), getattr(other, name)), name
    for b in (0, 7, batch - 1):
        one = Drafts(drafts.tokens[b : b + 1], drafts.logprobs[b : b + 1])
        alone = verify(padded[b : b + 1], one, m[b : b + 1], seeds[b : b + 1], pos[b : b + 1])
        assert torch.equal(alone.tokens[0], full.tokens[b]) and torch.equal(alone.logprobs[0], full.logprobs[b])
    # Emitted logprobs are the target's processed logprobs of the emitted tokens.
    for b in range(batch):
        k = int(full.num_emitted[b])
        rows = padded[b, torch.arange(k)]
        assert torch.equal(full.logprobs[b, :k], rows.gather(1, full.tokens[b, :k].unsqueeze(1)).squeeze(1))
        assert bool((full.tokens[b, k:] == -1).all())


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_missing_drafts_and_placeholders(method, tables):
    log_q, log_p = tables
    batch = 64
    anchors = torch.arange(batch, dtype=torch.int64) % (V - 1)
    pos = torch.full((batch,), 20, dtype=torch.int64)
    seeds = sequence_seeds(batch, 9)
    m = torch.full((batch,), N, dtype=torch.int64)
    verify = VERIFIERS[method]
    drafts = draft_block(log_p, anchors, pos, seeds, N)
    tokens = drafts.tokens.clone()
    tokens[:, 2:] = -1  # drafts 3.. missing: never accepted
    res, _ = spec_step(verify, log_q, log_p, anchors, pos, seeds, m, N, drafts=Drafts(tokens, drafts.logprobs))
    assert bool((res.num_accepted <= 2).all())
    # Decision D6: placeholder drafts (id V-1, one-hot) after prefill.
    q = log_q.clone()
    q[:, V - 1] = float("-inf")  # the target never proposes V-1 here
    q = q - q.logsumexp(-1, keepdim=True)
    ph = placeholder_drafts(batch, N, V)
    assert bool((ph.confidences == 0).all())
    res, _ = spec_step(verify, q, log_p, anchors, pos, seeds, m, N, drafts=ph)
    assert bool((res.num_accepted == 0).all()) and bool((res.tokens[:, 0] != V - 1).all())
    assert bool(res.resampled.all())  # the anchor row goes through the residual path (D6)


def test_rejection_uses_the_documented_streams(tables):
    """Recompute procedure V for one request by hand from the kernels' uniforms."""
    from deepinfer_kernels.ops.sampling import accept_uniforms, sampling_uniforms
    from deepinfer_spec import DRAFT_PROB_PENALTY

    log_q, log_p = tables
    for salt in range(40):
        anchors = torch.tensor([salt % V])
        pos = torch.tensor([30 + salt])
        seeds = sequence_seeds(1, 1000 + salt)
        res, drafts = spec_step(rejection_verify, log_q, log_p, anchors, pos, seeds, torch.tensor([N]), N)
        prev, out = int(anchors[0]), []
        for j in range(N):
            d = int(drafts.tokens[0, j])
            ratio = math.exp(min(float(log_q[prev, d]) - float(drafts.logprobs[0, j, d]), 0.0))
            if ratio > float(accept_uniforms(seeds, pos + j + 1)[0]):
                out.append(d)
                prev = d
                continue
            r = (log_q[prev].exp() - DRAFT_PROB_PENALTY * drafts.logprobs[0, j].exp()).clamp(min=0).double()
            u = float(sampling_uniforms(seeds, pos + j + 1, resample=True)[0])
            out.append(int((r.cumsum(0) <= u * r.sum()).sum()))
            break
        else:
            out.append(int(draw_tokens(log_q[prev].unsqueeze(0), seeds, pos + N + 1)[0]))
        assert res.tokens[0, : len(out)].tolist() == out


def test_block_residual_after_a_partial_accept():
    """Fixed drafts where block verification can only stop at tau = 0 or 1 and w_1 = 1/2, so the
    residual after d_1 must be max(w_1 q_1 - p_1, 0) (support {0} here; max(q_1 - p_1, 0) would
    also emit token 1) and P(tau = 1) = h_1 = R_1 / (R_1 + 1 - w_1)."""
    draws = 20_000
    q0, p0 = [0.25, 0.25, 0.25, 0.25], [0.5, 1 / 6, 1 / 6, 1 / 6]
    q1, p1 = [0.6, 0.3, 0.1, 0.0], [0.05, 0.25, 0.3, 0.4]  # d_2 = 3 has q_1 = 0: h_2 = w_2 = 0
    target = torch.tensor([q0, q1, q0]).log().expand(draws, 3, 4).contiguous()
    drafts = Drafts(
        torch.tensor([[0, 3]]).expand(draws, 2).contiguous(),
        torch.tensor([p0, p1]).log().expand(draws, 2, 4).contiguous(),
    )
    m = torch.full((draws,), 2, dtype=torch.int64)
    res = block_verify(target, drafts, m, sequence_seeds(draws, 17), torch.full((draws,), 60, dtype=torch.int64))
    tau, y = res.num_accepted, res.tokens.gather(1, res.num_accepted.unsqueeze(1)).squeeze(1)
    assert bool((tau <= 1).all()) and bool(res.resampled.all())
    assert bool((y[tau == 1] == 0).all())  # max(0.5 q_1 - p_1, 0) = (0.25, 0, 0, 0)
    assert bool((y[tau == 0] != 0).all())  # max(q_0 - p_0, 0) = (0, 1/12, 1/12, 1/12)
    h1 = 0.25 / (0.25 + 0.5)
    assert abs(float((tau == 1).double().mean()) - h1) < math.sqrt(math.log(2 / DELTA) / (2 * draws))


def test_verify_dispatch_and_input_checks(tables):
    from deepinfer_spec import verify

    log_q, log_p = tables
    anchors = torch.tensor([1, 2])
    pos = torch.tensor([5, 9])
    seeds = sequence_seeds(2, 1)
    drafts = draft_block(log_p, anchors, pos, seeds, N)
    target = log_q[torch.cat([anchors.unsqueeze(1), drafts.tokens], 1)]
    m = torch.tensor([N, 1])
    assert torch.equal(
        verify("rejection", target, drafts, m, seeds, pos).tokens,
        rejection_verify(target, drafts, m, seeds, pos).tokens,
    )
    assert torch.equal(
        verify("block", target, drafts, m, seeds, pos).tokens, block_verify(target, drafts, m, seeds, pos).tokens
    )
    with pytest.raises(ValueError, match="method"):
        verify("greedy", target, drafts, m, seeds, pos)
    with pytest.raises(ValueError, match="num_verified"):
        rejection_verify(target, drafts, torch.tensor([N + 1, 0]), seeds, pos)
    with pytest.raises(ValueError, match="flat target_logprobs"):
        rejection_verify(target[0], drafts, m, seeds, pos)
    with pytest.raises(ValueError, match="fp32"):
        block_verify(target.double(), drafts, m, seeds, pos)
    with pytest.raises(ValueError, match="seeds"):
        block_verify(target, drafts, m, seeds.int(), pos)
