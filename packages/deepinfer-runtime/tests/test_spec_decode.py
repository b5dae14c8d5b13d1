"""Speculative decoding through the engine: greedy outputs are token for token those of plain decoding (V4.1 with
DSpark, V4-Flash-0731 with its DSpark stages, V4 with prompt lookup and with its MTP layer, whose drafts do not
depend on the prefix cache; mixed lengths, chunked prefill, prefix-cache hits, drafts trimmed by the token budget),
acceptance statistics are right on constructed drafts (always / never accepted), and seeded sampling with drafts is
reproducible. The verifiers' distribution tests live in deepinfer-spec."""

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.scripted_proposer import ScriptedProposer
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

DSPARK = {"method": "dspark", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "v41", "v4.1", "fp8+fp4", seed=7)


def _prompts(seed: int, vocab: int = 129000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (30,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 9, 41, 70)]
    prompts.insert(1, shared + torch.randint(3, vocab, (4,), generator=g).tolist())
    prompts.append(shared + torch.randint(3, vocab, (25,), generator=g).tolist())  # a prefix hit in the 2nd half
    loop = torch.randint(3, vocab, (6,), generator=g).tolist()
    prompts.append(loop * 5)  # repeats: prompt lookup finds drafts
    return prompts


def _generate(path, prompts, spec, params=None, **kw):
    opts = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=24, log_stats=False)
    opts.update(kw)
    llm = LLM(model=path, speculative_config=spec, **opts)
    params = params or SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)
    if not isinstance(params, SamplingParams):
        return llm, llm.generate(prompts, params, use_tqdm=False)
    half = len(prompts) // 2  # the second half finds the first half's blocks in the prefix cache
    return llm, llm.generate(prompts[:half], params, use_tqdm=False) + llm.generate(
        prompts[half:], params, use_tqdm=False
    )


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids, f"prompt of {len(x.prompt_token_ids)} tokens"


@pytest.mark.parametrize(
    "yoco, verification, varlen", [("off", "rejection", False), ("compact", "rejection", False), ("off", "block", True)]
)
def test_v41_dspark_greedy_equals_plain_decoding(v41_dir, yoco, verification, varlen):
    prompts = _prompts(0)
    kw = dict(yoco_mode=yoco, yoco_keep_tokens=24)
    _, plain = _generate(v41_dir, prompts, None, **kw)
    llm, spec = _generate(v41_dir, prompts, {**DSPARK, "verification": verification, "varlen": varlen}, **kw)
    _same(spec, plain)
    total = llm.spec.stats.total
    assert total.steps > 0 and total.verified > 0  # drafts were verified (D6 placeholder steps are not counted)
    assert sum(o.num_cached_tokens for o in spec) > 0  # with prefix-cache hits
    m = spec[4].metrics.spec_decoding
    assert m["spec_verify_steps"] > 0 and 1.0 <= m["spec_mean_accepted_length"] <= 6.0
    llm.engine.scheduler.blocks.check()


def test_v4_greedy_with_drafts_equals_plain_decoding(tiny_v4_dirs):
    """V4 has no DSpark head: prompt lookup drafts (rarely right on a random model) and scripted drafts
    (always right, never right) exercise verification and every V4 cache kind's rollback."""
    path = tiny_v4_dirs["mixed"]
    prompts = _prompts(1, vocab=1000)[2:]
    _, plain = _generate(path, prompts, None)
    _, ngram = _generate(path, prompts, {"method": "ngram", "num_speculative_tokens": 3})
    _same(ngram, plain)
    for wrong in (False, True):
        llm = LLM(model=path, dtype="float32", device="cpu", speculative_config={"method": "ngram"}, log_stats=False)
        _scripted(llm, plain, wrong)
        params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
        _same(llm.generate(prompts, params, use_tqdm=False), plain)
        assert llm.spec.stats.total.acceptance_rate == (0.0 if wrong else 1.0)


@pytest.fixture(scope="module")
def v4_mtp_dir(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("spec") / "v4mtp", "v4", config={"num_nextn_predict_layers": 1}
    )


def _recorded_drafts(llm) -> dict:
    """Record every draft block the engine proposes: (prompt, known tokens) -> drafts."""
    seen, propose = {}, llm.spec.propose

    def recording(reqs, after_prefill):
        propose(reqs, after_prefill)
        for r in reqs:
            seen[(tuple(r.prompt_token_ids), r.num_known_tokens)] = list(r.spec_token_ids)

    llm.spec.propose = recording
    return seen


def test_v4_mtp_greedy_equals_plain_decoding(v4_mtp_dir, num_drafts=2):
    """V4's MTP layer drafts; outputs equal plain decoding, and the drafts themselves do not depend on the prefix
    cache (a hit restores the MTP state exactly) or on the batch."""
    prompts = _prompts(4, vocab=1000)
    _, plain = _generate(v4_mtp_dir, prompts, None)
    mtp = {"method": "mtp", "num_speculative_tokens": num_drafts}
    drafts = []
    for caching, seqs in ((True, 4), (False, 2)):
        opts = dict(dtype="float32", device="cpu", max_num_seqs=seqs, max_num_batched_tokens=24, log_stats=False)
        llm = LLM(model=v4_mtp_dir, speculative_config=mtp, enable_prefix_caching=caching, **opts)
        drafts.append(_recorded_drafts(llm))
        params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)
        half = len(prompts) // 2
        out = llm.generate(prompts[:half], params, use_tqdm=False) + llm.generate(
            prompts[half:], params, use_tqdm=False
        )
        _same(out, plain)
        assert (sum(o.num_cached_tokens for o in out) > 0) == caching
        assert llm.spec.stats.total.verified > 0 and out[0].metrics.spec_decoding["spec_verify_steps"] > 0
    assert drafts[0] == drafts[1] and len(drafts[0]) > len(prompts)


V4_DSPARK = {"dspark_target_layer_ids": [2, 3, 4], "dspark_markov_rank": 16}


@pytest.mark.parametrize("confidence, varlen", [(True, False), (True, True), (False, True)])
def test_v4_0731_dspark_greedy_equals_plain_decoding(tmp_path_factory, confidence, varlen):
    """V4-Flash-0731's DSpark stages draft; outputs equal plain decoding with prefix-cache hits, also under
    confidence-scheduled verification, and with no confidence head (procedure S counts 1.0 per draft)."""
    omit = () if confidence else ("confidence_head",)
    root = tmp_path_factory.mktemp("spec")
    path = write_tiny_checkpoint(root / "v4ds", "v4", "fp8+fp4", seed=9, config=V4_DSPARK, omit=omit)
    prompts = _prompts(5, vocab=1000)
    _, plain = _generate(path, prompts, None)
    llm, spec = _generate(path, prompts, {**DSPARK, "varlen": varlen})
    _same(spec, plain)
    assert (llm.model.dspark_markov()[2] is not None) == confidence
    assert llm.spec.stats.total.verified > 0 and sum(o.num_cached_tokens for o in spec) > 0
    m = spec[4].metrics.spec_decoding
    assert m["spec_verify_steps"] > 0 and 1.0 <= m["spec_mean_accepted_length"] <= 6.0
    llm.engine.scheduler.blocks.check()


def test_prompt_lookup_drafts_what_followed_the_last_match():
    from deepinfer_runtime.engine.proposers import NgramProposer
    from deepinfer_spec import SpeculativeConfig

    p = NgramProposer(100, SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2))
    assert p.lookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]) == [7, 8, 2]  # the latest earlier "2 3"
    assert p.lookup([5, 6, 7, 6]) == [7, 6]  # falls back to the 1-gram
    assert p.lookup([1, 2, 3]) == []


def _scripted(llm, plain, wrong):
    scripts = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain}
    llm.spec.proposer = ScriptedProposer(scripts, 5, llm.model.cfg.vocab_size, wrong=wrong)


@pytest.mark.parametrize("wrong", [False, True])
def test_statistics_when_drafts_are_always_or_never_right(v41_dir, wrong):
    prompts = _prompts(2)[:3]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    _, plain = _generate(v41_dir, prompts, None, params, yoco_mode="off", max_num_batched_tokens=256)
    ngram = {"method": "ngram", "num_speculative_tokens": 5}  # its proposer is replaced by the scripted one
    opts = dict(dtype="float32", device="cpu", log_stats=False, yoco_mode="off", max_num_batched_tokens=256)
    llm = LLM(model=v41_dir, speculative_config=ngram, **opts)
    _scripted(llm, plain, wrong)
    spec = llm.generate(prompts, params, use_tqdm=False)
    _same(spec, plain)
    for x, y in zip(spec, plain):  # logprob entries of verified tokens = those of plain sampling
        assert x.outputs[0].logprobs == y.outputs[0].logprobs
    t = llm.spec.stats.total
    if wrong:
        assert t.accepted == 0 and t.verified > 0 and t.mean_accepted_length == 1.0
    else:  # 13 tokens after the first: one step of 6, one of 6, then the 1 left (room 0: plain decode)
        assert t.acceptance_rate == 1.0 and t.accepted == t.verified
        assert all(o.metrics.spec_decoding["spec_verify_steps"] == 2 for o in spec)
        assert t.position_acceptance_rates == [1.0] * 5


def test_seeded_sampling_with_drafts_is_reproducible(v41_dir):
    prompts = _prompts(3)[:4]
    params = [SamplingParams(temperature=1.0, top_k=50, max_tokens=6, seed=s, ignore_eos=True) for s in range(4)]
    _, a = _generate(v41_dir, prompts[:3], DSPARK, params[:3], yoco_mode="off")
    _, b = _generate(v41_dir, prompts[::-1], DSPARK, params[::-1], yoco_mode="off", max_num_seqs=2)
    _same(a, b[::-1][:3])  # other batch compositions, same tokens


def test_bad_speculative_configs_are_named(v41_dir, tiny_v4_dirs):
    with pytest.raises(ValueError, match="dspark_block_size"):
        LLM(
            model=v41_dir,
            dtype="float32",
            device="cpu",
            speculative_config={"method": "dspark", "num_speculative_tokens": 3},
        )
    with pytest.raises(ValueError, match="no DSpark head"):
        LLM(model=tiny_v4_dirs["mixed"], dtype="float32", device="cpu", speculative_config=DSPARK)
    with pytest.raises(ValueError, match="unknown key"):
        LLM(model=v41_dir, dtype="float32", device="cpu", speculative_config={"methd": "dspark"})
    with pytest.raises(ValueError, match="has no MTP layer"):
        LLM(model=v41_dir, dtype="float32", device="cpu", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(model=tiny_v4_dirs["mixed"], dtype="float32", device="cpu", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=v41_dir, dtype="float32", device="cpu", speculative_config=DSPARK, async_scheduling=True)
