"""Tiny static-cache layouts and target logits for the decoding tests."""

import torch


def tiny_layout(kind: str, attention: str = "sdpa"):
    """A 4-layer random causal LM of one layout, vocabulary 1,024, built in memory."""
    import transformers

    base = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**base),
        "llama-rope-scaling-bias": lambda: transformers.LlamaConfig(**base, attention_bias=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}),
        "qwen3": lambda: transformers.Qwen3Config(**base),
        "qwen2-sliding": lambda: transformers.Qwen2Config(**base, use_sliding_window=True, sliding_window=12, max_window_layers=2),
        "mistral-sliding": lambda: transformers.MistralConfig(**base, sliding_window=12),
        "gemma3": lambda: transformers.Gemma3TextConfig(**base, sliding_window=12, final_logit_softcapping=30.0),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[kind](), dtype=torch.float32, attn_implementation=attention).eval()


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]

def prefilled(model, prompt: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return cache
