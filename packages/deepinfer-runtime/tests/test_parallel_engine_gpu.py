"""The multi-process engine on two GPUs with NCCL: greedy outputs of DP + EP + CP (+ live EPLB) equal the
single-process engine's, in bf16 with batch-invariant kernels (a request's bits must not depend on which rank's
batch it shares). Skipped without 2 CUDA devices."""

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

LENGTHS = [5, 17, 80, 1, 40, 64, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# an explicit KV budget: the reference engine in this process must not take the memory rank 0 needs
OPTS = dict(
    device="cuda",
    dtype="bfloat16",
    batch_invariant=True,
    kv_cache_memory=1 << 30,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    log_stats=False,
)


@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_nccl_dp_ep_cp_eplb_equals_single_process(arch, tmp_path):
    path = write_tiny_checkpoint(tmp_path / arch, arch, "fp8+fp4" if arch == "v4.1" else "none", seed=5)
    kw = dict(yoco_keep_tokens=22) if arch == "v4.1" else {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 129000, (n,), generator=g).tolist() for n in LENGTHS]
    single = LLM(model=path, **OPTS, **kw)
    ref = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    del single
    torch.cuda.empty_cache()
    llm = LLM(
        model=path,
        data_parallel_size=2,
        context_parallel_size=2,
        context_parallel_min_tokens=50,
        enable_eplb=True,
        eplb_window_size=4,
        eplb_step_interval=3,
        **OPTS,
        **kw,
    )
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    print(
        f"\n{arch}: single {ref}\n{arch}: nccl   {outs}\n{arch}: cp prefills {llm.engine.cp_prefills}, "
        f"EPLB rearrangements {llm.engine.eplb_rearrangements} ({llm.engine.eplb_moved_slots} slots moved)"
    )
    assert llm.engine.cp_prefills == 2 and llm.engine.eplb_rearrangements >= 1
    assert outs == ref
