"""`dflash-pipeline decode`: one prompt answered with speculative decoding, streaming, in the mode
evaluate measured fastest for the drafter unless the options choose (`evaluate.recorded_mode`).
`dflash-pipeline generate`, its name until now, runs it too with a notice, for one release."""

import inspect
from pathlib import Path

import click
from click.core import ParameterSource

from dflash_pipeline.cli.group import EXISTING_DIR, main, target_info
from dflash_pipeline.foundation.config import EvaluateConfig, GenerateConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import device_option, one_line_errors

DEFAULTS = EvaluateConfig()
GENERATE_DEFAULTS = GenerateConfig()
RENAMED_NOTICE = "note: `dflash-pipeline generate` is now `dflash-pipeline decode`; the old name goes in the next release"


@main.command("decode", short_help="Answer a prompt with speculative decoding, streaming.")
@click.argument("prompt")
@click.option("--target", "target_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="The target stage's target.json, or a local Hugging Face model folder.")
@click.option("--drafter", "drafter_dir", required=True, type=EXISTING_DIR,
              help="A training checkpoint (step_NNNNNN), an export, or a published DFlash drafter folder.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--rule", type=click.Choice(["ratio", "match"]), default=DEFAULTS.sampling_rule, show_default=True,
              help="Acceptance rule at T > 0: speculative sampling, or the drafter's argmax matched against the target's sample "
                   "(params.yaml evaluate.sampling_rule).")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=GENERATE_DEFAULTS.max_new_tokens, show_default=True,
              help="Answer length cap (params.yaml generate.max_new_tokens).")
@click.option("--verify-tokens", type=click.IntRange(min=1), default=DEFAULTS.verify_tokens,
              help="Drafted tokens verified per chain step (default at T = 0: the mode evaluate measured fastest for this drafter; "
                   "else all B-1).")
@click.option("--tree-budget", type=click.IntRange(min=1), default=None,
              help="Verify a DDTree of this many drafted nodes per step instead of a chain (greedy only; default at T = 0: "
                   "the mode evaluate measured fastest).")
@click.option("--compare", is_flag=True, help="Also decode without the drafter and report both.")
@device_option
@one_line_errors
def decode(prompt, target_path, drafter_dir, temperature, rule, top_k, top_p, seed, max_new_tokens, verify_tokens, tree_budget, compare,
           device):
    """Answer PROMPT (one user turn, in the target's chat template) with the drafter, streaming the
    text, then one line: tokens, tokens per step, tokens/s. --compare adds plain decoding of the
    same prompt; at T = 0 the two answers must be identical. A prompt that with --max-new-tokens
    would run past the target's context (its max_position_embeddings) is refused.

    At T = 0 without --tree-budget or --verify-tokens, the mode is the one evaluate measured fastest
    for this drafter (the chain at its verify length or a DDTree budget): recorded in an export's
    dflash_pipeline.json by the export stage, or, for a checkpoint of a pipeline run, in its
    data/eval/best.json. Without a record it is a chain of all B-1 drafted tokens. The first line
    says which mode and why.

    \b
    Example:
      dflash-pipeline decode "Write a haiku about autumn." --target data/target/target.json \\
          --drafter data/export/drafter --temperature 0.7 --compare
    """
    from dflash_pipeline.data.prompts import Prompt
    from dflash_pipeline.decoding.session import open_session
    from dflash_pipeline.drafters.loading import load_drafter_folder
    from dflash_pipeline.generate.run import render_prompt
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.speculation.sampling import Sampling

    sampling = Sampling(temperature, rule=rule, top_k=top_k, top_p=top_p, seed=seed) if temperature > 0 else None
    mode = DecodingMode.of(tree_budget=tree_budget, verify_tokens=verify_tokens, sampled=sampling is not None,
                           names=("--tree-budget", "--verify-tokens", "--temperature"))
    target = target_info(target_path)
    loaded = load_drafter_folder(drafter_dir, target=target, device=device)
    if sampling is None:  # the mode that pays best is a greedy measurement: evaluate's, unless the options choose
        from dflash_pipeline.evaluate.recorded_mode import choose_decode_mode
        from dflash_pipeline.foundation.devices import machine_description

        context = click.get_current_context()
        explicit = {name for name in ("tree_budget", "verify_tokens")
                    if context.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}
        mode, line = choose_decode_mode(drafter_dir=drafter_dir, kind=loaded.kind, block_size=loaded.drafter.config.block_size,
                                        requested=mode, explicit=explicit, machine=f"{device} on {machine_description()}")
        click.echo(line)
    session = open_session(target, loaded.drafter, device=device)
    prompt_ids = render_prompt(session.tokenizer, Prompt(id="cli", messages=(("user", prompt),), category="cli", split="val", source_line=0),
                               system_prompt=GENERATE_DEFAULTS.system_prompt, enable_thinking=GENERATE_DEFAULTS.enable_thinking)
    context = target.max_position_embeddings
    if context and len(prompt_ids) + max_new_tokens > context:  # decoding on past it runs off what the target was built for
        raise PipelineError(f"PROMPT is {len(prompt_ids)} tokens in the target's chat template; with --max-new-tokens {max_new_tokens} "
                            f"that is {len(prompt_ids) + max_new_tokens}, past the target's context of {context} tokens "
                            f"(max_position_embeddings in {target_path}): shorten the prompt or lower --max-new-tokens")
    speculation = session.speculation(mode)
    if compare:  # first-call allocations and kernel choice would otherwise fall on the side that runs first
        session.plain(prompt_ids, max_new_tokens=4)
    shown: list[int] = []

    def stream(tokens: list[int]) -> None:
        before = session.tokenizer.decode(shown, skip_special_tokens=True)
        shown.extend(tokens)
        click.echo(session.tokenizer.decode(shown, skip_special_tokens=True)[len(before):], nl=False)

    run = session.decode(prompt_ids, speculation, max_new_tokens=max_new_tokens, sampling=sampling, on_tokens=stream)
    click.echo()
    steps = sum(run.steps) / len(run.steps) if run.steps else 1.0
    how = ("greedy" if not mode.is_tree else f"greedy, tree of {mode.tree_budget}") if sampling is None else f"T={temperature}, {rule} rule"
    click.echo(f"speculative ({how}): {len(run.tokens)} tokens, {steps:.2f} tokens per step, {len(run.tokens) / run.seconds:.1f} tokens/s on the {session.engine} engine")
    if compare:
        plain = session.plain(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling)
        rate = len(plain.tokens) / plain.seconds
        how = "greedy" if sampling is None else how
        same = "identical answers" if plain.tokens == run.tokens else (
            "different answers: NOT LOSSLESS" if sampling is None else "different samples (expected at T > 0: same distribution)")
        click.echo(f"plain ({how}): {len(plain.tokens)} tokens, {rate:.1f} tokens/s; speedup {len(run.tokens) / run.seconds / rate:.2f}; {same}")


def _generate_renamed(**options):
    """`generate`, decode's old name: the same command, after a notice of the new name."""
    click.echo(RENAMED_NOTICE, err=True)
    return decode.callback(**options)


# Kept for one release so scripts that call `generate` keep working; hidden from the command list.
main.add_command(click.Command(
    "generate", callback=_generate_renamed, params=decode.params, context_settings=decode.context_settings, hidden=True,
    short_help="Deprecated name of `decode`.",
    help=f"The old name of `dflash-pipeline decode`, gone in the next release.\n\n{inspect.cleandoc(decode.help)}"))
