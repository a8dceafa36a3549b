"""Stage 3, memory: static bytes and saved activations (``static``); storage lifetimes, the phase points
and the peak, factored by L (``liveness``); the CUDA caching allocator (``allocator``) and the reserved
bytes it gives the step's timeline (``reserved``). Reads traces and the layer stack."""
