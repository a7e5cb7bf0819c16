"""Exploratory Sampling (ESamp): an online Distiller steers n samples toward novel tokens.

The package never imports textual; the dashboard lives in ``esamp_tui``.
"""

from esamp.config import EsampConfig, SamplingConfig
from esamp.errors import EsampError

__all__ = ["EsampConfig", "SamplingConfig", "EsampError", "__version__"]
__version__ = "0.1.0"
