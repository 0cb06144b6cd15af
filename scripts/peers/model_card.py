"""Write a Hugging Face style model folder (config.json, tokenizer.json, tokenizer_config.json,
generation_config.json) for a Llama-family GGUF file, so that a peer that loads models the
Hugging Face way (NVIDIA Dynamo's frontend) tokenizes exactly as Flotilla does.

usage: python model_card.py MODEL.gguf OUT_DIR     (needs the `gguf` and `tokenizers` packages)
"""
import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # GGUF token type of special (control) tokens


def main(gguf_path: str, out: str) -> None:
    fields = GGUFReader(gguf_path).fields
    get = lambda key: fields[key].contents()  # noqa: E731
    tokens = get("tokenizer.ggml.tokens")
    kinds = get("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     unk_token=None, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    # SmolLM2 (GPT-2 style byte-level BPE, digits split one by one).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, k in enumerate(kinds) if k == CONTROL])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "bos_token": tokens[bos],
                   "eos_token": tokens[eos], "pad_token": tokens[eos], "unk_token": tokens[0],
                   "add_bos_token": False, "add_prefix_space": False,
                   "model_max_length": 8192, "chat_template": get("tokenizer.chat_template"),
                   "clean_up_tokenization_spaces": False}, f, indent=1)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": get("llama.embedding_length"),
        "intermediate_size": get("llama.feed_forward_length"),
        "num_hidden_layers": get("llama.block_count"),
        "num_attention_heads": get("llama.attention.head_count"),
        "num_key_value_heads": get("llama.attention.head_count_kv"),
        "head_dim": get("llama.rope.dimension_count"),
        "max_position_embeddings": get("llama.context_length"),
        "rms_norm_eps": get("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": get("llama.rope.freq_base"), "vocab_size": get("llama.vocab_size"),
        "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": get("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f)
    ids = Tokenizer.from_file(os.path.join(out, "tokenizer.json")).encode("Hello world, 12345!").ids
    print(f"wrote {out}: {len(tokens)} tokens; 'Hello world, 12345!' -> {ids}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
