"""The deepinfer CLI: generate (arguments, file, stdin) and bench (summary + JSON), on a tiny checkpoint."""

import io
import json

import pytest
from deepinfer_runtime.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "v41", "v4.1", "fp8+fp4", seed=2)


def test_generate_from_arguments_file_and_stdin(ckpt, tmp_path, capsys, monkeypatch):
    assert main(["generate", "Hello", "Bonjour", "--model", str(ckpt), "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "'Hello' ->" in out and "'Bonjour' ->" in out and "3 tokens, length" in out
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "from a file"}\n\nplain line\n')
    assert main(["generate", "--prompts-file", str(f), "--model", str(ckpt), "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "'from a file' ->" in out and "'plain line' ->" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "2"]) == 0
    assert "'from stdin' ->" in capsys.readouterr().out


def test_generate_errors_are_clear(ckpt, tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(ckpt), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_bench_writes_json(ckpt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--model",
        str(ckpt),
        "--num-requests",
        "3",
        "--context",
        "40",
        "--suffix",
        "10",
        "--output-len",
        "2",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for key in (
        "requests_per_second",
        "input_tokens_per_second",
        "output_tokens_per_second",
        "elapsed_time",
        "mean_ttft_s",
        "prefix_cache_hit_rate",
    ):
        assert key in result
    assert result["num_requests"] == 3 and result["total_output_tokens"] == 6
    assert "output tokens/s" in capsys.readouterr().out
