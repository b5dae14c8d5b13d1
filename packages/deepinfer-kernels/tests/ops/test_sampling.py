"""Sampling ops: the counter-based stream against a pure-Python SplitMix64, the sampled distribution
against the exact filtered softmax (chi-square at p = 0.001), greedy = argmax, bitwise batch
invariance of every op, penalties against a brute-force loop, processed logprobs and their top-k."""

import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from deepinfer_kernels import (
    SAMPLING_EPS,
    accept_uniforms,
    apply_penalties,
    draw_tokens,
    log_softmax_rows,
    process_logits,
    processed_logprobs,
    sample_tokens,
    sampling_uniforms,
    seed_to_int64,
    topk_logprobs,
)
from deepinfer_kernels.testing.compare import assert_bitwise

# chi-square 0.999 quantiles (p = 0.001) for 1..30 degrees of freedom
CHI2_CRIT = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264, 32.909,
             34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315, 46.797, 48.268, 49.728, 51.179,
             52.620, 54.052, 55.476, 56.892, 58.301, 59.703]  # fmt: skip

U64 = 1 << 64
PHI = 0x9E3779B97F4A7C15


@pytest.fixture(autouse=True)
def _force_reference(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; bins with expected count < 5 are merged."""
    n = sum(counts)
    bins, acc_o, acc_e = [], 0, 0.0
    for o, p in sorted(zip(counts, probs), key=lambda t: -t[1]):
        acc_o, acc_e = acc_o + o, acc_e + n * p
        if acc_e >= 5:
            bins.append((acc_o, acc_e))
            acc_o, acc_e = 0, 0.0
    if acc_e > 0 and bins:
        o, e = bins.pop()
        bins.append((o + acc_o, e + acc_e))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1


def assert_fits(tokens: torch.Tensor, probs: list[float], what: str) -> None:
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    impossible = [t for t, (c, p) in enumerate(zip(counts, probs)) if p == 0 and c > 0]
    assert not impossible, f"{what}: sampled filtered tokens {impossible}"
    stat, df = chi_square(counts, [p for p in probs])
    assert df >= 1
    assert stat < CHI2_CRIT[df - 1], f"{what}: chi2 {stat:.1f} >= {CHI2_CRIT[df - 1]} (df {df}), counts {counts}"


def expected_distribution(logits: list[float], t: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Decisions B4 in float64, written independently: scale, min-p, top-p (mass strictly before
    a token > top_p drops it, stable descending order), top-k on the survivors, renormalise."""
    s = [x / t for x in logits]
    m = max(s)
    w = [math.exp(x - m) for x in s]
    keep = [wi >= min_p for wi in w]
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    total = sum(w[i] for i in order if keep[i])
    before, survivors = 0.0, []
    for i in order:
        if not keep[i]:
            continue
        if top_p < 1 and before > top_p * total:
            keep[i] = False
        else:
            survivors.append(i)
        before += w[i]
    if top_k > 0:
        for i in survivors[top_k:]:
            keep[i] = False
    z = sum(w[i] for i in range(len(s)) if keep[i])
    return [w[i] / z if keep[i] else 0.0 for i in range(len(s))]


def py_uniform(seed: int, pos: int, c: int = 0, accept: bool = False) -> float:
    def h(x: int) -> float:
        x = (x + PHI) % U64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % U64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % U64
        x ^= x >> 31
        return (x >> 11) * 2.0**-53

    if accept:
        return h(seed ^ (((3 * pos + 2) * PHI) % U64))
    t = ((3 * pos + c) * PHI) % U64
    return h((seed + (t ^ ((t << 13) % U64))) % U64)


def _vec(*vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype)


def _params(b: int, t=1.0, k=0, p=1.0, mp=0.0, greedy=False):
    return (
        torch.full((b,), t, dtype=torch.float32),
        torch.full((b,), k, dtype=torch.int64),
        torch.full((b,), p, dtype=torch.float64),
        torch.full((b,), mp, dtype=torch.float32),
        torch.full((b,), greedy, dtype=torch.bool),
    )


# ---------------------------------------------------------------- the random stream


def test_uniforms_match_python_splitmix64():
    rng = random.Random(0)
    seeds = [0, 1, 5, (1 << 63) - 1, 1 << 63, U64 - 1] + [rng.getrandbits(64) for _ in range(50)]
    positions = [0, 1, 7, 1 << 20, (1 << 40) + 3] + [rng.randrange(1 << 31) for _ in range(51)]
    st = torch.tensor([seed_to_int64(s) for s in seeds])
    pt = torch.tensor(positions)
    for c in (0, 1):
        got = sampling_uniforms(st, pt, resample=bool(c)).tolist()
        assert got == [py_uniform(s, p, c) for s, p in zip(seeds, positions)]
    assert accept_uniforms(st, pt).tolist() == [py_uniform(s, p, accept=True) for s, p in zip(seeds, positions)]


def test_uniforms_are_uniform():
    n, bins = 20000, 20
    along_request = sampling_uniforms(torch.full((n,), 1234), torch.arange(n))
    across_seeds = sampling_uniforms(torch.randint(-(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(1)),
                                     torch.full((n,), 99))  # fmt: skip
    for u in (along_request, across_seeds):
        assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
        assert_fits((u * bins).long(), [1 / bins] * bins, "uniforms")


# ---------------------------------------------------------------- distributions

LOGITS = [2.0, 1.6, 1.5, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -2.0, -3.0, 1.55, 0.2, -0.5, 0.9, -4.0]

CONFIGS = {
    "plain": dict(t=1.0),
    "cold": dict(t=0.5),
    "hot": dict(t=2.0),
    "top_k": dict(t=1.0, k=4),
    "top_p": dict(t=1.0, p=0.6),
    "min_p": dict(t=1.0, mp=0.3),
    "top_p_then_top_k": dict(t=3.0, k=3, p=0.35),  # vLLM's top-k-then-top-p would keep 2 tokens here
    "all": dict(t=0.8, k=5, p=0.9, mp=0.05),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampled_distribution(name):
    cfg = CONFIGS[name]
    probs = expected_distribution(LOGITS, cfg["t"], cfg.get("k", 0), cfg.get("p", 1.0), cfg.get("mp", 0.0))
    n = 4000
    logits = torch.tensor(LOGITS).expand(n, -1)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # not hash(): randomised per process
    # half the draws along one request's stream, half across seeds at random positions
    seeds = torch.cat([torch.full((n // 2,), 77), torch.randint(-(2**62), 2**62, (n // 2,), generator=g)])
    positions = torch.cat([torch.arange(n // 2), torch.randint(0, 1 << 30, (n // 2,), generator=g)])
    tokens = sample_tokens(logits, *_params(n, **cfg)[:4], seeds, positions, _params(n, **cfg)[4])
    assert tokens.dtype == torch.int64
    assert_fits(tokens, probs, name)


def test_top_p_then_top_k_order():
    """DI's order (top-p on the full distribution, then top-k) differs from vLLM's here."""
    probs = expected_distribution(LOGITS, 3.0, 3, 0.35, 0.0)
    processed = process_logits(torch.tensor([LOGITS]), *_params(1, t=3.0, k=3, p=0.35))
    kept = torch.isfinite(processed[0]).nonzero().flatten().tolist()
    assert kept == [i for i, p in enumerate(probs) if p > 0]
    assert len(kept) == 3


def test_processed_logits_values():
    x = torch.tensor([LOGITS, LOGITS])
    out = process_logits(x, _vec(0.5, 2.0), _vec(0, 3, dtype=torch.int64), _vec(1.0, 1.0, dtype=torch.float64),
                         _vec(0.0, 0.0), _vec(False, False, dtype=torch.bool))  # fmt: skip
    assert_bitwise(out[0], x[0] / 0.5)
    kept = torch.isfinite(out[1])
    assert kept.sum() == 3 and torch.equal(out[1][kept], x[1][kept] / 2.0)


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(3)
    b, v = 300, 1000
    logits = torch.randn(b, v, generator=g) * 3
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    positions = torch.randint(0, 10000, (b,), generator=g)
    argmax = logits.argmax(-1)
    # flagged greedy with filters that would otherwise matter, and temperature 0 / below the floor
    t, k, p, mp, greedy = _params(b, t=0.7, k=5, p=0.3, mp=0.5, greedy=True)
    assert torch.equal(sample_tokens(logits, t, k, p, mp, seeds, positions, greedy), argmax)
    for temp in (0.0, SAMPLING_EPS / 2):
        t, k, p, mp, greedy = _params(b, t=temp, k=5, p=0.3, mp=0.5)
        assert torch.equal(sample_tokens(logits, t, k, p, mp, seeds, positions, greedy), argmax)
    # the greedy floor is T = 1e-5 with the filters off
    floor = processed_logprobs(logits[:4], *_params(4, greedy=True))
    assert torch.isfinite(floor).all()
    assert_bitwise(floor, log_softmax_rows(logits[:4] / torch.tensor(SAMPLING_EPS)))


def test_greedy_exact_tie_stays_in_the_tied_set():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]]).expand(400, -1)
    t, k, p, mp, greedy = _params(400, greedy=True)
    tokens = sample_tokens(logits, t, k, p, mp, torch.arange(400), torch.zeros(400, dtype=torch.long), greedy)
    assert set(tokens.tolist()) == {1, 3}


def test_never_draws_an_excluded_token():
    v = 50
    x = torch.full((2000, v), float("-inf"))
    x[:, 17] = 0.0
    x[:1000, 49] = -1e-3  # the last token, tie-adjacent to the top
    tokens = draw_tokens(x, torch.arange(2000) * 7919 - 5000, torch.arange(2000))
    assert set(tokens[1000:].tolist()) == {17}
    assert set(tokens[:1000].tolist()) == {17, 49}


# ---------------------------------------------------------------- batch invariance


def _random_rows(g: torch.Generator, b: int, v: int):
    logits = torch.randn(b, v, generator=g) * 2
    logits[torch.rand(b, v, generator=g) < 0.01] = float("-inf")
    logits[:, 0] = torch.randn(b, generator=g)  # at least one finite logit per row
    t = torch.rand(b, generator=g) * 1.5
    t[torch.rand(b, generator=g) < 0.2] = 0.0
    k = torch.randint(-1, 40, (b,), generator=g)
    p = torch.rand(b, generator=g).double() * 0.9 + 0.1
    p[torch.rand(b, generator=g) < 0.3] = 1.0
    mp = torch.rand(b, generator=g) * 0.2
    greedy = torch.rand(b, generator=g) < 0.1
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    positions = torch.randint(0, 1 << 20, (b,), generator=g)
    return logits, t, k, p, mp, greedy, seeds, positions


def _outputs(rows):
    logits, t, k, p, mp, greedy, seeds, positions = rows
    tokens = sample_tokens(logits, t, k, p, mp, seeds, positions, greedy)
    return tokens, processed_logprobs(logits, t, k, p, mp, greedy)


@pytest.mark.parametrize("v", [1031, 129280])
def test_row_invariant_in_any_batch(v):
    g = torch.Generator().manual_seed(v)
    target = _random_rows(g, 1, v)
    target[1][0], target[2][0], target[3][0] = 0.9, 20, 0.8  # a row with every filter active
    alone = _outputs(target)
    sizes = (*range(1, 9), 15, 16, 17, 31, 32, 33, 47, 63, 64) if v < 10000 else (1, 2, 17)
    for others in sizes:
        rows = _random_rows(g, others, v)
        at = int(torch.randint(0, others + 1, (1,), generator=g))
        batch = tuple(torch.cat([r[:at], tr, r[at:]]) for r, tr in zip(rows, target))
        tokens, logprobs = _outputs(batch)
        assert_bitwise(tokens[at : at + 1], alone[0], f"token, {others} others")
        assert_bitwise(logprobs[at : at + 1], alone[1], f"logprobs, {others} others")
    assert_bitwise(_outputs(target)[0], alone[0], "second call")


def test_penalties_and_topk_row_invariant():
    g = torch.Generator().manual_seed(5)
    b, v = 33, 517
    logits = torch.randn(b, v, generator=g)
    counts = torch.randint(0, 3, (b, v), generator=g)
    prompt = torch.rand(b, v, generator=g) < 0.1
    pres, freq, rep = torch.rand(b, generator=g), torch.rand(b, generator=g), torch.rand(b, generator=g) + 0.5
    full = apply_penalties(logits, counts, prompt, pres, freq, rep)
    full_top = topk_logprobs(log_softmax_rows(full), 7)
    for i in range(b):
        one = apply_penalties(logits[i : i + 1], counts[i : i + 1], prompt[i : i + 1], pres[i : i + 1], freq[i : i + 1],
                              rep[i : i + 1])  # fmt: skip
        assert_bitwise(one, full[i : i + 1])
        top = topk_logprobs(log_softmax_rows(one), 7)
        assert_bitwise(top[0], full_top[0][i : i + 1])
        assert_bitwise(top[1], full_top[1][i : i + 1])


# ---------------------------------------------------------------- penalties, logprobs, top-k


def test_penalties_against_brute_force():
    g = torch.Generator().manual_seed(11)
    b, v = 4, 24
    logits = torch.randn(b, v, generator=g) * 3
    logits[0, 3] = 0.0
    logits[1, 5] = float("-inf")
    counts = torch.randint(0, 4, (b, v), generator=g) * (torch.rand(b, v, generator=g) < 0.3)
    prompt = torch.rand(b, v, generator=g) < 0.25
    pres, freq, rep = _vec(0.5, -1.0, 0.0, 2.0), _vec(0.3, 0.0, -0.7, 1.5), _vec(1.3, 0.8, 1.0, 2.0)
    got = apply_penalties(logits, counts, prompt, pres, freq, rep)
    want = logits.clone()
    for i in range(b):
        for j in range(v):
            x = logits[i, j]
            c = int(counts[i, j])
            if c > 0 or bool(prompt[i, j]):
                x = x / rep[i] if x > 0 else x * rep[i]
            x = x - freq[i] * c
            if c > 0:
                x = x - pres[i]
            want[i, j] = x
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got[1, 5] == float("-inf")
    neutral = apply_penalties(logits, counts, prompt, torch.zeros(b), torch.zeros(b), torch.ones(b))
    assert_bitwise(neutral, logits)


def test_processed_logprobs_are_log_softmax_of_processed_logits():
    g = torch.Generator().manual_seed(8)
    logits, t, k, p, mp, greedy, _, _ = _random_rows(g, 24, 300)
    processed = process_logits(logits, t, k, p, mp, greedy)
    lp = processed_logprobs(logits, t, k, p, mp, greedy)
    assert_bitwise(lp, log_softmax_rows(processed))
    ref = F.log_softmax(processed.double(), -1).float()
    assert torch.equal(torch.isinf(lp), torch.isinf(ref)) and torch.equal(torch.isinf(lp), torch.isinf(processed))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(lp[finite], ref[finite], rtol=0, atol=2e-6)
    torch.testing.assert_close(lp.double().exp().sum(-1), torch.ones(24, dtype=torch.float64))


def test_topk_logprobs():
    lp = torch.tensor([[-1.0, -0.5, -0.5, float("-inf"), -3.0], [-2.0, -2.0, -2.0, -0.25, -9.0]])
    values, ids = topk_logprobs(lp, 3)
    assert ids.tolist() == [[1, 2, 0], [3, 0, 1]]
    assert values.tolist() == [[-0.5, -0.5, -1.0], [-0.25, -2.0, -2.0]]
    values, ids = topk_logprobs(lp, 0)
    assert values.shape == (2, 0) and ids.shape == (2, 0)
    with pytest.raises(ValueError, match="k must be"):
        topk_logprobs(lp, 6)


def test_input_checks():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="temperature"):
        process_logits(x, torch.ones(2), *_params(3)[1:])
    with pytest.raises(ValueError, match="top_k must be an integer"):
        process_logits(x, torch.ones(3), torch.zeros(3), *_params(3)[2:])
    with pytest.raises(ValueError, match="logits must be"):
        sample_tokens(torch.randn(8), *_params(3)[:4], torch.zeros(3, dtype=torch.long),
                      torch.zeros(3, dtype=torch.long), _params(3)[4])  # fmt: skip


def test_seed_to_int64():
    assert seed_to_int64(0) == 0 and seed_to_int64(U64 - 1) == -1 and seed_to_int64(1 << 63) == -(1 << 63)
    assert seed_to_int64(U64 + 5) == 5
