"""Many GPUs: a parallel layout (``layout``), PyTorch's pipeline schedules (``schedule``), per-rank memory,
communication and step time (``rank``), and the planner (``plan``)."""
