"""Model zoo: plain-PyTorch GPT / Llama / BERT / MLP / GShard MoE, Hugging Face models (tiny
presets, or any config.json through transformers' Auto classes), user factories.

``get_model(name)`` returns ``(model, example_inputs)`` with ``model(*example_inputs)`` a scalar
loss, built on the meta device unless asked otherwise. The Hugging Face models import
transformers only when built.
"""
from autoshard.zoo.models import (MLP, GPT, Bert, BertConfig, GPTConfig, Llama, LlamaConfig,
                                  MLPConfig, RMSNorm, count_parameters)
from autoshard.zoo.hf import from_config
from autoshard.zoo.moe import GShardMoE, MoEConfig
from autoshard.zoo.registry import ZOO, ZooEntry, get_model, load_config, load_factory, load_model

__all__ = ["ZOO", "ZooEntry", "get_model", "load_config", "load_factory", "load_model",
           "from_config", "MLP", "MLPConfig", "GPT", "GPTConfig",
           "Llama", "LlamaConfig", "Bert", "BertConfig", "GShardMoE", "MoEConfig", "RMSNorm",
           "count_parameters"]
