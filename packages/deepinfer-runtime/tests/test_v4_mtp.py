"""V4-Flash's MTP layer as a drafter: the incremental state (backbone streams kept for at most W + B positions,
the layer's window ring, chained draft rows taken back, rollbacks of rejected drafts, skipped prefill rows)
gives bitwise the logits of recomputing the layer from scratch over the whole accepted sequence."""

import pytest
import torch
from deepinfer_runtime import load_model
from deepinfer_runtime.errors import CheckpointError, ConfigError
from deepinfer_runtime.models.deepseek_v4_cache import LayerCache
from deepinfer_runtime.models.deepseek_v4_weights import v4_mtp_inventory
from deepinfer_runtime.slot_pool import SlotPool, SlotSpec
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

N = 3  # drafts per step; rollback ring B = N + 1


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "v4", "v4", config={"num_nextn_predict_layers": 1})


@pytest.fixture(scope="module")
def model(mtp_dir):
    return load_model(mtp_dir, dtype=torch.float32, mtp=True, progress=False)


def _backbone_streams(model, tokens: list[int]) -> torch.Tensor:
    """Streams [S, n, d] after the last backbone layer (before the mHC head) of a full forward."""
    out = []
    hook = model.layers[-1].register_forward_hook(lambda mod, args, y: out.append(y))
    model.forward_logits(torch.tensor([tokens]))
    hook.remove()
    return out[0]


def _recomputed_logits(model, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """Section A.9 from scratch: rows 0 .. a-1 (X_main at i, token i+1; the anchor tokens[a] last) in one pass
    over a fresh window, then one chained row per draft. fp32 [len(drafts), V]."""
    layer, a = model.mtp[0], len(tokens) - 1
    ids = torch.tensor(tokens[1:])
    spec = SlotSpec("window", "test", model.cfg.sliding_window - 1 + N, model.cfg.head_dim, torch.float32)
    window = LayerCache(SlotPool.private([spec], "cpu")["window"])
    x = layer.run(_backbone_streams(model, tokens[:-1]), model.embed.weight[ids], ids, [torch.arange(a)], [window])
    x = x[-1:]
    logits = [layer.logits(x, model.head)]
    for j, d in enumerate(drafts[:-1]):
        t = torch.tensor([d])
        x = layer.run(x, model.embed.weight[t], t, [torch.tensor([a + j])], [window])
        logits.append(layer.logits(x, model.head))
    return torch.cat(logits)


@pytest.mark.parametrize("prompt_len, chunk", [(1, 1), (6, 4), (45, 16)])  # window 16: 45 skips prefill rows
def test_incremental_drafts_equal_recomputation(model, prompt_len, chunk):
    g = torch.Generator().manual_seed(prompt_len)
    rand = lambda n: torch.randint(3, 1000, (n,), generator=g).tolist()  # noqa: E731
    tokens = rand(prompt_len)
    cache = model.new_cache(backtrack=N + 1)
    for s in range(0, prompt_len, chunk):
        model.forward_step([torch.tensor(tokens[s : s + chunk])], [cache])
    tokens += rand(1)  # the first sampled token: the first anchor
    accepted_counts = set()
    for _ in range(7):
        drafts, got = [], []

        def sample(j, logits, drafts=drafts, got=got):
            got.append(logits)
            drafts.append(rand(1)[0])
            return torch.tensor(drafts[-1:])

        seq = list(tokens)
        model.draft_mtp([cache.mtp], [lambda s, e, seq=seq: seq[s:e]], [len(tokens) - 1], N, sample)
        assert torch.equal(torch.cat(got), _recomputed_logits(model, tokens, drafts))
        # verify [anchor, drafts] with the backbone, keep a random number of drafts, roll the rest back
        model.forward_step([torch.tensor(tokens[-1:] + drafts)], [cache])
        acc = int(torch.randint(0, N + 1, (1,), generator=g))
        accepted_counts.add(acc)
        model.rollback_cache(cache, N - acc, None)
        tokens += drafts[:acc] + rand(1)  # accepted drafts, then the residual / bonus token (the next anchor)
        assert cache.mtp.streams.end == cache.seq_len == len(tokens) - 1
    assert len(accepted_counts) > 1


def test_mtp_loading_errors(tmp_path, tiny_v4_dirs, mtp_dir):
    with pytest.raises(ConfigError, match="no MTP layer"):
        load_model(tiny_v4_dirs["mixed"], dtype=torch.float32, mtp=True, progress=False)
    # a config promising an MTP layer whose tensors are missing: the loader names them
    import json
    import shutil

    broken = tmp_path / "no_mtp_tensors"
    shutil.copytree(tiny_v4_dirs["mixed"], broken)
    raw = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="mtp.0.e_proj.weight"):
        load_model(broken, dtype=torch.float32, mtp=True, progress=False)
    plain = load_model(mtp_dir, dtype=torch.float32, progress=False)  # without mtp=True the layer is not loaded
    assert plain.mtp is None and "mtp.0.e_proj.weight" in {s.name for s in v4_mtp_inventory(plain.cfg)}
