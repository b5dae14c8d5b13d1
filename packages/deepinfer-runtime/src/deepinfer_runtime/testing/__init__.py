"""Test helpers shipped with the runtime: tiny checkpoints in the real names, formats and tokenizer."""
