"""Stage 2, cost: a FLOP and byte rule per aten op (``rules``), the layer stack (``layers``: which
ModuleList repeats L times, the block of an op, the factoring), every op costed into a networkx graph of
frozen records (``graph``), a mixture of experts' routed pairs (``experts``). Reads traces; knows nothing
of memory, time or reports."""
