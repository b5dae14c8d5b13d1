"""The offline engine core, in reading order:
request -> kv_cache -> prefix_cache -> scheduler -> model_runner -> llm_engine.

Components exchange typed records: the scheduler produces a ``StepPlan``, the runner returns a
``StepResult``; the model receives explicit per-request caches, never globals.
"""
