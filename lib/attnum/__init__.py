"""attnum: numerical deviation of FlashAttention-style attention kernels.

Modules: ``precision`` (the precision policy), ``reference`` (reference and
golden attention), ``flash`` (tiled forward emulator), ``metrics`` and
``acceptance`` (errors and acceptance rules), ``inputs`` (seeded generators),
``ncio`` (the NetCDF writer and reader), ``plots``, ``runner`` (papermill
runner and sweeps), ``publish`` (the static site), ``studies`` (the
computations behind each notebook).
"""
from .flash import flash_attention
from .precision import PRESETS, PrecisionPolicy, get_policy, policy_for, round_to, unit_roundoff
from .reference import golden_attention, reference_attention

__version__ = "0.1.0"
__all__ = ["PRESETS", "PrecisionPolicy", "flash_attention", "get_policy", "golden_attention",
           "policy_for", "reference_attention", "round_to", "unit_roundoff"]
