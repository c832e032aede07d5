"""The served model: a Llama-shaped config for `--load-format dummy` (random weights, no
download) and a word-level tokenizer built offline with the `tokenizers` library.

The tokenizer maps the words `w3`, `w4`, ... to their ids and back, one word per token, so
text round-trips exactly through it: prompts built from token ids, the engine's answers and
the benchmark's history all keep their token ids.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

#: The default shape: a 512-hidden, 8-layer Llama (bf16 KV: 16 KiB per token, 2 MiB per
#: 128-token block).
DEFAULT_SHAPE: Dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}

#: Token ids below this are special (unk, bos, eos); words are `w<id>` above.
FIRST_WORD = 3


def config(shape: Dict[str, Any]) -> Dict[str, Any]:
    """A Llama config.json of the given shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }


def kv_bytes_per_token(shape: Dict[str, Any]) -> int:
    """KV cache bytes per token of the model (K and V of every layer)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    elem = 4 if shape["torch_dtype"] == "float32" else 2
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * elem


def write(directory: str, shape: Dict[str, Any] = DEFAULT_SHAPE) -> str:
    """Writes config.json and the tokenizer's files into `directory` (made if missing) and
    returns it. Needs the `tokenizers` package (a dependency of vLLM and transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config(shape), f, indent=1)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": shape["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=1,
        )
    return directory


def text(ids) -> str:
    """The text of token ids under this tokenizer."""
    return " ".join(f"w{i}" for i in ids)
