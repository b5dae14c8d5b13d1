"""Engram setup-time constants: the tokenizer-derived compressed vocabulary, the per-layer hash
multipliers and the per-layer prime table sizes (spec B.6.1 steps 1, 4 and 6).

These run once at model load. ``tokenizers`` and ``numpy`` are imported inside the functions
that need them, so importing deepinfer-kernels needs neither.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

DEAD = -1
"""Compressed id of a token that blocks every n-gram through it (image-span tokens), and of a
history slot before the start of the sequence."""

SEED_STRIDE = 10007
"""The NumPy seed of Engram layer ``layer_id`` is ``SEED_STRIDE * layer_id``."""

_SENTINEL = "\ue000"  # private-use code point that protects a token that is exactly one space
_REPLACEMENT_CHAR = "\ufffd"


def _normalizer():
    """NFKC -> NFD -> strip accents -> lowercase -> [ \\t\\r\\n]+ to one space -> a lone space
    protected by the sentinel -> strip -> sentinel back to a space.

    Built from the ``tokenizers`` normalizer components because their semantics are the ones
    the released vocabulary was counted with: ``StripAccents`` removes every combining mark
    (Unicode categories Mn, Mc and Me, not only Mn), and ``Lowercase`` maps code point by
    code point (no final-sigma rule).
    """
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


@functools.lru_cache(maxsize=4)
def _build_token_map(path: str, mtime_ns: int, size: int) -> torch.Tensor:
    # mtime_ns and size are only part of the cache key (a rewritten file is rebuilt).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    normalize = _normalizer().normalize_str

    key_to_id: dict[str, int] = {}
    out = [0] * n
    for i, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:  # a partial UTF-8 byte sequence: key by the raw token string
            raw = tok.id_to_token(i)
            key = raw if raw is not None else text
        else:
            key = normalize(text) or text
        out[i] = key_to_id.setdefault(key, len(key_to_id))
    return torch.tensor(out, dtype=torch.int64)


def compressed_token_map(tokenizer_json: str | Path, *, expected_size: int | None = None) -> torch.Tensor:
    """Token id -> Engram compressed id, built from a raw ``tokenizer.json`` (spec B.6.1 step 1).

    Every token id 0 .. V-1 (V = the tokenizer's size including added tokens) is decoded on its
    own with special tokens kept and no clean-up. If the text contains U+FFFD (a partial UTF-8
    byte token) its key is the raw token string; otherwise the key is the normalised text (see
    ``_normalizer``), or the text itself when normalising leaves it empty. Equal keys share one
    compressed id; ids are assigned in order of first occurrence over the token ids, so they are
    exactly 0 .. C-1 with C = ``int(map.max()) + 1`` the compressed vocabulary size.

    Build it from the raw tokenizer.json of the checkpoint, before any engine-side added tokens
    (decision C8). The DeepSeek V4 / V4.1 tokenizer gives V = 129,280 and C = 99,092.

    Args:
        tokenizer_json: path to a Hugging Face ``tokenizer.json``.
        expected_size: if given, raise ValueError unless C equals it (pass
            ``engram_compressed_vocab_size``: the hash multipliers depend on C).

    Returns:
        int64 [V] on CPU (a fresh copy; the build is cached per resolved path, mtime and size).
    """
    path = Path(tokenizer_json).resolve()
    st = os.stat(path)
    token_map = _build_token_map(str(path), st.st_mtime_ns, st.st_size).clone()
    if expected_size is not None:
        size = int(token_map.max()) + 1 if token_map.numel() else 0
        if size != expected_size:
            raise ValueError(
                f"compressed_token_map: {path} gives {size} compressed ids, expected {expected_size} "
                "(engram_compressed_vocab_size)"
            )
    return token_map


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int = 4) -> list[int]:
    """The ``max_ngram`` odd hash multipliers of Engram layer ``layer_id`` (spec B.6.1 step 4).

    M[s] = 2 U[s] + 1 with U = ``numpy.random.default_rng(10007 * layer_id).integers(0, bound,
    max_ngram)`` (int64, PCG64), bound = max(1, floor(floor((2^63 - 1) / C) / 2)), C =
    ``compressed_vocab_size``. Every M[s] < (2^63 - 1) / C, so a product id * M[s] with
    0 <= id < C never overflows int64. ``layer_id`` is the model layer index (1 and 14 for V4.1).

    Returns Python ints. They depend on NumPy's PCG64 stream; V4.1 with C = 99,092 gives
    layer 1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    layer 14: [67716810739261, 51510806800915, 30921347202721, 82619226485591].
    """
    import numpy as np

    if compressed_vocab_size < 1:
        raise ValueError(f"engram_multipliers: compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, ((2**63 - 1) // compressed_vocab_size) // 2)
    draws = np.random.default_rng(SEED_STRIDE * layer_id).integers(0, bound, max_ngram, dtype=np.int64)
    return [2 * int(u) + 1 for u in draws]


_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24, far beyond any table size)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_table_primes(vocab_start: int, n_layers: int, n_ngram_sizes: int, n_heads: int) -> list[list[int]]:
    """Bucket sizes of the Engram tables (spec B.6.1 step 6).

    Consecutive primes, the first being the smallest prime > ``vocab_start - 1`` (i.e. >=
    ``engram_vocab_size``), drawn without reuse in the order (layer, n-gram size, head): layer
    L gets ``n_ngram_sizes * n_heads`` primes and column c = n_heads * (n - 2) + k holds the
    prime of n-gram size n and head k. A layer's table has sum(primes) rows and column c's
    bucket starts at the exclusive cumulative sum (``engram_hash_ids`` adds it).

    V4.1 (16,000,000, 2 layers, 3 sizes, 8 heads): layer 1 uses 16,000,057 ... 16,000,463
    (sum 384,006,168), layer 14 uses 16,000,477 ... 16,000,889 (sum 384,016,682), i.e.
    ``engram_num_embeddings``.

    Returns:
        ``n_layers`` lists of ``n_ngram_sizes * n_heads`` Python ints.
    """
    per_layer = n_ngram_sizes * n_heads
    if n_layers < 0 or per_layer < 0:
        raise ValueError("engram_table_primes: counts must be non-negative")
    tables: list[list[int]] = []
    candidate = max(vocab_start, 2)
    for _ in range(n_layers):
        layer: list[int] = []
        while len(layer) < per_layer:
            if _is_prime(candidate):
                layer.append(candidate)
            candidate += 1
        tables.append(layer)
    return tables
