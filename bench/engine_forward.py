"""The static step's forward: transformers' own layers against hand-written Llama layers, side by side.

    python bench/engine_forward.py [--target data/target/target.json] [--batches 1,64] [--steps 48]
                                   [--rounds 3] [--json bench/results/engine_forward_cpu.json]

Issue #36 asked which forward the one decoding engine should run: transformers' own decoder
forward (what `decoding/static_decoder.py` does: our column-addressed static cache handed to the
model's layers, a 4-D mask, position ids), which serves every layout transformers maintains, or
small per-layout adapters that call the layers' submodules themselves (what the step did before,
for Llama only; kept here as `HandWrittenLlama`, the measured alternative). Both decode the same
left-padded batch of val prompts greedily over the same static cache shapes; each round runs them
back to back, alternating which goes first. Printed per batch size: ms per decode step of each,
their ratio, and whether their tokens are identical. Llama targets only (the alternative's reach).
"""

import json
import os
import sys
import time
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def hand_written_llama(StaticDecoder):
    """The alternative: the Llama layer loop written out (norms, projections, rotate-half RoPE,
    grouped SDPA over the static cache, MLP), subclassing the engine's decoder for everything else."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    class HandWrittenLlama(StaticDecoder):
        def _attention(self, index, attention, hidden, cos, sin, columns, visible):
            batch, steps = hidden.shape[:2]
            shape = (batch, steps, -1, self.head_dim)
            query = attention.q_proj(hidden).view(shape).transpose(1, 2)
            key = attention.k_proj(hidden).view(shape).transpose(1, 2)
            value = attention.v_proj(hidden).view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            self.keys[index].index_copy_(2, columns, key)
            self.values[index].index_copy_(2, columns, value)
            out = F.scaled_dot_product_attention(query, self.keys[index], self.values[index], attn_mask=visible[:, None],
                                                 scale=attention.scaling, enable_gqa=True)
            return attention.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))

        def forward(self, input_ids, positions, columns, visible):
            decoder = self.decoder
            hidden = decoder.embed_tokens(input_ids)
            cos, sin = decoder.rotary_emb(hidden, positions)
            with torch.no_grad():
                for index, layer in enumerate(decoder.layers):
                    hidden = hidden + self._attention(index, layer.self_attn, layer.input_layernorm(hidden), cos, sin, columns, visible)
                    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                return decoder.norm(hidden)

    return HandWrittenLlama


@click.command()
@click.option("--target", "target_json", type=click.Path(exists=True, path_type=Path), default=Path("data/target/target.json"), show_default=True)
@click.option("--generated", type=click.Path(exists=True, path_type=Path), default=Path("data/generated/val.parquet"), show_default=True)
@click.option("--batches", default="1,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--steps", default=48, show_default=True, help="Decode steps per run.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(target_json, generated, batches, steps, rounds, json_path):
    import pandas as pd
    import torch

    from dflash_pipeline.decoding.static_decoder import StaticDecoder
    from dflash_pipeline.foundation.devices import machine_description
    from dflash_pipeline.generate.run import left_padded
    from dflash_pipeline.target.load import TargetInfo, load_target

    target = TargetInfo.from_json(target_json)
    model, tokenizer = load_target(target, device="cpu")
    if model.config.model_type != "llama":
        raise click.ClickException(f"{target_json}: the hand-written alternative covers Llama only, this target is '{model.config.model_type}'")
    HandWritten = hand_written_llama(StaticDecoder)
    rows = pd.read_parquet(generated)
    column = "prompt_ids" if "prompt_ids" in rows.columns else "input_ids"
    prompts = [list(map(int, ids))[:256] for ids in rows[column].head(max(int(b) for b in batches.split(",")))]

    def decode(kind, batch: int):
        ids, valid = left_padded(prompts[:batch], tokenizer.pad_token_id or 0)
        decoder = kind(model, batch=batch, length=ids.shape[1] + steps + 1, trim=False)  # both over the whole length: the forwards alone compared
        tokens = [decoder.prefill(ids, valid).argmax(-1)]
        began = time.perf_counter()
        for _ in range(steps):
            tokens.append(decoder.step(tokens[-1]).argmax(-1))
        return (time.perf_counter() - began) / steps, torch.stack(tokens, 1)

    figures = {}
    for batch in (int(b) for b in batches.split(",")):
        decode(StaticDecoder, batch), decode(HandWritten, batch)  # warm-up
        seconds = {"transformers": [], "hand_written": []}
        identical = True
        for round_number in range(rounds):
            order = [("transformers", StaticDecoder), ("hand_written", HandWritten)]
            if round_number % 2:
                order.reverse()
            outputs = {}
            for name, kind in order:
                step, outputs[name] = decode(kind, batch)
                seconds[name].append(step)
            identical &= torch.equal(outputs["transformers"], outputs["hand_written"])
        ms = {name: 1000 * sorted(values)[len(values) // 2] for name, values in seconds.items()}
        figures[batch] = {"transformers_ms_per_step": round(ms["transformers"], 3), "hand_written_ms_per_step": round(ms["hand_written"], 3),
                          "transformers_over_hand_written": round(ms["transformers"] / ms["hand_written"], 4), "identical_tokens": identical}
        print(f"batch {batch}: {json.dumps(figures[batch])}", flush=True)
    result = {"machine": machine_description(), "torch_threads": torch.get_num_threads(), "target": f"{target.architecture} ({target.num_layers} layers)", "steps": steps,
              "rounds": rounds, "batches": figures}
    print(f"\n{result['target']} on {result['machine']}, torch threads {torch.get_num_threads()}, {steps} steps, median of {rounds} rounds")
    print(f"{'batch':>5s} {'transformers ms':>15s} {'hand-written ms':>15s} {'ratio':>7s}  identical")
    for batch, row in figures.items():
        print(f"{batch:5d} {row['transformers_ms_per_step']:15.2f} {row['hand_written_ms_per_step']:15.2f} "
              f"{row['transformers_over_hand_written']:7.3f}  {row['identical_tokens']}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
