"""``SpeculativeConfig``: which proposer, how many drafts, how they are verified and scheduled.

Built once by the engine from its ``speculative_config`` argument (vLLM's dict shape) and DeepInfer's
environment variables; the engine argument wins field by field, the environment fills the rest:

========================================  =====================================  ==============
field                                     environment variable                   default
========================================  =====================================  ==============
``num_speculative_tokens`` (1..32)        ``DEEPINFER_USE_NEXTN_DECODE`` (0=off) 5
``varlen`` (procedure S)                  ``DEEPINFER_ENABLE_MTP_VARLEN``        off
``confidence_temperatures`` (decision D2) ``DEEPINFER_DFLASH_CONFIDENCE_HEAD_``  (1.0,)
                                          ``TEMPERATURE`` (one value or N, comma-separated)
========================================  =====================================  ==============

Engine-argument keys: ``method`` ("dspark" | "mtp" | "ngram"), ``num_speculative_tokens``, ``verification``
("rejection" | "block"; vLLM's ``rejection_sample_method`` "standard" | "block" is accepted as an
alias), ``varlen`` (vLLM alias ``enable_adaptive_verification``), ``verify_budget`` (cap on verify rows
per step, None: the largest profiled decode graph), ``confidence_temperature`` (float or list), and
``model`` (must be None: the proposer lives in the target checkpoint), and for "ngram" (vLLM's prompt
lookup) ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram lengths, default 1 / 4). Unknown keys and bad
values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from deepinfer_kernels.ops.sampling import SAMPLING_EPS

ENV_NUM_TOKENS = "DEEPINFER_USE_NEXTN_DECODE"
ENV_VARLEN = "DEEPINFER_ENABLE_MTP_VARLEN"
ENV_CONF_TEMP = "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"

DEFAULT_NUM_SPECULATIVE_TOKENS = 5  # DI's DEEPINFER_USE_NEXTN_DECODE default (spec 8.5)
MAX_NUM_SPECULATIVE_TOKENS = 32
METHODS = ("dspark", "mtp", "ngram")
VERIFICATIONS = ("rejection", "block")
_VLLM_VERIFICATION = {"standard": "rejection", "rejection": "rejection", "block": "block"}
_KEYS = (
    "method",
    "num_speculative_tokens",
    "verification",
    "rejection_sample_method",
    "varlen",
    "enable_adaptive_verification",
    "verify_budget",
    "confidence_temperature",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (validated on construction).

    Attributes:
        method: "dspark" (the V4.1 DSpark head, or V4-Flash-0731's), "mtp" (V4-Flash's MTP layer) or
            "ngram" (prompt lookup: drafts copied from the sequence itself; any model).
        num_speculative_tokens: N, the most drafts proposed per request and step, 1..32.
        verification: "rejection" (procedure V, the default, DeepInfer-compatible) or "block"
            (vLLM's block verification, opt-in; decision D4).
        varlen: confidence-scheduled verification length (procedure S). It makes a request's verify
            length depend on the batch, so results are not deterministic with it on (decision B2).
        verify_budget: the most verify rows (anchors + drafts) per step for procedure S; None = no cap
            beyond the largest profiled decode graph.
        confidence_temperatures: T_k of the confidence head (decision D2), one value for every
            position or one per position, each floored at 1e-5.
    """

    method: str = "dspark"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    verification: str = "rejection"
    varlen: bool = False
    verify_budget: int | None = None
    confidence_temperatures: tuple[float, ...] = (1.0,)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an int in [1, {MAX_NUM_SPECULATIVE_TOKENS}], "
                f"got {n!r}"
            )
        if self.verification not in VERIFICATIONS:
            raise ValueError(
                f"speculative_config.verification must be one of {VERIFICATIONS}, got {self.verification!r}"
            )
        if not isinstance(self.varlen, bool):
            raise ValueError(f"speculative_config.varlen must be a bool, got {self.varlen!r}")
        b = self.verify_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config.verify_budget must be None or an int >= 1, got {b!r}")
        temps = self.confidence_temperatures
        if not isinstance(temps, tuple) or len(temps) not in (1, n):
            raise ValueError(
                f"speculative_config.confidence_temperature must hold 1 or num_speculative_tokens = {n} values, "
                f"got {temps!r}"
            )
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
                raise ValueError(
                    f"speculative_config.confidence_temperature values must be finite and >= 0, got {temps!r}"
                )
        # Decision D2: each temperature is floored at 1e-5.
        object.__setattr__(self, "confidence_temperatures", tuple(max(float(t), SAMPLING_EPS) for t in temps))

    @property
    def deterministic(self) -> bool:
        """True when verification lengths do not depend on the batch (varlen off; decision B2)."""
        return not self.varlen

    def confidence_temperature(self, k: int) -> float:
        """T_k for draft k (0-based): the single value, or the k-th of N."""
        if not 0 <= k < self.num_speculative_tokens:
            raise ValueError(f"draft index {k} outside [0, {self.num_speculative_tokens})")
        temps = self.confidence_temperatures
        return temps[0] if len(temps) == 1 else temps[k]

    @classmethod
    def from_engine_arg(
        cls, arg: Mapping[str, object] | None, env: Mapping[str, str] | None = None
    ) -> SpeculativeConfig | None:
        """The config from the engine argument and the environment, or None when speculation is off.

        Speculation is on when ``arg`` is a dict, or when ``arg`` is None and
        ``DEEPINFER_USE_NEXTN_DECODE`` is set to a positive value (then method "dspark"). It is off
        when ``arg`` is None and the variable is unset or 0.

        Args:
            arg: vLLM-shaped ``{"method": "dspark", "num_speculative_tokens": 5, ...}`` or None.
            env: the environment to read (default ``os.environ``).
        """
        env = os.environ if env is None else env
        env_n = _env_int(env, ENV_NUM_TOKENS)
        if arg is None:
            if env_n is None or env_n == 0:
                return None
            arg = {}
        if not isinstance(arg, Mapping):
            raise ValueError(f"speculative_config must be a dict or None, got {type(arg).__name__}")
        unknown = [k for k in arg if k not in _KEYS]
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known keys are {list(_KEYS)}")
        if arg.get("model") is not None:
            raise ValueError(
                "speculative_config.model must be None: the DSpark / MTP proposer is read from the target checkpoint"
            )
        if "verification" in arg and "rejection_sample_method" in arg:
            raise ValueError("speculative_config: give only one of verification and rejection_sample_method")
        if "varlen" in arg and "enable_adaptive_verification" in arg:
            raise ValueError("speculative_config: give only one of varlen and enable_adaptive_verification")

        n = arg.get("num_speculative_tokens", env_n if env_n else DEFAULT_NUM_SPECULATIVE_TOKENS)
        verification = arg.get("verification", "rejection")
        if "rejection_sample_method" in arg:
            raw = arg["rejection_sample_method"]
            if raw not in _VLLM_VERIFICATION:
                raise ValueError(
                    f"speculative_config.rejection_sample_method must be one of {list(_VLLM_VERIFICATION)}, got {raw!r}"
                )
            verification = _VLLM_VERIFICATION[raw]
        varlen = arg.get("varlen", arg.get("enable_adaptive_verification"))
        if varlen is None:
            varlen = _env_bool(env, ENV_VARLEN)
        temps = arg.get("confidence_temperature")
        if temps is None:
            temps = _env_floats(env, ENV_CONF_TEMP)
        elif isinstance(temps, (int, float)) and not isinstance(temps, bool):
            temps = (temps,)
        elif isinstance(temps, (list, tuple)):
            temps = tuple(temps)
        else:
            raise ValueError(f"speculative_config.confidence_temperature must be a float or a list, got {temps!r}")
        return cls(
            method=arg.get("method", "dspark"),
            num_speculative_tokens=n,
            verification=verification,
            varlen=varlen,
            verify_budget=arg.get("verify_budget"),
            confidence_temperatures=temps,
            prompt_lookup_min=arg.get("prompt_lookup_min", 1),
            prompt_lookup_max=arg.get("prompt_lookup_max", max(4, arg.get("prompt_lookup_min", 1))),
        )

    def with_overrides(self, **fields: object) -> SpeculativeConfig:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **fields)


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not 0 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"{name} must lie in [0, {MAX_NUM_SPECULATIVE_TOKENS}], got {value}")
    return value


def _env_bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "0").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


def _env_floats(env: Mapping[str, str], name: str) -> tuple[float, ...]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return (1.0,)
    try:
        return tuple(float(part) for part in raw.split(","))
    except ValueError:
        raise ValueError(f"{name} must be one float or comma-separated floats, got {raw!r}") from None
