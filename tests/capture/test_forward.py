"""capture/forward.py: a padded batch's features, greedy next tokens and top-k log-probabilities
equal those of a plain forward of each sequence alone (the GPU path's contract: test_gpu_contract.py)."""

import torch

from dflash_pipeline.capture.forward import forward_batch
from dflash_pipeline.capture.plan import Sequence
from dflash_pipeline.target.load import LayerTap, load_target


def test_batched_capture_equals_one_sequence_forwards(tiny_llama_target):
    model, _ = load_target(tiny_llama_target)
    generator = torch.Generator().manual_seed(1)
    batch = [Sequence(f"s{i}", torch.randint(3, 49152, (n,), generator=generator).tolist(), [0] * 3 + [1] * (n - 3))
             for i, n in enumerate([17, 9, 12])]
    layer_ids = [1, 3]
    tap = LayerTap(model, layer_ids)
    batched = forward_batch(model, tap, batch, pad_id=2, top_k=5, logits_chunk=7)
    for sequence, captured in zip(batch, batched):
        with torch.inference_mode():
            out = model(torch.tensor([sequence.input_ids]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(captured.features, expected, rtol=1e-5, atol=1e-5)
        assert captured.target_next.tolist() == out.logits[0].argmax(-1).tolist()
        # The top-5: the full-vocabulary log-softmax's five largest, in order, per position.
        log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
        assert captured.topk_ids.shape == captured.topk_logprobs.shape == (len(sequence.input_ids), 5)
        torch.testing.assert_close(captured.topk_logprobs, log_probs.gather(1, captured.topk_ids.long()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured.topk_logprobs, log_probs.topk(5, dim=-1).values, rtol=1e-5, atol=1e-5)
        assert captured.topk_ids[:, 0].tolist() == captured.target_next.tolist()
    tap.remove()
