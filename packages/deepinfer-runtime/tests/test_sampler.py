"""SamplingParams (validation, aliases, greedy reset) and the batched Sampler (logit bias,
min_tokens, penalties, logprobs, batch invariance, the sampled distribution)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from deepinfer_kernels.ops.sampling import apply_penalties, process_logits
from deepinfer_runtime.sampler import (
    Sampler,
    SamplingRequest,
    child_seed,
    derive_request_seed,
)
from deepinfer_runtime.sampling_params import SamplingParams, SamplingParamsError

CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.fixture(autouse=True)
def _force_reference(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")


# ---------------------------------------------------------------- SamplingParams

INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=float("inf"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.0)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=float("nan"))),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=1 << 64)),
    ("seed", dict(seed=1.5)),
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[1])),
    ("stop_token_ids", dict(stop_token_ids=[-3])),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("ignore_eos", dict(ignore_eos=1)),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=-2)),
    ("logit_bias", dict(logit_bias={"7": 1.0})),
    ("logit_bias", dict(logit_bias={1.0: 1.0})),
    ("logit_bias", dict(logit_bias={3: float("nan")})),
    ("logit_bias", dict(logit_bias=[(1, 2.0)])),
    ("skip_special_tokens", dict(skip_special_tokens="yes")),
    ("structured_outputs", dict(structured_outputs="json")),
    ("so_args", dict(so_args=[1])),
    ("seed", dict(seed=1, seq_seed=2)),
    ("logprobs", dict(logprobs=1, top_logprobs=2)),
]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_values_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b") as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, SamplingParamsError)


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.min_tokens) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
        16,
        0,
    )
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.seed is None and not sp.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(seed=(1 << 64) - 1).seed == (1 << 64) - 1
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(logit_bias={3: 2}).logit_bias == {3: 2.0}
    assert SamplingParams(so_args={"json": {}}).so_args == {"json": {}}
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword arguments only


def test_aliases():
    assert SamplingParams(seq_seed=5).seed == 5
    assert SamplingParams(top_logprobs=3).logprobs == 3
    assert SamplingParams(seed=5, seq_seed=5).seq_seed == 5
    assert SamplingParams(logprobs=2).top_logprobs == 2
    assert dataclasses.replace(SamplingParams(seq_seed=5), seed=7).seed == 7


def test_greedy_resets_filters():
    sp = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert sp.greedy and (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=5e-6).greedy and not SamplingParams(temperature=1e-5).greedy


# ---------------------------------------------------------------- Sampler


def _req(params, prompt=(), output=(), seed=None, position=None):
    return SamplingRequest(params, list(prompt), list(output), seed, position)


def test_seeds_and_positions():
    assert derive_request_seed(0, 0) != derive_request_seed(0, 1) != derive_request_seed(1, 0)
    assert derive_request_seed(42, 3) == derive_request_seed(42, 3) < 1 << 64
    assert child_seed((1 << 64) - 1, 2) == 1
    r = _req(SamplingParams(seed=9), prompt=[1, 2, 3], output=[4])
    assert r.effective_position() == 4 and r.effective_seed() == 9
    with pytest.raises(ValueError, match="no seed"):
        Sampler()(torch.zeros(1, 4), [_req(SamplingParams())])


def test_greedy_and_logit_bias():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    argmax = logits.argmax(-1)
    reqs = [
        _req(SamplingParams(temperature=0), seed=1),
        _req(SamplingParams(temperature=0, logit_bias={7: 100.0}), seed=2),
        _req(SamplingParams(temperature=0, logit_bias={int(argmax[2]): -100.0}), seed=3),
    ]
    tokens = Sampler()(logits, reqs).token_ids
    assert tokens[0] == argmax[0] and tokens[1] == 7
    second = logits[2].clone()
    second[argmax[2]] = float("-inf")
    assert tokens[2] == second.argmax()


def test_min_tokens_masks_eos_and_stop_ids():
    v, eos, stop = 20, 2, 5
    logits = torch.zeros(4, v)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    sp = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    reqs = [
        _req(sp, output=[1, 1], seed=1),  # 2 < 3 outputs: EOS and the stop id masked
        _req(sp, output=[1, 1, 1], seed=1),  # min_tokens reached
        _req(ignore, output=[1], seed=1),  # ignore_eos: EOS not masked, the stop id is
        _req(SamplingParams(temperature=0), seed=1),
    ]
    tokens = Sampler(eos_token_ids=eos)(logits, reqs).token_ids.tolist()
    assert tokens[0] not in (eos, stop) and tokens[1] == eos and tokens[2] == eos and tokens[3] == eos
    logits[2, eos] = -1.0  # the stop id is still masked: the token is one of the tied zeros
    assert Sampler(eos_token_ids=[eos])(logits, reqs).token_ids[2] not in (eos, stop)


def test_penalties_in_the_sampler():
    g = torch.Generator().manual_seed(4)
    v = 30
    logits = torch.randn(2, v, generator=g) * 2
    sp = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                        logprobs=v)  # fmt: skip
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 9]
    reqs = [_req(sp, prompt, output, seed=11), _req(SamplingParams(logprobs=v), prompt, output, seed=11)]
    out = Sampler()(logits, reqs)
    want = logits[0].clone()
    for t in range(v):
        c = output.count(t)
        if c or t in prompt:
            want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
        want[t] -= 0.25 * c + (0.5 if c else 0.0)
    got0 = {t: lp.logprob for t, lp in out.logprobs_for(0).items()}
    ref0 = F.log_softmax(want, -1)
    for t, lp in got0.items():
        assert math.isclose(lp, float(ref0[t]), abs_tol=1e-5)
    got1 = {t: lp.logprob for t, lp in out.logprobs_for(1).items()}  # no penalties on the second row
    for t, lp in got1.items():
        assert math.isclose(lp, float(F.log_softmax(logits[1], -1)[t]), abs_tol=1e-5)


def test_logprobs_semantics():
    g = torch.Generator().manual_seed(6)
    v = 64
    logits = torch.randn(3, v, generator=g) * 2
    reqs = [
        _req(SamplingParams(temperature=0.7, top_k=10, top_p=0.9, top_logprobs=4), seed=5, position=12),
        _req(SamplingParams(temperature=0.7), seed=5, position=12),  # asks for none
        _req(SamplingParams(temperature=1.2, min_p=0.1, logprobs=0, logit_bias={3: 1.0}), seed=8),
    ]
    out = Sampler()(logits, reqs)
    assert out.logprobs_for(1) is None
    lp0 = out.logprobs_for(0)
    tok0 = int(out.token_ids[0])
    assert next(iter(lp0)) == tok0 and len(lp0) in (4, 5)
    processed = process_logits(
        logits[:1],
        torch.tensor([0.7]),
        torch.tensor([10]),
        torch.tensor([0.9], dtype=torch.float64),
        torch.zeros(1),
        torch.zeros(1, dtype=torch.bool),
    )
    ref = F.log_softmax(processed[0].double(), -1)
    top = torch.sort(ref, descending=True, stable=True)
    for j in range(4):
        t = int(top.indices[j])
        assert lp0[t].rank == j + 1 or t == tok0
        assert math.isclose(lp0[t].logprob, float(ref[t]), abs_tol=2e-6)
    assert lp0[tok0].rank == 1 + int((ref > ref[tok0]).sum())
    # logprobs=0: only the sampled token; the bias is part of the processed distribution
    lp2 = out.logprobs_for(2)
    assert list(lp2) == [int(out.token_ids[2])]
    biased = logits[2].clone()
    biased[3] += 1.0
    processed2 = process_logits(biased[None], torch.tensor([1.2]), torch.tensor([0]),
                                torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.1]),
                                torch.zeros(1, dtype=torch.bool))  # fmt: skip
    assert math.isclose(lp2[int(out.token_ids[2])].logprob, float(F.log_softmax(processed2[0], -1)[out.token_ids[2]]),
                        abs_tol=2e-6)  # fmt: skip


def test_sampler_batch_invariance():
    g = torch.Generator().manual_seed(12)
    v = 257
    target_logits = torch.randn(1, v, generator=g) * 2
    target = _req(SamplingParams(temperature=0.9, top_k=30, top_p=0.95, presence_penalty=0.3, logit_bias={4: 2.0},
                                 logprobs=3), prompt=[1, 5, 9], output=[4, 4, 8], seed=(1 << 64) - 12345)  # fmt: skip
    alone = Sampler()(target_logits, [target])
    for others in (1, 3, 16, 40):
        logits = torch.randn(others, v, generator=g) * 2
        reqs = [
            _req(
                SamplingParams(
                    temperature=float(torch.rand(1, generator=g)),
                    top_k=int(torch.randint(0, 50, (1,), generator=g)),
                    repetition_penalty=1.2,
                    logprobs=5,
                ),
                prompt=[i],
                output=[i + 1],
                seed=i,
            )  # fmt: skip
            for i in range(others)
        ]
        at = others // 2
        out = Sampler()(torch.cat([logits[:at], target_logits, logits[at:]]), reqs[:at] + [target] + reqs[at:])
        assert out.token_ids[at] == alone.token_ids[0]
        assert out.sampled_logprobs[at] == alone.sampled_logprobs[0]
        assert torch.equal(out.top_logprobs[at, :3], alone.top_logprobs[0, :3])
        assert torch.equal(out.top_token_ids[at, :3], alone.top_token_ids[0, :3])


def test_sampler_distribution_chi_square():
    logits = torch.tensor([1.0, 0.5, 0.4, 0.0, -0.5, -1.0, -2.0, -3.0])
    n = 3000
    sp = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5)
    reqs = [_req(sp, prompt=[0], seed=derive_request_seed(7, i)) for i in range(n)]
    tokens = Sampler()(logits.expand(n, -1), reqs).token_ids
    x = logits.clone()
    x[0] = x[0] / 1.5
    probs = torch.softmax(x.double() / 0.8, -1)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[torch.sort(x, descending=True, stable=True).indices[:5]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[~keep].sum() == 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert stat < CHI2_CRIT_P001[4], (stat, counts.tolist())


def test_vocabulary_checks():
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler()(torch.zeros(1, 4), [_req(SamplingParams(logit_bias={9: 1.0}), seed=1)])
    with pytest.raises(ValueError, match="output"):
        Sampler()(torch.zeros(1, 4), [_req(SamplingParams(presence_penalty=1.0), output=[4], seed=1)])
    with pytest.raises(ValueError, match="B = 2"):
        Sampler()(torch.zeros(1, 4), [_req(SamplingParams(), seed=1)] * 2)


def test_penalty_op_matches_sampler_counts():
    """The sampler's counts / prompt mask feed apply_penalties as a dense loop would."""
    v = 12
    logits = torch.linspace(-2, 2, v)[None]
    sp = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.1, logprobs=v)
    out = Sampler()(logits, [_req(sp, prompt=[11], output=[10, 10], seed=3)])
    counts = torch.zeros(1, v, dtype=torch.long)
    counts[0, 10] = 2
    mask = torch.zeros(1, v, dtype=torch.bool)
    mask[0, 11] = True
    pen = apply_penalties(logits, counts, mask, torch.zeros(1), torch.tensor([0.1]), torch.tensor([2.0]))
    assert int(out.token_ids[0]) == int(pen.argmax()) == 9
