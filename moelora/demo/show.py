"""`moelora demo`: the same inputs through the base model and every demo adapter, in one batch."""

from __future__ import annotations

import time
from collections.abc import Callable

from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir
from moelora.demo.tasks import heldout_inputs, transform, user_prompt


def run_demo_batch(llm, inputs: list[str]) -> dict[tuple[str, str], str]:
    """Greedy answers of every (task, input) pair, generated as one mixed batch."""
    from moelora import SamplingParams

    tasks = ["copy", *ADAPTER_NAMES]
    pairs = [(task, text) for text in inputs for task in tasks]  # interleaved: adapters mixed in the batch
    prompts = [user_prompt(text) for _, text in pairs]
    adapters = [None if task == "copy" else task for task, _ in pairs]
    params = SamplingParams(max_tokens=64, temperature=0)
    outs = llm.generate(prompts, params, adapters)
    return {pair: out.text for pair, out in zip(pairs, outs, strict=True)}


def load_demo_llm(device: str | None = None, **engine_kwargs):
    from moelora import LLM

    return LLM(
        model_dir(),
        {name: adapter_dir(name) for name in ADAPTER_NAMES},
        device=device,
        max_lora_rank=64,
        max_loras=len(ADAPTER_NAMES),
        **engine_kwargs,
    )


def show_demo(device: str | None = None, num_inputs: int = 4, print_fn: Callable[[str], None] = print) -> int:
    """Prints a table of answers; returns how many answers differ from the task's expected one."""
    t0 = time.perf_counter()
    llm = load_demo_llm(device)
    inputs = heldout_inputs(num_inputs, seed=7)
    answers = run_demo_batch(llm, inputs)
    elapsed = time.perf_counter() - t0
    wrong = 0
    print_fn("moelora demo: one tiny Qwen3-MoE, three LoRA adapters (attention + routed experts), one batch\n")
    for text in inputs:
        print_fn(f"input: {text}")
        for task in ("copy", *ADAPTER_NAMES):
            got = answers[(task, text)]
            ok = got == transform(task, text)
            wrong += not ok
            label = "base" if task == "copy" else f"adapter {task}"
            print_fn(f"  {label:>16}: {got}  {'ok' if ok else 'MISMATCH (expected ' + transform(task, text) + ')'}")
    print_fn(
        f"\n{len(answers)} requests in one mixed batch, {len(answers) - wrong} as expected, "
        f"{elapsed:.1f} s including loading ({llm.engine.device})"
    )
    return wrong
