"""DeepSeek-V4.1 KV-cache bytes: stored record sizes and bytes per token by cache kind, from the config.

The formats are the V4.1 records DeepInfer stores (model_v41_flash.md section 12, SM100 / Ascend layout):

* window KV (every layer and every DSpark stage): FP8 e4m3 over all ``head_dim`` channels (RoPE included) with
  one UE8M0 scale byte per 32 channels -> ``head_dim + head_dim / 32`` bytes (released: 512 + 16 = 528 B);
* compressed KV (KV-source layers): FP4 E2M1, two codes per byte, with one E4M3 scale byte per 16 channels ->
  ``head_dim / 2 + head_dim / 16`` bytes (released: 256 + 32 = 288 B);
* index keys (KV-source layers, ``indexer.wk``): MXFP4, ``index_head_dim / 2 + index_head_dim / 32`` bytes
  (released: 64 + 4 = 68 B).

Growing with context: each KV source adds (compressed record + index-key record) / ratio bytes per token
(released: 3 x 144 + 288 + 3 x 34 + 68 = 890 B/token). Fixed per request:

* window rings: ``num_hidden_layers x (sliding_window + backtracking)`` window records;
* DSpark context windows: ``stages x (sliding_window + backtracking)`` window records;
* compressor tails, ratio > 1 KV sources only: ``ratio - 1 + backtracking`` rows (the ``ratio - 1`` tokens
  pending until the next compressed entry is complete, plus the rollback history, i.e. the ring of
  ``ratio + backtracking - 1`` rows of section 12) of FP32 ``wkv`` + ``wgate`` outputs, ``head_dim`` values
  each. Ratio-1 sources compress every token on its own and keep no tail;
* Engram lookback: the last ``engram_max_ngram_size - 1`` token ids as int64 (one copy serves every Engram layer).
"""

from __future__ import annotations

from typing import Any

from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config

DEFAULT_BACKTRACKING = 6

__all__ = ["DEFAULT_BACKTRACKING", "cache_bytes_per_token", "format_cache_bytes"]


def _records(cfg: DeepseekV41Config) -> dict[str, int]:
    hd, dh = cfg.head_dim, cfg.index_head_dim
    if hd % 32 or dh % 32:
        raise ValueError(f"head_dim {hd} and index_head_dim {dh} must be multiples of 32 for the V4.1 cache records")
    return {
        "window": hd + hd // 32,  # FP8 e4m3 + UE8M0 per 32
        "compressed_kv": hd // 2 + hd // 16,  # FP4 E2M1 + E4M3 per 16
        "index_key": dh // 2 + dh // 32,  # MXFP4: E2M1 + UE8M0 per 32
    }


def cache_bytes_per_token(cfg: DeepseekV41Config, backtracking: int = DEFAULT_BACKTRACKING) -> dict[str, Any]:
    """Record sizes and cache bytes of ``cfg``, per token (growing with context) and per request (fixed).

    Returns a dict:

    * ``record_bytes``: ``{"window", "compressed_kv", "index_key"}`` bytes per stored entry;
    * ``per_token``: rows ``{kind: {"owners": layer ids, "record": bytes, "entries_per_token": float,
      "bytes_per_token": float}}`` for ``compressed_kv_r{ratio}`` and ``index_key_r{ratio}`` (one row per ratio
      that has KV sources);
    * ``per_token_total``: bytes per token of context (released 890);
    * ``per_request``: ``{"window", "dspark_window", "compressor_tail", "engram_lookback"}`` rows
      ``{"rows": how many entries, "record": bytes each, "bytes": total}``;
    * ``per_request_total``, ``backtracking``.
    """
    if backtracking < 0:
        raise ValueError(f"backtracking = {backtracking} must be >= 0")
    rec = _records(cfg)
    per_token: dict[str, dict[str, Any]] = {}
    for kind in ("compressed_kv", "index_key"):
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}, reverse=True)
        for ratio in ratios:
            owners = tuple(s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == ratio)
            entries = len(owners) / ratio
            per_token[f"{kind}_r{ratio}"] = {
                "owners": owners,
                "record": rec[kind],
                "entries_per_token": entries,
                "bytes_per_token": rec[kind] * entries,
            }

    ring = cfg.sliding_window + backtracking
    tail_sources = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1]
    tail_rows = sum(cfg.compress_ratios[s] - 1 + backtracking for s in tail_sources)
    # one FP32 row of head_dim per projection: wkv, plus wgate on gated (ratio > 1) compressors
    tail_record = 4 * cfg.head_dim * 2
    lookback = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
    per_request = {
        "window": {"rows": cfg.num_hidden_layers * ring, "record": rec["window"]},
        "dspark_window": {"rows": cfg.num_nextn_predict_layers * ring, "record": rec["window"]},
        "compressor_tail": {"rows": tail_rows, "record": tail_record, "owners": tuple(tail_sources)},
        "engram_lookback": {"rows": lookback, "record": 8},
    }
    for row in per_request.values():
        row["bytes"] = row["rows"] * row["record"]
    return {
        "backtracking": backtracking,
        "record_bytes": rec,
        "per_token": per_token,
        "per_token_total": sum(r["bytes_per_token"] for r in per_token.values()),
        "per_request": per_request,
        "per_request_total": sum(r["bytes"] for r in per_request.values()),
    }


def _num(x: float) -> str:
    return f"{x:g}" if x != int(x) else f"{int(x):,}"


def format_cache_bytes(d: dict[str, Any]) -> str:
    """A small text table of ``cache_bytes_per_token``'s result."""
    rec = d["record_bytes"]
    lines = [
        f"records: window {rec['window']} B (FP8 + UE8M0/32), compressed KV {rec['compressed_kv']} B "
        f"(FP4 + E4M3/16), index key {rec['index_key']} B (MXFP4)",
        f"{'per token (growing)':<22} {'owners':<16} {'record B':>9} {'entries/tok':>12} {'B/token':>9}",
    ]
    for kind, r in d["per_token"].items():
        owners = ",".join(map(str, r["owners"]))
        lines.append(
            f"{kind:<22} {owners:<16} {r['record']:>9} {_num(r['entries_per_token']):>12} "
            f"{_num(r['bytes_per_token']):>9}"
        )
    lines.append(f"{'total':<22} {'':<16} {'':>9} {'':>12} {_num(d['per_token_total']):>9}")
    lines.append(f"{'per request (fixed)':<22} {'rows':>16} {'record B':>9} {'':>12} {'bytes':>9}")
    for kind, r in d["per_request"].items():
        lines.append(f"{kind:<22} {r['rows']:>16,} {r['record']:>9} {'':>12} {r['bytes']:>9,}")
    lines.append(
        f"{'total':<22} {'':>16} {'':>9} {'':>12} {d['per_request_total']:>9,}  (backtracking {d['backtracking']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m deepinfer_runtime.models.deepseek_v41_cache_bytes CHECKPOINT_DIR_OR_CONFIG [--backtracking N]``"""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="bytes per token by cache kind for a DeepSeek-V4.1 config")
    ap.add_argument("config", help="checkpoint directory or config.json")
    ap.add_argument("--backtracking", type=int, default=6)
    args = ap.parse_args(argv)
    path = Path(args.config)
    cfg = DeepseekV41Config.from_file(path / "config.json" if path.is_dir() else path)
    print(format_cache_bytes(cache_bytes_per_token(cfg, backtracking=args.backtracking)))


if __name__ == "__main__":
    main()
