"""decoding/loop.py: the contract of what the one loop drives (`DecodeStep`): both steps keep it,
and it names everything the loop, `cached_step` and `run_prompt` touch on a step."""

import ast
import inspect

from dflash_pipeline.decoding import loop
from dflash_pipeline.decoding.loop import DecodeStep, PlainStep
from dflash_pipeline.decoding.static_speculation import SpeculativeStep
from dflash_pipeline.speculation.modes import DecodingMode


def test_the_plain_and_the_speculative_step_are_decode_steps(tiny_target):
    model, _, head, drafter, _ = tiny_target
    steps = [PlainStep(model, capacity=16, max_new_tokens=8, eos_ids={2}),
             *(SpeculativeStep(model, drafter, head, capacity=16, max_new_tokens=8, eos_ids={2}, mode=mode)
               for mode in (DecodingMode.chain(), DecodingMode.chain(1), DecodingMode.tree(4)))]
    assert all(isinstance(step, DecodeStep) for step in steps)
    assert not isinstance(object(), DecodeStep)


def test_the_contract_names_every_member_the_loop_touches_on_a_step():
    members = {name for name in DecodeStep.__annotations__} | {
        name for name, value in vars(DecodeStep).items() if inspect.isfunction(value) and not name.startswith("_")}
    touched = set()
    for function in (loop.run_steps, loop.cached_step, loop.run_prompt):
        tree = ast.parse(inspect.getsource(function))
        touched |= {node.attr for node in ast.walk(tree)  # `old`: cached_step's kept step
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("step", "old")}
    assert touched and touched <= members, sorted(touched - members)
