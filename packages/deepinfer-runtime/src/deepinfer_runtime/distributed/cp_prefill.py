"""The CP phase of a lockstep step: long prompts prefilled by their owner's CP group, then served by the owner.

For a ``CPJob`` (request of prompt length L, owner rank o), every rank of o's CP group runs prompt tokens
[0, L-1) through ``cp_prefill_v4`` / ``cp_prefill_v41`` on its zigzag share of the positions. The owner's copy of
the request cache lives in its KV pools and in one of its request slots (blocks for all L tokens are taken first,
so the later admission can never un-admit it and drop the state; the slot counts as held from then on, so the
scheduler admits fewer fresh requests); the helpers' copies are throwaway. The owner then hands the request to its
scheduler as a request with L-1 computed tokens, the way a prefix-cache hit starts: its next chunk is the last
prompt token (with YOCO's prompt length L, as single-process chunked prefill would have it), which samples the
first output token. Chunked prefill is bitwise chunking-invariant, so outputs equal the single-process engine's.

Ranks of CP groups without a job this step join the collectives with one empty pass (a CP forward calls every
collective site, EP MoE and sharded Engram, once on each participating rank). If the owner cannot take the
blocks or has no free request slot now, the whole group skips the job (one broadcast decides) and the owner
queues the request for ordinary prefill.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel import zigzag_assignment

from deepinfer_runtime.distributed.messages import CPJob
from deepinfer_runtime.engine.request import Request


def run_cp_phase(st, rank: int, jobs: list[CPJob]) -> tuple[list[Request], bool]:
    """This rank's part of the step's CP jobs (at most one per CP group). Returns (the requests this rank took
    over as owner, whether it ran a CP prefill)."""
    config = st.config
    mine = [j for j in jobs if config.cp_group_of(j.owner) == config.cp_group_of(rank)]
    if not mine:
        st.sites.dummy_pass()
        return [], False
    job = mine[0]
    req, llm = job.request, st.llm
    engine = llm.engine
    is_owner = rank == job.owner
    total = req.num_prompt_tokens
    blocks = engine.scheduler.blocks
    fits = blocks.can_grow([], total) and engine.scheduler.slots_held() < engine.scheduler.config.max_num_seqs
    ok = torch.tensor([1 if (not is_owner or fits) else 0], dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if config.backend == "nccl" else torch.device("cpu")
    ok = ok.to(device)
    dist.broadcast(ok, src=job.owner, group=st.cp_group)
    if not int(ok):
        st.sites.dummy_pass()
        if is_owner:
            engine.add_request(req)
        return ([req] if is_owner else []), False
    model = llm.model
    if is_owner:
        blocks.grow(req.block_ids, total)
        cache = engine.runner.new_cache(req)
    else:
        cache = model.new_cache()
    n = total - 1
    cp_size = config.context_parallel_size
    assignment = zigzag_assignment(n, cp_size)
    owned = [assignment.positions(q) for q in range(cp_size)]
    ids = torch.tensor(req.prompt_token_ids[:n], dtype=torch.long)
    cp_rank = rank - config.cp_ranks(config.cp_group_of(rank))[0]
    if hasattr(model, "engram_ids"):  # V4.1
        from deepinfer_runtime.distributed.cp_v41 import cp_prefill_v41

        cp_prefill_v41(model, ids, cache, owned, cp_rank, st.cp_group, prompt_len=total)
    else:
        from deepinfer_runtime.distributed.cp_v4 import cp_prefill_v4

        cp_prefill_v4(model, ids, cache, owned, cp_rank, st.cp_group)
    if not is_owner:
        return [], True
    req.cache, req.num_computed_tokens = cache, n
    engine.add_request(req)
    return [req], True
