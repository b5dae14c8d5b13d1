"""DeepSeek-V4.1-Flash: the incremental model against the full-recompute reference, bitwise in float32.

The tiny config of model_v41_decisions.md section 6 keeps the released structure: window-only layers,
ratio-2 KV sources and reusers, the ratio-1 source (candidate source), re-index layers, two Engram
layers and three DSpark stages.
"""

import pytest
import torch
from deepinfer_runtime import load_model
from deepinfer_runtime.models.deepseek_v41_reference import reference_forward
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

PROMPT = 100  # > 16 ratio-1 entries, so the candidate filter really is a second level; ~6 windows of 16


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt", "v4.1", "fp8+fp4", seed=0)


@pytest.fixture(scope="module", params=[True, False], ids=["quantisers", "identity"])
def model(request, v41_dir):
    return load_model(v41_dir, dtype=torch.float32, progress=False, fake_quant=request.param, yoco_mode="off")


KEEP = 28  # window 16 + 12, mirroring 140 = 128 + 12 (decisions section 6)


@pytest.fixture(scope="module", params=["mask", "compact"])
def yoco_model(request, v41_dir):
    return load_model(v41_dir, dtype=torch.float32, progress=False, yoco_mode=request.param, yoco_keep_tokens=KEEP)


def _ids(batch=2, length=PROMPT, seed=0):
    return torch.randint(0, 129280, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_full_forward_equals_reference_bitwise(model):
    ids = _ids()
    ref = reference_forward(model, ids)
    assert torch.isfinite(ref).all()
    assert torch.equal(model.forward_logits(ids), ref)


@pytest.mark.parametrize("chunk", [1, 7, 33])
def test_chunked_prefill_equals_reference_bitwise(model, chunk):
    ids = _ids(seed=1)
    ref = reference_forward(model, ids)
    caches = [model.new_cache(), model.new_cache()]
    got = torch.cat([model(ids[:, s : s + chunk], caches) for s in range(0, ids.shape[1], chunk)], dim=1)
    assert torch.equal(got, ref)


def test_structure_is_exercised(model):
    """The test prompt reaches every mechanism: candidate filter, re-index masking, Engram, DSpark taps."""
    cfg = model.cfg
    roles = [cfg.layer_role(i) for i in range(cfg.num_hidden_layers)]
    assert {"window", "kv_source", "reuse", "reindex"} <= set(roles)
    assert cfg.candidate_source_layer_id is not None and PROMPT > cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert len(cfg.engram_layer_ids) == 2 and len(model.mtp) == 3


def _prefill(model, ids, chunk, prompt_len=None):
    caches = [model.new_cache() for _ in range(ids.shape[0])]
    lens = [prompt_len or ids.shape[1]] * ids.shape[0]
    parts = [model(ids[:, s : s + chunk], caches, prompt_lens=lens) for s in range(0, ids.shape[1], chunk)]
    return torch.cat(parts, dim=1), caches


@pytest.mark.parametrize("chunk", [9, 40, PROMPT])
def test_yoco_prefill_equals_reference_with_same_truncation(yoco_model, chunk):
    ids = _ids(seed=2)
    ref = reference_forward(yoco_model, ids, yoco_mode=yoco_model.yoco_mode, keep=KEEP)
    got, _ = _prefill(yoco_model, ids, chunk)
    kept = slice(PROMPT - KEEP, PROMPT)
    assert torch.equal(got[:, kept], ref[:, kept])
    if yoco_model.yoco_mode == "compact":  # decoder rows before the floor are not computed
        assert torch.isnan(got[:, : PROMPT - KEEP]).all() and torch.isnan(ref[:, : PROMPT - KEEP]).all()
    else:
        assert torch.equal(got, ref)


def test_compact_equals_mask_on_kept_rows_and_differs_from_off(v41_dir, model):
    ids = _ids(seed=3)
    mask = load_model(v41_dir, torch.float32, progress=False, yoco_mode="mask", yoco_keep_tokens=KEEP)
    compact = load_model(v41_dir, torch.float32, progress=False, yoco_mode="compact", yoco_keep_tokens=KEEP)
    kept = slice(PROMPT - KEEP, PROMPT)
    a = reference_forward(mask, ids, "mask", KEEP)[:, kept]
    b = reference_forward(compact, ids, "compact", KEEP)[:, kept]
    assert torch.equal(a, b)
    if model.fake_quant:  # same weights as the mask/compact models
        off = reference_forward(model, ids)[:, kept]
        assert not torch.equal(a, off)  # truncation is a real approximation: the test can tell


def test_compact_prefill_then_decode_equals_reference(yoco_model):
    ids = _ids(batch=1, length=PROMPT + 12, seed=4)
    got, caches = _prefill(yoco_model, ids[:, :PROMPT], 33, prompt_len=PROMPT)
    steps = [yoco_model(ids[:, t : t + 1], caches) for t in range(PROMPT, ids.shape[1])]
    ref = reference_forward(yoco_model, ids, yoco_model.yoco_mode, KEEP, prompt_len=PROMPT)
    assert torch.equal(torch.cat(steps, dim=1), ref[:, PROMPT:])
    assert torch.equal(got[:, PROMPT - 1], ref[:, PROMPT - 1])


def test_off_prefill_then_decode_equals_full_forward(model):
    ids = _ids(batch=1, length=PROMPT + 10, seed=5)
    _, caches = _prefill(model, ids[:, :PROMPT], 25)
    steps = torch.cat([model(ids[:, t : t + 1], caches) for t in range(PROMPT, ids.shape[1])], dim=1)
    assert torch.equal(steps, model.forward_logits(ids)[:, PROMPT:])


def test_keep_tokens_below_window_plus_backtracking_is_refused(v41_dir):
    with pytest.raises(ValueError, match="KEEP_TOKENS"):
        load_model(v41_dir, torch.float32, progress=False, yoco_mode="compact", yoco_keep_tokens=20)
    with pytest.raises(ValueError, match="TRUNCATION_MODE"):
        load_model(v41_dir, torch.float32, progress=False, yoco_mode="sometimes")


def test_truncation_settings_come_from_the_environment(v41_dir, monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "30")
    m = load_model(v41_dir, torch.float32, progress=False)
    assert (m.yoco_mode, m.yoco_keep) == ("mask", 30)
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
    m = load_model(v41_dir, torch.float32, progress=False)
    assert (m.yoco_mode, m.yoco_keep) == ("compact", 140)  # DeepInfer's documented V4.1 serving default


def test_image_tokens_are_refused_without_vision(model):
    ids = _ids(batch=1, length=8)
    ids[0, 3] = model.cfg.image_token_id
    with pytest.raises(ValueError, match="image tokens"):
        model.forward_logits(ids)


@pytest.mark.parametrize("chunk", [1, 30])
def test_dspark_draft_block(model, chunk):
    from deepinfer_runtime.models.deepseek_v41_reference import reference_draft_block

    ids = _ids(batch=1, length=60, seed=6)
    _, caches = _prefill(model, ids, chunk)
    anchor = torch.tensor([1234])
    block = model.draft_block(anchor, caches)
    n = model.cfg.dspark_block_size
    assert block.tokens.shape == (1, n) and block.confidences.shape == (1, n)
    assert ((block.confidences > 0) & (block.confidences < 1)).all()
    assert torch.allclose(block.logprobs.exp().sum(-1), torch.ones(1, n), atol=1e-4)
    want_tokens, want_conf = reference_draft_block(model, ids[0], 1234)
    assert block.tokens[0].tolist() == want_tokens.tolist()
    assert torch.allclose(block.confidences[0], want_conf, rtol=1e-5, atol=1e-6)
    # the draft depends on the anchor (block inputs) and not on call order
    other = model.draft_block(torch.tensor([99]), caches)
    assert not torch.equal(other.logprobs, block.logprobs)
    assert torch.equal(model.draft_block(anchor, caches).tokens, block.tokens)


@pytest.mark.parametrize("chunk", [7, PROMPT])
def test_expand_collapse_gives_the_same_bits(v41_dir, monkeypatch, chunk):
    """``EXPAND_COLLAPSE`` (each mHC expand making the next site's input, across layers too) against the model
    without it, bitwise: prefill in chunks, then decode steps, with and without YOCO compaction (its boundary layer
    takes the compressor's input from the layer before). The fused op must run at every site but the last layer's
    FFN one and those before an Engram layer."""
    import deepinfer_runtime.models.deepseek_v41 as v41
    import deepinfer_runtime.models.layers as layers

    ids = _ids(batch=2, length=PROMPT + 4, seed=6)
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return fused_op(*args, **kw)

    fused_op = layers.mhc_expand_collapse
    monkeypatch.setattr(layers, "mhc_expand_collapse", counted)
    for mode in ("off", "compact"):
        m = load_model(v41_dir, dtype=torch.float32, progress=False, yoco_mode=mode, yoco_keep_tokens=KEEP)

        def run(m=m, lens=PROMPT if mode != "off" else None):
            got, caches = _prefill(m, ids[:, :PROMPT], chunk, prompt_len=lens)
            return torch.cat([got, *(m(ids[:, t : t + 1], caches) for t in range(PROMPT, ids.shape[1]))], dim=1)

        monkeypatch.setattr(v41, "EXPAND_COLLAPSE", False)
        base = run()
        assert not calls
        monkeypatch.setattr(v41, "EXPAND_COLLAPSE", True)
        got = run()
        assert torch.equal(got.isnan(), base.isnan()) and torch.equal(got.nan_to_num(), base.nan_to_num()), mode
        layers_n = m.cfg.num_hidden_layers
        before_engram = sum(1 for i in m.cfg.engram_layer_ids if i > 0)
        forwards = -(-PROMPT // chunk) + ids.shape[1] - PROMPT
        assert len(calls) == forwards * (2 * layers_n - 1 - before_engram), mode
        calls.clear()
