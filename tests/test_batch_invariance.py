"""Batch invariance on the CPU and, with the gpu marker, on CUDA (issue: batch-invariant inference and
deterministic sampling).

One request alone versus the same request inside batches of 1 to 64 others of different lengths, under
different token budgets (so its prompt is chunked differently and its rows share steps with other
prefills and decodes): its logits must be bitwise equal at every step, for V4 and V4.1, and seeded
sampling at temperature 1 must give the same tokens across those compositions and across runs.
"""

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

TARGET_LEN, NEW = 57, 6


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


@pytest.fixture(scope="module", params=["v4", "v4.1"])
def ckpt(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bi") / request.param, request.param, "none", seed=7)


def _run(path, others: int, budget: int, seed: int, temperature: float, device: str = "cpu"):
    llm = LLM(
        model=path,
        dtype="float32",
        device=device,
        max_num_seqs=max(others + 1, 4),
        max_num_batched_tokens=budget,
        batch_invariant=True,
        log_stats=False,
        kv_cache_memory=1 << 30,  # several engines share one GPU in this process; the pools take the budget
        **({"yoco_mode": "off"} if path.name == "v4.1" else {}),
    )
    g = torch.Generator().manual_seed(100 + others)
    prompts = [
        torch.randint(3, 129000, (int(n),), generator=g).tolist() for n in torch.randint(1, 90, (others,), generator=g)
    ]
    target = torch.randint(3, 129000, (TARGET_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    at = others // 2
    prompts.insert(at, target)
    params = [
        SamplingParams(temperature=1.0, max_tokens=int(torch.randint(2, 9, (1,), generator=g)), seed=i)
        for i in range(len(prompts))
    ]
    params[at] = SamplingParams(temperature=temperature, max_tokens=NEW, seed=seed, ignore_eos=True)
    seen = []
    sampler = llm.engine.runner.sampler
    original = sampler.__call__

    def spy(logits, requests):  # record the target's logits row at every step it is sampled
        for row, req in enumerate(requests):
            if list(req.prompt_token_ids) == target:
                seen.append(logits[row].clone())
        return original(logits, requests)

    llm.engine.runner.sampler = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs[at].outputs[0].token_ids, torch.stack(seen)


@pytest.mark.parametrize("others, budget", [(1, 16), (8, 64), (64, 256)])
def test_logits_and_seeded_tokens_do_not_depend_on_the_batch(ckpt, others, budget, device):
    alone_tokens, alone_logits = _run(ckpt, 0, 32, seed=42, temperature=1.0, device=device)
    tokens, logits = _run(ckpt, others, budget, seed=42, temperature=1.0, device=device)
    assert alone_logits.shape == logits.shape == (NEW, 129280)
    assert torch.equal(logits, alone_logits), f"logits differ with {others} others at budget {budget}"
    assert tokens == alone_tokens


def test_logits_do_not_depend_on_the_batch_with_many_cpu_threads(ckpt):
    """torch's CPU reductions split a short output's reduction across threads: a reference that reduced over a
    non-last dim (the compressor's pooling) changed a row's bits with the batch at 8 threads, not at 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        alone = _run(ckpt, 0, 32, seed=42, temperature=1.0)[1]
        assert torch.equal(_run(ckpt, 8, 64, seed=42, temperature=1.0)[1], alone)
    finally:
        torch.set_num_threads(before)


def test_seeded_sampling_is_reproducible_run_to_run(ckpt):
    first = _run(ckpt, 8, 48, seed=3, temperature=1.0)[0]
    assert _run(ckpt, 8, 48, seed=3, temperature=1.0)[0] == first
    assert _run(ckpt, 8, 48, seed=4, temperature=1.0)[0] != first
