"""Stage 3, memory: static bytes and saved activations (``static``); storage lifetimes, the phase points
and the peak, factored by L (``liveness``). Reads traces and the layer stack."""
