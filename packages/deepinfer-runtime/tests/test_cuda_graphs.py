"""CUDA graphs (``LLM(enforce_eager=False)``, the default on CUDA): whole decode steps and the FFN sublayers of
other short steps. On CUDA the engine's tokens and logprobs are bitwise those of eager execution (V4, V4.1 with its
Engram tables in pinned host memory, read in place, or on the device, V4-Flash-0731 with DSpark drafting, whose
draft blocks replay graphs too); on the CPU the option is accepted and runs eagerly."""

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]


def _generate(path, device, eager, **kw):
    llm = LLM(
        model=path, device=device, max_num_seqs=4, max_num_batched_tokens=64, log_stats=False,
        kv_cache_memory=1 << 30, enforce_eager=eager, **kw,
    )  # fmt: skip
    return llm, llm.generate(_prompts(), PARAMS, use_tqdm=False)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == y.outputs[0].cumulative_logprob


def test_cpu_runs_eagerly(tiny_v4_dirs):
    llm, outs = _generate(tiny_v4_dirs["mixed"], "cpu", eager=False, dtype="float32")
    assert llm.model.layers[0].graphs is None and all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "arch, config, kw",
    [
        ("v4", {}, {}),
        ("v4.1", {}, {"yoco_mode": "off"}),
        ("v4.1", {}, {"yoco_mode": "compact", "engram_device": "cuda"}),
        (
            "v4",
            {"dspark_target_layer_ids": [2, 3, 4], "dspark_markov_rank": 16},
            {"speculative_config": {"method": "dspark"}},
        ),
    ],
)
def test_graphs_give_the_eager_results(tmp_path, arch, config, kw):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = write_tiny_checkpoint(tmp_path / "ckpt", arch, "fp8+fp4", seed=4, config=config)
    _, eager = _generate(path, "cuda", True, dtype="bfloat16", **kw)
    llm, graphed = _generate(path, "cuda", False, dtype="bfloat16", **kw)
    assert len(llm.model.layers[0].graphs) > 0  # graphs were captured and replayed
    whole_steps = "speculative_config" not in kw  # V4.1's host Engram tables are pinned: read in place, no sync
    assert (len(llm.model.step_graphs) > 0) == whole_steps
    _same(eager, graphed)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_v41_expand_collapse_gives_the_same_tokens(tmp_path, monkeypatch, eager):
    """``deepseek_v41.EXPAND_COLLAPSE`` (each mHC expand making the next site's input with the Triton kernels, bf16
    streams): the tokens and logprobs of the unfused eager run, eagerly and through the graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import deepinfer_runtime.models.deepseek_v41 as v41

    path = write_tiny_checkpoint(tmp_path / "ckpt", "v4.1", "fp8+fp4", seed=4)
    kw = {"yoco_mode": "compact", "engram_device": "cuda"}
    _, base = _generate(path, "cuda", True, dtype="bfloat16", **kw)
    monkeypatch.setattr(v41, "EXPAND_COLLAPSE", True)
    llm, fused = _generate(path, "cuda", eager, dtype="bfloat16", **kw)
    assert eager or len(llm.model.layers[0].graphs) > 0
    _same(base, fused)
