"""deepinfer-spec: DSpark speculative decoding, the engine-independent part.

Reading order (decisions section 3):

* ``config``: ``SpeculativeConfig.from_engine_arg`` (vLLM's dict shape + DeepInfer's variables);
* ``protocol``: ``Proposer`` / ``ProposeBatch`` / ``Drafts``, the contract with a proposer;
* ``drafting``: procedure D steps 5-6 (Markov drafts, confidences, the D3 draft sampler);
* ``placeholders``: decision D6, the drafts of the first decode step after prefill;
* ``varlen``: procedure S, confidence-scheduled verification length;
* ``rejection``: procedure V, token-level rejection sampling (default; greedy is its T = 1e-5 case);
* ``block_verify``: vLLM's block verification (opt-in);
* ``stats``: acceptance statistics.

The package does not import the runtime; the runtime drives it.
"""

from .block_verify import block_step_seeds, block_verify
from .config import SpeculativeConfig
from .drafting import confidence, draft_seeds, markov_drafts, sample_draft
from .placeholders import placeholder_drafts
from .protocol import Drafts, ProposeBatch, Proposer
from .rejection import DRAFT_PROB_PENALTY, rejection_verify
from .stats import AcceptanceCounts, SpecStats
from .varlen import CostEstimator, VerifyCostModel, admit, choose_budget, schedule_verify, survivals
from .verify_result import VerifyResult

__version__ = "0.1.0"


def verify(method: str, *args, **kwargs) -> VerifyResult:
    """``rejection_verify`` for method "rejection", ``block_verify`` for "block" (same arguments)."""
    if method == "rejection":
        return rejection_verify(*args, **kwargs)
    if method == "block":
        return block_verify(*args, **kwargs)
    raise ValueError(f"verify: method must be 'rejection' or 'block', got {method!r}")


__all__ = [
    "DRAFT_PROB_PENALTY",
    "AcceptanceCounts",
    "CostEstimator",
    "Drafts",
    "ProposeBatch",
    "Proposer",
    "SpecStats",
    "SpeculativeConfig",
    "VerifyCostModel",
    "VerifyResult",
    "admit",
    "block_step_seeds",
    "block_verify",
    "choose_budget",
    "confidence",
    "draft_seeds",
    "markov_drafts",
    "placeholder_drafts",
    "rejection_verify",
    "sample_draft",
    "schedule_verify",
    "survivals",
    "verify",
]
