"""Ember: disaggregated LLM serving core (engine, model, KV blocks)."""
import os

# Several Ember processes share a few cores. Busy-waiting OpenMP threads make a
# 2-thread decode 4-25x slower while another process computes (two q4 decoders side by
# side: 3.6 tok/s each spinning, 39 passive), so wait passively unless the operator chose
# otherwise. A process alone on its cores decodes ~1.6x faster with libgomp's default
# brief spin: EMBER_OMP_PASSIVE=0 keeps that default. Must be set before torch is imported.
if os.environ.get("EMBER_OMP_PASSIVE", "1") != "0":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
