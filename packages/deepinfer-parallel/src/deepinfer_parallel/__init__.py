"""deepinfer-parallel: expert parallel (dispatch/combine, EPLB), attention data parallel and balanced
context parallel over torch.distributed. Nothing is implemented yet (see the README status table)."""

__version__ = "0.1.0"
