"""Exploratory Sampling (ESamp): an online Distiller steers n samples toward novel tokens.

The package never imports textual; the dashboard lives in ``esamp_tui``.
"""

from esamp.core.config import EsampConfig, Filters, SamplingConfig, Steering
from esamp.errors import EsampError

__all__ = ["EsampConfig", "Filters", "SamplingConfig", "Steering", "EsampError", "__version__"]
__version__ = "0.1.0"
