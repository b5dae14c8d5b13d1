"""deepinfer-spec: DSpark speculative decoding (block drafts, confidence-scheduled verification,
lossless rejection sampling). Nothing is implemented yet (see the README status table)."""

__version__ = "0.1.0"
