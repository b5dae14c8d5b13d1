"""The engine end to end: continuous batching, chunked prefill, mixed steps and preemption must not
change a single greedy token, and seeded sampling must not depend on the batch."""

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.models.deepseek_v41_reference import reference_forward
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

LENGTHS = [1, 2, 3, 5, 8, 13, 17, 21, 30, 34, 47, 55, 64, 77, 89, 120]  # 16 prompts of very different lengths
NEW = 6


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 129000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "v41", "v4.1", "fp8+fp4", seed=1)


def _small_llm(path, **kw):
    # 24-token steps force chunked prefill and mixed prefill/decode steps; the KV budgets below (6 request slots
    # + 6 prefix snapshots + 10 blocks of 16 = 160 tokens of growth) fit the largest request alone but not all of
    # them: preemption happens (and a recomputed request may hit its own cached blocks)
    opts = dict(dtype="float32", device="cpu", max_num_seqs=6, max_num_batched_tokens=24, log_stats=False)
    opts.update(kw)
    return LLM(model=path, **opts)


def test_v41_greedy_batch_equals_reference_alone(v41_dir):
    llm = _small_llm(v41_dir, yoco_mode="off", kv_cache_memory=12 * 127_000 + 160 * 1536)
    assert llm.budget.num_tokens == 160
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the budget should have forced preemption"
    model = llm.model
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(NEW):
            logits = reference_forward(model, torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == seq[len(prompt) :], f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"


def test_v4_greedy_batch_equals_transformers_alone(tiny_v4_dirs):
    from transformers import DeepseekV4ForCausalLM

    path = tiny_v4_dirs["mixed"]
    llm = _small_llm(path, kv_cache_memory=12 * 28_672 + 160 * 136)
    assert llm.budget.num_tokens == 160
    prompts = _prompts(seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the budget should have forced preemption"
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :]
        assert out.outputs[0].token_ids == want.tolist(), f"prompt of {len(prompt)} tokens"


def test_seeded_sampling_does_not_depend_on_the_batch(v41_dir):
    llm = _small_llm(v41_dir, yoco_mode="off", max_num_batched_tokens=64, max_num_seqs=16)
    target = _prompts(seed=2)[9]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(seed=3)[:10]
    mixed = llm.generate(
        others[:4] + [target] + others[4:],
        [SamplingParams(temperature=1.0, max_tokens=5)] * 4
        + [sp]
        + [SamplingParams(temperature=0.7, max_tokens=9)] * 6,
        use_tqdm=False,
    )
    assert mixed[4].outputs[0].token_ids == alone
    again = llm.generate(
        [target],
        SamplingParams(temperature=1.0, top_p=0.9, seq_seed=1234, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert again.outputs[0].token_ids == alone
    other_seed = llm.generate(
        [target], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert other_seed.outputs[0].token_ids != alone


def test_outputs_text_stop_and_n(v41_dir):
    llm = _small_llm(v41_dir, yoco_mode="compact", max_num_batched_tokens=64)
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=10, logprobs=2), use_tqdm=False
    )[0]
    c = out.outputs[0]
    assert out.prompt == "The capital of France is" and out.prompt_token_ids[0] == 0  # BOS
    assert len(c.token_ids) == 10 and c.text == llm.tokenizer.decode(c.token_ids)
    assert len(c.logprobs) == 10 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    assert out.metrics.time_to_first_token > 0
    stop = c.text[3:6]
    if stop.strip():
        cut = llm.generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=10, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == c.text[: c.text.index(stop)]
    truncated = llm.generate("Hi", SamplingParams(prompt_logprobs=1), use_tqdm=False)[0]
    assert "yoco_mode" in truncated.error  # compact mode computes no decoder rows for most prompt tokens
    many = llm.generate("Hi", SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=4), use_tqdm=False)[0]
    assert [o.index for o in many.outputs] == [0, 1, 2] and len({tuple(o.token_ids) for o in many.outputs}) > 1
    tok = llm.generate(
        "Hi", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[c.token_ids[1]]), use_tqdm=False
    )
    assert tok[0].outputs[0].token_ids[-1] == c.token_ids[1] or tok[0].outputs[0].finish_reason == "length"


def test_bad_requests_do_not_take_the_others_down(v41_dir, tmp_path):
    llm = _small_llm(v41_dir, yoco_mode="off", max_model_len=64)
    image = llm.model.cfg.image_token_id  # no vision tower: refused at admission, not inside a step
    outs = llm.generate(
        ["", [5] * 100, "fine", [129280 + 5], [5, image, 6]],
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length", "error", "error"]
    assert "empty" in outs[0].error and "max_model_len" in outs[1].error and "vocabulary" in outs[3].error
    assert "image tokens" in outs[4].error
    assert len(outs[2].outputs[0].token_ids) == 3 and outs[2].error is None
    until_full = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=None), use_tqdm=False)[0]
    assert len(until_full.prompt_token_ids) + len(until_full.outputs[0].token_ids) == 64  # max_model_len
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    from deepinfer_runtime import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model=tmp_path / "nope")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model=v41_dir, max_num_seqs=0)


def test_prompt_logprobs_match_the_reference(v41_dir):
    llm = _small_llm(v41_dir, yoco_mode="off")  # 24-token steps: the prompt's logprobs come in 3 chunks
    prompt = _prompts(seed=4)[12]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    ref = torch.log_softmax(reference_forward(llm.model, torch.tensor([prompt]))[0].float(), dim=-1)
    for p in range(1, len(prompt)):
        entry, want = plp[p], ref[p - 1]
        assert prompt[p] in entry and 2 <= len(entry) <= 3
        assert entry[prompt[p]].logprob == pytest.approx(float(want[prompt[p]]), rel=1e-5, abs=1e-5)
        lp = want[prompt[p]]  # rank: 1 + tokens above it (within float noise of two log-softmax implementations)
        assert int((want > lp + 1e-5).sum()) <= entry[prompt[p]].rank - 1 <= int((want > lp - 1e-5).sum())
        best = int(want.argmax())
        assert best in entry and entry[best].rank == 1


def test_async_scheduling_changes_nothing(v41_dir):
    # the same mixed workload with and without overlap: greedy, seeded sampling, penalties (which drain the
    # step in flight), stop strings, EOS, n > 1; a small KV budget adds preemption and prefix self-hits
    prompts = _prompts(seed=6)
    params = [
        SamplingParams(temperature=0, max_tokens=7, logprobs=1),
        SamplingParams(temperature=1.0, seed=11, max_tokens=9),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=5, stop=["e"]),
    ] * 4
    outs = {}
    for mode in (False, True):
        llm = _small_llm(v41_dir, yoco_mode="off", async_scheduling=mode, kv_cache_memory=12 * 127_000 + 160 * 1536)
        outs[mode] = llm.generate(prompts, params, use_tqdm=False)
        if mode:
            assert llm.engine.num_overlapped > 0, "no step was processed while the next one ran"
    assert sum(o.metrics.num_preemptions for o in outs[True]) > 0
    for a, b in zip(outs[False], outs[True]):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids,
                y.text,
                y.finish_reason,
                y.stop_reason,
            )
            assert x.cumulative_logprob == y.cumulative_logprob


def test_pending_tokens_are_filled_in_on_the_device_in_one_batch():
    """Asynchronous scheduling: a chunk's last token may still be pending (-1, sampled by the previous launch, on
    the device); the runner fills every pending token from that launch's output by request, in one gather and one
    scatter, and refuses a pending token that the previous launch did not sample."""
    from types import SimpleNamespace

    from deepinfer_runtime.engine.model_runner import ModelRunner

    def chunk(rid, tokens):
        return SimpleNamespace(
            request=SimpleNamespace(request_id=rid, token_ids=lambda s, e: tokens[s:e]), start=0, num_tokens=len(tokens)
        )

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner._prev = (torch.tensor([70, 80, 90]), {"a": 2, "b": 0, "c": 1})
    chunks = [chunk("a", [5, -1]), chunk("x", [1, 2, 3]), chunk("c", [-1]), chunk("b", [4, 6, -1])]
    got = [t.tolist() for t in runner._input_ids(chunks)]
    assert got == [[5, 90], [1, 2, 3], [80], [4, 6, 70]]
    with pytest.raises(RuntimeError, match="request y: a pending token that the previous step did not sample"):
        runner._input_ids([chunk("a", [-1]), chunk("y", [-1])])
    runner._prev = None
    with pytest.raises(RuntimeError, match="request a: a pending token"):
        runner._input_ids([chunk("a", [-1])])


def test_requests_compare_by_identity():
    """The scheduler finds requests in its lists by identity: comparing dataclass fields instead made scheduling a
    step at batch 256 cost ~67 ms on the host (O(B^2) comparisons of ~20 fields); twins stay distinct."""
    from deepinfer_runtime.engine.request import Request

    a, b = (Request("r", None, [3, 4], SamplingParams(), seed=0) for _ in range(2))
    assert a == a and a != b and len({a, b}) == 2 and [a, b].index(b) == 1
