"""V4-Flash-0731's DSpark head (vLLM 0.33's ``DSparkDeepseekV4Model``): the released config parses, the draft stages
load from ``mtp.*`` (with or without a confidence head), and the incremental drafting state (context keys written
as the target runs, chunked or not, rolled back with rejected drafts) gives the block hiddens and base logits of a
from-scratch recomputation: a full forward for the tap streams, each stage's keys of main_x, and a dense softmax
attention of the block rows over the last W context keys and every block row."""

import pytest
import torch
from deepinfer_kernels import mhc_collapse, mhc_head_weights
from deepinfer_runtime import load_model
from deepinfer_runtime.errors import CheckpointError, ConfigError
from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

DSPARK = {"dspark_target_layer_ids": [2, 3, 4], "dspark_markov_rank": 16}  # tap 4 = the last layer's output
B = 6  # num_speculative_tokens 5 + 1

# DeepSeek-V4-Flash-0731's config.json as public tests quote it: 46 compress ratios for 43 layers (the last 3 are
# the DSpark stages'), the DSpark fields, and the stale num_nextn_predict_layers = 1
V4_0731 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    "num_nextn_predict_layers": 1,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


def test_released_config_parses():
    cfg = DeepseekV4Config.from_dict(V4_0731)
    d = cfg.dspark
    assert (d.target_layer_ids, d.num_stages, d.block_size, d.noise_token_id, d.markov_rank) == (
        (40, 41, 42),
        3,
        5,
        128799,
        256,
    )
    base = {k: v for k, v in V4_0731.items() if not k.startswith("dspark")}
    assert DeepseekV4Config.from_dict({**base, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}).dspark is None


@pytest.mark.parametrize(
    "change, match",
    [
        ({"compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 4, 0]}, "DSpark stages' ratios"),
        ({"dspark_n_routed_experts": 64}, "backbone's MoE"),
        ({"dspark_target_layer_ids": [0, 41]}, "dspark_target_layer_ids"),
        ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
        ({"dspark_noise_token_id": 129280}, "dspark_noise_token_id"),
        ({"n_mtp_layers": 0}, "n_mtp_layers"),
    ],
)
def test_bad_dspark_fields_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekV4Config.from_dict({**V4_0731, **change})


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dspark") / "v4", "v4", "fp8+fp4", seed=3, config=DSPARK)


@pytest.fixture(scope="module")
def model(dspark_dir):
    return load_model(dspark_dir, dtype=torch.float32, dspark=True, progress=False)


def _dense_block_attention(stage, x, pos, ctx):
    """The block rows x [N, d] (normed) over [ctx | their own keys], every row seeing every key; sinks join the
    softmax denominator."""
    a = stage.attn
    _, q = a.query(x, pos)
    kv = torch.cat([ctx, a.window_kv(x, pos)]).float()
    scores = torch.einsum("nhd,kd->nhk", q.float(), kv) * a.head_dim**-0.5
    sink = a.attn_sink.float()[None, :, None].expand(x.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return a.output(torch.einsum("nhk,kd->nhd", probs, kv).to(x.dtype), pos)


@torch.no_grad()
def _recomputed(model, tokens: list[int], anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base logits [N, V], hiddens [N, d]) of the block after ``tokens`` (anchor at position len(tokens))."""
    cfg, spec = model.cfg, model.cfg.dspark
    taps = {}
    hooks = [
        model.layers[t].register_forward_pre_hook(lambda m, args, t=t: taps.__setitem__(t, args[0].mean(1)))
        for t in spec.target_layer_ids
        if t < cfg.num_hidden_layers
    ]
    hooks.append(
        model.layers[-1].register_forward_hook(lambda m, args, y: taps.__setitem__(len(model.layers), y.mean(1)))
    )
    model.forward_logits(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    s0 = model.mtp[0]
    main_x = s0.main_norm(s0.main_proj(torch.cat([taps[t] for t in spec.target_layer_ids], -1)))
    s, n = len(tokens), spec.block_size
    ctx_pos = torch.arange(max(s - cfg.sliding_window, 0), s)
    pos = torch.arange(s, s + n)
    ids = torch.tensor([anchor] + [spec.noise_token_id] * (n - 1))
    x = model.embed.weight[ids][:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    for stage in model.mtp:
        ctx = stage.attn.window_kv(main_x[ctx_pos], ctx_pos)
        x = stage.run_block(x, ids, lambda u, st=stage, c=ctx: _dense_block_attention(st, u, pos, c))
    last = model.mtp[-1]
    pre = mhc_head_weights(
        x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps
    )
    h = mhc_collapse(x, pre)
    return torch.nn.functional.linear(last.norm(h).float(), model.head.weight.float()), h


@pytest.mark.parametrize("prompt_len, chunk", [(3, 1), (40, 7), (40, 40)])  # window 16: 40 wraps the rings
def test_incremental_block_equals_recomputation(model, prompt_len, chunk):
    g = torch.Generator().manual_seed(prompt_len + chunk)
    rand = lambda k: torch.randint(3, 1000, (k,), generator=g).tolist()  # noqa: E731
    tokens = rand(prompt_len)
    cache = model.new_cache(backtrack=B)
    for s in range(0, prompt_len, chunk):
        model.forward_step([torch.tensor(tokens[s : s + chunk])], [cache])
    n = model.cfg.dspark.block_size
    for step in range(4):
        anchor = rand(1)[0]
        base, hidden = model.dspark_hidden(torch.tensor([anchor]), [cache])
        want_base, want_hidden = _recomputed(model, tokens, anchor)
        assert torch.allclose(hidden[0], want_hidden, rtol=1e-4, atol=1e-5), f"step {step}"
        assert torch.allclose(base[0], want_base, rtol=1e-4, atol=1e-4), f"step {step}"
        assert torch.equal(base[0].argmax(-1), want_base.argmax(-1))
        # verify [anchor, n - 1 drafts], keep a random prefix, roll the rest back (the context keys too)
        drafts = rand(n - 1)
        model.forward_step([torch.tensor([anchor] + drafts)], [cache])
        acc = int(torch.randint(0, n, (1,), generator=g))
        model.rollback_cache(cache, n - 1 - acc)
        tokens += [anchor] + drafts[:acc]
        assert cache.ctx_end == cache.seq_len == len(tokens)


def test_draft_depends_on_the_anchor_only_through_the_block(model):
    cache = model.new_cache()
    model.forward_step([torch.arange(5, 30)], [cache])
    a, _ = model.dspark_hidden(torch.tensor([7]), [cache])
    b, _ = model.dspark_hidden(torch.tensor([8]), [cache])
    assert not torch.equal(a, b)
    assert torch.equal(model.dspark_hidden(torch.tensor([7]), [cache])[0], a)  # drafting leaves the cache alone


def test_loading(tmp_path, dspark_dir, model, tiny_v4_dirs):
    w1, w2, conf = model.dspark_markov()
    assert w1.shape == w2.shape == (model.cfg.vocab_size, 16) and conf.shape == (1, model.cfg.hidden_size + 16)
    plain = load_model(dspark_dir, dtype=torch.float32, progress=False)  # the stages load only when asked for
    assert plain.mtp is None and plain.draft_method is None
    ids = torch.randint(3, 1000, (1, 20))
    assert torch.equal(plain.forward_logits(ids), model.forward_logits(ids))  # they never change the target
    with pytest.raises(ConfigError, match="DSpark stages"):
        load_model(dspark_dir, dtype=torch.float32, mtp=True, progress=False)
    with pytest.raises(ConfigError, match="no DSpark head"):
        load_model(tiny_v4_dirs["mixed"], dtype=torch.float32, dspark=True, progress=False)
    # a checkpoint without the (optional) confidence head: drafts carry no confidences
    bare = write_tiny_checkpoint(tmp_path / "bare", "v4", seed=3, config=DSPARK, omit=("confidence_head",))
    m = load_model(bare, dtype=torch.float32, dspark=True, progress=False)
    assert m.dspark_markov()[2] is None and not hasattr(m.mtp[-1], "confidence_head")
    # a missing stage tensor is named
    broken = write_tiny_checkpoint(tmp_path / "broken", "v4", seed=3, config=DSPARK, omit=("mtp.0.main_proj",))
    with pytest.raises(CheckpointError, match="mtp.0.main_proj.weight"):
        load_model(broken, dtype=torch.float32, dspark=True, progress=False)
