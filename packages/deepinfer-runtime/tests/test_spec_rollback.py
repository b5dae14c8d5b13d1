"""Speculative rollback: after a verify chunk of k + 1 tokens and a rollback of the rejected ones, every
cache kind (window rings, compressed KV and index keys, compressor tails and previous windows, Engram
lookback, DSpark context of V4.1 and V4-Flash-0731) is exactly that of a cache that only ever ran the
accepted tokens, and the next step's logits are bitwise the same. Random accept patterns, crossing
compressor group boundaries."""

import random

import pytest
import torch
from deepinfer_runtime import load_model
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

B = 6  # num_speculative_tokens 5 + 1 (decisions Y6)


@pytest.fixture(scope="module")
def v41_model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("rollback") / "v41", "v4.1", "fp8+fp4", seed=5)
    return load_model(path, torch.float32, "cpu", progress=False, yoco_mode="off")


def _v41_state(c, window):
    """What the next steps read, trimmed to what attention uses (the rings may hold more)."""
    out = {"seq_len": c.seq_len, "ctx_end": c.ctx_end, "engram": c.engram_history}
    for layer, w in c.windows.items():
        out[f"win{layer}"] = w.view()[-(window - 1) :]
    for layer, s in c.sources.items():
        out[f"kv{layer}"], out[f"idx{layer}"] = s.entries.view(), s.keys.view()
        if s.ratio > 1:  # the incomplete group's projections
            group = (s.num_entries * s.ratio, s.kv.end)
            out[f"tail{layer}"] = (s.kv.end, s.kv.read(*group), s.score.read(*group))
    for k, ctx in c.dspark_ctx.items():
        out[f"ctx{k}"] = ctx.view()[-window:]
    return out


def _v4_state(c, window):
    out = {"seq_len": c.seq_len, "ctx_end": c.ctx_end}
    for k, ctx in c.dspark_ctx.items():  # V4-Flash-0731's DSpark context keys
        out[f"ctx{k}"] = ctx.view()[-window:]
    for i, lc in enumerate(c.layers):
        out[f"win{i}"] = lc.window.view()[-(window - 1) :]
        for name, s in (("comp", lc.compressor), ("idx", lc.indexer)):
            if s is not None:  # entries, the incomplete group and the previous window's A-halves
                out[f"{name}{i}"] = (None if s.entries is None else s.entries.view(), *s.carried())
    return out


def _assert_same(a, b, where):
    assert a.keys() == b.keys(), where
    for key in a:
        x, y = a[key], b[key]
        xs, ys = (x, y) if isinstance(x, tuple) else ((x,), (y,))
        for u, v in zip(xs, ys):
            if isinstance(u, int):
                assert u == v, f"{where}: {key}"
            elif u is None or v is None:
                empty = lambda t: t is None or t.numel() == 0  # noqa: E731
                assert empty(u) and empty(v), f"{where}: {key}"
            else:
                assert u.shape == v.shape and torch.equal(u, v), f"{where}: {key}"


def _check_rollback(model, state_fn, window, vocab, seed, prefill):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (prefill,), generator=g).tolist()
    spec, ref = model.new_cache(backtrack=B), model.new_cache(backtrack=B)
    model.forward(torch.tensor([seq]), [spec])
    model.forward(torch.tensor([seq]), [ref])
    for step in range(12):
        k = rng.randint(0, B - 1)
        accepted = rng.randint(0, k)
        chunk = torch.randint(3, vocab, (k + 1,), generator=g).tolist()
        model.forward(torch.tensor([chunk]), [spec])  # the anchor and k drafts
        kept = chunk[: accepted + 1]
        model.rollback_cache(spec, k - accepted, lambda s, e, ids=seq + kept: ids[s:e])
        model.forward(torch.tensor([kept]), [ref])  # only what survived
        seq += kept
        _assert_same(state_fn(spec, window), state_fn(ref, window), f"step {step} (k={k}, accepted={accepted})")
    nxt = torch.randint(3, vocab, (1, 3), generator=g)
    assert torch.equal(model.forward(nxt, [spec]), model.forward(nxt, [ref]))


@pytest.mark.parametrize("prefill", [7, 40])
def test_v41_rollback_equals_running_only_accepted_tokens(v41_model, prefill):
    cfg = v41_model.cfg
    _check_rollback(v41_model, _v41_state, cfg.sliding_window, cfg.vocab_size, seed=prefill, prefill=prefill)


@pytest.mark.parametrize("name", ["mixed", "released_ratios", "dspark"])
def test_v4_rollback_equals_running_only_accepted_tokens(tiny_v4_dirs, tmp_path_factory, name):
    if name == "dspark":  # V4-Flash-0731 with its DSpark stages (context rings)
        cfg = {"dspark_target_layer_ids": [1, 3], "dspark_markov_rank": 8, "n_mtp_layers": 2}
        path = write_tiny_checkpoint(tmp_path_factory.mktemp("rollback") / "v4ds", "v4", seed=4, config=cfg)
        model = load_model(path, torch.float32, "cpu", progress=False, dspark=True)
        assert len(model.mtp) == 2
    else:
        model = load_model(tiny_v4_dirs[name], torch.float32, "cpu", progress=False)
    cfg = model.cfg
    _check_rollback(model, _v4_state, cfg.sliding_window, cfg.vocab_size, seed=11, prefill=cfg.sliding_window + 5)


def test_rollback_beyond_the_ring_is_refused(v41_model):
    cache = v41_model.new_cache(backtrack=2)
    v41_model.forward(torch.tensor([[5, 6, 7, 8]]), [cache])
    with pytest.raises(RuntimeError, match="backtrack ring"):
        v41_model.rollback_cache(cache, 3, lambda s, e: [5, 6, 7, 8][s:e])
