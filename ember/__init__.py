"""Ember: disaggregated LLM serving core (engine, model, KV blocks)."""
import os

# Several Ember processes share a few cores. Busy-waiting OpenMP threads make a
# 2-thread decode 4-25x slower while another process computes, so wait passively
# unless the operator chose otherwise. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
