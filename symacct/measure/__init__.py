"""Measurement, above derive: PyTorch's own counts on a real step (``run``), predicted against measured
(``verify``), resource logs (``track``), random models checked against real runs (``fuzz``)."""
