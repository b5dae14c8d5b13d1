"""DeepSeek-V4-Flash against the oracle, transformers 5.23.0 ``DeepseekV4ForCausalLM``.

Both load the same checkpoint directory (released tensor names, real tokenizer) in float32.
"""

import pytest
import torch
from deepinfer_kernels.testing.compare import assert_rel_close
from deepinfer_runtime import load_model

transformers = pytest.importorskip("transformers")
# prompt lengths: several windows of every compressor (CSA 4, HCA 16, and 2+ windows of 128)
PROMPT_LEN = {"mixed": 150, "released_ratios": 300, "routed_only": 120}


def _hf(path):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _prompt(name, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 129280, (batch, PROMPT_LEN[name]), generator=g)


@pytest.mark.parametrize("name", list(PROMPT_LEN))
def test_full_forward_matches_transformers(tiny_v4_dirs, name):
    ids = _prompt(name)
    ours = load_model(tiny_v4_dirs[name], dtype=torch.float32, progress=False).forward_logits(ids)
    with torch.no_grad():
        ref = _hf(tiny_v4_dirs[name])(ids, use_cache=False).logits.float()
    assert_rel_close(ours, ref, 1e-4, f"{name} full forward")


@pytest.mark.parametrize("name", list(PROMPT_LEN))
def test_prefill_then_decode_matches_transformers(tiny_v4_dirs, name):
    ids = _prompt(name, batch=1, seed=1)
    prefill = ids.shape[1] - 40
    model = load_model(tiny_v4_dirs[name], dtype=torch.float32, progress=False)
    with torch.no_grad():
        ref = _hf(tiny_v4_dirs[name])(ids, use_cache=False).logits.float()
    cache = model.new_cache()
    first = model(ids[:, :prefill], [cache])
    steps = [model(ids[:, t : t + 1], [cache]) for t in range(prefill, ids.shape[1])]
    assert_rel_close(first, ref[:, :prefill], 1e-4, f"{name} prefill")
    assert_rel_close(torch.cat(steps, dim=1), ref[:, prefill:], 1e-4, f"{name} token-by-token decode")


@pytest.mark.parametrize("name", list(PROMPT_LEN))
def test_greedy_continuation_identical(tiny_v4_dirs, name):
    ids = _prompt(name, batch=1, seed=2)
    model = load_model(tiny_v4_dirs[name], dtype=torch.float32, progress=False)
    hf = _hf(tiny_v4_dirs[name])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, ids.shape[1] :
        ]
    cache = model.new_cache()
    logits = model(ids, [cache])
    got = []
    for _ in range(32):
        nxt = logits[0, -1].argmax()
        got.append(int(nxt))
        logits = model(nxt.view(1, 1), [cache])
    assert got == want.tolist()


@pytest.mark.parametrize("chunk", [1, 7, 33])
def test_chunked_prefill_matches_full_forward(tiny_v4_dirs, chunk):
    """Compressor partial groups, CSA overlap halves and window tails carry across chunk edges."""
    ids = _prompt("mixed", batch=2, seed=3)
    model = load_model(tiny_v4_dirs["mixed"], dtype=torch.float32, progress=False)
    full = model.forward_logits(ids)
    caches = [model.new_cache(), model.new_cache()]
    parts = [model(ids[:, s : s + chunk], caches) for s in range(0, ids.shape[1], chunk)]
    assert torch.equal(torch.cat(parts, dim=1), full), f"chunk {chunk}: not bitwise equal"
