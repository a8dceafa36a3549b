"""Reference architectures for symacct, importable as ``symacct.models``.

Each model is one readable file with a config dataclass, rebuildable as
``type(model)(model.config)``, and an ``example_inputs(B, S)`` method that
returns the positional inputs of one training step.
"""

from symacct.models.cruncher import Cruncher, CruncherConfig
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.models.llama import Llama, LlamaConfig
from symacct.models.resnet import ResNet, ResNetConfig

__all__ = ["GPT2", "Cruncher", "CruncherConfig", "GPT2Config", "Llama", "LlamaConfig", "ResNet", "ResNetConfig"]
