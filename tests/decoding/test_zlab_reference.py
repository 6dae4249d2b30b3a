"""Our sampled speculative decoding against z-lab's reference decoder (`dflash_generate` of the
registry's dflash==0.1.0), with the same exported drafter on the same small target at T = 1, for
a DFlash drafter and a DFlash2 drafter (whose candidate selector samples a path and yields q over
its K candidates).

Both use speculative sampling (the drafter samples each slot from q, accept with p/q, resample a
rejection from the residual), so over many seeds they must agree in distribution: the second and
third answer tokens (where the drafter's slots decide) follow the target's own exact marginals in
both, by a chi-square test, and the first step's acceptance length has the same mean.
"""

import pytest
import torch
from support.drafters import random_drafter

from dflash_pipeline.decoding.session import Speculation, speculative_decode
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.serving import export_drafter
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.target.load import TargetHead

pytestmark = pytest.mark.slow  # minutes: thousands of sampled decodes against z-lab's reference (test lanes, pyproject.toml)

VOCAB, RUNS, NEW_TOKENS = 32, 400, 5  # 5 new tokens: the first block is drafted whole (B - 1 = 3 slots) in both


@pytest.fixture(scope="module")
def small_target():
    """A 4-layer Llama over 32 tokens whose head is peaked enough that a random drafter is accepted
    sometimes, not always (near-uniform p and q would accept almost everything)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=256)).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.1)
    return model


def exact_marginals(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p(answer token 2) and p(answer token 3) at T = 1, summed over every earlier answer."""
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]: (t1, t2)
        ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
        probs = torch.softmax(model(input_ids=ids).logits[:, -3:], -1)  # after the prompt, after t1, after t2
    joint12 = first[pairs[:, 0]] * probs[:, 1].gather(1, pairs[:, 1:2])[:, 0]  # p(t1, t2)
    second = joint12.view(VOCAB, VOCAB).sum(0)
    third = (joint12[:, None] * probs[:, 2]).sum(0)
    return second, third


def goodness_of_fit(samples: list[int], probs: torch.Tensor) -> float:
    """Chi-square p-value of samples against probs, cells of expected count < 5 pooled into one."""
    observed = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    degrees = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))


ARCHITECTURES = {"dflash": {}, "dflash2": dict(architecture="dflash2", options=dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                                                                                   selector_top_k=8))}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_our_speculative_sampling_matches_the_reference_decoder_in_distribution(tmp_path, small_target, zlab_draft_model_class,
                                                                                 monkeypatch, architecture):
    import dflash.model as reference_module

    model = small_target
    drafter = random_drafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, vocab_size=VOCAB, block_size=4, target_layer_ids=(1, 3), num_target_layers=4,
                                           mask_token_id=VOCAB - 1, **ARCHITECTURES[architecture]))
    if architecture == "dflash2":
        from support.drafters import randomize

        randomize(drafter, seed=1)  # a selector that walks its own way, not each slot's argmax ...
        with torch.no_grad():  # ... but not so sharply that it is never accepted
            for weight in drafter.candidate_selector.parameters():
                weight.mul_(0.4)
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    reference_class = reference_module.DFlash2DraftModel if architecture == "dflash2" else zlab_draft_model_class
    reference = reference_class.from_pretrained(export_drafter(drafter, tmp_path / "drafter"), dtype=torch.float32).eval()
    monkeypatch.setattr(reference_module, "_cuda_time", __import__("time").perf_counter)  # its stats path times with CUDA syncs
    prompt = [3, 17, 5, 9, 22, 11]

    ours, theirs = {"second": [], "third": [], "first_step": []}, {"second": [], "third": [], "first_step": []}
    speculation = Speculation(drafter, head)
    for seed in range(RUNS):
        sampling = Sampling(1.0, rule="ratio", seed=seed)
        run = speculative_decode(model, speculation, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set(), sampling=sampling,
                                 feature_dtype="bf16")
        for key, value in zip(ours, (run.tokens[1], run.tokens[2], run.steps[0])):
            ours[key].append(value)
    for seed in range(RUNS):
        torch.manual_seed(seed)
        stats = reference_module.dflash_generate(reference, model, torch.tensor([prompt]), NEW_TOKENS, None, temperature=1.0,
                                                 return_stats=True)
        answer = stats.output_ids[0, len(prompt):].tolist()
        for key, value in zip(theirs, (answer[1], answer[2], stats.acceptance_lengths[0])):
            theirs[key].append(value)

    second, third = exact_marginals(model, prompt)
    for name, samples in (("ours", ours), ("z-lab's", theirs)):
        assert goodness_of_fit(samples["second"], second) > 1e-3, f"{name} second tokens are not the target's distribution"
        assert goodness_of_fit(samples["third"], third) > 1e-3, f"{name} third tokens are not the target's distribution"
    ours_steps, theirs_steps = torch.tensor(ours["first_step"]).double(), torch.tensor(theirs["first_step"]).double()
    print(f"{architecture}: first-step tokens ours {float(ours_steps.mean()):.3f}, z-lab's {float(theirs_steps.mean()):.3f} over {RUNS} seeds")
    assert 1.2 < float(ours_steps.mean()) < 3.5, "the drafter should be accepted sometimes, not never or always"
    error = float((ours_steps.var() / RUNS + theirs_steps.var() / RUNS).sqrt())
    assert abs(float(ours_steps.mean() - theirs_steps.mean())) < 4 * error, (float(ours_steps.mean()), float(theirs_steps.mean()))
