"""Token sampling: penalties, the temperature / min-p / top-p / top-k filter, the counter-based
random stream and the seeded draw, processed log-probabilities and their top-k.

Semantics follow docs/model_v41_decisions.md section 4 (binding), B3 and B4:

* **Temperature** (B4.2): rows that are greedy, or whose temperature is below ``SAMPLING_EPS``
  (1e-5), are processed at T = 1e-5 with top-p = 1 and top-k and min-p off; every other row divides
  its fp32 logits by T. Greedy therefore equals argmax except between tokens whose logits differ by
  less than about 1e-4 (exact ties included), which the seeded uniform breaks like any other draw.
* **min-p** (not in DI; vLLM's place, right after temperature): drop tokens whose probability under
  the scaled softmax is below ``min_p`` times the largest one.
* **top-p first** (B4.3): on the softmax of the surviving scaled logits, in a stable descending
  sort (equal logits: lower token id first), drop a token when the mass strictly before it
  exceeds top_p. top_p >= 1 disables it.
* **top-k second** (B4.4): keep the first top_k survivors of that order; top_k <= 0 (0 or -1)
  disables it. (vLLM applies top-k before top-p; DeepInfer does not.)
* **The draw** (B3): one uniform u per row from (seed, position) only, u = H(seed + (t ^ t*2^13)),
  t = (3 pos + c) phi, H = SplitMix64 -> 53-bit uniform, c = 0 (1 for the spec-decode residual
  resample); the token is the first vocabulary index whose fp64 cumulative sum of the unnormalised
  probabilities exp(x - max) exceeds u times their total. ``pos`` is the absolute position of the
  token being produced (the prompt length for the first output token). Seeds are uint64 carried in
  int64 tensors with the same bits (``seed_to_int64``); a draft row uses seed + ``DRAFT_SEED_OFFSET``.
* **Logprobs** (B4.5): log_softmax of the processed (scaled, filtered) logits; filtered tokens get
  -inf.

Every op is row-invariant: a row's result is bitwise the same whatever other rows are in the
call, so a seeded request samples the same tokens in any batch and across runs.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)
from .reference import SAMPLING_EPS

DRAFT_SEED_OFFSET = 1_000_000_007  # decisions B3: seed' of DSpark draft rows = seq_seed + this

__all__ = [
    "DRAFT_SEED_OFFSET",
    "SAMPLING_EPS",
    "accept_uniforms",
    "apply_penalties",
    "draw_tokens",
    "log_softmax_rows",
    "process_logits",
    "processed_logprobs",
    "sample_tokens",
    "sampling_uniforms",
    "seed_to_int64",
    "topk_logprobs",
]


def seed_to_int64(seed: int) -> int:
    """A uint64 seed (any int, taken modulo 2^64) as the int64 with the same bits, for seed tensors."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _check_logits(fn: str, logits: torch.Tensor) -> int:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{fn}: logits must be [B, V] with V >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{fn}: logits must be floating point, got {logits.dtype}")
    return logits.shape[0]


def _check_rows(fn: str, b: int, **vectors: torch.Tensor) -> None:
    for name, t in vectors.items():
        if t.shape != (b,):
            raise ValueError(f"{fn}: {name} must be [B] = [{b}], got shape {tuple(t.shape)}")


def _check_int(fn: str, name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{fn}: {name} must be an integer tensor, got {t.dtype}")


def sampling_uniforms(seeds: torch.Tensor, positions: torch.Tensor, resample: bool = False) -> torch.Tensor:
    """The per-token uniform of decisions B3: u = H(seed + (t ^ (t * 2^13))), t = (3 pos + c) * phi.

    H is SplitMix64 (add phi; x ^= x>>30, * 0xBF58476D1CE4E5B9; x ^= x>>27, * 0x94D049BB133111EB;
    x ^= x>>31; u = (x>>11) * 2^-53), everything modulo 2^64. c = 0 for a fresh sample, 1 for the
    residual resample (``resample=True``). Depends on (seed, position) only.

    Args:
        seeds: int64 [...] uint64 seeds as int64 bits (``seed_to_int64``).
        positions: int64 [...] (broadcastable with seeds) absolute positions of the produced tokens.

    Returns:
        float64 [...] in [0, 1), multiples of 2^-53.
    """
    _check_int("sampling_uniforms", "seeds", seeds)
    _check_int("sampling_uniforms", "positions", positions)
    return dispatch("sampling_uniforms", seeds.device, seeds, positions, resample)


def accept_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The speculative accept-test uniform of decisions B3: H(seed ^ ((3 pos + 2) * phi)).

    Same argument conventions and result as ``sampling_uniforms``.
    """
    _check_int("accept_uniforms", "seeds", seeds)
    _check_int("accept_uniforms", "positions", positions)
    return dispatch("accept_uniforms", seeds.device, seeds, positions)


def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties, in that order, in fp32.

    With c = output_token_counts[b, v] and seen = c > 0 or prompt_mask[b, v]:
    1. repetition: if seen, x / r when x > 0, else x * r (tokens of the prompt or the output);
    2. frequency: x - f * c (output tokens only);
    3. presence: x - p * (c > 0) (output tokens only).
    r = 1, f = 0, p = 0 leave a row bitwise unchanged. -inf logits stay -inf.

    Args:
        logits: [B, V] float (computed in fp32).
        output_token_counts: integer [B, V], occurrences of each token in the request's output.
        prompt_mask: bool [B, V], True for tokens that occur in the prompt.
        presence, frequency, repetition: [B] float; repetition > 0.

    Returns:
        fp32 [B, V] (a new tensor).
    """
    fn = "apply_penalties"
    b = _check_logits(fn, logits)
    if output_token_counts.shape != logits.shape or prompt_mask.shape != logits.shape:
        raise ValueError(
            f"{fn}: output_token_counts {tuple(output_token_counts.shape)} and prompt_mask "
            f"{tuple(prompt_mask.shape)} must match logits {tuple(logits.shape)}"
        )
    _check_int(fn, "output_token_counts", output_token_counts)
    if prompt_mask.dtype != torch.bool:
        raise ValueError(f"{fn}: prompt_mask must be bool, got {prompt_mask.dtype}")
    _check_rows(fn, b, presence=presence, frequency=frequency, repetition=repetition)
    return dispatch(fn, logits.device, logits, output_token_counts, prompt_mask, presence, frequency, repetition)


def _check_filters(fn, logits, temperature, top_k, top_p, min_p, greedy) -> int:
    b = _check_logits(fn, logits)
    _check_rows(fn, b, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy)
    _check_int(fn, "top_k", top_k)
    if greedy.dtype != torch.bool:
        raise ValueError(f"{fn}: greedy must be bool, got {greedy.dtype}")
    return b


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """The logits actually sampled from: scaled by temperature, then min-p, top-p, top-k filtered.

    See the module docstring for the exact rule (decisions B4). Rows must hold at least one finite
    logit and no NaN or +inf (-inf marks banned tokens). The largest logit is never filtered.

    Args:
        logits: [B, V] float (computed in fp32), after logit bias and penalties.
        temperature: [B] float >= 0.
        top_k: integer [B]; <= 0 disables (0 and -1 both mean "off"); >= V keeps all.
        top_p: [B] float in (0, 1]; computed against in fp64 (pass fp64 to avoid fp32 rounding).
        min_p: [B] float in [0, 1]; 0 disables.
        greedy: bool [B]; True processes the row as temperature 0 (the 1e-5 floor, filters off).

    Returns:
        fp32 [B, V]: logits / T where kept, -inf where filtered (or banned on input).
    """
    _check_filters("process_logits", logits, temperature, top_k, top_p, min_p, greedy)
    return dispatch("process_logits", logits.device, logits, temperature, top_k, top_p, min_p, greedy)


def draw_tokens(processed: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One seeded draw per row from softmax(processed) by inverse CDF (decisions B3).

    u = ``sampling_uniforms(seeds, positions)``; the token is the first index whose fp64 cumulative
    sum of exp(processed - max) exceeds u times the total (never a token of probability 0).

    Args:
        processed: [B, V] float from ``process_logits`` (-inf = excluded).
        seeds: int64 [B] uint64 seeds as int64 bits. positions: int64 [B].

    Returns:
        int64 [B] token ids.
    """
    fn = "draw_tokens"
    b = _check_logits(fn, processed)
    _check_rows(fn, b, seeds=seeds, positions=positions)
    _check_int(fn, "seeds", seeds)
    _check_int(fn, "positions", positions)
    return dispatch(fn, processed.device, processed, seeds, positions)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """``draw_tokens(process_logits(logits, ...), seeds, positions)``: int64 [B] token ids.

    A row's token depends only on its own logits, parameters, seed and position: bitwise the same
    whatever else is in the batch and across runs. Arguments as in ``process_logits`` and
    ``draw_tokens``.
    """
    fn = "sample_tokens"
    b = _check_filters(fn, logits, temperature, top_k, top_p, min_p, greedy)
    _check_rows(fn, b, seeds=seeds, positions=positions)
    _check_int(fn, "seeds", seeds)
    _check_int(fn, "positions", positions)
    return dispatch(fn, logits.device, logits, temperature, top_k, top_p, min_p, seeds, positions, greedy)


def log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-invariant log_softmax over the last dim of [B, V]: (x - max) - log(sum exp(x - max)).

    The sum is accumulated in fp64 in vocabulary order; the result is fp32, -inf where x is -inf.
    Agrees with ``F.log_softmax`` to a few ulp.
    """
    _check_logits("log_softmax_rows", x)
    return dispatch("log_softmax_rows", x.device, x)


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """fp32 [B, V] log-distribution sampled from: ``log_softmax_rows(process_logits(...))``.

    This is what DeepInfer reports as logprobs (decisions B4.5): filtered tokens get -inf, and a
    greedy row is the distribution at T = 1e-5.
    """
    _check_filters("processed_logprobs", logits, temperature, top_k, top_p, min_p, greedy)
    return dispatch("processed_logprobs", logits.device, logits, temperature, top_k, top_p, min_p, greedy)


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row, largest first; ties: lower token id first.

    Args:
        logprobs: [B, V] float. k: int in [0, V].

    Returns:
        (values [B, k] in logprobs.dtype, ids int64 [B, k]).
    """
    _check_logits("topk_logprobs", logprobs)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= logprobs.shape[1]:
        raise ValueError(f"topk_logprobs: k must be an int in [0, {logprobs.shape[1]}], got {k!r}")
    return dispatch("topk_logprobs", logprobs.device, logprobs, k)
