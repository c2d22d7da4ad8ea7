"""nbtorch: nanoBragg as differentiable PyTorch.

Public API::

    config_from_args(argv) -> SimulationConfig     # nanoBragg command-line flags
    Simulator(config, dtype=, device=)             # nn.Module; forward(**overrides) -> image
    SimulationConfig, InputError, PARAMETER_NAMES
    eager()                                        # context: no torch.compile inside (gradcheck-safe)

The rest lives in rooms by job (docs/architecture.md): ``geometry``, ``sampling``, ``rules``, ``runtime``, ``cli``,
``dials``, ``physics``, ``io`` and ``tools``.
"""

from nbtorch.cli.args import config_from_args
from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.runtime.policy import eager
from nbtorch.parameters import PARAMETER_NAMES
from nbtorch.simulator import Simulator

__all__ = ["config_from_args", "SimulationConfig", "InputError", "PARAMETER_NAMES", "Simulator", "eager"]
__version__ = "0.1.0"
