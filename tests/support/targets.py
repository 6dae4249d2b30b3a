"""Targets for tests: folder configs as transformers 4.x and 5.x spell them, and a scripted target with
a small vocabulary (`small_vocab_setup`, `ScriptedTarget`) scored over an in-memory val split."""

import json

import torch

from dflash_pipeline.data.shards import Sample
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.target.load import TargetHead

# tokenizer_class values that transformers 4.57's AutoTokenizer resolves to a fast tokenizer built
# from tokenizer.json: "PreTrainedTokenizerFast" (its tokenizer_class_from_name returns that class
# by name) and the GPT2 classes (listed in its TOKENIZER_MAPPING_NAMES; the hub's SmolLM2 names
# GPT2Tokenizer). 5.x's "TokenizersBackend" is not one: 4.57.1 raises "Tokenizer class
# TokenizersBackend does not exist or is not currently imported".
TOKENIZER_CLASSES_4X_KNOWS = ("PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast")

def config_as_5x_reads_it(config: dict, folder):
    """`config` as transformers 5 loads it (from `folder`/config.json), minus where it was loaded from."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(folder).to_dict()
    loaded.pop("_name_or_path", None)
    return loaded


def small_vocab_setup(seed=0, vocab=3, block_size=4, **config_overrides):
    """A drafter over a 3-token vocabulary (labels use two): random guesses hit often enough that
    correct slots, taus and tree streaks all take many values."""
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=vocab, block_size=block_size, target_layer_ids=(1, 2), num_target_layers=4,
                           mask_token_id=vocab - 1, **config_overrides)
    drafter = DFlashDrafter(config).eval()
    head = TargetHead(torch.randn(vocab, 32), torch.randn(vocab, 32))
    generator = torch.Generator().manual_seed(seed + 1)
    samples = []
    for index in range(7):
        length = int(torch.randint(12, 40, (1,), generator=generator))
        prompt = int(torch.randint(3, 8, (1,), generator=generator))
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[prompt:] = 1
        samples.append(Sample(sequence_id=f"s{index}", input_ids=torch.randint(0, vocab - 1, (length,), generator=generator, dtype=torch.int32),
                              loss_mask=mask, target_next=torch.zeros(length, dtype=torch.int32),
                              features=torch.randn(length, 64, generator=generator).to(torch.bfloat16)))
    return drafter, head, InMemorySplit(samples)

class ScriptedTarget(torch.nn.Module):
    """A stand-in target whose greedy token after position p is script[p], whatever the context:
    unlike the tiny random target (which repeats one token), its text never repeats."""

    def __init__(self, script: list[int], feature_width: int):
        from transformers import LlamaConfig

        super().__init__()
        self.device_marker = torch.nn.Parameter(torch.zeros(1))
        self.config = LlamaConfig(vocab_size=max(script) + 1, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
        self.script, self.feature_width, self.features = script, feature_width, None

    def forward(self, input_ids, position_ids=None, cache=None, use_cache=True, logits_to_keep=0, attention_mask=None):
        from types import SimpleNamespace

        positions = (position_ids if position_ids is not None else torch.arange(input_ids.shape[1])[None])[0].tolist()
        logits = torch.zeros(1, len(positions), self.config.vocab_size)
        for row, position in enumerate(positions):
            logits[0, row, self.script[position]] = 1.0
        self.features = torch.randn(1, len(positions), self.feature_width)
        if cache is not None and use_cache:  # a real KV cache entry per position, so cropping and keep_path act on it
            entries = torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1)
            cache.update(entries, entries.clone(), 0)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


class InMemorySplit:
    """A stand-in for a shard folder: the scorer only needs len, [i] and lengths()."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]

    def lengths(self):
        return [s.input_ids.shape[0] for s in self.samples]
