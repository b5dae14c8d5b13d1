"""Plain-PyTorch sampling (the definition of correct; the contracts are in ``__init__.py``).

Row invariance on the CPU: everything here is elementwise, a per-row max, a stable per-row sort,
a gather/scatter, or a per-row ``cumsum``, all of which give a row the same bits whatever other
rows are in the call. Row *sums* are deliberately taken as the last element of an fp64 ``cumsum``:
``torch.sum`` over a long last dim (V = 129280) splits the reduction across threads when there is
one row and not when there are many, so its bits depend on the batch size (measured on this CPU).

The random stream is SplitMix64 in two's-complement int64 arithmetic (additions and
multiplications wrap modulo 2^64; a logical right shift is an arithmetic shift followed by a
mask), reproducing decisions section 4, B3, bit for bit.
"""

import torch

from deepinfer_kernels.registry import register_reference

_NEG_INF = float("-inf")

SAMPLING_EPS = 1e-5  # decisions B4 step 2: temperatures below it are floored to it (greedy)
_U64 = 1 << 64


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


PHI = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_TWO_POW_M53 = 2.0**-53


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on int64)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _hash_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of int64 bits -> fp64 uniform in [0, 1) on a 2^-53 grid (decisions B3, hash H)."""
    x = x + PHI
    x = (x ^ _lsr(x, 30)) * _MIX1
    x = (x ^ _lsr(x, 27)) * _MIX2
    x = x ^ _lsr(x, 31)
    return _lsr(x, 11).to(torch.float64) * _TWO_POW_M53


@register_reference("sampling_uniforms")
def sampling_uniforms_ref(seeds: torch.Tensor, positions: torch.Tensor, resample: bool = False) -> torch.Tensor:
    t = (positions.long() * 3 + (1 if resample else 0)) * PHI
    return _hash_to_uniform(seeds.long() + (t ^ (t * 8192)))


@register_reference("accept_uniforms")
def accept_uniforms_ref(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return _hash_to_uniform(seeds.long() ^ ((positions.long() * 3 + 2) * PHI))


@register_reference("apply_penalties")
def apply_penalties_ref(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    x = logits.float()
    counts = output_token_counts.to(torch.float32)
    in_output = output_token_counts > 0
    seen = in_output | prompt_mask.bool()
    rep = repetition.float().unsqueeze(-1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency.float().unsqueeze(-1) * counts
    return x - presence.float().unsqueeze(-1) * in_output.to(torch.float32)


@register_reference("process_logits")
def process_logits_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    x = logits.float()
    v = x.shape[-1]
    temperature = temperature.float()
    # B4 step 2: greedy rows (or T below the floor) sample at T = 1e-5 with every filter off.
    greedy = greedy.bool() | (temperature < SAMPLING_EPS)
    temperature = torch.where(greedy, torch.full_like(temperature, SAMPLING_EPS), temperature)
    top_p = torch.where(greedy, torch.ones_like(top_p, dtype=torch.float64), top_p.double())
    top_k = torch.where(greedy, torch.zeros_like(top_k, dtype=torch.int64), top_k.long())
    min_p = torch.where(greedy, torch.zeros_like(min_p, dtype=torch.float32), min_p.float())

    s = x / temperature.unsqueeze(-1)
    e = torch.exp(s - s.amax(-1, keepdim=True))  # p / p_max of the scaled softmax; -inf -> 0
    keep = e >= min_p.unsqueeze(-1)  # min-p on the full scaled distribution (min_p = 0 keeps all)

    use_p = top_p < 1
    use_k = (top_k > 0) & (top_k < v)
    if bool((use_p | use_k).any()):  # a row with neither filter is unchanged either way
        s_kept = s.masked_fill(~keep, _NEG_INF)
        order = torch.sort(s_kept, dim=-1, descending=True, stable=True).indices
        e_sorted = torch.where(keep, e, torch.zeros_like(e)).gather(-1, order).double()
        cum = e_sorted.cumsum(-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass strictly before
        # B4 step 3: drop a token when the (renormalised) mass strictly before it exceeds top_p.
        drop = use_p.unsqueeze(-1) & (before > top_p.unsqueeze(-1) * cum[:, -1:])
        # B4 step 4: top-k on the survivors by stable rank (survivors are a prefix of the order).
        rank = torch.arange(v, device=x.device).unsqueeze(0)
        drop = drop | (use_k.unsqueeze(-1) & (rank >= top_k.unsqueeze(-1)))
        keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return s.masked_fill(~keep, _NEG_INF)


@register_reference("draw_tokens")
def draw_tokens_ref(processed: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = processed.float()
    v = x.shape[-1]
    e = torch.exp(x - x.amax(-1, keepdim=True)).double()  # unnormalised probabilities
    cum = e.cumsum(-1)
    threshold = sampling_uniforms_ref(seeds, positions) * cum[:, -1]
    first_above = (cum <= threshold.unsqueeze(-1)).sum(-1)
    # u * total can round up to total; never step past the last token with a positive probability.
    last_positive = (v - 1) - (e > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.minimum(first_above, last_positive)


@register_reference("sample_tokens")
def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    processed = process_logits_ref(logits, temperature, top_k, top_p, min_p, greedy)
    return draw_tokens_ref(processed, seeds, positions)


@register_reference("log_softmax_rows")
def log_softmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    z = x - x.amax(-1, keepdim=True)
    total = torch.exp(z).double().cumsum(-1)[:, -1:]
    return (z.double() - torch.log(total)).float()


@register_reference("processed_logprobs")
def processed_logprobs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    return log_softmax_rows_ref(process_logits_ref(logits, temperature, top_k, top_p, min_p, greedy))


@register_reference("topk_logprobs")
def topk_logprobs_ref(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), ids[:, :k].contiguous()
