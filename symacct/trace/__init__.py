"""Stage 1, trace: one training step on fake tensors, recorded op by op (``record``); the probe sizes
that make every traced integer read back as a product of symbols (``probe``); the sizes the model can
run, learned from the trace (``constraints``). Imports nothing above the base modules."""
