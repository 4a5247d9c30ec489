"""Model zoo: plain-PyTorch GPT / Llama / BERT / MLP, tiny Hugging Face models, user factories.

``get_model(name)`` returns ``(model, example_inputs)`` with ``model(*example_inputs)`` a scalar
loss, built on the meta device unless asked otherwise. The Hugging Face models import
transformers only when built.
"""
from autoshard.zoo.models import (MLP, GPT, Bert, BertConfig, GPTConfig, Llama, LlamaConfig,
                                  MLPConfig, RMSNorm, count_parameters)
from autoshard.zoo.registry import ZOO, ZooEntry, get_model, load_factory

__all__ = ["ZOO", "ZooEntry", "get_model", "load_factory", "MLP", "MLPConfig", "GPT", "GPTConfig",
           "Llama", "LlamaConfig", "Bert", "BertConfig", "RMSNorm", "count_parameters"]
